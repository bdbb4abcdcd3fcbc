"""What the offline random-weight models of every family share (each family's file declares its own small config
and its ``tiny-random-<family>`` model in its spec): the byte-level tokenizer of the offline models as a
transformers fast tokenizer (bytes are ids 0-255, the chat's special tokens follow), so the families' own
processors run with it; building a transformers class from a small config with seeded random weights; and keeping
random answers to printable text. Their answers are noise: they are for mechanics and for checking kvdemo against
transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..cache.attention import ATTN_IMPLEMENTATION

#: The chat's special tokens, after the 256 bytes (the trained tiny model's seven first, then LLaVA's placeholders).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|video_pad|>",
    "<|image_pad|>",
    "<image>",
    "<video>",
)
TOKEN_ID = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}
VOCAB = 256 + len(SPECIAL_TOKENS)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer whose ids are the bytes of the text (GPT-2's byte-to-unicode alphabet, no
    merges), the special tokens after them: the same ids as :class:`kvdemo.models.tiny.ByteTokenizer`."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    others = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {char_of[b]: b for b in range(256)} | TOKEN_ID
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


#: Token ids every tiny config names (the chat's ends of text and of turn).
TEXT_IDS = dict(
    bos_token_id=TOKEN_ID["<|endoftext|>"], eos_token_id=TOKEN_ID["<|im_end|>"], pad_token_id=TOKEN_ID["<|endoftext|>"]
)


def qwen_ids() -> dict[str, int]:
    """The vision token ids a Qwen-style config names (the byte tokenizer's)."""
    return dict(
        image_token_id=TOKEN_ID["<|image_pad|>"],
        video_token_id=TOKEN_ID["<|video_pad|>"],
        vision_start_token_id=TOKEN_ID["<|vision_start|>"],
        vision_end_token_id=TOKEN_ID["<|vision_end|>"],
    )


def build_hf_model(make_config: Callable[[], Any], model_class: Any, seed: int = 0) -> Any:
    """``model_class`` built from ``make_config()`` (float32, CPU), identical weights for a given ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(make_config(), attn_implementation=ATTN_IMPLEMENTATION)
    return model.float().eval()


def printable_answers(adapter: Any, vocab: int) -> Any:
    """``adapter`` with its answers kept to printable ASCII and the end of turn (random weights pick arbitrary
    bytes otherwise), through its logit bias ``[vocab]``."""
    bias = torch.full((vocab,), float("-inf"))
    bias[32:127] = 0.0
    bias[TOKEN_ID["<|im_end|>"]] = 0.0
    adapter.logit_bias = bias
    return adapter
