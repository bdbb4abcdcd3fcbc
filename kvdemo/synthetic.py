"""Generated streams with questions and ground truth: what the offline tiny model is trained and
evaluated on, the app's bundled sample, and the mechanics benchmarks' long clips.

Two kinds of stream (``StreamSpec.kind``):

- ``static``: a fixed camera. Objects of distinct shapes (circle, square, triangle, cross, star, diamond;
  each shape at most once per stream, so "the circle" names one object) in palette colours (drawn with
  replacement, so same-colour decoys are common), each visible for a few frame pairs at a random time,
  half of them moving, over a textured grey background with small clutter bars and dots in palette
  colours. Only the objects and the per-frame noise change over time, so a token that differs from the
  same patch of the recent frames is an object: the case redundancy heuristics are made for.
- ``moving``: what real video has and ``static`` lacks. The objects live in a world larger than the frame
  and a camera looks at it: it pans (one 14-px cell every one or two frame pairs, changing direction at
  random, bouncing at the world's edge) and zooms between 1x and 1.5x, so the same patch position shows
  different content over time. The background is the world's texture seen through the camera, plus a
  texture of two plane waves drifting freely (not on the grid) and a lighting drift (a slow sinusoidal
  gain on the whole frame). Scenes are busier: 3-5 objects, plus 2-4 decoys (a ring, a slab, a corner:
  object-sized shapes in palette colours that no question asks about, so that what stands out in a frame
  is not always evidence) and 4-8 clutter items; colours are drawn uniformly, so a colour seen on screen
  says nothing about the answer. Objects and decoys can reappear (a second sighting after a gap, at
  another place) and are drawn only while their whole box is in view.

Objects sit on the vision encoder's 14-px patch grid and move in 14-px steps: a box of 2 x 2 patches
whose top-left corner is a patch corner, the shape 22-26 px wide inside it. (A feasibility run showed
that the tiny two-block vision encoder never learns shape when objects sit at free sub-patch positions;
see the README.) The moving kind keeps that (kvdemo's own design): the camera pans in whole cells, and its
zooms are 1x and 1.5x, at which a 2 x 2-cell box becomes exactly 3 x 3 cells (a 33-39 px shape); an object
at an odd world cell lands half a cell off the grid at 1.5x and is snapped to it (the background, which
carries no ground truth, is drawn exactly). The camera moves and zooms between frame pairs, never inside
one: the vision encoder merges the two frames of a pair into one token. Frames are sampled at 2 fps, so
one frame pair (one temporal grid, 16 visual tokens at 112 x 112) spans one second of stream time.

Questions (answers from a small vocabulary):

- ``colour``: "What colour was the <shape>?" -> a colour name; the evidence is that object (any sighting).
- ``first``: "Which shape appeared first?" -> a shape name; the evidence is the earliest object (asked
  only when one object appeared strictly before the others, at frame-pair resolution; decoys are not
  shapes of the question's vocabulary and do not count).

Each question records when its evidence was first shown and when it left view for the last time
(``left_s``: the time of the first frame after the subject's last drawn frame, reappearances included);
the query delay is measured from ``left_s``, so after it no frame shows the subject. Ground truth comes
from what was drawn: an object's ``shown`` frames are exactly the frames it is drawn in. Everything is a
pure function of the seed (``numpy.random.default_rng(seed)``; a seed may be a tuple of ints, which is how
training and evaluation keep disjoint streams).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
            raise VideoError(f"stream and visibility lengths must be positive ranges, got {self.pairs}, {self.visible_pairs}")


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
#: The bundled sample of each stream kind: ``(seed, spec)``. The moving one was picked for showing every
#: feature of its kind in 40 s (two zooms, a reappearing object, a "which shape appeared first?").
SAMPLES = {
    "static": (SAMPLE_SEED, SAMPLE_SPEC),
    "moving": (2, StreamSpec(pairs=(40, 40), objects=(4, 4), clutter=(5, 5), kind="moving")),
}


@lru_cache(maxsize=None)
def sample_episode(kind: str = "static") -> Episode:
    """The bundled sample of the app and the CLI: a 40 s generated stream of ``kind`` (made in code, no file)."""
    if kind not in SAMPLES:
        raise VideoError(f"unknown stream kind {kind!r}: one of {', '.join(SAMPLES)}")
    return generate_episode(*SAMPLES[kind])


def sample_manifest(episode: Episode) -> str:
    """Markdown listing what a generated stream shows and the questions it has a ground truth for."""
    video = episode.video
    height, width = video.size
    items = "\n".join(f"- {line}" for line in episode.describe())
    questions = "\n".join(f"- {q.text} → *{q.answer}*" for q in episode.questions)
    camera = ""
    if episode.camera is not None:
        camera = (" The camera pans in 14-px steps and zooms between 1x and 1.5x, the background drifts and the light "
                  "changes; objects can leave and reappear; decoys (ring, slab, corner) are never asked about.")
    return (
        f"**Bundled sample**: a generated stream ({video.num_frames / video.fps:g} s at {video.fps:g} fps, "
        f"{width}x{height}, seed {','.join(map(str, episode.seed))}, kind {episode.kind}); objects sit on the 14-px "
        f"patch grid.{camera}\n"
        f"{items}\n\n**Questions with a ground truth** (the answers are graded in the chat):\n{questions}"
    )


# --- generation ---------------------------------------------------------------------------------------


def generate_episode(seed: int | Sequence[int], spec: StreamSpec = StreamSpec(), pairs: int | None = None) -> Episode:
    """The stream, its labels and its questions for ``seed`` (``pairs`` overrides the spec's length range).

    The kind of stream is ``spec.kind``; the static kind draws exactly what it drew before the moving kind
    existed (same seed, same frames)."""
    seed_tuple = (int(seed),) if np.isscalar(seed) else tuple(int(s) for s in seed)
    rng = np.random.default_rng(seed_tuple)
    num_pairs = int(pairs if pairs is not None else rng.integers(spec.pairs[0], spec.pairs[1] + 1))
    if num_pairs < 1:
        raise VideoError(f"a generated stream needs at least one frame pair, got {num_pairs}")
    num_frames = num_pairs * FRAMES_PER_PAIR
    camera, decoys = None, []
    if spec.kind == "static":
        objects = _place_objects(rng, spec, num_pairs)
        clutter = _place_clutter(rng, spec, num_frames)
        frames, owners = _render(rng, spec, num_frames, objects, clutter)
    else:
        zoom, offset = _camera_path(rng, spec, num_pairs)
        objects, decoys = _place_seen_objects(rng, spec, num_pairs, zoom, offset)
        clutter = _place_clutter(rng, replace(spec, size=world_size(spec.size)), num_frames)
        frames, owners, gain = _render_moving(rng, spec, num_frames, zoom, offset, objects + decoys, clutter)
        camera = Camera(zoom, offset, gain)
    # Decoys are drawn as objects (owners after the objects) and labelled as clutter.
    colour_labels, shape_labels = _token_labels(owners, objects, decoys + clutter)
    video = Video(
        frames=frames,
        times_s=np.arange(num_frames, dtype=np.float64) / spec.fps,
        fps=float(spec.fps),
        source=f"generated({'' if spec.kind == 'static' else spec.kind + ', '}seed={','.join(map(str, seed_tuple))})",
        source_fps=float(spec.fps),
        source_frames=num_frames,
        source_size=spec.size,
    )
    return Episode(
        seed_tuple, video, objects, clutter, _questions(objects, spec.fps), colour_labels, shape_labels, spec, camera, decoys
    )


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


def _path(
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


# --- the moving kind --------------------------------------------------------------------------------


def world_size(size: tuple[int, int]) -> tuple[int, int]:
    """The moving kind's world in pixels at 1x: the frame plus ``WORLD_MARGIN`` cells on every side."""
    return size[0] + 2 * WORLD_MARGIN * CELL, size[1] + 2 * WORLD_MARGIN * CELL


def drawn_side(side: int, box: int) -> int:
    """The side in pixels of a shape of ``side`` px at 1x drawn in a box of ``box`` cells (2 at 1x, 3 at 1.5x)."""
    return (side * box + 1) // 2


def _offset_limit(spec: StreamSpec, zoom: float) -> np.ndarray:
    """The largest camera offset ``(row, col)`` in cells at ``zoom`` that keeps the frame inside the world."""
    frame = np.array(spec.size) // CELL
    return np.floor(zoom * np.array(world_size(spec.size)) / CELL + 1e-9).astype(np.int64) - frame


def _camera_path(rng: np.random.Generator, spec: StreamSpec, num_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """Zoom ``[pairs]`` and offset ``[pairs, 2]`` per frame pair: a pan of one cell every one or two pairs in
    a direction among the 8 neighbours or none (bouncing at the world's edge, turning with chance ``TURN``
    per pair), and a zoom that toggles between 1x and 1.5x with chance ``ZOOM_CHANGE`` per pair, about the
    frame's centre."""
    half = np.array(spec.size) / CELL / 2
    level = int(rng.random() < ZOOMED_START)
    offset = rng.integers(0, _offset_limit(spec, ZOOMS[level]) + 1)
    velocity = rng.integers(-1, 2, size=2)
    every = int(rng.integers(1, 3))
    zooms, offsets = np.empty(num_pairs), np.empty((num_pairs, 2), dtype=np.int64)
    for pair in range(num_pairs):
        if pair:
            if rng.random() < ZOOM_CHANGE:
                centre = (offset + half) / ZOOMS[level]  # in world cells
                level = 1 - level
                offset = np.clip(np.floor(ZOOMS[level] * centre - half + 0.5).astype(np.int64), 0, _offset_limit(spec, ZOOMS[level]))
            elif pair % every == 0:
                limit = _offset_limit(spec, ZOOMS[level])
                velocity = np.where((offset + velocity < 0) | (offset + velocity > limit), -velocity, velocity)
                offset = np.clip(offset + velocity, 0, limit)
            if rng.random() < TURN:
                velocity = rng.integers(-1, 2, size=2)
        zooms[pair], offsets[pair] = ZOOMS[level], offset
    return zooms, offsets


def _sightings(rng: np.random.Generator, spec: StreamSpec, num_pairs: int, count: int) -> list[list[tuple[int, int]]]:
    """Per object, its sightings as ``(first pair, pairs)``: one, or with chance ``spec.reappear`` a second one
    starting 2-8 pairs after the first ends (when the stream is long enough). Start times are re-drawn a few
    times when the earliest first sighting is tied, so that "which shape appeared first?" can be asked."""
    low, high = spec.visible_pairs
    for _ in range(8):
        objects = []
        for _ in range(count):
            visible = min(int(rng.integers(low, high + 1)), num_pairs)
            start = int(rng.integers(0, num_pairs - visible + 1))
            seen = [(start, visible)]
            if rng.random() < spec.reappear:
                again = start + visible + int(rng.integers(2, 9))
                visible = int(rng.integers(low, high + 1))
                if again + visible <= num_pairs:
                    seen.append((again, visible))
            objects.append(seen)
        starts = sorted(seen[0][0] for seen in objects)
        if count < 2 or starts[0] < starts[1] or num_pairs < 2:
            break
    return objects


def _place_seen_objects(
    rng: np.random.Generator, spec: StreamSpec, num_pairs: int, zoom: np.ndarray, offset: np.ndarray
) -> tuple[list[SceneObject], list[SceneObject]]:
    """Objects and decoys of the moving kind, in world cells seen through the camera. Each sighting starts in
    view at a random world cell and is still or moves as in the static kind (in world cells); it is drawn in
    the frames where its whole box is in view and clear of the items placed before it (objects first, then
    decoys). Up to 100 placements are tried per sighting; the first drawn in all its frames wins, else the
    one drawn in most. An item drawn in no frame is left out."""
    count = int(rng.integers(spec.objects[0], spec.objects[1] + 1))
    shapes = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:count]]
    sightings = _sightings(rng, spec, num_pairs, count)
    decoys = int(rng.integers(spec.decoys[0], spec.decoys[1] + 1))
    shapes += [DECOY_SHAPES[int(i)] for i in rng.integers(len(DECOY_SHAPES), size=decoys)]
    sightings += _sightings(rng, spec, num_pairs, decoys)
    frame = np.array(spec.size) // CELL
    world = np.array(world_size(spec.size)) // CELL - 1  # top-left world cells keep the 2 x 2 box in the world
    all_cells = np.stack(np.meshgrid(np.arange(world[0]), np.arange(world[1]), indexing="ij"), -1).reshape(-1, 2)
    camera = Camera(zoom, offset, np.ones(0))
    num_frames = num_pairs * FRAMES_PER_PAIR
    # Per frame, the placed items' boxes: top-left cell and side (side 0: nothing there).
    taken_cells = np.zeros((0, num_frames, 2), dtype=np.int64)
    taken_boxes = np.zeros((0, num_frames), dtype=np.int64)
    placed: list[SceneObject] = []
    for shape, seen in zip(shapes, sightings):
        colour = COLOUR_NAMES[int(rng.integers(len(COLOURS)))]
        side = int(rng.integers(spec.object_side[0], spec.object_side[1] + 1))
        moving = bool(rng.random() < 0.5)
        cells_of = np.zeros((num_frames, 2), dtype=np.int64)
        box_of = np.zeros(num_frames, dtype=np.int64)
        for start, visible in seen:
            frames = np.arange(start * FRAMES_PER_PAIR, (start + visible) * FRAMES_PER_PAIR)
            pairs = frames // FRAMES_PER_PAIR
            boxes = np.where(zoom[pairs] == 1.0, 2, 3)
            # World cells whose box is in view in the sighting's first frame.
            first = camera.frame_cells(all_cells, np.full(len(all_cells), pairs[0]))
            starts = all_cells[((first >= 0) & (first + boxes[0] <= frame)).all(-1)]
            best, best_good = None, -1
            for _ in range(100):
                begin = starts[int(rng.integers(len(starts)))]
                path = np.array(_path(rng, int(world[0]), int(world[1]), len(frames), moving, (int(begin[0]), int(begin[1]))))
                cells = camera.frame_cells(path, pairs)
                inside = ((cells >= 0) & (cells + boxes[:, None] <= frame)).all(-1)
                # Boxes of sides a, b at p, q overlap when p - b < q < p + a on both axes (side 0: nothing).
                other, size = taken_cells[:, frames], taken_boxes[:, frames]
                apart = (other + size[..., None] <= cells) | (cells + boxes[:, None] <= other) | (size[..., None] == 0)
                good = inside & ~(~apart.any(-1)).any(0)
                if good.sum() > best_good:
                    best, best_good = (cells, good), int(good.sum())
                if best_good == len(frames):
                    break
            cells, good = best
            cells_of[frames[good]], box_of[frames[good]] = cells[good], boxes[good]
        shown = np.flatnonzero(box_of)
        taken_cells = np.concatenate([taken_cells, cells_of[None]])
        taken_boxes = np.concatenate([taken_boxes, box_of[None]])
        if len(shown):
            placed.append(
                SceneObject(
                    shape,
                    colour,
                    side,
                    int(shown[0]),
                    tuple((int(r), int(c)) for r, c in cells_of[shown]),
                    moving,
                    tuple(int(f) for f in shown),
                    tuple(int(b) for b in box_of[shown]),
                )
            )
    return [o for o in placed if o.shape in SHAPES], [o for o in placed if o.shape in DECOY_SHAPES]


def _render_moving(
    rng: np.random.Generator,
    spec: StreamSpec,
    num_frames: int,
    zoom: np.ndarray,
    offset: np.ndarray,
    objects: list[SceneObject],
    clutter: list[Clutter],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frames ``[T, H, W, 3]`` uint8, owner maps ``[T, H, W]`` int8 (as :func:`_render`; ``objects`` here are
    the objects then the decoys) and the lighting gain
    ``[T]``. Background: the world's texture (grey 45-95, a gradient, a tint, an 8-px block texture) seen
    through the camera (nearest pixel), plus two plane waves of 5-10 grey levels drifting 0.5-2 px per frame
    each, plus per-frame noise; then clutter and objects; everything times the gain ``1 + a sin(...)``."""
    height, width = spec.size
    world_h, world_w = world_size(spec.size)
    yy, xx = np.mgrid[0:world_h, 0:world_w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    ramp = (np.cos(angle) * xx / world_w + np.sin(angle) * yy / world_h) * rng.uniform(-20, 20)
    blocks = rng.uniform(-8, 8, size=(-(-world_h // 8), -(-world_w // 8))).astype(np.float32)
    texture = np.kron(blocks, np.ones((8, 8), dtype=np.float32))[:world_h, :world_w]
    world = (rng.uniform(45, 95) + ramp + texture)[..., None] + rng.uniform(-8, 8, size=3).astype(np.float32)
    pair = np.arange(num_frames) // FRAMES_PER_PAIR
    z, top_left = zoom[pair], offset[pair] * CELL  # [T], [T, 2]: the camera per frame (top-left in zoomed pixels)
    # The camera holds still within a pair: look up each pair's view once.
    rows = np.minimum(((np.arange(height) + offset[:, :1] * CELL) / zoom[:, None]).astype(np.int64), world_h - 1)  # [P, H]
    cols = np.minimum(((np.arange(width) + offset[:, 1:] * CELL) / zoom[:, None]).astype(np.int64), world_w - 1)  # [P, W]
    frames = world[rows[:, :, None], cols[:, None, :]][pair]  # [T, H, W, 3]
    t = np.arange(num_frames, dtype=np.float32)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    grey = np.zeros((num_frames, height, width), dtype=np.float32)
    for _ in range(2):  # A sin(k (along - v t) + phi), split as sin(a - b) = sin a cos b - cos a sin b
        direction = rng.uniform(0, 2 * np.pi)
        wavelength, speed, amplitude = rng.uniform(16, 48), rng.uniform(0.5, 2.0), rng.uniform(5, 10)
        space = (2 * np.pi / wavelength) * (np.cos(direction) * x + np.sin(direction) * y) + rng.uniform(0, 2 * np.pi)
        drift = (2 * np.pi / wavelength) * speed * t
        grey += (amplitude * np.sin(space))[None] * np.cos(drift)[:, None, None]
        grey -= (amplitude * np.cos(space))[None] * np.sin(drift)[:, None, None]
    grey += rng.standard_normal((num_frames, height, width), dtype=np.float32) * np.float32(rng.uniform(2, 5))
    frames += grey[..., None]
    period = rng.uniform(*LIGHT_PERIOD_S) * spec.fps
    gain = 1 + rng.uniform(*LIGHT_AMPLITUDE) * np.sin(2 * np.pi * np.arange(num_frames) / period + rng.uniform(0, 2 * np.pi))
    owners = np.full((num_frames, height, width), -1, dtype=np.int8)
    for j, item in enumerate(clutter):
        for f in range(item.first_frame, item.last_frame + 1):
            size = max(1, int(item.height * z[f] + 0.5)), max(1, int(item.width * z[f] + 0.5))
            mask = shape_mask("circle", size[0]) if item.kind == "dot" else np.ones(size, dtype=bool)
            top = int(np.floor(item.top * z[f] + 0.5)) - top_left[f, 0]
            left = int(np.floor(item.left * z[f] + 0.5)) - top_left[f, 1]
            _paste(frames[f], owners[f], top, left, mask, COLOURS[item.colour], len(objects) + j)
    for k, item in enumerate(objects):
        colour = COLOURS[item.colour]
        for index, f in enumerate(item.frames):
            top, left, side = item.drawn(index)
            _paste(frames[f], owners[f], top, left, shape_mask(item.shape, side), colour, k)
    frames *= gain.astype(np.float32)[:, None, None, None]
    return np.clip(np.rint(frames), 0, 255).astype(np.uint8), owners, gain


def _paste(frame: np.ndarray, owner: np.ndarray, top: int, left: int, mask: np.ndarray, colour, index: int) -> None:
    """Paint ``mask`` ``[h, w]`` in ``colour`` into ``frame`` ``[H, W, 3]`` at ``(top, left)``, cut at the frame's
    edge, and mark those pixels ``index`` in ``owner`` ``[H, W]``."""
    height, width = owner.shape
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + mask.shape[0], height), min(left + mask.shape[1], width)
    if y0 >= y1 or x0 >= x1:
        return
    cut = mask[y0 - top : y1 - top, x0 - left : x1 - left]
    frame[y0:y1, x0:x1][cut] = colour
    owner[y0:y1, x0:x1][cut] = index
