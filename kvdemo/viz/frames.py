"""Frames and what survives of them: thumbnails, patch overlays on the frame grid, captioned strips, and the
survivor views of any memory (aggregated over layers and KV heads, or one head coloured by the policy's
reason), with the patches pruned before the LLM (they never entered the memory) in a colour of their own."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..analysis.survival import survival_counts
from ..cache.memory import KVMemory

#: Reason code of a patch that is not held (evicted).
EVICTED = -1
NEW_COLOUR = (170, 170, 170)
#: The colour of a patch pruned before the LLM (it never entered the memory), and its legend entry.
PRUNED_COLOUR = (214, 39, 120)
PRUNED_NAME = "pruned before the LLM"
REASON_COLOURS = [(66, 133, 244), (251, 140, 0), (52, 168, 83), (171, 71, 188), (0, 172, 193)]


def thumbnail(frame: np.ndarray, max_width: int = 320, min_width: int = 224) -> np.ndarray:
    """Downscale an RGB frame ``[H, W, 3]`` to at most ``max_width`` wide (aspect kept); a frame narrower
    than ``min_width`` (the tiny model's 112 x 112) is enlarged by a whole factor, pixels repeated, so its
    patches stay crisp and the captions above it fit."""
    height, width = frame.shape[:2]
    if width < min_width:
        factor = max(1, min(-(-min_width // width), max_width // width))
        return np.ascontiguousarray(frame.repeat(factor, axis=0).repeat(factor, axis=1))
    if width <= max_width:
        return np.ascontiguousarray(frame)
    new_size = (max_width, max(1, round(height * max_width / width)))
    return np.asarray(Image.fromarray(frame).resize(new_size, Image.BILINEAR))


def drawable(grids, thumbnails: list[np.ndarray | None]) -> list[int]:
    """The grids of ``grids`` that have a thumbnail (a caller may hold fewer thumbnails than the memory grids:
    older ones left behind by a GPU call, or a chunk still being fed)."""
    return [g for g in grids if g < len(thumbnails) and thumbnails[g] is not None]


def _upsample(values: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    rows, cols = values.shape
    ys = np.minimum((np.arange(size[0]) * rows) // size[0], rows - 1)
    xs = np.minimum((np.arange(size[1]) * cols) // size[1], cols - 1)
    return values[ys][:, xs]


def _grid_lines(image: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = shape
    height, width = image.shape[:2]
    out = image.copy()
    for r in range(1, rows):
        out[r * height // rows, :] = (out[r * height // rows, :] * 0.6).astype(np.uint8)
    for c in range(1, cols):
        out[:, c * width // cols] = (out[:, c * width // cols] * 0.6).astype(np.uint8)
    return out


def overlay_fraction(frame: np.ndarray, fraction: np.ndarray) -> np.ndarray:
    """Darken evicted patches and tint kept ones: ``frame [H, W, 3]``, ``fraction [rows, cols]`` in [0, 1]."""
    mask = _upsample(fraction, frame.shape[:2])[..., None]
    tint = np.array([255, 214, 0], dtype=np.float32)
    image = frame.astype(np.float32) * (0.25 + 0.75 * mask)
    image = image * (1 - 0.25 * mask) + tint * 0.25 * mask
    return _grid_lines(np.clip(image, 0, 255).astype(np.uint8), fraction.shape)


def overlay_reasons(frame: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Colour each held patch by its reason code, darken evicted ones (``codes [rows, cols]``)."""
    height, width = frame.shape[:2]
    palette = np.zeros((len(REASON_COLOURS) + 2, 3), dtype=np.float32)
    palette[: len(REASON_COLOURS)] = REASON_COLOURS
    palette[-2] = NEW_COLOUR  # REASON_NEW indexes -2
    kept = _upsample((codes != EVICTED).astype(np.float32), (height, width))[..., None]
    colour = palette[_upsample(codes.astype(np.float32), (height, width)).astype(np.int64)]
    image = frame.astype(np.float32) * (0.25 + 0.75 * kept)
    image = image * (1 - 0.45 * kept) + colour * 0.45 * kept
    return _grid_lines(np.clip(image, 0, 255).astype(np.uint8), codes.shape)


#: The outline of a patch in proportion to its value (:func:`overlay_values`): a colour none of the generated streams'
#: objects has, on the patch's edge only.
VALUE_OUTLINE = np.array([0, 229, 255], dtype=np.float32)


def overlay_values(frame: np.ndarray, values: np.ndarray, border: int = 2) -> np.ndarray:
    """Each patch's ``values [rows, cols]`` in [0, 1] shown without changing the hue of what it covers: the frame's
    own colours at a brightness that grows with the value (dark where it is 0), and an outline ``border`` pixels
    wide on the patch's edge, as opaque as the value (a tint would turn a purple object pink)."""
    height, width = frame.shape[:2]
    rows, cols = values.shape
    clipped = np.clip(values, 0, 1).astype(np.float32)
    heat = _upsample(clipped, (height, width))[..., None]
    image = frame.astype(np.float32) * (0.3 + 0.7 * heat)  # one factor for all three channels: the hue stays

    def edges(size: int, cells: int) -> np.ndarray:  # [size] bool: within ``border`` pixels of a cell's edge
        cell = np.minimum(np.arange(size) * cells // size, cells - 1)
        before = cell[np.maximum(np.arange(size) - border, 0)]
        after = cell[np.minimum(np.arange(size) + border, size - 1)]
        index = np.arange(size)
        return (before != cell) | (after != cell) | (index < border) | (index >= size - border)

    on_edge = edges(height, rows)[:, None] | edges(width, cols)[None, :]
    alpha = heat * on_edge[..., None]
    image = image * (1 - alpha) + VALUE_OUTLINE * alpha
    return _grid_lines(np.clip(image, 0, 255).astype(np.uint8), values.shape)


def wrap_caption(caption: str, width: float, measure) -> list[str]:
    """``caption`` broken at spaces into lines no wider than ``width`` (``measure(text)`` -> pixels); a
    single word wider than that keeps its own line."""
    lines: list[str] = []
    for word in caption.split():
        if lines and measure(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines or [""]


def frame_strip(tiles: list[np.ndarray], captions: list[str], gap: int = 6) -> np.ndarray:
    """Tiles side by side with a caption above each (one JPEG-friendly image); a caption wider than its
    tile wraps onto more lines instead of running into the next tile's."""
    if not tiles:
        return np.full((60, 320, 3), 245, dtype=np.uint8)
    height = max(t.shape[0] for t in tiles)
    width = sum(t.shape[1] for t in tiles) + gap * (len(tiles) - 1)
    font = ImageFont.load_default(size=16)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength
    wrapped = [
        wrap_caption(caption, tile.shape[1] - 6, lambda text: measure(text, font=font))
        for tile, caption in zip(tiles, captions)
    ]
    line_height = 20
    band = 6 + line_height * max(len(lines) for lines in wrapped)
    canvas = Image.new("RGB", (width, height + band), (250, 250, 250))
    draw = ImageDraw.Draw(canvas)
    x = 0
    for tile, lines in zip(tiles, wrapped):
        canvas.paste(Image.fromarray(tile), (x, band))
        for i, line in enumerate(lines):
            draw.text((x + 3, 4 + i * line_height), line, fill=(20, 20, 20), font=font)
        x += tile.shape[1] + gap
    return np.asarray(canvas)


def labelled_rows(rows: list[tuple[str, np.ndarray]], gap: int = 8) -> np.ndarray:
    """Images stacked top to bottom, each under a bold label band, left-aligned: one strip per engine, whose
    frames then sit in the same columns (the strips show the same grids)."""
    if not rows:
        return np.full((60, 320, 3), 245, dtype=np.uint8)
    font = ImageFont.load_default(size=18)
    band = 26
    width = max(image.shape[1] for _, image in rows)
    height = sum(image.shape[0] + band for _, image in rows) + gap * (len(rows) - 1)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    y = 0
    for label, image in rows:
        draw.rectangle([0, y, width, y + band - 3], fill=(232, 236, 244))
        draw.text((6, y + 3), label, fill=(10, 10, 60), font=font)
        canvas.paste(Image.fromarray(image), (0, y + band))
        y += band + image.shape[0] + gap
    return np.asarray(canvas)


def mark_pruned(tile: np.ndarray, pruned: np.ndarray | None) -> np.ndarray:
    """``tile [H, W, 3]`` (a frame already overlaid) with its patches ``pruned [rows, cols]`` (bool: pruned before the
    LLM) painted in :data:`PRUNED_COLOUR` over the frame, darkened, diagonally striped so they read apart from
    evicted patches in any overlay; ``tile`` itself when nothing was pruned."""
    if pruned is None or not pruned.any():
        return tile
    height, width = tile.shape[:2]
    mask = _upsample(pruned.astype(np.float32), (height, width))[..., None]
    stripes = (((np.arange(height)[:, None] + np.arange(width)[None, :]) // 3) % 2 == 0)[..., None]
    colour = np.array(PRUNED_COLOUR, dtype=np.float32)
    painted = tile.astype(np.float32) * 0.45 + colour * np.where(stripes, 0.55, 0.3)
    return _grid_lines(np.where(mask > 0, painted, tile).clip(0, 255).astype(np.uint8), pruned.shape)


def pruned_legend() -> str:
    """The legend entry of the patches pruned before the LLM."""
    return f"<span style='color:rgb{PRUNED_COLOUR}'>■</span> {PRUNED_NAME}"


def legend_text(reason_names: dict[int, str], pruned: bool = False) -> str:
    """Markdown legend of the reason colours (``pruned``: with the entry of the patches pruned before the LLM)."""
    parts = [
        f"<span style='color:rgb{REASON_COLOURS[code % len(REASON_COLOURS)]}'>■</span> {name}"
        for code, name in sorted(reason_names.items())
    ]
    parts.append(f"<span style='color:rgb{NEW_COLOUR}'>■</span> new since the last compression")
    if pruned:
        parts.append(pruned_legend())
    parts.append("dark = evicted")
    return " &nbsp; ".join(parts)


def survival_fraction_map(memory: KVMemory, layer: int | None = None, head: int | None = None) -> np.ndarray:
    """``[grids, rows, cols]`` fraction of (layer, head) copies of each patch still held."""
    counts = survival_counts(memory, layer, head).double()
    layers = memory.num_layers if layer is None else 1
    heads = memory.num_kv_heads if head is None else 1
    return (counts / (layers * heads)).numpy()


def reason_map(memory: KVMemory, layer: int, head: int) -> np.ndarray:
    """``[grids, rows, cols]`` reason code of each held patch of one layer/head (``EVICTED`` if not held).

    The memory stores, per slot, the reason the last compression gave for keeping the token (the
    policy's code), or ``REASON_NEW`` for a token appended since; it moves with the token.
    """
    rows, cols = memory.grid_shape or (0, 0)
    grid = np.full((memory.num_grids, rows, cols), EVICTED, dtype=np.int16)
    if not memory.grid_shape:
        return grid
    frame, row, col, codes = (
        t[head].long().cpu().numpy()
        for t in (memory.frame[layer], memory.row[layer], memory.col[layer], memory.reason[layer])
    )
    valid = memory.valid[layer]
    held = valid[head].cpu().numpy() if valid is not None else np.ones(frame.shape, dtype=bool)
    grid[frame[held], row[held], col[held]] = codes[held]
    return grid


def survivor_strip(
    memory: KVMemory,
    thumbnails: list[np.ndarray],
    layer: int | None = None,
    head: int | None = None,
    last: int = 4,
    by_reason: bool = False,
    pruned: np.ndarray | None = None,
) -> np.ndarray:
    """The newest ``last`` temporal grids with what survives of each, as one image.

    Aggregated over layers/heads (tint = fraction of copies held) unless ``layer`` and ``head`` are
    given; then ``by_reason`` colours each kept patch by the policy's reason. ``pruned [grids, rows, cols]``
    (bool) marks the patches pruned before the LLM (:func:`mark_pruned`).
    """
    grids = drawable(range(max(0, memory.num_grids - last), memory.num_grids), thumbnails)
    if not grids:
        return frame_strip([], [])
    single = layer is not None and head is not None
    if single and by_reason:
        codes = reason_map(memory, layer, head)
        tiles = [overlay_reasons(thumbnails[g], codes[g]) for g in grids]
        kept = [(codes[g] != EVICTED).mean() for g in grids]
    else:
        fraction = survival_fraction_map(memory, layer, head)
        tiles = [overlay_fraction(thumbnails[g], fraction[g]) for g in grids]
        kept = [fraction[g].mean() for g in grids]
    captions = [f"t={memory.grid_times_s[g]:.1f}s  {100 * k:.0f}% kept" for g, k in zip(grids, kept)]
    return frame_strip(*with_pruned(tiles, captions, grids, pruned))


def with_pruned(
    tiles: list[np.ndarray], captions: list[str], grids: list[int], pruned: np.ndarray | None
) -> tuple[list[np.ndarray], list[str]]:
    """``tiles`` and ``captions`` of ``grids`` with their patches pruned before the LLM marked and counted (``pruned
    [grids, rows, cols]`` bool, or None)."""
    if pruned is None:
        return tiles, captions
    shown = [g < len(pruned) for g in grids]
    tiles = [mark_pruned(tile, pruned[g]) if ok else tile for tile, g, ok in zip(tiles, grids, shown)]
    captions = [
        f"{caption} · {100 * pruned[g].mean():.0f}% pruned" if ok and pruned[g].any() else caption
        for caption, g, ok in zip(captions, grids, shown)
    ]
    return tiles, captions


def survivor_gallery(
    memory: KVMemory, thumbnails: list[np.ndarray], max_width: int = 160, pruned: np.ndarray | None = None
) -> list[tuple[np.ndarray, str]]:
    """Every temporal grid so far with what survives of it (aggregated), captioned with time and share (and what was
    pruned before the LLM: ``pruned [grids, rows, cols]``)."""
    fraction = survival_fraction_map(memory)
    grids = drawable(range(memory.num_grids), thumbnails)
    tiles = [overlay_fraction(thumbnail(thumbnails[g], max_width), fraction[g]) for g in grids]
    captions = [f"t={memory.grid_times_s[g]:.1f}s · {100 * fraction[g].mean():.0f}% kept" for g in grids]
    return list(zip(*with_pruned(tiles, captions, grids, pruned))) if grids else []
