"""What a model name means before anything loads (no transformers here, so the CLI can check a budget
against a chunk without loading one): the offline models' names, notices and pixel ranges, what ``auto``
resolves to, and the pixel range a name declares."""

from __future__ import annotations

import os

import torch

from ..video import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

#: The real model ``auto`` means on a machine with a CUDA GPU.
DEFAULT_REAL_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
TINY_NAME = "tiny"
TINY_RANDOM_NAME = "tiny-random"
RANDOM_WEIGHTS_NOTICE = (
    "Answers come from the offline tiny model with random weights: they show the mechanics, not understanding."
)
TRAINED_NOTICE = "A tiny model trained on synthetic streams: it knows shapes and colours, nothing else."
OFFLINE_NOTICES = {TINY_NAME: TRAINED_NOTICE, TINY_RANDOM_NAME: RANDOM_WEIGHTS_NOTICE}
#: The trained model's pixel range: 112 x 112 frames stay as they are (16 tokens per pair); other aspect
#: ratios resize to about as many pixels (e.g. 16:9 and 4:3 -> 84 x 140, 15 tokens).
TRAINED_MIN_PIXELS = 112 * 112
TRAINED_MAX_PIXELS = 20 * 28 * 28


def resolve_model_name(name: str | None = None) -> str:
    """``auto`` -> a real Qwen2.5-VL on a CUDA machine, the offline ``tiny`` model otherwise.

    ``KVDEMO_MODEL`` overrides the default when no name is given.
    """
    name = name or os.environ.get("KVDEMO_MODEL") or "auto"
    if name == "auto":
        return DEFAULT_REAL_MODEL if torch.cuda.is_available() else "tiny"
    return name


def preferred_pixel_range(name: str | None = None) -> tuple[int, int]:
    """The pixel range the model ``name`` declares (``QwenVL.min_pixels/max_pixels``), known without loading
    it: the trained tiny model's own, Qwen's defaults for every other model."""
    if resolve_model_name(name) == TINY_NAME:
        return TRAINED_MIN_PIXELS, TRAINED_MAX_PIXELS
    return DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS
