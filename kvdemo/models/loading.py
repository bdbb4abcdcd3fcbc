"""Loading a model by name into its family's adapter (:class:`~kvdemo.models.base.VideoLM`): the offline models
(``tiny``, ``tiny-random``, ``tiny-random-<family>``), ``auto``, Hugging Face ids and local folders. What a name
means before anything loads is :mod:`.catalog`; the adapters know nothing of each other."""

from __future__ import annotations

import logging
import time

from .base import VideoLM
from .catalog import TINY_NAME, TINY_RANDOM_NAME, checkpoint_config, family_module, offline_model, resolve_model_name
from .tiny import build_tiny_model, load_trained_tiny
from .tiny_random import build_random_model

log = logging.getLogger("kvdemo")


def load_model(name: str | None = None) -> VideoLM:
    """Load ``tiny`` (trained), ``tiny-random``, ``tiny-random-<family>``, ``auto`` or a Hugging Face id / local path."""
    resolved = resolve_model_name(name)
    log.info("loading model %s%s", resolved, f" ({name} resolves to it)" if name and name != resolved else "")
    start = time.perf_counter()
    if resolved == TINY_NAME:
        model = load_trained_tiny()
    elif resolved == TINY_RANDOM_NAME:
        model = build_tiny_model()
    elif offline_model(resolved) is not None:
        model = build_random_model(resolved)
    else:
        config = checkpoint_config(resolved)
        model = family_module(config.model_type).load(resolved, config)
    log.info(
        "loaded %s (%s, %d attention layers, %d KV heads) on %s as %s in %.1f s%s",
        model.name, model.family, model.num_layers, model.num_kv_heads, model.device, str(model.dtype).replace("torch.", ""),
        time.perf_counter() - start, "; random weights" if model.random_weights else "",
    )
    return model
