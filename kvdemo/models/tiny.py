"""The offline tiny models: transformers' own ``Qwen2_5_VLForConditionalGeneration`` at 0.92M parameters
with the real vision geometry, and a byte-level tokenizer made in code with Qwen's chat special tokens.

- ``tiny``: trained by the project on generated streams (``python -m kvdemo train-tiny``, weights in
  ``kvdemo/assets/tiny``, package data). It knows the shapes and colours of its own kind of stream and nothing
  else, and saw 112 x 112 frames (16 visual tokens per frame pair): it declares that pixel range, so videos are
  resized to it.
- ``tiny-random``: the same class with random weights (seeded), for mechanics tests; its answers are noise.

Both run the whole pipeline on a CPU with no download; each says what its answers are worth
(``Qwen2VL.notice``). This file holds their config, tokenizer and weights' folder; the family's file
(:mod:`.qwen2_vl`) builds them behind its adapter and declares them in its spec.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from transformers import Qwen2_5_VLConfig

from .base import ModelError

# The trained weights ship inside the package (package data), so an installed kvdemo finds them too. pip unpacks
# wheels, so the resource is a folder on disk, which ``from_pretrained`` needs.
TRAINED_DIR = Path(str(resources.files("kvdemo") / "assets" / "tiny"))
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|video_pad|>",
    "<|image_pad|>",
)


class ByteTokenizer:
    """Bytes 0-255 are ids 0-255; Qwen's chat special tokens follow. ``encode``/``decode`` like a HF tokenizer."""

    def __init__(self, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> None:
        self.special_tokens = tuple(special_tokens)
        self.special_to_id = {token: 256 + i for i, token in enumerate(self.special_tokens)}
        self.id_to_special = {i: token for token, i in self.special_to_id.items()}
        self.vocab_size = 256 + len(self.special_tokens)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.special_tokens) + ")")

    @classmethod
    def from_spec(cls, path: str | Path) -> "ByteTokenizer":
        """The tokenizer described by a spec written by :func:`save_tokenizer_spec`."""
        spec = json.loads(Path(path).read_text())
        if spec.get("kind") != "bytes":
            raise ModelError(f"{path}: not a byte-level tokenizer spec")
        return cls(tuple(spec["special_tokens"]))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self.special_to_id:
                ids.append(self.special_to_id[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special_tokens and i in self.id_to_special:
                out.append(self.id_to_special[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def save_tokenizer_spec(folder: str | Path) -> Path:
    """Write ``tokenizer.json``: bytes 0-255 are ids 0-255, the special tokens follow in order."""
    path = Path(folder) / "tokenizer.json"
    path.write_text(json.dumps({"kind": "bytes", "special_tokens": list(SPECIAL_TOKENS)}, indent=1) + "\n")
    return path


def tiny_config(initializer_range: float = 0.1):
    """A 4-layer, 2-KV-head Qwen2.5-VL with the real vision geometry (patch 14, merge 2, temporal 2).

    ``initializer_range`` 0.1 (the random model) is wider than the usual 0.02 so that random answers
    depend on what the cache holds (with 0.02 every context decodes to the same repeated byte), which
    makes compression visible in the chat; training starts from 0.02.
    """
    tokenizer = ByteTokenizer()
    ids = tokenizer.special_to_id
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=tokenizer.vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]},
            rms_norm_eps=1e-6,
            initializer_range=initializer_range,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            out_hidden_size=128,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
            initializer_range=initializer_range,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )


#: The trained tiny model's dialogue replay bound (kvdemo's choice): it was trained on dialogues of a stream's own
#: questions (about 250 tokens); measured on the bundled sample, it answers every colour question right after one
#: earlier turn of 426 tokens and gets three of four wrong after two.
TRAINED_DIALOGUE_TOKENS = 512


def export_transformers_folder(folder: str | Path, out: str | Path) -> Path:
    """The trained tiny model in ``folder`` written to ``out`` as an ordinary transformers Qwen2.5-VL folder: the
    weights and config, a byte-level fast tokenizer (the same ids), and a processor whose image and video processors
    keep frames in the model's pixel range (112 x 112 stays 112 x 112) with Qwen2.5-VL's own chat template (kvdemo's
    prompt is that template's text). What lmms-eval's own ``qwen2_5_vl`` model loads (the cross-check)."""
    import torch  # deferred with transformers' model class: this module stays light (config and tokenizer)
    from transformers import (  # deferred: export only
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from .catalog import TINY_NAME, offline_model  # deferred: the catalog reads the family files, which import this one
    from .tiny_random import byte_tokenizer  # deferred: that module loads every family's adapter

    out = Path(out)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.save_pretrained(out)
    geometry = offline_model(TINY_NAME).geometry
    size = {"shortest_edge": geometry.min_pixels, "longest_edge": geometry.max_pixels}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        video_processor=Qwen2VLVideoProcessor(size=size),
        tokenizer=byte_tokenizer(),
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out


#: Qwen2.5-VL's chat template (system turn, then each turn's pictures/videos before its text).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
