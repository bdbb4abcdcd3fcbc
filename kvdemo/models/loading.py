"""Loading a model by name into its family's adapter (:class:`~kvdemo.models.base.VideoLM`): the offline models
(``tiny``, ``tiny-random``, ``tiny-random-<family>``), ``auto``, Hugging Face ids and local folders. What a name
means before anything loads is :mod:`.catalog`; how each model is built or loaded is its family's spec
(:mod:`.spec`); the adapters know nothing of each other."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from .base import VideoLM
from .catalog import checkpoint_config, chosen_model_name, family_spec, offline_model

log = logging.getLogger("kvdemo")


def load_model(name: str | None = None, device: str | None = None) -> VideoLM:
    """Load ``tiny`` (trained), ``tiny-random``, ``tiny-random-<family>``, ``auto`` or a Hugging Face id / local path
    (a folder written by ``python -m kvdemo train-tiny`` loads as the trained tiny model). ``device`` places a real
    checkpoint (e.g. ``cuda:1`` for one data-parallel process; default: every GPU, or the CPU)."""
    if name and is_tiny_folder(name):
        from .qwen2_vl import load_trained_tiny  # deferred on purpose: the catalog imports family files on demand

        return load_trained_tiny(name)
    resolved = chosen_model_name(name)
    log.info("loading model %s%s", resolved, f" ({name} resolves to it)" if name and name != resolved else "")
    start = time.perf_counter()
    offline = offline_model(resolved)
    if offline is not None:
        model = offline.build()
    else:
        config = checkpoint_config(resolved)
        model = family_spec(config.model_type).load(resolved, config, device)
    log.info(
        "loaded %s (%s, %d attention layers, %d KV heads) on %s as %s in %.1f s%s",
        model.name,
        model.family,
        model.num_layers,
        model.num_kv_heads,
        model.device,
        str(model.dtype).replace("torch.", ""),
        time.perf_counter() - start,
        "; random weights" if model.random_weights else "",
    )
    return model


def is_tiny_folder(name: str) -> bool:
    """Whether ``name`` is a folder of tiny-model weights (its ``tokenizer.json`` is kvdemo's byte spec)."""
    spec = Path(name) / "tokenizer.json"
    try:
        return Path(name).is_dir() and spec.is_file() and json.loads(spec.read_text()).get("kind") == "bytes"
    except (OSError, ValueError):
        return False
