"""Loading a model by name (``auto``, the offline ``tiny`` / ``tiny-random`` models, Hugging Face ids and
local folders) into its adapter (:class:`~kvdemo.models.base.VideoLM`). What a name means before anything
loads is :mod:`.catalog`; the adapters know nothing of each other."""

from __future__ import annotations

import logging
import time

from .base import VideoLM
from .catalog import TINY_NAME, TINY_RANDOM_NAME, resolve_model_name
from .qwen_vl import load_qwen
from .tiny import build_tiny_model, load_trained_tiny

log = logging.getLogger("kvdemo")


def load_model(name: str | None = None) -> VideoLM:
    """Load ``tiny`` (trained), ``tiny-random``, ``auto`` or a Hugging Face model id / local path."""
    resolved = resolve_model_name(name)
    log.info("loading model %s%s", resolved, f" ({name} resolves to it)" if name and name != resolved else "")
    start = time.perf_counter()
    if resolved == TINY_NAME:
        model = load_trained_tiny()
    elif resolved == TINY_RANDOM_NAME:
        model = build_tiny_model()
    else:
        model = load_qwen(resolved)
    log.info(
        "loaded %s (%s, %d layers, %d KV heads) on %s as %s in %.1f s%s",
        model.name, model.family, model.num_layers, model.num_kv_heads, model.device, str(model.dtype).replace("torch.", ""),
        time.perf_counter() - start, "; random weights" if model.random_weights else "",
    )
    return model
