"""Generated streams with questions and ground truth: what the offline tiny model is trained and
evaluated on, the app's bundled sample, and the mechanics benchmarks' long clips.

A stream shows objects of distinct shapes (circle, square, triangle, cross, star, diamond; each shape
at most once per stream, so "the circle" names one object) in palette colours (drawn with replacement,
so same-colour decoys are common), each visible for a few frame pairs at a random time, half of them
moving, over a textured grey background with small clutter bars and dots in palette colours.

Objects sit on the vision encoder's 14-px patch grid and move in 14-px steps: a box of 2 x 2 patches
whose top-left corner is a patch corner, the shape 22-26 px wide inside it. (A feasibility run showed
that the tiny two-block vision encoder never learns shape when objects sit at free sub-patch positions;
see the README.) Frames are sampled at 2 fps, so one frame pair (one temporal grid, 16 visual tokens at
112 x 112) spans one second of stream time.

Questions (answers from a small vocabulary):

- ``colour``: "What colour was the <shape>?" -> a colour name; the evidence is that object.
- ``first``: "Which shape appeared first?" -> a shape name; the evidence is the earliest object (asked
  only when one object appeared strictly before the others, at frame-pair resolution).

Each question records when its evidence was first shown and when it left view (``left_s``: the time
of the first frame after its last appearance); the query delay is measured from ``left_s``.
Everything is a pure function of the seed (``numpy.random.default_rng(seed)``; a seed may be a tuple
of ints, which is how training and evaluation keep disjoint streams).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

from .video import Video, VideoError

FPS = 2.0
FRAMES_PER_PAIR = 2
#: The vision encoder's patch size: objects sit on this grid and move in steps of it.
CELL = 14
#: A 112 x 112 frame pair is 4 x 4 = 16 visual tokens.
FRAME_SIDE = 112
#: Pixels per side of one visual token of the offline model (patch 14 x merge 2): generated frames are cut on it.
RESIZE_FACTOR = 2 * CELL
SHAPES = ("circle", "square", "triangle", "cross", "star", "diamond")
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


@dataclass(frozen=True)
class StreamSpec:
    """What a generated stream may contain; ranges are inclusive ``(low, high)``."""

    pairs: tuple[int, int] = (8, 40)
    objects: tuple[int, int] = (2, 4)
    visible_pairs: tuple[int, int] = (1, 5)
    clutter: tuple[int, int] = (0, 2)
    object_side: tuple[int, int] = (22, 26)
    size: tuple[int, int] = (FRAME_SIDE, FRAME_SIDE)
    fps: float = FPS

    def __post_init__(self) -> None:
        height, width = self.size
        if height % RESIZE_FACTOR or width % RESIZE_FACTOR or height < OBJECT_BOX or width < OBJECT_BOX:
            raise VideoError(f"generated frames need sides that are multiples of {RESIZE_FACTOR}, got {height}x{width}")
        if not 1 <= self.objects[0] <= self.objects[1] <= len(SHAPES):
            raise VideoError(f"a stream holds 1 to {len(SHAPES)} objects (one per shape), got {self.objects}")
        if self.pairs[0] < 1 or self.pairs[0] > self.pairs[1] or self.visible_pairs[0] < 1:
            raise VideoError(f"stream and visibility lengths must be positive ranges, got {self.pairs}, {self.visible_pairs}")


@dataclass(frozen=True)
class SceneObject:
    """One object: its box's top-left patch cell ``(row, col)`` in each frame of ``frames`` (first..last)."""

    shape: str
    colour: str
    side: int
    first_frame: int
    cells: tuple[tuple[int, int], ...]
    moving: bool

    @property
    def last_frame(self) -> int:
        return self.first_frame + len(self.cells) - 1

    @property
    def first_pair(self) -> int:
        return self.first_frame // FRAMES_PER_PAIR

    @property
    def last_pair(self) -> int:
        return self.last_frame // FRAMES_PER_PAIR


@dataclass(frozen=True)
class Clutter:
    """A small bar or dot at a free pixel position, visible over frames ``first_frame..last_frame``."""

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


@dataclass
class Episode:
    """A generated stream, what it shows, and the questions it answers.

    ``colour_labels``/``shape_labels``: ``[pairs, tokens_per_pair]`` int64 per visual token (grid-major,
    row-major like the encoder's merged tokens): the item covering most of the token's 28 x 28 px over the
    pair (at least ``MIN_LABEL_PIXELS``), else ``NOTHING_COLOUR``/``NOTHING``.
    """

    seed: tuple[int, ...]
    video: Video
    objects: list[SceneObject]
    clutter: list[Clutter]
    questions: list[Question]
    colour_labels: np.ndarray
    shape_labels: np.ndarray
    spec: StreamSpec = field(default_factory=StreamSpec)

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
        """One line per object and per clutter item, in order of appearance, with times in seconds."""
        seconds = 1.0 / self.video.fps
        lines = []
        for item in sorted(self.objects, key=lambda o: o.first_frame):
            motion = "moving" if item.moving else "still"
            lines.append(
                f"{item.colour} {item.shape} ({motion}), {item.first_frame * seconds:g}-{(item.last_frame + 1) * seconds:g} s"
            )
        for item in self.clutter:
            lines.append(
                f"clutter: {item.colour} {item.kind}, {item.first_frame * seconds:g}-{(item.last_frame + 1) * seconds:g} s"
            )
        return lines


@dataclass(frozen=True)
class Grade:
    """How an answer compares with a generated stream's ground truth (``correct`` is None when there is
    nothing to compare with); ``note`` says it in a few words for the chat."""

    expected: str | None
    correct: bool | None
    note: str


def grade(episode: Episode, question: str, answer: str, time_s: float) -> Grade:
    """Compare ``answer`` to ``question`` asked at stream time ``time_s`` with ``episode``'s ground truth."""
    known = episode.answer_for(question)
    if known is None:
        return Grade(None, None, "no ground truth for this question in the generated stream")
    if time_s <= known.shown_s:
        return Grade(None, None, f"its evidence appears at {known.shown_s:g} s, later in the stream")
    if grade_answer(known.answer, answer):
        return Grade(known.answer, True, f"✓ matches the ground truth ({known.answer})")
    return Grade(known.answer, False, f"✗ the ground truth is {known.answer}")


def normalise_question(text: str) -> str:
    text = re.sub(r"\bcolor\b", "colour", (text or "").casefold())
    return " ".join(re.sub(r"[^a-z ]", " ", text).split())


def grade_answer(expected: str, answer: str) -> bool:
    """An answer is right when it is the expected word (case, spacing and final punctuation ignored)."""
    return (answer or "").strip().strip(".!").casefold() == expected.casefold()


# --- the bundled sample --------------------------------------------------------------------------

SAMPLE_SEED = 7
SAMPLE_SPEC = StreamSpec(pairs=(40, 40), objects=(4, 4), clutter=(2, 2))


@lru_cache(maxsize=1)
def sample_episode() -> Episode:
    """The bundled sample of the app and the CLI: a 40 s generated stream (made in code, no file)."""
    return generate_episode(SAMPLE_SEED, SAMPLE_SPEC)


def sample_manifest(episode: Episode) -> str:
    """Markdown listing what a generated stream shows and the questions it has a ground truth for."""
    video = episode.video
    height, width = video.size
    items = "\n".join(f"- {line}" for line in episode.describe())
    questions = "\n".join(f"- {q.text} → *{q.answer}*" for q in episode.questions)
    return (
        f"**Bundled sample**: a generated stream ({video.num_frames / video.fps:g} s at {video.fps:g} fps, "
        f"{width}x{height}, seed {','.join(map(str, episode.seed))}); objects sit on the 14-px patch grid.\n"
        f"{items}\n\n**Questions with a ground truth** (the answers are graded in the chat):\n{questions}"
    )


# --- generation ---------------------------------------------------------------------------------------


def generate_episode(seed: int | Sequence[int], spec: StreamSpec = StreamSpec(), pairs: int | None = None) -> Episode:
    """The stream, its labels and its questions for ``seed`` (``pairs`` overrides the spec's length range)."""
    seed_tuple = (int(seed),) if np.isscalar(seed) else tuple(int(s) for s in seed)
    rng = np.random.default_rng(seed_tuple)
    num_pairs = int(pairs if pairs is not None else rng.integers(spec.pairs[0], spec.pairs[1] + 1))
    if num_pairs < 1:
        raise VideoError(f"a generated stream needs at least one frame pair, got {num_pairs}")
    num_frames = num_pairs * FRAMES_PER_PAIR
    objects = _place_objects(rng, spec, num_pairs)
    clutter = _place_clutter(rng, spec, num_frames)
    frames, owners = _render(rng, spec, num_frames, objects, clutter)
    colour_labels, shape_labels = _token_labels(owners, objects, clutter)
    video = Video(
        frames=frames,
        times_s=np.arange(num_frames, dtype=np.float64) / spec.fps,
        fps=float(spec.fps),
        source=f"generated(seed={','.join(map(str, seed_tuple))})",
        source_fps=float(spec.fps),
        source_frames=num_frames,
        source_size=spec.size,
    )
    return Episode(seed_tuple, video, objects, clutter, _questions(objects, spec.fps), colour_labels, shape_labels, spec)


def _questions(objects: list[SceneObject], fps: float) -> list[Question]:
    seconds = 1.0 / fps
    questions = [
        Question(
            "colour",
            COLOUR_QUESTION.format(shape=o.shape),
            o.colour,
            o.shape,
            o.first_frame * seconds,
            (o.last_frame + 1) * seconds,
        )
        for o in objects
    ]
    starts = sorted(o.first_pair for o in objects)
    if len(starts) > 1 and starts[0] < starts[1]:
        first = min(objects, key=lambda o: o.first_frame)
        questions.append(
            Question("first", FIRST_QUESTION, first.shape, first.shape, first.first_frame * seconds, (first.last_frame + 1) * seconds)
        )
    return questions


def _place_objects(rng: np.random.Generator, spec: StreamSpec, num_pairs: int) -> list[SceneObject]:
    """Objects with distinct shapes, random colours, 1-5 visible pairs each, half moving one cell every
    2-4 frames (bouncing off the edges); boxes of objects visible at the same time never overlap."""
    count = int(rng.integers(spec.objects[0], spec.objects[1] + 1))
    shapes = rng.permutation(len(SHAPES))[:count]
    spans = []
    for _ in range(count):
        visible = int(rng.integers(spec.visible_pairs[0], spec.visible_pairs[1] + 1))
        visible = min(visible, num_pairs)
        spans.append((visible, int(rng.integers(0, num_pairs - visible + 1))))
    # Ask "which shape appeared first?" when possible: re-draw start times (a few times) if the earliest is tied.
    for _ in range(8):
        starts = sorted(start for _, start in spans)
        if count < 2 or starts[0] < starts[1] or num_pairs < 2:
            break
        spans = [(visible, int(rng.integers(0, num_pairs - visible + 1))) for visible, _ in spans]
    rows = spec.size[0] // CELL - 1  # top-left cells 0..rows-1 keep the 2 x 2 box inside the frame
    cols = spec.size[1] // CELL - 1
    placed: list[SceneObject] = []
    for shape_index, (visible, start) in zip(shapes, spans):
        frames = visible * FRAMES_PER_PAIR
        moving = bool(rng.random() < 0.5)
        for _ in range(100):
            cells = _path(rng, rows, cols, frames, moving)
            candidate = SceneObject(
                SHAPES[shape_index],
                COLOUR_NAMES[int(rng.integers(len(COLOURS)))],
                int(rng.integers(spec.object_side[0], spec.object_side[1] + 1)),
                start * FRAMES_PER_PAIR,
                cells,
                moving,
            )
            if not any(_overlap(candidate, other) for other in placed):
                break
        placed.append(candidate)
    return placed


def _path(rng: np.random.Generator, rows: int, cols: int, frames: int, moving: bool) -> tuple[tuple[int, int], ...]:
    row, col = int(rng.integers(rows)), int(rng.integers(cols))
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


def _overlap(a: SceneObject, b: SceneObject) -> bool:
    """Whether the 2 x 2-cell boxes of ``a`` and ``b`` ever overlap in a frame where both are visible."""
    for frame in range(max(a.first_frame, b.first_frame), min(a.last_frame, b.last_frame) + 1):
        (ra, ca), (rb, cb) = a.cells[frame - a.first_frame], b.cells[frame - b.first_frame]
        if abs(ra - rb) < 2 and abs(ca - cb) < 2:
            return True
    return False


def _place_clutter(rng: np.random.Generator, spec: StreamSpec, num_frames: int) -> list[Clutter]:
    items = []
    for _ in range(int(rng.integers(spec.clutter[0], spec.clutter[1] + 1))):
        if rng.random() < 0.5:
            length, thickness = int(rng.integers(10, 19)), 3
            height, width = (length, thickness) if rng.random() < 0.5 else (thickness, length)
            kind = "bar"
        else:
            height = width = int(rng.integers(5, 8))
            kind = "dot"
        first = int(rng.integers(0, num_frames))
        last = int(rng.integers(first, num_frames))
        items.append(
            Clutter(
                kind,
                COLOUR_NAMES[int(rng.integers(len(COLOURS)))],
                int(rng.integers(0, spec.size[0] - height + 1)),
                int(rng.integers(0, spec.size[1] - width + 1)),
                height,
                width,
                first,
                last,
            )
        )
    return items


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
    else:
        raise VideoError(f"unknown shape {shape!r}")
    return np.asarray(image, dtype=bool)


def _render(
    rng: np.random.Generator, spec: StreamSpec, num_frames: int, objects: list[SceneObject], clutter: list[Clutter]
) -> tuple[np.ndarray, np.ndarray]:
    """Frames ``[T, H, W, 3]`` uint8 and owner maps ``[T, H, W]`` int8 (-1 background, object k -> k,
    clutter j -> len(objects) + j). Background: grey 45-95, a linear gradient, a tint, an 8-px block
    texture and per-frame grey noise."""
    height, width = spec.size
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    ramp = (np.cos(angle) * xx / width + np.sin(angle) * yy / height) * rng.uniform(-20, 20)
    blocks = rng.uniform(-8, 8, size=(-(-height // 8), -(-width // 8))).astype(np.float32)
    texture = np.kron(blocks, np.ones((8, 8), dtype=np.float32))[:height, :width]
    grey = rng.uniform(45, 95) + ramp + texture
    background = np.rint(grey[..., None] + rng.uniform(-8, 8, size=3)).astype(np.int16)
    noise = (rng.standard_normal((num_frames, height, width, 1), dtype=np.float32) * rng.uniform(2, 5)).astype(np.int16)
    frames = background[None] + noise  # int16: far cheaper than float for the clip below
    owners = np.full((num_frames, height, width), -1, dtype=np.int8)
    for j, item in enumerate(clutter):
        window = (slice(item.first_frame, item.last_frame + 1), slice(item.top, item.top + item.height),
                  slice(item.left, item.left + item.width))
        if item.kind == "dot":
            mask = shape_mask("circle", item.height)
            frames[window][:, mask] = COLOURS[item.colour]
            owners[window][:, mask] = len(objects) + j
        else:
            frames[window] = COLOURS[item.colour]
            owners[window] = len(objects) + j
    for k, item in enumerate(objects):
        mask = shape_mask(item.shape, item.side)
        offset = (OBJECT_BOX - item.side) // 2
        colour = COLOURS[item.colour]
        for index, (row, col) in enumerate(item.cells):
            top, left = row * CELL + offset, col * CELL + offset
            target = (item.first_frame + index, slice(top, top + item.side), slice(left, left + item.side))
            frames[target][mask] = colour
            owners[target][mask] = k
    return np.clip(frames, 0, 255, out=frames).astype(np.uint8), owners


def _token_labels(owners: np.ndarray, objects: list[SceneObject], clutter: list[Clutter]) -> tuple[np.ndarray, np.ndarray]:
    """Per visual token (28 x 28 px over a frame pair): colour and shape labels of the item covering most of it."""
    frames, height, width = owners.shape
    if frames % FRAMES_PER_PAIR:
        owners = np.concatenate([owners, owners[-1:]])
    rows, cols = height // RESIZE_FACTOR, width // RESIZE_FACTOR
    items = len(objects) + len(clutter)
    # [pairs, 2, rows, 28, cols, 28] -> per (pair, token): pixel counts of each item (+1 for background)
    cells = owners.reshape(-1, FRAMES_PER_PAIR, rows, RESIZE_FACTOR, cols, RESIZE_FACTOR).transpose(0, 2, 4, 1, 3, 5)
    cells = cells.reshape(-1, rows * cols, FRAMES_PER_PAIR * RESIZE_FACTOR**2).astype(np.int64) + 1
    offsets = np.arange(cells.shape[0] * rows * cols).reshape(cells.shape[0], rows * cols, 1) * (items + 1)
    counts = np.bincount((cells + offsets).ravel(), minlength=cells.shape[0] * rows * cols * (items + 1))
    counts = counts.reshape(cells.shape[0], rows * cols, items + 1)[..., 1:]
    best = counts.argmax(-1) if items else np.zeros(counts.shape[:2], dtype=np.int64)
    covered = (counts.max(-1) >= MIN_LABEL_PIXELS) if items else np.zeros(counts.shape[:2], dtype=bool)
    colour_of = np.array([COLOUR_NAMES.index(o.colour) for o in objects] + [COLOUR_NAMES.index(c.colour) for c in clutter] + [0])
    shape_of = np.array([SHAPES.index(o.shape) for o in objects] + [CLUTTER] * len(clutter) + [0])
    colour_labels = np.where(covered, colour_of[best], NOTHING_COLOUR).astype(np.int64)
    shape_labels = np.where(covered, shape_of[best], NOTHING).astype(np.int64)
    return colour_labels, shape_labels


# --- generated clips for the mechanics (benchmarks, tests) --------------------------------------------------


def synthetic_video(
    num_frames: int = 48,
    height: int = 224,
    width: int = 336,
    fps: float = 2.0,
    seed: int = 0,
) -> Video:
    """``num_frames`` frames of a generated stream (:mod:`kvdemo.synthetic`: shapes appearing, moving and
    leaving on a textured background) at ``height`` x ``width`` (multiples of 28); no file, no download.

    Deterministic for a given ``seed``.
    """
    if num_frames <= 0:
        raise VideoError(f"a synthetic video needs at least one frame, got {num_frames}")
    pairs = -(-num_frames // 2)
    spec = StreamSpec(pairs=(pairs, pairs), size=(height, width), fps=fps)
    return generate_episode(seed, spec).video.head(num_frames)
