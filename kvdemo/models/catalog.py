"""What a model name means before its weights load: the families (each declared by one spec in its own file,
:mod:`.spec`, found here by looking through this package), the offline models, what ``auto`` resolves to, the real
checkpoints the app offers, and each name's :class:`~kvdemo.media.geometry.FrameGeometry` and starting budget.

Importing this module is light (the CLI checks its arguments first); the family files, which import
transformers, are imported the first time a family is asked for.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from ..media.geometry import FrameGeometry
from .base import ModelError
from .spec import RANDOM_WEIGHTS_NOTICE, TINY_NAME, TINY_RANDOM_NAME, TRAINED_NOTICE, FamilySpec, OfflineModel

__all__ = [
    "DEFAULT_REAL_MODEL",
    "RANDOM_WEIGHTS_NOTICE",
    "TINY_NAME",
    "TINY_RANDOM_NAME",
    "TRAINED_NOTICE",
    "FamilySpec",
    "OfflineModel",
    "caveat_for",
    "checkpoint_config",
    "default_budget",
    "families",
    "family_of",
    "family_spec",
    "geometry_for",
    "notice_for",
    "offline_model",
    "register_family",
    "released_configs",
    "chosen_model_name",
]

#: The real model ``auto`` means on a machine with a CUDA GPU.
DEFAULT_REAL_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"

_FAMILIES: dict[str, FamilySpec] = {}  # config.model_type -> its family's spec
#: What marks a family file of this package: it declares its spec at the top level (``SPEC = FamilySpec(...)``).
FAMILY_FILE_MARK = "\nSPEC = FamilySpec("
_DISCOVERED = False


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add a family (its file's ``SPEC`` is registered this way when the package is looked through; a plugin or
    a test may register one itself). A model type or offline model name that another family already has is a
    :class:`ModelError`."""
    taken = set(_FAMILIES) & set(spec.model_types)
    names = {m.name for known in set(_FAMILIES.values()) if known is not spec for m in known.offline}
    clash = names & {m.name for m in spec.offline}
    if any(_FAMILIES[t] is not spec for t in taken) or clash:
        raise ModelError(f"family {spec.name!r} clashes with a registered one: {sorted(taken | clash)}")
    for model_type in spec.model_types:
        _FAMILIES[model_type] = spec
    return spec


def families() -> dict[str, FamilySpec]:
    """``config.model_type`` -> its family's spec in menu order, every family file of this package registered on
    first use."""
    global _DISCOVERED
    if not _DISCOVERED:
        for path in sorted(Path(__file__).parent.glob("*.py")):
            if FAMILY_FILE_MARK not in path.read_text():
                continue  # not a family file (importing it is not needed to know the families)
            # deferred on purpose: each family file imports transformers, needed only once a family is asked for
            module = importlib.import_module(f"{__package__}.{path.stem}")
            if isinstance(getattr(module, "SPEC", None), FamilySpec):
                register_family(module.SPEC)
        _DISCOVERED = True
    return dict(sorted(_FAMILIES.items(), key=lambda item: item[1].menu_order))


def family_spec(model_type: str) -> FamilySpec:
    """The spec of the family that loads ``model_type`` checkpoints; :class:`ModelError` naming the supported ones."""
    known = families()
    if model_type not in known:
        raise ModelError(
            f"a {model_type!r} model is not supported; kvdemo supports the families {', '.join(sorted(known))}"
        )
    return known[model_type]


def __getattr__(name: str) -> Any:
    """``OFFLINE_MODELS`` (name -> :class:`OfflineModel`) and ``REAL_MODELS`` (checkpoint ids the app lists), read
    from the registered families each time they are asked for."""
    if name in ("OFFLINE_MODELS", "REAL_MODELS"):
        specs = list(dict.fromkeys(families().values()))
        if name == "OFFLINE_MODELS":
            return {model.name: model for spec in specs for model in spec.offline}
        return tuple(dict.fromkeys([DEFAULT_REAL_MODEL, *(c for spec in specs for c in spec.checkpoints)]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def chosen_model_name(name: str | None = None) -> str:
    """``auto`` -> a real Qwen2.5-VL on a CUDA machine, the offline ``tiny`` model otherwise.

    ``KVDEMO_MODEL`` overrides the default when no name is given.
    """
    name = name or os.environ.get("KVDEMO_MODEL") or "auto"
    if name == "auto":
        return DEFAULT_REAL_MODEL if torch.cuda.is_available() else TINY_NAME
    return name


def offline_model(name: str | None) -> OfflineModel | None:
    """The offline model ``name`` resolves to, or None for a real checkpoint."""
    resolved = chosen_model_name(name)
    return next((m for spec in families().values() for m in spec.offline if m.name == resolved), None)


def notice_for(name: str | None) -> str | None:
    """What the answers of model ``name`` are worth, when that needs saying (None for a real checkpoint)."""
    offline = offline_model(name)
    return offline.notice if offline else None


def family_of(name: str | None) -> str | None:
    """The family (``config.model_type``) of model ``name``; None when a real checkpoint's config cannot be read."""
    offline = offline_model(name)
    if offline is not None:
        return offline.family
    try:
        return checkpoint_config(chosen_model_name(name)).model_type
    except ModelError:
        return None


def checkpoint_config(model_id: str) -> Any:
    """A checkpoint's config (local folder, Hugging Face cache, or the Hub); :class:`ModelError` naming it if it
    cannot be read. A name that is neither a folder nor an ``owner/name`` id is refused at once; the folder and the
    cache are tried first, and the Hub is asked only once it answered one
    request (``hub_reachable``): without a network, huggingface_hub would retry each file five times (about 25 s
    and a dozen warnings) before failing."""
    shown = model_id if len(model_id) <= 80 else model_id[:77] + "..."
    if "/" not in model_id and not os.path.isdir(model_id):  # no folder, and not a Hub id (owner/name): say so now
        raise ModelError(
            f"model {shown!r} is not an offline model ({', '.join(__getattr__('OFFLINE_MODELS'))}), a local folder "
            "or a Hugging Face id (owner/name)"
        )
    from transformers import AutoConfig  # deferred on purpose: only real checkpoints need it

    try:
        return AutoConfig.from_pretrained(model_id, trust_remote_code=False, local_files_only=True)
    except Exception as exc:
        if os.path.isdir(model_id):
            raise ModelError(f"cannot load model {shown!r}: {str(exc).splitlines()[0][:200]}") from None
    reachable = hub_reachable()
    if reachable is not None:
        raise ModelError(
            f"model {shown!r} is neither a local folder nor in the Hugging Face cache, and the Hub "
            f"cannot be reached ({reachable}); give a local checkpoint folder (--model /path/to/folder) "
            f"or an offline model ({', '.join(__getattr__('OFFLINE_MODELS'))})"
        )
    try:
        return AutoConfig.from_pretrained(model_id, trust_remote_code=False)
    except Exception as exc:
        raise ModelError(f"cannot load model {shown!r}: {str(exc).splitlines()[0][:200]}") from None


def hub_reachable(timeout_s: float = 5.0) -> str | None:
    """None if the Hugging Face Hub (``HF_ENDPOINT``) answers one request within ``timeout_s``, else why not
    (offline mode, no connection): one attempt, no retries."""
    from huggingface_hub import constants, get_session  # deferred on purpose: only real checkpoints need it

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception as exc:
        return f"{constants.ENDPOINT}: {type(exc).__name__}"
    return None


def default_budget(name: str | None) -> tuple[int, int, int]:
    """``(M, C, max pixels)`` the app starts model ``name`` with (its offline entry's, or its family's)."""
    offline = offline_model(name)
    if offline is not None:
        return (*offline.budget, offline.geometry.max_pixels)
    config = checkpoint_config(chosen_model_name(name))
    spec = family_spec(config.model_type)
    return (*spec.budget, spec.geometry(config).max_pixels)


def released_configs() -> dict[str, dict[str, Any]]:
    """Every family's released configs by short name (:attr:`FamilySpec.released`), for random weights at real shapes."""
    return {name: config for spec in dict.fromkeys(families().values()) for name, config in spec.released.items()}


def geometry_for(name: str | None) -> FrameGeometry:
    """How model ``name`` sizes frames, known without loading its weights (a real checkpoint's config is read)."""
    offline = offline_model(name)
    if offline is not None:
        return offline.geometry
    config = checkpoint_config(chosen_model_name(name))
    return family_spec(config.model_type).geometry(config)


def caveat_for(family: str | None) -> str | None:
    """What a user must know about ``family`` (a ``config.model_type``) in a streaming memory, if anything."""
    spec = families().get(family or "")
    return spec.caveat if spec else None
