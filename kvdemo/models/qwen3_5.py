"""Qwen3.5 through transformers' own classes (no remote code): Qwen3-VL's processor, stream layout and
positions (:mod:`.qwen3_vl`), no DeepStack, and a hybrid language model.

Three of every four decoder layers are Gated DeltaNet linear attention: they hold no keys and values, only a
fixed-size state (a convolution state and a float32 recurrent state) that every forward overwrites. The memory
covers the full-attention layers alone (``layer_map``: model layer -> memory layer); the budget, eviction and
provenance exist there only, and frames evicted from them keep influencing answers through the recurrent state.
A question runs on a copy-on-write fork of that state (:class:`kvdemo.cache.attention.LinearStateLayer`). Partial
rotary: 64 of the 256 head dims rotate (:class:`~kvdemo.models.adapter.Rotation` rotates the first
``rotary_dim`` channels only). :data:`SPEC` is what the rest of kvdemo knows of the family.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from .adapter import load_checkpoint
from .qwen3_vl import (
    PIXEL_MEAN,
    PIXEL_STD,
    SMALL_GEOMETRY,
    SMALL_MAX_PIXELS,
    SMALL_MIN_PIXELS,
    Qwen3VL,
    config_geometry,
)
from .spec import RANDOM_WEIGHTS_NOTICE, FamilySpec, OfflineModel
from .tiny_random import TEXT_IDS, VOCAB, build_hf_model, byte_tokenizer, printable_answers, qwen_ids

MODEL_CLASSES: dict[str, Any] = {"qwen3_5": Qwen3_5ForConditionalGeneration}


class Qwen3_5(Qwen3VL):
    """A Qwen3.5 model behind the :class:`~kvdemo.models.base.VideoLM` protocol (its vision side is Qwen3-VL's,
    without DeepStack; its language model mixes linear and full attention)."""


def load(model_id: str, config: Any, device: str | None = None) -> Qwen3_5:
    """Load a Qwen3.5 checkpoint (Hub id or local folder) with transformers' classes."""
    model, tokenizer, processor = load_checkpoint(MODEL_CLASSES[config.model_type], model_id, device)
    return Qwen3_5(model, tokenizer, name=model_id, processor=processor)


# --- the offline model and the spec -------------------------------------------------------------------------


def tiny_random_config() -> Qwen3_5Config:
    """Qwen3.5: 8 layers, three linear-attention layers (Gated DeltaNet) for each full-attention one (layers 3 and
    7 hold keys and values); 4 heads / 2 KV heads of 32 with a quarter rotating (partial rotary); vision as Qwen3-VL's."""
    return Qwen3_5Config(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=32768,
            initializer_range=0.1,
            **TEXT_IDS,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.25,
            },
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            initializer_range=0.1,
        ),
        **qwen_ids(),
        tie_word_embeddings=False,
    )


def build_tiny_random() -> Qwen3_5:
    """``tiny-random-qwen3.5``: :func:`tiny_random_config` with seeded random weights and the byte tokenizer."""
    model = build_hf_model(tiny_random_config, Qwen3_5ForConditionalGeneration)
    adapter = Qwen3_5(
        model,
        byte_tokenizer(),
        "tiny-random-qwen3.5",
        random_weights=True,
        notice=RANDOM_WEIGHTS_NOTICE,
        min_pixels=SMALL_MIN_PIXELS,
        max_pixels=SMALL_MAX_PIXELS,
    )
    return printable_answers(adapter, VOCAB)


SPEC = FamilySpec(
    name="Qwen3.5",
    model_types=tuple(MODEL_CLASSES),
    geometry=config_geometry,
    pixel_mean=PIXEL_MEAN,
    pixel_std=PIXEL_STD,
    load=load,
    menu_order=2,
    budget=(6144, 4608),
    caveat="Qwen3.5: only its full-attention layers (one in four) hold tokens, so the budget, eviction and heatmaps "
    "cover those layers; frames evicted from them keep influencing answers through the linear-attention "
    "layers' recurrent state.",
    verified="random weights, CPU: linear-state fork exact, chunked prefill = forward; real clip",
    checkpoints=("Qwen/Qwen3.5-2B",),
    offline=(
        OfflineModel(
            "tiny-random-qwen3.5", "qwen3_5", SMALL_GEOMETRY, RANDOM_WEIGHTS_NOTICE, build_tiny_random, (320, 224)
        ),
    ),
)
