"""What a view shows, as plain data: declared by whoever owns the knowledge (a policy's own state, an
answer's attribution), drawn by :mod:`kvdemo.viz`, laid out by the app. Nothing here draws, and nothing
here knows a policy, a model or Gradio.

A policy declares its views with :meth:`kvdemo.policies.contract.Policy.views`, which receives a
:class:`ViewContext` (what the memory looked like) and returns a list of :data:`View`: a strip of frames
whose patches carry integer labels (:class:`PatchLabels`), a strip of frames whose patches carry a value
(:class:`PatchValues`), or a chart made of parts (:class:`Chart`: histograms, series, a grid of labelled
cells).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun`` in agreement, as every count the app prints says it: "1 token", "2 tokens", "0 tokens"
    (``plural`` for a noun whose plural is not ``noun + "s"``: ``counted(1, "patch", "patches")``)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def tokens_held(memory: Any) -> str:
    """What a memory holds, as the CLI and the app say it: "150 visual tokens held", and for a policy with a summary
    region the slots it reserves in ``M`` from the first chunk beside them ("150 visual tokens held + 4608 summary
    slots reserved (0 in use)"), never added to the tokens held."""
    held = counted(memory.held_tokens, "visual token") + " held"
    if not memory.summary_slots:
        return held
    return f"{held} + {counted(memory.summary_slots, 'summary slot')} reserved ({memory.summary_active} in use)"


#: Label of a patch that carries none (drawn as it is), and of one whose label no longer holds (dark red).
UNLABELLED, LOST = -1, -2


@dataclass
class ViewContext:
    """What a view may read of an engine besides its own state: the memory's shape and timeline."""

    num_layers: int
    num_kv_heads: int
    grid_shape: tuple[int, int] | None
    grid_times_s: list[float]
    timeline: list[Any] = field(default_factory=list)  # OccupancyEvent, oldest first
    summary_slots: int = 0
    #: ``[2, layers, grids]`` visual tokens of each frame in the offload stores, and of those the ones the last
    #: question retrieved (None: nothing offloaded)
    retrieved_frames: Any = None

    @property
    def num_grids(self) -> int:
        return len(self.grid_times_s)


@dataclass
class PatchLabels:
    """Frames (temporal grids ``grids``) with every patch coloured by its integer label ``labels [n, rows, cols]``
    (the same label, the same colour across frames; :data:`UNLABELLED` as it is, :data:`LOST` dark red), the
    label written in each patch when it fits; ``frame_captions`` one per frame."""

    title: str
    caption: str
    grids: list[int]
    labels: np.ndarray
    frame_captions: list[str]


@dataclass
class PatchValues:
    """Frames (temporal grids ``grids``) with every patch tinted by a value in [0, 1] (``values [n, rows, cols]``),
    e.g. the attention an answer put on it; ``frame_captions`` one per frame."""

    title: str
    caption: str
    grids: list[int]
    values: np.ndarray
    frame_captions: list[str]


@dataclass
class Histogram:
    """A histogram of ``values`` (log-spaced integer bins when ``log_bins``)."""

    values: np.ndarray
    x_title: str
    y_title: str
    log_bins: bool = True


@dataclass
class Series:
    """Lines over a shared x axis: ``lines`` maps a name to its y values; ``limit`` draws a dashed level;
    ``log_y`` a logarithmic y axis; ``markers`` a dot at each point (few points, or gaps: None values)."""

    x: list[float]
    lines: dict[str, list[float]]
    x_title: str
    y_title: str
    limit: float | None = None
    log_y: bool = False
    markers: bool = False


@dataclass
class CellGrid:
    """A grid of cells (rows x columns, e.g. layers x KV heads), each in one of ``class_names`` (``classes
    [rows, cols]`` int) with ``numbers [rows, cols]`` written in and a hover line per cell."""

    classes: np.ndarray
    class_names: dict[int, str]
    numbers: np.ndarray
    hover: list[list[str]]
    row_names: list[str]
    col_names: list[str]


@dataclass
class Chart:
    """A chart of one or more parts side by side."""

    title: str
    caption: str
    parts: list[Histogram | Series | CellGrid]


View = PatchLabels | PatchValues | Chart
