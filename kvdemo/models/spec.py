"""What kvdemo knows about a model family, declared once: each family's file (``kvdemo/models/<family>.py``) holds
one :class:`FamilySpec` named ``SPEC``, and everything else (the catalog, loading, the app, the CLI, the test and
benchmark fixtures) reads it. Adding a family is adding that one file (see docs/library.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.chunk import VisualChunk
from ..media.geometry import FrameGeometry

#: The offline models' names: the trained tiny model and its random-weight twin (what ``auto`` means on a CPU).
TINY_NAME = "tiny"
TINY_RANDOM_NAME = "tiny-random"
RANDOM_WEIGHTS_NOTICE = (
    "Answers come from the offline tiny model with random weights: they show the mechanics, not understanding."
)
TRAINED_NOTICE = "A tiny model trained on synthetic streams: it knows shapes and colours, nothing else."


@dataclass(frozen=True)
class OfflineModel:
    """A model of a family that runs with no download (built in code, or the trained tiny model shipped with
    kvdemo): its name, the ``config.model_type`` it builds, how it sizes frames, what its answers are worth, the
    budget ``(M, C)`` the app starts it with (one that compresses visibly within the bundled sample or the real
    test clip), and how to build it."""

    name: str
    family: str
    geometry: FrameGeometry
    notice: str
    build: Callable[[], Any]  # () -> the model behind its family's adapter (a VideoLM)
    budget: tuple[int, int] = (1024, 768)


@dataclass(frozen=True)
class FamilySpec:
    """One model family, everything kvdemo knows about it in one place.

    model_types: the checkpoints' ``config.model_type`` values the family's file loads.
    geometry: a checkpoint's config -> how it sizes frames (patch x merge = the resize factor, the pixel range
    per frame, the family's resize rule; :class:`~kvdemo.media.geometry.FrameGeometry`).
    pixel_mean / pixel_std: the normalisation its vision tower was trained with (a test checks them against the
    family's video processor).
    load: ``(checkpoint id or folder, its config, device or None)`` -> the model behind the family's adapter.
    budget: the ``(M, C)`` the app starts a real checkpoint with.
    caveat: what a user must know about this family in a streaming memory (the app's banner and the CLI say it).
    verified: what the family was checked against here, and how (the app says it beside an offline model).
    checkpoints: real checkpoints the app lists (any other id or local folder of the family loads too).
    offline: its models that run with no download (the tests' models of this family).
    menu_order: where the app and the catalog list the family among the others (lower first).
    released: released checkpoints' configs by a short name (``model_type``, ``text_config``, ``vision_config``,
    ``tie_word_embeddings``: the fields that shape the computation, from each ``config.json``), for random weights at
    real shapes (``python -m kvdemo doctor --full-depth``).
    synthetic_positions: ``(chunk, start)`` -> positions ``[3, n]`` of a chunk's tokens after ``start`` tokens at a
    real checkpoint's settings, without a model (synthetic memories in tests and benchmarks); None where the
    family's positions need a model.
    """

    name: str
    model_types: tuple[str, ...]
    geometry: Callable[[Any], FrameGeometry]
    pixel_mean: tuple[float, float, float]
    pixel_std: tuple[float, float, float]
    load: Callable[[str, Any, str | None], Any]
    verified: str
    budget: tuple[int, int] = (6144, 4608)
    caveat: str | None = None
    checkpoints: tuple[str, ...] = ()
    offline: tuple[OfflineModel, ...] = ()
    menu_order: int = 100
    synthetic_positions: Callable[[VisualChunk, int], torch.Tensor] | None = None
    released: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False, compare=False)
