"""Loading a model by name into its family's adapter (:class:`~kvdemo.models.base.VideoLM`): the offline models
(``tiny``, ``tiny-random``, ``tiny-random-<family>``), ``auto``, Hugging Face ids and local folders. What a name
means before anything loads is :mod:`.catalog`; how each model is built or loaded is its family's spec
(:mod:`.spec`); the adapters know nothing of each other."""

from __future__ import annotations

import logging
import time

from .base import VideoLM
from .catalog import checkpoint_config, family_spec, offline_model, resolve_model_name

log = logging.getLogger("kvdemo")


def load_model(name: str | None = None) -> VideoLM:
    """Load ``tiny`` (trained), ``tiny-random``, ``tiny-random-<family>``, ``auto`` or a Hugging Face id / local path."""
    resolved = resolve_model_name(name)
    log.info("loading model %s%s", resolved, f" ({name} resolves to it)" if name and name != resolved else "")
    start = time.perf_counter()
    offline = offline_model(resolved)
    if offline is not None:
        model = offline.build()
    else:
        config = checkpoint_config(resolved)
        model = family_spec(config.model_type).load(resolved, config, None)
    log.info(
        "loaded %s (%s, %d attention layers, %d KV heads) on %s as %s in %.1f s%s",
        model.name, model.family, model.num_layers, model.num_kv_heads, model.device, str(model.dtype).replace("torch.", ""),
        time.perf_counter() - start, "; random weights" if model.random_weights else "",
    )
    return model
