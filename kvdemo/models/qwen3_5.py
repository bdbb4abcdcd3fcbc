"""Qwen3.5 through transformers' own classes (no remote code): Qwen3-VL's processor, stream layout and
positions (:mod:`.qwen3_vl`), no DeepStack, and a hybrid language model.

Three of every four decoder layers are Gated DeltaNet linear attention: they hold no keys and values, only a
fixed-size state (a convolution state and a float32 recurrent state) that every forward overwrites. The memory
covers the full-attention layers alone (``layer_map``: model layer -> memory layer); the budget, eviction and
provenance exist there only, and frames evicted from them keep influencing answers through the recurrent state.
A question runs on a copy-on-write fork of that state (:class:`kvdemo.attention.LinearStateLayer`). Partial
rotary: 64 of the 256 head dims rotate (:class:`~kvdemo.models.adapter.Rotation` rotates the first
``rotary_dim`` channels only).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3_5ForConditionalGeneration

from .adapter import load_checkpoint
from .qwen3_vl import Qwen3VL

MODEL_CLASSES: dict[str, Any] = {"qwen3_5": Qwen3_5ForConditionalGeneration}


class Qwen3_5(Qwen3VL):
    """A Qwen3.5 model behind the :class:`~kvdemo.models.base.VideoLM` protocol (its vision side is Qwen3-VL's,
    without DeepStack; its language model mixes linear and full attention)."""


def load(model_id: str, config: Any, device: str | None = None) -> Qwen3_5:
    """Load a Qwen3.5 checkpoint (Hub id or local folder) with transformers' classes."""
    model, tokenizer, processor = load_checkpoint(MODEL_CLASSES[config.model_type], model_id, device)
    return Qwen3_5(model, tokenizer, name=model_id, processor=processor)
