"""The moving kind of generated stream (:mod:`kvdemo.world.synthetic`): a camera that pans and zooms over a world larger
than the frame, objects and decoys seen once or twice at places the camera shows, a drifting background and
lighting, and the frames rendered through that camera."""

from __future__ import annotations

import numpy as np

from .scene import (
    CELL,
    COLOUR_NAMES,
    COLOURS,
    DECOY_SHAPES,
    FRAMES_PER_PAIR,
    LIGHT_AMPLITUDE,
    LIGHT_PERIOD_S,
    SHAPES,
    TURN,
    ZOOM_CHANGE,
    ZOOMED_START,
    ZOOMS,
    Camera,
    Clutter,
    SceneObject,
    StreamSpec,
    grid_path,
    shape_mask,
    world_size,
)


def _offset_limit(spec: StreamSpec, zoom: float) -> np.ndarray:
    """The largest camera offset ``(row, col)`` in cells at ``zoom`` that keeps the frame inside the world."""
    frame = np.array(spec.size) // CELL
    return np.floor(zoom * np.array(world_size(spec.size)) / CELL + 1e-9).astype(np.int64) - frame


def camera_path(rng: np.random.Generator, spec: StreamSpec, num_pairs: int) -> tuple[np.ndarray, np.ndarray]:
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
                offset = np.clip(
                    np.floor(ZOOMS[level] * centre - half + 0.5).astype(np.int64), 0, _offset_limit(spec, ZOOMS[level])
                )
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


def place_seen_objects(
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
                path = np.array(
                    grid_path(rng, int(world[0]), int(world[1]), len(frames), moving, (int(begin[0]), int(begin[1])))
                )
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


def render_moving(
    rng: np.random.Generator,
    spec: StreamSpec,
    num_frames: int,
    zoom: np.ndarray,
    offset: np.ndarray,
    objects: list[SceneObject],
    clutter: list[Clutter],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frames ``[T, H, W, 3]`` uint8, owner maps ``[T, H, W]`` int8 (as :func:`kvdemo.world.synthetic._render`; ``objects`` here are
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
    rows = np.minimum(
        ((np.arange(height) + offset[:, :1] * CELL) / zoom[:, None]).astype(np.int64), world_h - 1
    )  # [P, H]
    cols = np.minimum(
        ((np.arange(width) + offset[:, 1:] * CELL) / zoom[:, None]).astype(np.int64), world_w - 1
    )  # [P, W]
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
    gain = 1 + rng.uniform(*LIGHT_AMPLITUDE) * np.sin(
        2 * np.pi * np.arange(num_frames) / period + rng.uniform(0, 2 * np.pi)
    )
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
