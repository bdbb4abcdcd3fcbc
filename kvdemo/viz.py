"""Figures and heatmaps: pure functions of engine state (no Gradio here).

Heatmaps are numpy/PIL images (the UI sends them as JPEG); charts are Plotly figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .memory import REASON_NEW, KVMemory, OccupancyEvent

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
        if any(e.offloaded_bytes for e in events):  # HybridKV: host-memory store, apart from the resident cache
            data.append(dict(type="scatter", x=x, y=[e.offloaded_bytes / 2**20 for e in events], mode="lines",
                             name=f"{label}: offloaded (host)", legendgroup=label, xaxis="x", yaxis="y2",
                             line=dict(color=colour, width=2, dash="dot")))
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
        t[head].long().cpu().numpy() for t in (memory.frame[layer], memory.row[layer], memory.col[layer], memory.reason[layer])
    )
    valid = memory.valid[layer]
    held = valid[head].cpu().numpy() if valid is not None else np.ones(frame.shape, dtype=bool)
    grid[frame[held], row[held], col[held]] = codes[held]
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
    wrapped = [wrap_caption(caption, tile.shape[1] - 6, lambda text: measure(text, font=font))
               for tile, caption in zip(tiles, captions)]
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
        codes = reason_map(memory, layer, head)
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


# --- the policies' own views ---------------------------------------------------------------------


@dataclass
class Panel:
    """One view a policy declares: a title, ``kind`` "image" (numpy RGB) or "plot" (Plotly figure), the
    drawn value and a caption (markdown)."""

    title: str
    kind: str
    value: Any
    caption: str = ""


#: Distinct colours for prototype ids (id modulo the palette).
PROTOTYPE_COLOURS = np.array(
    [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240),
     (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128), (220, 190, 255), (170, 110, 40),
     (255, 250, 200), (128, 0, 0), (170, 255, 195), (128, 128, 0), (255, 215, 180), (0, 0, 128), (128, 128, 128)],
    dtype=np.float32,
)
NOT_ABSORBED, LOST = -1, -2


def policy_panels(engine, thumbnails: list[np.ndarray], layer: int | None = None, head: int | None = None) -> list[Panel]:
    """The views ``engine.policy`` declares (``Policy.panels``), for one layer and KV head (0 and 0 when the
    view is aggregated over all)."""
    panels = []
    for name in engine.policy.panels:
        draw = PANEL_DRAWERS.get(name)
        panel = draw(engine, thumbnails, layer or 0, head or 0) if draw else None
        if panel is not None:
            panels.append(panel)
    return panels


def prototype_assignment_panel(engine, thumbnails: list[np.ndarray], layer: int, head: int, last: int = 4) -> Panel | None:
    """ProtoKV: the newest absorbed grids, each absorbed patch coloured by the prototype it went to (the same
    colour for the same prototype across grids) with its id; patches still exact are dimmed."""
    data = engine.policy.assignments(layer, head, engine.memory.num_kv_heads)
    if not data or not data["grids"]:
        return None
    grids, proto, mass = data["grids"][-last:], data["prototype"][-last:], data["mass"]
    tiles, captions = [], []
    for grid, ids in zip(grids, proto):
        if grid >= len(thumbnails):
            continue
        tiles.append(_prototype_tile(thumbnails[grid], ids))
        captions.append(f"t={engine.memory.grid_times_s[grid]:.1f}s  {100 * (ids >= 0).mean():.0f}% in the bank")
    shown = np.unique(np.concatenate([p[p >= 0] for p in proto]).astype(np.int64)) if len(proto) else np.array([], int)
    top = sorted(shown.tolist(), key=lambda k: -int(mass[k]))[:8]
    listed = ", ".join(f"<b>{k}</b> (mass {int(mass[k])})" for k in top)
    caption = (f"Layer {layer}, KV head {head}: each patch of these absorbed frames is represented by the prototype "
               f"whose id it shows (same colour = same prototype); dimmed = still exact in the near window"
               + ("; dark red = its prototype was recycled since" if (np.concatenate(list(proto)) == LOST).any() else "")
               + (f". Heaviest here: {listed}." if listed else "."))
    return Panel("Prototype assignments", "image", frame_strip(tiles, captions), caption)


def _prototype_tile(frame: np.ndarray, ids: np.ndarray) -> np.ndarray:
    height, width = frame.shape[:2]
    rows, cols = ids.shape
    colour = PROTOTYPE_COLOURS[np.clip(ids, 0, None) % len(PROTOTYPE_COLOURS)]
    colour[ids == LOST] = (120, 0, 0)
    absorbed = _upsample((ids != NOT_ABSORBED).astype(np.float32), (height, width))[..., None]
    tint = colour[_upsample(np.arange(rows * cols).reshape(rows, cols).astype(np.float32), (height, width)).astype(np.int64) // cols,
                  _upsample(np.arange(rows * cols).reshape(rows, cols).astype(np.float32), (height, width)).astype(np.int64) % cols]
    image = frame.astype(np.float32) * (0.35 + 0.65 * absorbed)
    image = image * (1 - 0.55 * absorbed) + tint * 0.55 * absorbed
    canvas = Image.fromarray(_grid_lines(np.clip(image, 0, 255).astype(np.uint8), (rows, cols)))
    cell_w, cell_h = width / cols, height / rows
    if cell_w >= 14 and cell_h >= 10:
        draw = ImageDraw.Draw(canvas)
        font = ImageFont.load_default(size=max(8, int(min(cell_h, cell_w / 2) * 0.55)))
        for r in range(rows):
            for c in range(cols):
                if ids[r, c] >= 0:
                    draw.text((c * cell_w + 2, r * cell_h + 1), str(int(ids[r, c])), fill=(255, 255, 255), font=font)
    return np.asarray(canvas)


def prototype_bank_panel(engine, thumbnails: list[np.ndarray], layer: int, head: int) -> Panel | None:
    """ProtoKV: the mass histogram of one (layer, KV head) bank, and bank occupancy (visible pseudo-tokens,
    mean over KV heads, fullest layer) over stream time."""
    import plotly.graph_objects as go

    data = engine.policy.assignments(layer, head, engine.memory.num_kv_heads)
    if data is None:
        return None
    mass = data["mass"][data["mass"] > 0]
    events = engine.memory.timeline
    capacity = engine.memory.summary_slots
    edges = np.unique(np.round(np.geomspace(1, max(2, int(mass.max()) + 1 if mass.size else 2), 12)).astype(int))
    counts, _ = np.histogram(mass, bins=edges) if mass.size else (np.zeros(len(edges) - 1), edges)
    labels = [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(edges[:-1], edges[1:])]
    data_traces = [
        dict(type="bar", x=labels, y=counts.tolist(), name="prototypes", marker=dict(color="#1f77b4"), xaxis="x", yaxis="y",
             hovertemplate="mass %{x}: %{y} prototypes<extra></extra>"),
        dict(type="scatter", x=[e.time_s for e in events], y=[e.summary_active for e in events], mode="lines",
             name="pseudo-tokens visible", line=dict(color="#2ca02c", width=2), xaxis="x2", yaxis="y2"),
    ]
    layout = dict(
        height=280, margin=dict(l=50, r=20, t=40, b=40), template="plotly_white", showlegend=False,
        xaxis=dict(domain=[0, 0.45], title=dict(text=f"mass n_k (layer {layer}, head {head})"), type="category"),
        yaxis=dict(title=dict(text="prototypes")),
        xaxis2=dict(domain=[0.55, 1], title=dict(text="stream time (s)"), anchor="y2"),
        yaxis2=dict(anchor="x2", rangemode="tozero", title=dict(text="pseudo-tokens")),
        shapes=[dict(type="line", xref="x2 domain", x0=0, x1=1, yref="y2", y0=capacity, y1=capacity,
                     line=dict(color="#555", dash="dash", width=1))],
    )
    caption = (f"{int(mass.size)} of {len(data['mass'])} prototypes active in this bank, total mass {int(mass.sum())}; "
               f"right: pseudo-tokens attention can see (capacity {capacity}, dashed).")
    return Panel("Prototype bank", "plot", go.Figure(dict(data=data_traces, layout=layout)), caption)


def head_types_panel(engine, thumbnails: list[np.ndarray], layer: int, head: int) -> Panel | None:
    """HybridKV: the layers x KV heads map of the last pass (static / dynamic), each cell's budget written in."""
    import plotly.graph_objects as go

    data = engine.policy.head_types()
    if data is None:
        return None
    static, budget, sparsity = data["static"], data["budget"], data["sparsity"]
    layers, heads = static.shape
    text = [[f"{int(budget[l, h])}" for h in range(heads)] for l in range(layers)]
    hover = [[f"layer {l}, KV head {h}: {'static' if static[l, h] else 'dynamic'}, budget {int(budget[l, h])}, "
              f"sparsity {float(sparsity[l, h]):.3f}" for h in range(heads)] for l in range(layers)]
    trace = dict(type="heatmap", z=static.astype(int).tolist(), text=text, texttemplate="%{text}", customdata=hover,
                 hovertemplate="%{customdata}<extra></extra>", colorscale=[[0, "#ffbb78"], [1, "#1f77b4"]], zmin=0, zmax=1,
                 showscale=False, x=[f"head {h}" for h in range(heads)], y=[f"L{l}" for l in range(layers)])
    layout = dict(height=max(220, 22 * layers + 80), margin=dict(l=50, r=20, t=30, b=30), template="plotly_white",
                  yaxis=dict(autorange="reversed"))
    caption = (f"<span style='color:#1f77b4'>■</span> static ({int(static.sum())}: pruned by the probe's attention) "
               f"&nbsp; <span style='color:#ffbb78'>■</span> dynamic ({int((~static).sum())}: newest tokens resident, the rest "
               f"offloaded and retrieved while answering); numbers are each head's budget (cutoff {float(data['cutoff']):.3f}).")
    return Panel("Head types", "plot", go.Figure(dict(data=[trace], layout=layout)), caption)


PANEL_DRAWERS = {
    "prototype assignments": prototype_assignment_panel,
    "prototype bank": prototype_bank_panel,
    "head types": head_types_panel,
}


# --- what one head holds, beyond its exact tokens -------------------------------------------------

#: Per-patch status codes of :func:`patch_status`.
HELD, SUMMARISED, OFFLOADED, RETRIEVED = 0, 1, 2, 3
STATUS_COLOURS = {HELD: (255, 214, 0), SUMMARISED: (66, 133, 244), OFFLOADED: (171, 71, 188), RETRIEVED: (52, 168, 83)}
STATUS_NAMES = {HELD: "held exactly", SUMMARISED: "summarised by a prototype", OFFLOADED: "offloaded (host memory)",
                RETRIEVED: "retrieved while answering the last question"}


def patch_status(engine, layer: int, head: int) -> np.ndarray | None:
    """``[grids, rows, cols]`` status of every patch for one (layer, KV head): held exactly, summarised
    (ProtoKV: absorbed into a prototype that still exists), offloaded / retrieved during the last answer
    (HybridKV's dynamic heads), or ``EVICTED``. None for a policy that only selects (its view is
    :func:`survivor_strip`)."""
    memory = engine.memory
    store = memory.layers[layer] if memory.layers else None
    summarises, offloads = bool(memory.summary_slots), store is not None and store.offload is not None
    if memory.grid_shape is None or not (summarises or offloads):
        return None
    rows, cols = memory.grid_shape
    status = np.full((memory.num_grids, rows, cols), EVICTED, dtype=np.int16)
    if summarises:
        status[:] = SUMMARISED  # ProtoKV absorbs every token it evicts
        data = engine.policy.assignments(layer, head, memory.num_kv_heads)
        for grid, ids in zip(data["grids"], data["prototype"]) if data else ():
            status[grid][ids == LOST] = EVICTED
    if offloads:
        offload = store.offload
        chunks = int(offload.count[head])
        valid = offload.valid[head, :chunks].numpy()
        retrieved = offload.retrieved[head, :chunks].cpu().numpy()[:, None] & valid
        frame, row, col = (offload.provenance[name][head, :chunks].numpy() for name in ("frame", "row", "col"))
        status[frame[valid], row[valid], col[valid]] = OFFLOADED
        status[frame[retrieved], row[retrieved], col[retrieved]] = RETRIEVED
    frame, row, col = (t[head].long().cpu().numpy() for t in (memory.frame[layer], memory.row[layer], memory.col[layer]))
    held = memory.valid[layer][head].cpu().numpy() if memory.valid[layer] is not None else np.ones(frame.shape, dtype=bool)
    status[frame[held], row[held], col[held]] = HELD
    return status


def overlay_status(frame: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Colour each patch by its :func:`patch_status` code, darken evicted ones (``codes [rows, cols]``)."""
    height, width = frame.shape[:2]
    palette = np.zeros((len(STATUS_COLOURS) + 1, 3), dtype=np.float32)
    for code, colour in STATUS_COLOURS.items():
        palette[code] = colour
    shown = _upsample((codes != EVICTED).astype(np.float32), (height, width))[..., None]
    colour = palette[_upsample(codes.astype(np.float32), (height, width)).astype(np.int64)]
    image = frame.astype(np.float32) * (0.25 + 0.75 * shown)
    image = image * (1 - 0.4 * shown) + colour * 0.4 * shown
    return _grid_lines(np.clip(image, 0, 255).astype(np.uint8), codes.shape)


def status_legend(codes: np.ndarray) -> str:
    """Markdown legend of the statuses that appear in ``codes``."""
    present = set(np.unique(codes).tolist())
    parts = [f"<span style='color:rgb{STATUS_COLOURS[code]}'>■</span> {name}" for code, name in STATUS_NAMES.items() if code in present]
    return " &nbsp; ".join(parts + ["dark = evicted"])


def status_fractions(engine, layer: int | None = None, head: int | None = None) -> np.ndarray | None:
    """``[statuses, grids, rows, cols]``: the share of (layer, KV head) copies of each patch in each
    :func:`patch_status` (held, summarised, offloaded, retrieved), over all layers/heads or the chosen ones;
    None for a policy that only selects. Counted with one ``bincount`` per layer, like the survival map."""
    memory = engine.memory
    if memory.grid_shape is None or not memory.layers:
        return None
    layers = range(memory.num_layers) if layer is None else [layer]
    heads = list(range(memory.num_kv_heads)) if head is None else [head]
    summarises = bool(memory.summary_slots)
    offloads = any(memory.layers[l].offload is not None for l in layers)
    if not (summarises or offloads):
        return None
    rows, cols = memory.grid_shape
    size = memory.num_grids * rows * cols
    copies = len(layers) * len(heads)
    held = memory.survival_counts(layer, head).numpy().reshape(-1).astype(np.float64)
    out = np.zeros((len(STATUS_COLOURS), size))
    out[HELD] = held
    if summarises:  # ProtoKV absorbs everything it evicts, except what sits in since-recycled prototypes
        lost = np.zeros(size)
        for l in layers:
            for h in heads:
                data = engine.policy.assignments(l, h, memory.num_kv_heads)
                for grid, ids in zip(data["grids"], data["prototype"]) if data else ():
                    lost[grid * rows * cols : (grid + 1) * rows * cols] += (ids == LOST).reshape(-1)
        out[SUMMARISED] = copies - held - lost
    for l in layers:
        store = memory.layers[l].offload
        if store is None:
            continue
        flat = ((store.provenance["frame"] * rows + store.provenance["row"]) * cols + store.provenance["col"])[heads]
        valid = store.valid[heads]
        retrieved = store.retrieved[heads].cpu()[..., None] & valid
        out[RETRIEVED] += np.bincount(flat[retrieved].numpy(), minlength=size)
        out[OFFLOADED] += np.bincount(flat[valid & ~retrieved].numpy(), minlength=size)
    return (out / copies).reshape(len(STATUS_COLOURS), memory.num_grids, rows, cols)


def overlay_status_fractions(frame: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """Tint each patch by the shares of its statuses (``fractions [statuses, rows, cols]``); dark = evicted."""
    height, width = frame.shape[:2]
    colours = np.array([STATUS_COLOURS[code] for code in STATUS_COLOURS], dtype=np.float32)  # [S, 3]
    shares = np.stack([_upsample(f, (height, width)) for f in fractions], axis=-1)  # [h, w, S]
    shown = shares.sum(-1, keepdims=True).clip(0, 1)
    tint = (shares @ colours) / np.maximum(shown, 1e-6)
    image = frame.astype(np.float32) * (0.25 + 0.75 * shown)
    image = image * (1 - 0.4 * shown) + tint * 0.4 * shown
    return _grid_lines(np.clip(image, 0, 255).astype(np.uint8), fractions.shape[1:])


def _status_caption(fractions: np.ndarray) -> str:
    held, summarised, offloaded, retrieved = (float(f.mean()) for f in fractions)
    parts = [f"{100 * held:.0f}% exact"]
    if summarised:
        parts.append(f"{100 * summarised:.0f}% summarised")
    if offloaded or retrieved:
        parts.append(f"{100 * (offloaded + retrieved):.0f}% offloaded")
    return " · ".join(parts)


def engine_strip(engine, thumbnails: list[np.ndarray], layer: int | None = None, head: int | None = None,
                 by_reason: bool = False, last: int = 4) -> np.ndarray:
    """What survives of the newest grids for ``engine``: :func:`survivor_strip`, or, for a policy that
    summarises (ProtoKV) or offloads (HybridKV), each patch tinted by its statuses (:func:`patch_status`)
    over the chosen layer/KV head or all of them, so that a summarised patch never reads as evicted."""
    memory = engine.memory
    if not by_reason or layer is None or head is None:
        fractions = status_fractions(engine, layer, head)
        if fractions is not None:
            grids = list(range(max(0, memory.num_grids - last), memory.num_grids))
            tiles = [overlay_status_fractions(thumbnails[g], fractions[:, g]) for g in grids]
            captions = [f"t={memory.grid_times_s[g]:.1f}s  {_status_caption(fractions[:, g])}" for g in grids]
            return frame_strip(tiles, captions)
    return survivor_strip(memory, thumbnails, layer, head, last=last, by_reason=by_reason)


def engine_gallery(engine, thumbnails: list[np.ndarray], max_width: int = 160) -> list[tuple[np.ndarray, str]]:
    """Every grid so far with what survives of it (aggregated; statuses for summarising/offloading policies)."""
    fractions = status_fractions(engine)
    if fractions is None:
        return survivor_gallery(engine.memory, thumbnails, max_width)
    memory = engine.memory
    return [(overlay_status_fractions(thumbnail(thumbnails[g], max_width), fractions[:, g]),
             f"t={memory.grid_times_s[g]:.1f}s · {_status_caption(fractions[:, g])}") for g in range(memory.num_grids)]
