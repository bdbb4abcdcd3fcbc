"""Figures and heatmaps: pure functions of engine state (no Gradio here).

Heatmaps are numpy/PIL images (the UI sends them as JPEG); charts are Plotly figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .memory import KVMemory, OccupancyEvent

#: Reason code for tokens appended after the last compression (no reason reported yet).
REASON_NEW = -2
#: Reason code of a patch that is not held (evicted).
EVICTED = -1
NEW_COLOUR = (170, 170, 170)
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


# --- occupancy ---------------------------------------------------------------------------------


def occupancy_figure(series: dict[str, list[OccupancyEvent]], budget: int | None = None, title: str = ""):
    """Visual tokens (top) and real cache MB (bottom) over stream time for each engine.

    ``series`` maps a label ("infinipot-v at M=2048", "full cache") to its timeline; compression
    events are marked. A bounded policy draws a sawtooth under ``budget``; the full cache a line.
    (Built as one dict: plotly's subplot helpers cost ~100 ms per live update.)
    """
    import plotly.graph_objects as go

    colours = iter(["#d62728", "#1f77b4", "#2ca02c", "#9467bd"])
    data = []
    for label, events in series.items():
        colour = next(colours)
        x = [e.time_s for e in events]
        line = dict(color=colour, width=2)
        data.append(dict(type="scatter", x=x, y=[e.visual_tokens for e in events], mode="lines", name=label,
                         legendgroup=label, line=line, xaxis="x", yaxis="y"))
        data.append(dict(type="scatter", x=x, y=[e.cache_bytes / 2**20 for e in events], mode="lines", name=label,
                         legendgroup=label, showlegend=False, line=line, xaxis="x", yaxis="y2"))
        compressions = [e for e in events if e.event == "compress"]
        if compressions:
            data.append(dict(
                type="scatter", x=[e.time_s for e in compressions], y=[e.visual_tokens for e in compressions],
                mode="markers", name=f"{label}: compression", legendgroup=label, xaxis="x", yaxis="y",
                marker=dict(color=colour, symbol="triangle-down", size=8),
                hovertemplate="compressed to %{y} tokens at %{x:.1f}s<extra></extra>",
            ))
    shapes, annotations = [], [
        dict(text="visual tokens", x=0.5, y=1.0, xref="paper", yref="paper", showarrow=False, yanchor="bottom"),
        dict(text="KV cache (MB)", x=0.5, y=0.44, xref="paper", yref="paper", showarrow=False, yanchor="bottom"),
    ]
    if budget:
        shapes.append(dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=budget, y1=budget,
                           line=dict(color="#555", dash="dash", width=1)))
        annotations.append(dict(text=f"M = {budget}", xref="paper", x=0, yref="y", y=budget, showarrow=False,
                                xanchor="left", yanchor="bottom"))
    layout = dict(
        title=dict(text=title) if title else None, height=420, margin=dict(l=50, r=20, t=50, b=40),
        template="plotly_white", hovermode="x unified", shapes=shapes, annotations=annotations,
        legend=dict(orientation="h", yanchor="bottom", y=1.06, x=0),
        xaxis=dict(anchor="y2", title=dict(text="stream time (s)")),
        yaxis=dict(domain=[0.56, 1.0], rangemode="tozero"),
        yaxis2=dict(domain=[0.0, 0.44], rangemode="tozero"),
    )
    return go.Figure(dict(data=data, layout=layout))


def coverage_figure(summaries: dict[str, dict[str, Any]]):
    """CDF of every full-cache token's cosine distance to its nearest kept token (left is better)."""
    import plotly.graph_objects as go

    figure = go.Figure()
    dashes = {"joint": "solid", "key": "dash", "value": "dot"}
    colours = iter(["#d62728", "#1f77b4", "#2ca02c", "#9467bd"])
    for name, summary in summaries.items():
        colour = next(colours)
        for space, dash in dashes.items():
            curve = summary[space]["curve"]
            figure.add_trace(go.Scatter(x=curve["distance"], y=curve["fraction"], mode="lines", name=f"{name} ({space})",
                                        line=dict(color=colour, dash=dash)))
    figure.update_layout(
        title="coverage: distance to the nearest kept token (CDF, left is better)", height=320, template="plotly_white",
        xaxis_title="cosine distance", yaxis_title="fraction of full-cache tokens", margin=dict(l=50, r=20, t=50, b=40),
    )
    return figure


# --- survivors ---------------------------------------------------------------------------------


def survival_fraction_map(memory: KVMemory, layer: int | None = None, head: int | None = None) -> np.ndarray:
    """``[grids, rows, cols]`` fraction of (layer, head) copies of each patch still held."""
    counts = memory.survival_counts(layer, head).double()
    layers = memory.num_layers if layer is None else 1
    heads = memory.num_kv_heads if head is None else 1
    return (counts / (layers * heads)).numpy()


def reason_map(memory: KVMemory, info: dict[str, Any], layer: int, head: int) -> np.ndarray:
    """``[grids, rows, cols]`` reason code of each held patch of one layer/head (``EVICTED`` if not held).

    The last compression's reasons are aligned with the first ``C`` visual tokens of the memory (the
    kept tokens, in order); tokens appended since are ``REASON_NEW``.
    """
    rows, cols = memory.grid_shape or (0, 0)
    grid = np.full((memory.num_grids, rows, cols), EVICTED, dtype=np.int16)
    if not memory.grid_shape:
        return grid
    frame, row, col = (t[head].long().cpu().numpy() for t in (memory.frame[layer], memory.row[layer], memory.col[layer]))
    codes = np.full(frame.shape, REASON_NEW, dtype=np.int16)
    reasons = info.get("reason")
    if reasons is not None and layer < len(reasons):
        known = reasons[layer][head].cpu().numpy().astype(np.int16)
        codes[: min(len(known), len(codes))] = known[: len(codes)]
    grid[frame, row, col] = codes
    return grid


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


def frame_strip(tiles: list[np.ndarray], captions: list[str], gap: int = 6) -> np.ndarray:
    """Tiles side by side with a caption above each (one JPEG-friendly image)."""
    if not tiles:
        return np.full((60, 320, 3), 245, dtype=np.uint8)
    height = max(t.shape[0] for t in tiles)
    width = sum(t.shape[1] for t in tiles) + gap * (len(tiles) - 1)
    band = 26
    canvas = Image.new("RGB", (width, height + band), (250, 250, 250))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=16)
    x = 0
    for tile, caption in zip(tiles, captions):
        canvas.paste(Image.fromarray(tile), (x, band))
        draw.text((x + 3, 4), caption, fill=(20, 20, 20), font=font)
        x += tile.shape[1] + gap
    return np.asarray(canvas)


def legend_text(reason_names: dict[int, str]) -> str:
    """Markdown legend of the reason colours."""
    parts = [
        f"<span style='color:rgb{REASON_COLOURS[code % len(REASON_COLOURS)]}'>■</span> {name}"
        for code, name in sorted(reason_names.items())
    ]
    parts.append(f"<span style='color:rgb{NEW_COLOUR}'>■</span> new since the last compression")
    parts.append("dark = evicted")
    return " &nbsp; ".join(parts)


def survivor_strip(
    memory: KVMemory,
    thumbnails: list[np.ndarray],
    info: dict[str, Any],
    layer: int | None = None,
    head: int | None = None,
    last: int = 4,
    by_reason: bool = False,
) -> np.ndarray:
    """The newest ``last`` temporal grids with what survives of each, as one image.

    Aggregated over layers/heads (tint = fraction of copies held) unless ``layer`` and ``head`` are
    given; then ``by_reason`` colours each kept patch by the policy's reason.
    """
    grids = list(range(max(0, memory.num_grids - last), memory.num_grids))
    if not grids:
        return frame_strip([], [])
    single = layer is not None and head is not None
    if single and by_reason:
        codes = reason_map(memory, info, layer, head)
        tiles = [overlay_reasons(thumbnails[g], codes[g]) for g in grids]
        kept = [(codes[g] != EVICTED).mean() for g in grids]
    else:
        fraction = survival_fraction_map(memory, layer, head)
        tiles = [overlay_fraction(thumbnails[g], fraction[g]) for g in grids]
        kept = [fraction[g].mean() for g in grids]
    captions = [f"t={memory.grid_times_s[g]:.1f}s  {100 * k:.0f}% kept" for g, k in zip(grids, kept)]
    return frame_strip(tiles, captions)


def survivor_gallery(
    memory: KVMemory, thumbnails: list[np.ndarray], max_width: int = 160
) -> list[tuple[np.ndarray, str]]:
    """Every temporal grid so far with what survives of it (aggregated), captioned with time and share."""
    fraction = survival_fraction_map(memory)
    items = []
    for g in range(memory.num_grids):
        tile = overlay_fraction(thumbnail(thumbnails[g], max_width), fraction[g])
        items.append((tile, f"t={memory.grid_times_s[g]:.1f}s · {100 * fraction[g].mean():.0f}% kept"))
    return items
