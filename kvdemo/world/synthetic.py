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

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

import numpy as np

from ..media.video import Video, VideoError
from .camera import camera_path, place_seen_objects, render_moving
from .grading import Grade, grade, grade_answer  # grading is this module's API too
from .scene import (  # the vocabulary of a stream; the names below are this module's API too
    CELL,
    CLUTTER,
    COLOUR_NAMES,
    COLOUR_QUESTION,
    COLOURS,
    DECOY_SHAPES,
    FIRST_QUESTION,
    FRAMES_PER_PAIR,
    MIN_LABEL_PIXELS,
    NOTHING,
    NOTHING_COLOUR,
    OBJECT_BOX,
    RESIZE_FACTOR,
    SHAPES,
    STREAM_KINDS,
    Camera,
    Clutter,
    Episode,
    Question,
    SceneObject,
    StreamSpec,
    grid_path,
    normalise_question,
    shape_mask,
    world_size,
)

__all__ = [
    "CELL",
    "CLUTTER",
    "COLOUR_NAMES",
    "COLOURS",
    "DECOY_SHAPES",
    "MIN_LABEL_PIXELS",
    "NOTHING",
    "NOTHING_COLOUR",
    "SHAPES",
    "STREAM_KINDS",
    "Episode",
    "Grade",
    "Question",
    "StreamSpec",
    "generate_episode",
    "grade",
    "grade_answer",
    "normalise_question",
    "sample_episode",
    "sample_manifest",
    "shape_mask",
    "synthetic_video",
]


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
        camera = (
            " The camera pans in 14-px steps and zooms between 1x and 1.5x, the background drifts and the light "
            "changes; objects can leave and reappear; decoys (ring, slab, corner) are never asked about."
        )
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
        zoom, offset = camera_path(rng, spec, num_pairs)
        objects, decoys = place_seen_objects(rng, spec, num_pairs, zoom, offset)
        clutter = _place_clutter(rng, replace(spec, size=world_size(spec.size)), num_frames)
        frames, owners, gain = render_moving(rng, spec, num_frames, zoom, offset, objects + decoys, clutter)
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
        seed_tuple,
        video,
        objects,
        clutter,
        _questions(objects, spec.fps),
        colour_labels,
        shape_labels,
        spec,
        camera,
        decoys,
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
            Question(
                "first",
                FIRST_QUESTION,
                first.shape,
                first.shape,
                first.first_frame * seconds,
                (first.last_frame + 1) * seconds,
            )
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
            cells = grid_path(rng, rows, cols, frames, moving)
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
        window = (
            slice(item.first_frame, item.last_frame + 1),
            slice(item.top, item.top + item.height),
            slice(item.left, item.left + item.width),
        )
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


def _token_labels(
    owners: np.ndarray, objects: list[SceneObject], clutter: list[Clutter]
) -> tuple[np.ndarray, np.ndarray]:
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
    colour_of = np.array(
        [COLOUR_NAMES.index(o.colour) for o in objects] + [COLOUR_NAMES.index(c.colour) for c in clutter] + [0]
    )
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
    """``num_frames`` frames of a generated stream (:mod:`kvdemo.world.synthetic`: shapes appearing, moving and
    leaving on a textured background) at ``height`` x ``width`` (multiples of 28); no file, no download.

    Deterministic for a given ``seed``.
    """
    if num_frames <= 0:
        raise VideoError(f"a synthetic video needs at least one frame, got {num_frames}")
    pairs = -(-num_frames // 2)
    spec = StreamSpec(pairs=(pairs, pairs), size=(height, width), fps=fps)
    return generate_episode(seed, spec).video.head(num_frames)
