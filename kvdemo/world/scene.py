"""What a generated stream is made of (:mod:`kvdemo.world.synthetic` generates them, :mod:`kvdemo.world.camera` adds the moving
kind's camera): the vocabulary of shapes and colours, the patch grid objects sit on, a stream's specification,
its objects, clutter, camera and questions, and the shapes' pixel masks. See :mod:`kvdemo.world.synthetic` for what the
two kinds of stream show and how questions get their ground truth."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

from ..media.video import Video, VideoError

FPS = 2.0
FRAMES_PER_PAIR = 2
#: The vision encoder's patch size: objects sit on this grid and move in steps of it.
CELL = 14
#: A 112 x 112 frame pair is 4 x 4 = 16 visual tokens.
FRAME_SIDE = 112
#: Pixels per side of one visual token of the offline model (patch 14 x merge 2): generated frames are cut on it.
RESIZE_FACTOR = 2 * CELL
SHAPES = ("circle", "square", "triangle", "cross", "star", "diamond")
#: Moving kind: object-sized decoys that no question names (labelled CLUTTER for the shape head).
DECOY_SHAPES = ("ring", "slab", "corner")
COLOURS = {
    "red": (220, 45, 45),
    "green": (45, 185, 70),
    "blue": (55, 90, 235),
    "yellow": (235, 220, 45),
    "white": (240, 240, 240),
    "purple": (155, 65, 210),
    "orange": (245, 140, 35),
}
COLOUR_NAMES = tuple(COLOURS)
#: Per-token shape labels: a shape index, CLUTTER, or NOTHING; colour labels: a colour index or NOTHING_COLOUR.
CLUTTER = len(SHAPES)
NOTHING = len(SHAPES) + 1
NOTHING_COLOUR = len(COLOURS)
#: A token is labelled with the item covering most of its 28 x 28 px over the pair, if it covers this many pixels.
MIN_LABEL_PIXELS = 30
OBJECT_BOX = 2 * CELL
COLOUR_QUESTION = "What colour was the {shape}?"
FIRST_QUESTION = "Which shape appeared first?"
QUESTION_KINDS = ("colour", "first")
#: The kinds of generated stream (see the module docstring).
STREAM_KINDS = ("static", "moving")
#: Per kind, when a spec does not say: objects, decoys and clutter items per stream (the moving kind's
#: scenes are busier, with more same-palette distractors).
DEFAULT_OBJECTS = {"static": (2, 4), "moving": (3, 5)}
DEFAULT_DECOYS = {"static": (0, 0), "moving": (2, 4)}
DEFAULT_CLUTTER = {"static": (0, 2), "moving": (4, 8)}
#: Moving kind: the camera's zoom levels. At 1.5x a 2 x 2-cell object box is exactly 3 x 3 cells.
ZOOMS = (1.0, 1.5)
#: Moving kind: the world extends this many cells beyond the frame on every side (at 1x).
WORLD_MARGIN = 2
#: Moving kind, per frame pair: the chance that the camera starts zoomed in, changes its zoom, turns.
ZOOMED_START, ZOOM_CHANGE, TURN = 0.3, 0.08, 0.15
#: Moving kind: the lighting drift's amplitude range (a gain 1 +- a on the whole frame) and period (s).
LIGHT_AMPLITUDE, LIGHT_PERIOD_S = (0.05, 0.15), (8.0, 30.0)


def normalise_question(text: str) -> str:
    text = re.sub(r"\bcolor\b", "colour", (text or "").casefold())
    return " ".join(re.sub(r"[^a-z ]", " ", text).split())


@dataclass(frozen=True)
class StreamSpec:
    """What a generated stream may contain; ranges are inclusive ``(low, high)``.

    ``kind``: ``static`` or ``moving``; ``objects``, ``decoys`` and ``clutter`` left at ``None`` take the
    kind's default (:data:`DEFAULT_OBJECTS`, ...); decoys and ``reappear`` (the chance that an object or a
    decoy is seen twice) are the moving kind's only.
    """

    pairs: tuple[int, int] = (8, 40)
    objects: tuple[int, int] | None = None
    visible_pairs: tuple[int, int] = (1, 5)
    clutter: tuple[int, int] | None = None
    object_side: tuple[int, int] = (22, 26)
    size: tuple[int, int] = (FRAME_SIDE, FRAME_SIDE)
    fps: float = FPS
    kind: str = "static"
    reappear: float = 0.5
    decoys: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in STREAM_KINDS:
            raise VideoError(f"unknown stream kind {self.kind!r}: one of {', '.join(STREAM_KINDS)}")
        for name, defaults in (("objects", DEFAULT_OBJECTS), ("decoys", DEFAULT_DECOYS), ("clutter", DEFAULT_CLUTTER)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[self.kind])
        if self.kind == "static" and self.decoys != (0, 0):
            raise VideoError("decoys belong to the moving kind")
        height, width = self.size
        if height % RESIZE_FACTOR or width % RESIZE_FACTOR or height < OBJECT_BOX or width < OBJECT_BOX:
            raise VideoError(f"generated frames need sides that are multiples of {RESIZE_FACTOR}, got {height}x{width}")
        if not 1 <= self.objects[0] <= self.objects[1] <= len(SHAPES):
            raise VideoError(f"a stream holds 1 to {len(SHAPES)} objects (one per shape), got {self.objects}")
        if self.pairs[0] < 1 or self.pairs[0] > self.pairs[1] or self.visible_pairs[0] < 1:
            raise VideoError(
                f"stream and visibility lengths must be positive ranges, got {self.pairs}, {self.visible_pairs}"
            )


@dataclass(frozen=True)
class SceneObject:
    """One object: its box's top-left patch cell ``(row, col)`` in each frame of ``frames``.

    Static kind: ``frames`` are ``first_frame..first_frame + len(cells) - 1`` and boxes are 2 x 2 cells.
    Moving kind: ``shown`` lists the frames it is drawn in (gaps where it is gone or out of view) and
    ``boxes`` its box side in cells in each (2 at 1x, 3 at 1.5x); ``side`` is its shape's side at 1x.
    """

    shape: str
    colour: str
    side: int
    first_frame: int
    cells: tuple[tuple[int, int], ...]
    moving: bool
    shown: tuple[int, ...] = ()
    boxes: tuple[int, ...] = ()

    @property
    def frames(self) -> tuple[int, ...]:
        return self.shown or tuple(range(self.first_frame, self.first_frame + len(self.cells)))

    @property
    def last_frame(self) -> int:
        return self.shown[-1] if self.shown else self.first_frame + len(self.cells) - 1

    @property
    def appearances(self) -> list[tuple[int, int]]:
        """``(first, last)`` frame of each run of consecutive drawn frames: one per sighting."""
        frames = np.asarray(self.frames)
        breaks = np.flatnonzero(np.diff(frames) > 1)
        return [(int(a), int(b)) for a, b in zip(frames[np.r_[0, breaks + 1]], frames[np.r_[breaks, len(frames) - 1]])]

    def drawn(self, index: int) -> tuple[int, int, int]:
        """``(top, left, side)`` in pixels of the shape drawn in its ``index``-th frame."""
        box = self.boxes[index] if self.boxes else 2
        side = drawn_side(self.side, box)
        row, col = self.cells[index]
        offset = (box * CELL - side) // 2
        return row * CELL + offset, col * CELL + offset, side

    @property
    def first_pair(self) -> int:
        return self.first_frame // FRAMES_PER_PAIR

    @property
    def last_pair(self) -> int:
        return self.last_frame // FRAMES_PER_PAIR


@dataclass(frozen=True)
class Clutter:
    """A small bar or dot at a free pixel position, visible over frames ``first_frame..last_frame``
    (moving kind: a world position at 1x, seen through the camera and cut at the frame's edge)."""

    kind: str  # "bar" | "dot"
    colour: str
    top: int
    left: int
    height: int
    width: int
    first_frame: int
    last_frame: int


@dataclass(frozen=True)
class Question:
    """A question with its ground truth; ``shown_s``/``left_s``: when its evidence first appeared / left view."""

    kind: str
    text: str
    answer: str
    subject: str
    shown_s: float
    left_s: float


@dataclass(frozen=True, eq=False)
class Camera:
    """The moving kind's camera. Per frame pair: ``zoom`` ``[pairs]`` (1 or 1.5) and ``offset`` ``[pairs, 2]``
    int, the frame's top-left (row, col) in cells of the zoomed world; per frame: ``gain`` ``[frames]``,
    the lighting drift's factor on the whole frame. World cell ``w`` (1x) is frame cell
    ``floor(zoom * w + 0.5) - offset``; frame pixel ``y`` shows world pixel ``(y + 14 * offset) / zoom``."""

    zoom: np.ndarray
    offset: np.ndarray
    gain: np.ndarray

    def frame_cells(self, world: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """Frame cells ``[N, 2]`` of world cells ``[N, 2]`` seen in frame pairs ``[N]`` (snapped to the grid)."""
        return np.floor(self.zoom[pairs, None] * world + 0.5).astype(np.int64) - self.offset[pairs]


@dataclass
class Episode:
    """A generated stream, what it shows, and the questions it answers.

    ``colour_labels``/``shape_labels``: ``[pairs, tokens_per_pair]`` int64 per visual token (grid-major,
    row-major like the encoder's merged tokens): the item covering most of the token's 28 x 28 px over the
    pair (at least ``MIN_LABEL_PIXELS``), else ``NOTHING_COLOUR``/``NOTHING``; decoys are labelled like
    clutter (their colour, ``CLUTTER``). ``camera`` and ``decoys``: the moving kind's.
    """

    seed: tuple[int, ...]
    video: Video
    objects: list[SceneObject]
    clutter: list[Clutter]
    questions: list[Question]
    colour_labels: np.ndarray
    shape_labels: np.ndarray
    spec: StreamSpec = field(default_factory=StreamSpec)
    camera: Camera | None = None
    decoys: list[SceneObject] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def pairs(self) -> int:
        return self.colour_labels.shape[0]

    @property
    def pair_seconds(self) -> float:
        return FRAMES_PER_PAIR / self.video.fps

    def answer_for(self, question: str, time_s: float | None = None) -> Question | None:
        """The known question matching ``question`` (case, spacing, "color" and a missing "?" ignored),
        if its evidence had been shown by stream time ``time_s`` (any time when ``None``); else ``None``."""
        wanted = normalise_question(question)
        for known in self.questions:
            if normalise_question(known.text) == wanted and (time_s is None or time_s > known.shown_s):
                return known
        return None

    def describe(self) -> list[str]:
        """One line per object, decoy and clutter item, in order of appearance, with times in seconds."""
        seconds = 1.0 / self.video.fps
        lines = []
        for item in sorted(self.objects + self.decoys, key=lambda o: o.first_frame):
            motion = "moving" if item.moving else "still"
            spans = ", ".join(f"{first * seconds:g}-{(last + 1) * seconds:g} s" for first, last in item.appearances)
            decoy = "decoy: " if item.shape in DECOY_SHAPES else ""
            lines.append(f"{decoy}{item.colour} {item.shape} ({motion}), {spans}")
        for item in self.clutter:
            lines.append(
                f"clutter: {item.colour} {item.kind}, {item.first_frame * seconds:g}-{(item.last_frame + 1) * seconds:g} s"
            )
        return lines


def world_size(size: tuple[int, int]) -> tuple[int, int]:
    """The moving kind's world in pixels at 1x: the frame plus ``WORLD_MARGIN`` cells on every side."""
    return size[0] + 2 * WORLD_MARGIN * CELL, size[1] + 2 * WORLD_MARGIN * CELL


def drawn_side(side: int, box: int) -> int:
    """The side in pixels of a shape of ``side`` px at 1x drawn in a box of ``box`` cells (2 at 1x, 3 at 1.5x)."""
    return (side * box + 1) // 2


def grid_path(
    rng: np.random.Generator, rows: int, cols: int, frames: int, moving: bool, start: tuple[int, int] | None = None
) -> tuple[tuple[int, int], ...]:
    """Top-left cells of a 2 x 2 box in each of ``frames`` frames: from ``start`` (drawn when ``None``), still
    or one cell every 2-4 frames in a random direction, bouncing inside ``rows`` x ``cols`` cells."""
    row, col = (int(rng.integers(rows)), int(rng.integers(cols))) if start is None else start
    if not moving:
        return ((row, col),) * frames
    every = int(rng.integers(2, 5))
    step_r, step_c = 0, 0
    while step_r == 0 and step_c == 0:
        step_r, step_c = (int(x) for x in rng.integers(-1, 2, size=2))
    cells = []
    for frame in range(frames):
        if frame and frame % every == 0:
            if not 0 <= row + step_r < rows:
                step_r = -step_r
            if not 0 <= col + step_c < cols:
                step_c = -step_c
            row, col = min(max(row + step_r, 0), rows - 1), min(max(col + step_c, 0), cols - 1)
        cells.append((row, col))
    return tuple(cells)


@lru_cache(maxsize=None)
def shape_mask(shape: str, side: int) -> np.ndarray:
    """Boolean mask ``[side, side]`` of ``shape`` drawn without antialiasing."""
    image = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(image)
    last = side - 1
    centre = last / 2
    if shape == "circle":
        draw.ellipse([0, 0, last, last], fill=1)
    elif shape == "square":
        draw.rectangle([1, 1, last - 1, last - 1], fill=1)
    elif shape == "triangle":
        draw.polygon([(centre, 0), (last, last), (0, last)], fill=1)
    elif shape == "cross":
        arm = side / 3
        draw.rectangle([arm, 0, last - arm, last], fill=1)
        draw.rectangle([0, arm, last, last - arm], fill=1)
    elif shape == "star":
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, side / 2, side / 5)
        draw.polygon([(centre + r * np.cos(a), centre + 0.55 + r * np.sin(a)) for r, a in zip(radii, angles)], fill=1)
    elif shape == "diamond":
        draw.polygon([(centre, 0), (last, centre), (centre, last), (0, centre)], fill=1)
    elif shape == "ring":
        hole = side / 4
        draw.ellipse([0, 0, last, last], fill=1)
        draw.ellipse([hole, hole, last - hole, last - hole], fill=0)
    elif shape == "slab":
        draw.rectangle([0, side * 0.3, last, last - side * 0.3], fill=1)
    elif shape == "corner":
        arm = side / 3
        draw.rectangle([0, 0, arm, last], fill=1)
        draw.rectangle([0, last - arm, last, last], fill=1)
    else:
        raise VideoError(f"unknown shape {shape!r}")
    return np.asarray(image, dtype=bool)
