"""What a model name means before anything loads (no transformers here, so the CLI checks a budget against a
chunk of the user's video without loading a model): the offline models (their family, how they size frames,
what their answers are worth), what ``auto`` resolves to, the real checkpoints the app offers, and each name's
:class:`~kvdemo.models.base.FrameGeometry`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .base import FrameGeometry, ModelError

#: The real model ``auto`` means on a machine with a CUDA GPU.
DEFAULT_REAL_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
TINY_NAME = "tiny"
TINY_RANDOM_NAME = "tiny-random"
RANDOM_WEIGHTS_NOTICE = (
    "Answers come from the offline tiny model with random weights: they show the mechanics, not understanding."
)
TRAINED_NOTICE = "A tiny model trained on synthetic streams: it knows shapes and colours, nothing else."
#: The trained model's pixel range: 112 x 112 frames stay as they are (16 tokens per pair); other aspect
#: ratios resize to about as many pixels (e.g. 16:9 and 4:3 -> 84 x 140, 15 tokens).
TRAINED_MIN_PIXELS = 112 * 112
TRAINED_MAX_PIXELS = 20 * 28 * 28
#: Qwen's per-frame video bounds (Qwen2-VL / Qwen2.5-VL: 28-px tokens; Qwen3-VL / Qwen3.5: 32-px tokens).
QWEN2_PIXELS = (128 * 28 * 28, 768 * 28 * 28)
QWEN3_PIXELS = (128 * 32 * 32, 768 * 32 * 32)
#: The offline random-weight models of the new families use small frames (16 to 64 tokens a frame), so a CPU
#: streams the real clip through them in seconds.
SMALL_QWEN3_PIXELS = (16 * 32 * 32, 64 * 32 * 32)
#: At most this many tokens of stream text per grid with the byte tokenizer (``<99999.9 seconds>``, 17 bytes,
#: plus ``<|vision_start|>`` and ``<|vision_end|>``); real tokenizers need fewer.
BYTE_TEXT_PER_GRID = 19


@dataclass(frozen=True)
class OfflineModel:
    """An offline model: its family, how it sizes frames, what its answers are worth, and the budget ``(M, C)``
    the app starts it with (one that compresses visibly within the bundled sample or the real test clip)."""

    family: str
    geometry: FrameGeometry
    notice: str
    budget: tuple[int, int] = (1024, 768)


OFFLINE_MODELS: dict[str, OfflineModel] = {
    # M = 96 holds 12 s of the 40 s sample (16 tokens per frame pair); M - C = 24 holds a chunk at its max pixels.
    TINY_NAME: OfflineModel("qwen2_5_vl", FrameGeometry("qwen2-vl", 28, 2, TRAINED_MIN_PIXELS, TRAINED_MAX_PIXELS),
                            TRAINED_NOTICE, (96, 72)),
    TINY_RANDOM_NAME: OfflineModel("qwen2_5_vl", FrameGeometry("qwen2-vl", 28, 2, *QWEN2_PIXELS), RANDOM_WEIGHTS_NOTICE),
    "tiny-random-qwen2-vl": OfflineModel("qwen2_vl", FrameGeometry("qwen2-vl", 28, 2, *QWEN2_PIXELS), RANDOM_WEIGHTS_NOTICE),
    "tiny-random-qwen3-vl": OfflineModel("qwen3_vl", FrameGeometry("qwen3-vl", 32, 2, *SMALL_QWEN3_PIXELS,
                                                                    text_per_grid=BYTE_TEXT_PER_GRID), RANDOM_WEIGHTS_NOTICE,
                                        (320, 224)),
    "tiny-random-qwen3.5": OfflineModel("qwen3_5", FrameGeometry("qwen3-vl", 32, 2, *SMALL_QWEN3_PIXELS,
                                                                  text_per_grid=BYTE_TEXT_PER_GRID), RANDOM_WEIGHTS_NOTICE,
                                       (320, 224)),
    "tiny-random-llava-ov": OfflineModel("llava_onevision", FrameGeometry("fixed", 27, 1, 384 * 384, 384 * 384, fixed_size=(384, 384),
                                                                          fixed_grid=(14, 14)), RANDOM_WEIGHTS_NOTICE,
                                        (1568, 1176)),
}
#: The budget ``(M, C)`` the app starts a real checkpoint of each family with (InfiniPot-V's 6144 / 4608; for
#: LLaVA-OneVision 32 / 24 frames of 196 tokens).
FAMILY_BUDGETS = {"qwen2_vl": (6144, 4608), "qwen2_5_vl": (6144, 4608), "qwen3_vl": (6144, 4608), "qwen3_5": (6144, 4608),
                  "llava_onevision": (6272, 4704)}
#: Real checkpoints the app lists (any other id or local folder of these families loads too).
REAL_MODELS = (
    "Qwen/Qwen2.5-VL-3B-Instruct",
    "Qwen/Qwen2.5-VL-7B-Instruct",
    "Qwen/Qwen2-VL-2B-Instruct",
    "Qwen/Qwen3-VL-2B-Instruct",
    "Qwen/Qwen3-VL-8B-Instruct",
    "Qwen/Qwen3.5-2B",
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
    "llava-hf/llava-onevision-qwen2-7b-ov-hf",
)
#: What each family was checked against, and how (the README's table; the tests say the same).
VERIFIED = {
    "qwen2_5_vl": "trained tiny model and random weights, CPU: chunked prefill = transformers' forward; real clip",
    "qwen2_vl": "random weights, CPU: positions, pixels, chunked prefill = transformers' forward; real clip",
    "qwen3_vl": "random weights, CPU: positions = get_rope_index, pixels, DeepStack, chunked prefill = forward; real clip",
    "qwen3_5": "random weights, CPU: linear-state fork exact, chunked prefill = forward; real clip",
    "llava_onevision": "random weights, CPU: pooled provenance, newline once, chunked prefill = forward; real clip",
}


#: What a user must know about a family in a streaming memory (the app's banner and the CLI say it).
FAMILY_CAVEATS = {
    "qwen3_5": "Qwen3.5: only its full-attention layers (one in four) hold tokens, so the budget, eviction and "
               "heatmaps cover those layers; frames evicted from them keep influencing answers through the "
               "linear-attention layers' recurrent state.",
    "llava_onevision": "LLaVA-OneVision: positions grow by 196 a frame and eviction does not give them back, so the "
                       "stream stops with a message where the model's trained positions end (about 166 frames with "
                       "a 32K range; kvdemo's rule: kept keys are never re-rotated).",
}


def resolve_model_name(name: str | None = None) -> str:
    """``auto`` -> a real Qwen2.5-VL on a CUDA machine, the offline ``tiny`` model otherwise.

    ``KVDEMO_MODEL`` overrides the default when no name is given.
    """
    name = name or os.environ.get("KVDEMO_MODEL") or "auto"
    if name == "auto":
        return DEFAULT_REAL_MODEL if torch.cuda.is_available() else TINY_NAME
    return name


def offline_model(name: str | None) -> OfflineModel | None:
    """The offline model ``name`` resolves to, or None for a real checkpoint."""
    return OFFLINE_MODELS.get(resolve_model_name(name))


def notice_for(name: str | None) -> str | None:
    """What the answers of model ``name`` are worth, when that needs saying (None for a real checkpoint)."""
    offline = offline_model(name)
    return offline.notice if offline else None


#: ``config.model_type`` -> the adapter module of its family (imported when a checkpoint of it is used: every
#: adapter imports transformers). Adding a family is adding an adapter file and its line here.
FAMILY_MODULES = {
    "qwen2_vl": "kvdemo.models.qwen2_vl",
    "qwen2_5_vl": "kvdemo.models.qwen2_vl",
    "qwen3_vl": "kvdemo.models.qwen3_vl",
    "qwen3_5": "kvdemo.models.qwen3_5",
    "llava_onevision": "kvdemo.models.llava_onevision",
}


def family_module(model_type: str) -> ModuleType:
    """The adapter module of ``model_type``'s family (imported here, on purpose, only when one is used)."""
    if model_type not in FAMILY_MODULES:
        raise ModelError(f"a {model_type!r} model is not supported; kvdemo supports the families "
                         f"{', '.join(sorted(FAMILY_MODULES))}")
    return importlib.import_module(FAMILY_MODULES[model_type])


def family_of(name: str | None) -> str | None:
    """The family (``config.model_type``) of model ``name``; None when a real checkpoint's config cannot be read."""
    offline = offline_model(name)
    if offline is not None:
        return offline.family
    try:
        return checkpoint_config(resolve_model_name(name)).model_type
    except ModelError:
        return None


def checkpoint_config(model_id: str) -> Any:
    """A checkpoint's config (local folder, Hugging Face cache, or the Hub); :class:`ModelError` naming it if it
    cannot be read. The folder and the cache are tried first, and the Hub is asked only once it answered one
    request (``hub_reachable``): without a network, huggingface_hub would retry each file five times (about 25 s
    and a dozen warnings) before failing."""
    from transformers import AutoConfig  # deferred on purpose: only real checkpoints need it

    shown = model_id if len(model_id) <= 80 else model_id[:77] + "..."
    try:
        return AutoConfig.from_pretrained(model_id, trust_remote_code=False, local_files_only=True)
    except Exception as exc:
        if os.path.isdir(model_id):
            raise ModelError(f"cannot load model {shown!r}: {str(exc).splitlines()[0][:200]}") from None
    reachable = hub_reachable()
    if reachable is not None:
        raise ModelError(f"model {shown!r} is neither a local folder nor in the Hugging Face cache, and the Hub "
                         f"cannot be reached ({reachable}); give a local checkpoint folder (--model /path/to/folder) "
                         f"or an offline model ({', '.join(OFFLINE_MODELS)})")
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
    """``(M, C, max pixels)`` the app starts model ``name`` with."""
    offline = offline_model(name)
    if offline is not None:
        return (*offline.budget, offline.geometry.max_pixels)
    config = checkpoint_config(resolve_model_name(name))
    return (*FAMILY_BUDGETS[config.model_type], family_module(config.model_type).geometry(config).max_pixels)


def geometry_for(name: str | None) -> FrameGeometry:
    """How model ``name`` sizes frames, known without loading its weights (a real checkpoint's config is read)."""
    offline = offline_model(name)
    if offline is not None:
        return offline.geometry
    config = checkpoint_config(resolve_model_name(name))
    return family_module(config.model_type).geometry(config)
