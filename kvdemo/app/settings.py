"""The settings a user types, checked with the same rules as a run: the policy's parameters from the form, the
budget resolved once (:class:`~kvdemo.budget.Budget`), and the chunk it must hold; the defaults per model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..budget import Budget
from ..models.base import ModelError
from ..models.catalog import TINY_NAME, TINY_RANDOM_NAME, TRAINED_MAX_PIXELS, preferred_pixel_range, resolve_model_name
from ..policies import BudgetError, Policy, coerce_param, make_policy, policy_class, policy_params
from ..synthetic import sample_episode
from ..video import RESIZE_FACTOR, TEMPORAL_PATCH_SIZE, VideoError, open_video, smart_resize, tokens_per_grid
from .. import zerogpu
from ..engine import EngineError
from .sessions import RunSettings

FRAMES_PER_CHUNK = 2
#: The errors a user can cause: shown as one-line messages, never tracebacks.
USER_ERRORS = (VideoError, BudgetError, EngineError, ModelError)


def parse_params(policy: str, values: dict[str, Any]) -> dict[str, Any]:
    """Form values of ``policy``'s parameters -> keyword arguments (blank number lists mean "none")."""
    return {spec.name: coerce_param(policy, spec, values[spec.name]) for spec in policy_params(policy) if spec.name in values}


def chunk_tokens(size: tuple[int, int] | None, max_pixels: int, temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> tuple[int, str]:
    """Visual tokens of one chunk (``FRAMES_PER_CHUNK`` frames) and its shape in words, for frames resized
    to ``size`` (height, width) or, when the size is not known yet, the most ``max_pixels`` allows."""
    grids = -(-FRAMES_PER_CHUNK // temporal_patch_size)
    if size is not None:
        rows, cols = size[0] // RESIZE_FACTOR, size[1] // RESIZE_FACTOR
        return grids * tokens_per_grid(size), f"{grids} temporal grid(s) of {rows}x{cols} tokens"
    return grids * (int(max_pixels) // RESIZE_FACTOR**2), f"{FRAMES_PER_CHUNK} frames at max pixels"


def resolve_settings(settings: RunSettings) -> tuple[Policy, Budget]:
    """The settings as the engine will take them: the policy (with its parameters) and its budget, resolved
    once; :class:`BudgetError` with a one-line reason if they cannot work (the sampling and pixel numbers
    too). A policy sized by ``M`` alone ignores ``C``."""
    policy = make_policy(settings.policy, **settings.params)
    if settings.fps is None or float(settings.fps) <= 0:
        raise BudgetError(f"sampling fps must be positive, got {settings.fps}")
    if settings.max_pixels is None or int(settings.max_pixels) < RESIZE_FACTOR**2:
        raise BudgetError(f"max pixels must be at least {RESIZE_FACTOR**2} (one 28x28 patch), got {settings.max_pixels}")
    if settings.cap_mb is not None and settings.cap_mb < 0:
        raise BudgetError(f"the baseline memory cap must be 0 (no cap) or more MB, got {settings.cap_mb:g}")
    takes_keep = type(policy).takes_keep()
    if settings.budget is None or (takes_keep and settings.keep is None):
        raise BudgetError("set both M and C" if takes_keep else "set M")
    return policy, Budget.resolve(policy, settings.budget, settings.keep if takes_keep else None)


def validate_settings(
    policy: str, budget: Any, keep: Any, fps: Any = 2.0, max_pixels: Any = 200704, video: str | None = None,
    model: str | None = None,
) -> str:
    """A one-line verdict on the settings, shown as the user types: the same checks as the run they lead to,
    with one chunk of the uploaded ``video`` (resized into ``model``'s pixel range) when there is one, else of
    the bundled sample (what runs without an upload)."""
    try:
        settings = RunSettings("", policy, {}, budget, keep, fps, max_pixels, False, 0)
        _, resolved = resolve_settings(settings)
        min_pixels = min(int(max_pixels), preferred_pixel_range(model)[0])
        if video:
            size = open_video(video, fps=float(fps), max_pixels=int(max_pixels), min_pixels=min_pixels).size
            name = f" of {Path(video).name} ({size[1]}x{size[0]})"
        else:
            size = smart_resize(*sample_episode().video.size, min_pixels=min_pixels, max_pixels=int(max_pixels))
            name = " of the bundled sample"
        tokens, shape = chunk_tokens(size, max_pixels)
        resolved.check_chunk(tokens, shape)
    except USER_ERRORS as exc:
        return f"⚠️ {exc}"
    except (TypeError, ValueError) as exc:
        return f"⚠️ not a number: {exc}"
    upload = "" if video else f" (an upload's: up to {chunk_tokens(None, max_pixels)[0]} at max pixels)"
    if resolved.C is None:
        return (f"✓ M={resolved.M} = {resolved.split_text} (C does not apply); one chunk{name} is {tokens} visual "
                f"tokens{upload} and must fit the {resolved.window_name}")
    return (f"✓ M={resolved.M}, C={resolved.C}: one chunk{name} is {tokens} visual tokens{upload}; "
            f"M and M − C must each hold one chunk")


def policy_label(policy: str, budget: Budget) -> str:
    """"**infinipot-v**, M=1024 C=768" (Markdown; "**protokv**, M=1024" for a policy sized by M alone)."""
    if not budget.bounded:
        return f"**{policy}**"
    return f"**{policy}**, M={budget.M}" + (f" C={budget.C}" if budget.C is not None else "")


def takes_keep(policy: str) -> bool:
    """Whether ``policy``'s budget has a ``C`` (the C field is greyed out otherwise)."""
    return policy_class(policy).takes_keep()


def default_budget(model_name: str) -> tuple[int, int, int]:
    """(M, C, max pixels) defaults: the paper's 6144/4608 at Qwen's video resolution on a real model;
    budgets that compress visibly within a short clip on the tiny models (the trained one at the 112 x 112
    frames it was trained on, 16 tokens per frame pair: M = 96 holds 12 s of the 40 s sample, and M - C = 24,
    like a near window of 24 at M = 96 for a policy sized by M alone, holds a chunk at its max pixels, 20
    tokens)."""
    name = resolve_model_name(model_name)
    if name == TINY_NAME:
        return 96, 72, TRAINED_MAX_PIXELS
    if name == TINY_RANDOM_NAME:
        return 1024, 768, 256 * 28 * 28
    return 6144, 4608, 768 * 28 * 28


def baseline_cap_default() -> int:
    """The full-cache baseline's memory cap (MB): 2048, or 512 when every GPU call pickles the session's state
    in and out (ZeroGPU: the baseline's cache is most of what crosses, ~37 KB per visual token on
    Qwen2.5-VL-3B)."""
    return 512 if zerogpu.active() else 2048
