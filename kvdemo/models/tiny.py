"""The offline tiny model: transformers' own ``Qwen2_5_VLForConditionalGeneration`` built from a small
config with a fixed seed, and a byte-level tokenizer made in code with Qwen's chat special tokens.

It runs the whole pipeline on a CPU with no download. Its weights are random, so its answers are
noise: everything that shows them says so (``QwenVL.random_weights``).
"""

from __future__ import annotations

import re

import torch

from .qwen_vl import QwenVL

TINY_NAME = "tiny"
RANDOM_WEIGHTS_NOTICE = (
    "Answers come from the offline tiny model with random weights: they show the mechanics, not understanding."
)
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

    def __init__(self) -> None:
        self.special_to_id = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}
        self.id_to_special = {i: token for token, i in self.special_to_id.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

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


def tiny_config():
    """A 4-layer, 2-KV-head Qwen2.5-VL with the real vision geometry (patch 14, merge 2, temporal 2)."""
    from transformers import Qwen2_5_VLConfig

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
            initializer_range=0.1,
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
            initializer_range=0.1,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        # Wider than the usual 0.02 so that random answers depend on what the cache holds (with 0.02
        # every context decodes to the same repeated byte), which makes compression visible in the chat.
        initializer_range=0.1,
    )


def build_tiny_model(seed: int = 0) -> QwenVL:
    """The tiny model on the CPU in float32; identical weights for a given ``seed``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from ..attention import ATTN_IMPLEMENTATION

    config = tiny_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    tokenizer = ByteTokenizer()
    adapter = QwenVL(model.float().eval(), tokenizer, name=TINY_NAME, random_weights=True)
    # Random weights pick arbitrary bytes; keep answers to printable ASCII (and the stop token) so they stay legible.
    bias = torch.full((config.text_config.vocab_size,), float("-inf"))
    bias[32:127] = 0.0
    bias[tokenizer.special_to_id["<|im_end|>"]] = 0.0
    adapter.logit_bias = bias
    return adapter
