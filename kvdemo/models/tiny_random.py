"""Offline test models of every family: ``tiny-random-qwen2-vl``, ``tiny-random-qwen3-vl``, ``tiny-random-qwen3.5``
and ``tiny-random-llava-ov`` are transformers' own classes built from a small config in code with seeded
random weights and the real vision geometry (patch, merge, temporal patch; LLaVA-OneVision's 384-px SigLIP
input pooled to 14 x 14), with the byte-level tokenizer of the offline models as a transformers fast tokenizer
(bytes are ids 0-255, the chat's special tokens follow), so the families' own processors run with it. Their
answers are noise: they are for mechanics and for checking kvdemo against transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from ..attention import ATTN_IMPLEMENTATION
from . import qwen2_vl, qwen3_5, qwen3_vl
from .base import ModelError, VideoLM
from .catalog import OFFLINE_MODELS
from .llava_onevision import LlavaOnevision

#: The chat's special tokens, after the 256 bytes (the trained tiny model's seven first, then LLaVA's placeholders).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>",
                  "<|image_pad|>", "<image>", "<video>")
TOKEN_ID = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}
VOCAB = 256 + len(SPECIAL_TOKENS)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer whose ids are the bytes of the text (GPT-2's byte-to-unicode alphabet, no
    merges), the special tokens after them: the same ids as :class:`kvdemo.models.tiny.ByteTokenizer`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {char_of[b]: b for b in range(256)} | TOKEN_ID
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=list(SPECIAL_TOKENS[1:]))


#: Token ids every tiny config names (the chat's ends of text and of turn).
TEXT_IDS = dict(bos_token_id=TOKEN_ID["<|endoftext|>"], eos_token_id=TOKEN_ID["<|im_end|>"], pad_token_id=TOKEN_ID["<|endoftext|>"])


def _qwen_ids() -> dict[str, int]:
    return dict(image_token_id=TOKEN_ID["<|image_pad|>"], video_token_id=TOKEN_ID["<|video_pad|>"],
                vision_start_token_id=TOKEN_ID["<|vision_start|>"], vision_end_token_id=TOKEN_ID["<|vision_end|>"])


def qwen2_vl_config() -> Qwen2VLConfig:
    """Qwen2-VL: 4 layers, 4 heads / 2 KV heads of 32, M-RoPE sections 4/6/6; vision patch 14, merge 2."""
    return Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32768, initializer_range=0.1, **TEXT_IDS,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, initializer_range=0.1),
        **_qwen_ids(), tie_word_embeddings=False)


def qwen3_vl_config() -> Qwen3VLConfig:
    """Qwen3-VL: 4 layers, 4 heads / 2 KV heads of 16, interleaved M-RoPE sections 2/3/3; vision patch 16, merge 2,
    DeepStack from all three vision blocks."""
    return Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=32768, initializer_range=0.1, **TEXT_IDS,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1, 2], initializer_range=0.1),
        **_qwen_ids(), tie_word_embeddings=False)


def qwen3_5_config() -> Qwen3_5Config:
    """Qwen3.5: 8 layers, three linear-attention layers (Gated DeltaNet) for each full-attention one (layers 3 and
    7 hold keys and values); 4 heads / 2 KV heads of 32 with a quarter rotating (partial rotary); vision as Qwen3-VL's."""
    return Qwen3_5Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=32768, initializer_range=0.1, **TEXT_IDS,
                         linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True, "partial_rotary_factor": 0.25}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64, initializer_range=0.1),
        **_qwen_ids(), tie_word_embeddings=False)


def llava_onevision_config() -> LlavaOnevisionConfig:
    """LLaVA-OneVision: a 2-block SigLIP at 384 px (patch 14: 27 x 27 patches pooled to 14 x 14) and a 4-layer
    Qwen2 (4 heads / 2 KV heads of 16)."""
    return LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=384, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, initializer_range=0.1,
                         **TEXT_IDS),
        image_token_index=TOKEN_ID["<image>"], video_token_index=TOKEN_ID["<video>"], vision_feature_layer=-1,
        vision_feature_select_strategy="full", tie_word_embeddings=False)


#: name -> (config builder, transformers class, adapter builder(model, tokenizer, name)).
BUILDERS: dict[str, tuple[Any, Any, Any]] = {
    "tiny-random-qwen2-vl": (qwen2_vl_config, Qwen2VLForConditionalGeneration,
                             lambda model, tokenizer, name: qwen2_vl.Qwen2VL(model, tokenizer, name, random_weights=True,
                                                                             geometry_=OFFLINE_MODELS[name].geometry)),
    "tiny-random-qwen3-vl": (qwen3_vl_config, Qwen3VLForConditionalGeneration,
                             lambda model, tokenizer, name: qwen3_vl.Qwen3VL(model, tokenizer, name, random_weights=True,
                                                                             min_pixels=OFFLINE_MODELS[name].geometry.min_pixels,
                                                                             max_pixels=OFFLINE_MODELS[name].geometry.max_pixels)),
    "tiny-random-qwen3.5": (qwen3_5_config, Qwen3_5ForConditionalGeneration,
                            lambda model, tokenizer, name: qwen3_5.Qwen3_5(model, tokenizer, name, random_weights=True,
                                                                           min_pixels=OFFLINE_MODELS[name].geometry.min_pixels,
                                                                           max_pixels=OFFLINE_MODELS[name].geometry.max_pixels)),
    "tiny-random-llava-ov": (llava_onevision_config, LlavaOnevisionForConditionalGeneration,
                             lambda model, tokenizer, name: LlavaOnevision(model, tokenizer, name, random_weights=True)),
}


def build_hf_model(name: str, seed: int = 0) -> Any:
    """The transformers model of offline model ``name`` (float32, CPU), identical weights for a given ``seed``."""
    if name not in BUILDERS:
        raise ModelError(f"no offline model {name!r}; the offline models are {', '.join(sorted(BUILDERS))}")
    make_config, model_class, _ = BUILDERS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(make_config(), attn_implementation=ATTN_IMPLEMENTATION)
    return model.float().eval()


def build_random_model(name: str, seed: int = 0) -> VideoLM:
    """Offline model ``name`` behind its family's adapter, its answers kept to printable text (random weights pick
    arbitrary bytes otherwise)."""
    adapter = BUILDERS[name][2](build_hf_model(name, seed), byte_tokenizer(), name)
    adapter.notice = OFFLINE_MODELS[name].notice
    bias = torch.full((VOCAB,), float("-inf"))
    bias[32:127] = 0.0
    bias[TOKEN_ID["<|im_end|>"]] = 0.0
    adapter.logit_bias = bias
    return adapter
