"""Charts (Plotly figures, each built as one dict: plotly's subplot helpers cost ~100 ms per live update):
occupancy over stream time, the coverage CDF, and a declared :class:`~kvdemo.views.Chart` of parts."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import plotly
import plotly.graph_objects as go

from ..cache.memory import OccupancyEvent
from ..views import CellGrid, Chart, Histogram, Series

CHART_COLOURS = ["#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#8c564b"]
#: Lines of one series told apart by more than colour (equal values draw one line over another): dash styles and
#: marker symbols in step, the markers of earlier lines drawn larger so that a later one on top leaves a ring.
LINE_DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
MARKER_SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "star"]
#: Most tick labels on an integer axis (counts, layers): more would crowd a small panel.
MAX_INTEGER_TICKS = 8
#: The colours of a cell grid's classes, by class number (a legend entry each).
CELL_COLOURS = ["#ffbb78", "#1f77b4", "#98df8a", "#c5b0d5"]
#: Occupancy lines in order: the first engine red, then blue (the full cache next to one policy), green, purple...
OCCUPANCY_COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def same_values(lines: dict[str, Any]) -> dict[str, str]:
    """Each line whose values equal an earlier line's -> that earlier line's name: drawn on top of one another, so the
    legend says so ("full cache (same values as infinipot-v)") and the later one is dashed over the earlier."""
    first: dict[tuple, str] = {}
    same = {}
    for name, values in lines.items():
        key = tuple(values)
        if key in first:
            same[name] = first[key]
        else:
            first[key] = name
    return same


def occupancy_figure(
    series: dict[str, list[OccupancyEvent]],
    budget: int | None = None,
    title: str = "",
    log_scale: bool = False,
    pruning: dict[str, list[tuple[float, int, int]]] | None = None,
    lag: list[tuple[float, float]] | None = None,
):
    """Visual tokens (top) and real cache MB (bottom) over stream time for each engine.

    ``series`` maps a label ("infinipot-v at M=2048", "full cache") to its timeline; compression
    events are marked. A bounded policy draws a sawtooth under ``budget``; the full cache a line.
    ``log_scale``: logarithmic y axes, so a sawtooth stays visible beside a full cache that has grown.
    ``pruning`` maps the label of an engine with pruning before the LLM to its points ``(time s, visual tokens offered
    so far, entered so far)``: two more lines of its colour, what the stream offered against what entered.
    ``lag``: a live stream's ``(stream time, seconds behind live)`` per chunk, drawn over the bottom panel against
    its own axis on the right.
    (Built as one dict: plotly's subplot helpers cost ~100 ms per live update.)
    """
    pruning = pruning or {}
    data = []
    same = same_values({label: [(e.time_s, e.visual_tokens) for e in events] for label, events in series.items()})
    for index, (label, events) in enumerate(series.items()):
        colour = OCCUPANCY_COLOURS[index % len(OCCUPANCY_COLOURS)]
        x = [e.time_s for e in events]
        line = dict(color=colour, width=2, **({"dash": LINE_DASHES[index % len(LINE_DASHES)]} if label in same else {}))
        data.append(
            dict(
                type="scatter",
                x=x,
                y=[e.visual_tokens for e in events],
                mode="lines",
                name=f"{label} (same tokens as {same[label]})" if label in same else label,
                legendgroup=label,
                line=line,
                xaxis="x",
                yaxis="y",
            )
        )
        data.append(
            dict(
                type="scatter",
                x=x,
                y=[e.cache_bytes / 2**20 for e in events],
                mode="lines",
                name=label,
                legendgroup=label,
                showlegend=False,
                line=line,
                xaxis="x",
                yaxis="y2",
            )
        )
        if any(e.offloaded_bytes for e in events):  # HybridKV: host-memory store, apart from the resident cache
            data.append(
                dict(
                    type="scatter",
                    x=x,
                    y=[e.offloaded_bytes / 2**20 for e in events],
                    mode="lines",
                    name=f"{label}: offloaded (host)",
                    legendgroup=label,
                    xaxis="x",
                    yaxis="y2",
                    line=dict(color=colour, width=2, dash="dot"),
                )
            )
        for name, column, dash in (("offered so far", 1, "dot"), ("entered so far", 2, "dashdot")):
            if label in pruning:
                points = pruning[label]
                data.append(
                    dict(
                        type="scatter",
                        x=[p[0] for p in points],
                        y=[p[column] for p in points],
                        mode="lines",
                        name=f"{label}: {name} (pruning before the LLM)",
                        legendgroup=label,
                        xaxis="x",
                        yaxis="y",
                        line=dict(color=colour, width=1.5, dash=dash),
                    )
                )
        compressions = [e for e in events if e.event == "compress"]
        if compressions:
            data.append(
                dict(
                    type="scatter",
                    x=[e.time_s for e in compressions],
                    y=[e.visual_tokens for e in compressions],
                    mode="markers",
                    name=f"{label}: compression",
                    legendgroup=label,
                    xaxis="x",
                    yaxis="y",
                    marker=dict(color=colour, symbol="triangle-down", size=8),
                    hovertemplate="compressed to %{y} tokens at %{x:.1f}s<extra></extra>",
                )
            )
    shapes, annotations = (
        [],
        [
            dict(text="visual tokens", x=0.5, y=1.0, xref="paper", yref="paper", showarrow=False, yanchor="bottom"),
            dict(text="KV cache (MB)", x=0.5, y=0.44, xref="paper", yref="paper", showarrow=False, yanchor="bottom"),
        ],
    )
    if budget:
        shapes.append(
            dict(
                type="line",
                xref="paper",
                x0=0,
                x1=1,
                yref="y",
                y0=budget,
                y1=budget,
                line=dict(color="#555", dash="dash", width=1),
            )
        )
        level = float(np.log10(budget)) if log_scale else budget  # on a log axis an annotation sits at log10(y)
        # At the right end of its line, over the plot: at the left it sat on the axis' tick labels.
        annotations.append(
            dict(
                text=f"M = {budget}",
                xref="paper",
                x=1,
                yref="y",
                y=level,
                showarrow=False,
                xanchor="right",
                yanchor="bottom",
                bgcolor="rgba(255,255,255,0.8)",
            )
        )
    if lag is not None:
        style = dict(mode="lines+markers", line=dict(color="#7f7f7f", width=1.5, dash="dot"), marker=dict(size=4))
        x, y = [t for t, _ in lag], [seconds for _, seconds in lag]
        trace = dict(type="scatter", x=x, y=y, name="behind live (s)", xaxis="x", yaxis="y3", **style)
        data.append(dict(trace, hovertemplate="%{y:.2f} s behind live at %{x:.1f}s<extra></extra>"))
    tokens = [e.visual_tokens for events in series.values() for e in events] + ([budget] if budget else [])
    tokens += [p[1] for points in pruning.values() for p in points]
    megabytes = [max(e.cache_bytes, e.offloaded_bytes) / 2**20 for events in series.values() for e in events]
    scale = dict(type="log") if log_scale else dict(rangemode="tozero")
    empty = not any(series.values())
    layout = dict(
        title=dict(text=title) if title else None,
        height=420,
        margin=dict(l=50, r=20, t=50, b=40),
        template="plotly_white",
        hovermode="x unified",
        shapes=shapes,
        annotations=annotations,
        legend=dict(orientation="h", yanchor="bottom", y=1.06, x=0),
        # Before any event the axis starts at 0 s (plotly's empty autorange begins at -1).
        xaxis=dict(
            anchor="y2",
            title=dict(text="stream time (s)"),
            **(dict(range=[0, 10]) if empty else dict(rangemode="tozero")),
        ),
        yaxis=dict(
            domain=[0.56, 1.0],
            **scale,
            **(log_ticks(tokens) if log_scale else {}),
            title=dict(text="log scale" if log_scale else ""),
        ),
        yaxis2=dict(domain=[0.0, 0.44], **scale, **(log_ticks(megabytes) if log_scale else {})),
    )
    if lag is not None:
        layout["yaxis3"] = dict(
            overlaying="y2", side="right", rangemode="tozero", showgrid=False, title=dict(text="behind live (s)")
        )
        layout["margin"] = dict(layout["margin"], r=60)
    return go.Figure(dict(data=data, layout=layout))


def log_ticks(values: list[float]) -> dict[str, Any]:
    """Tick values for a logarithmic axis over ``values``: the coarsest of 1-10-100, 1-2-5, 1-2-3-5-7 and every
    digit that puts at least three ticks in their range, at most :data:`MAX_INTEGER_TICKS` (plotly's own choice on
    a short log axis labelled every digit, and the labels ran into each other); plotly's own ticks when even every
    digit puts fewer than two in the range (a range that narrow has room for whatever plotly labels)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return {}
    low, high = min(positive), max(positive)
    first, last = int(np.floor(np.log10(low))), int(np.ceil(np.log10(high)))
    chosen: list[float] = []
    for mantissas in ((1,), (1, 2, 5), (1, 2, 3, 5, 7), tuple(range(1, 10))):
        chosen = [m * 10.0**e for e in range(first, last + 1) for m in mantissas if low <= m * 10.0**e <= high]
        if len(chosen) >= 3:
            break
    if len(chosen) < 2:
        return {}
    step = -(-len(chosen) // MAX_INTEGER_TICKS)  # every step-th, when even powers of ten are too many
    return dict(tickmode="array", tickvals=[float(f"{v:.6g}") for v in chosen[::step]])


def integer_ticks(top: float) -> dict[str, Any]:
    """Ticks on whole numbers only, at most :data:`MAX_INTEGER_TICKS` from 0 to ``top`` (counts and layer numbers:
    plotly put ticks at 0.5, 1.5 on a short axis)."""
    return dict(tick0=0, dtick=max(1, int(np.ceil(max(top, 1) / MAX_INTEGER_TICKS))), tickformat="d")


def coverage_figure(summaries: dict[str, dict[str, Any]]):
    """CDF of every full-cache token's cosine distance to its nearest kept token (left is better)."""
    figure = go.Figure()
    dashes = {"joint": "solid", "key": "dash", "value": "dot"}
    colours = iter(["#d62728", "#1f77b4", "#2ca02c", "#9467bd"])
    for name, summary in summaries.items():
        colour = next(colours)
        for space, dash in dashes.items():
            curve = summary[space]["curve"]
            figure.add_trace(
                go.Scatter(
                    x=curve["distance"],
                    y=curve["fraction"],
                    mode="lines",
                    name=f"{name} ({space})",
                    line=dict(color=colour, dash=dash),
                )
            )
    figure.update_layout(
        title="coverage: distance to the nearest kept token (CDF, left is better)",
        height=320,
        template="plotly_white",
        xaxis_title="cosine distance",
        yaxis_title="fraction of full-cache tokens",
        margin=dict(l=50, r=20, t=50, b=40),
    )
    return figure


def chart_figure(chart: Chart, title: str = ""):
    """A Plotly figure of the chart's parts side by side (one dict: plotly's subplot helpers are slow), under ``title``
    if one is given (the app shows most charts' titles beside them); a legend, when there is one, under the axes."""
    parts = len(chart.parts)
    gap = 0.1 if parts > 1 else 0.0
    width = (1.0 - gap * (parts - 1)) / parts
    data, layout, shapes = [], {}, []
    for index, part in enumerate(chart.parts):
        suffix = "" if index == 0 else str(index + 1)
        xaxis, yaxis = f"x{suffix}", f"y{suffix}"
        domain = [index * (width + gap), index * (width + gap) + width]
        x_ticks: dict[str, Any] = {}
        y_ticks: dict[str, Any] = {}
        if isinstance(part, Histogram):
            values = np.asarray(part.values)
            top = int(values.max()) + 1 if values.size else 2
            edges = (
                np.unique(np.round(np.geomspace(1, max(2, top), 12)).astype(int))
                if part.log_bins
                else np.linspace(0, max(top, 1), 12)
            )
            counts, _ = np.histogram(values, bins=edges) if values.size else (np.zeros(len(edges) - 1), edges)
            labels = [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(edges[:-1], edges[1:])]
            data.append(
                dict(
                    type="bar",
                    x=labels,
                    y=counts.tolist(),
                    marker=dict(color=CHART_COLOURS[0]),
                    xaxis=xaxis,
                    yaxis=yaxis,
                    hovertemplate="%{x}: %{y}<extra></extra>",
                    showlegend=False,
                )
            )
            axis_type = "category"
            y_ticks = integer_ticks(float(counts.max()) if len(counts) else 1)
        elif isinstance(part, Series):
            count = len(part.lines)
            same = same_values(part.lines)
            for k, (colour, (name, ys)) in enumerate(zip(CHART_COLOURS[1:] + CHART_COLOURS[:1], part.lines.items())):
                marker = dict(
                    symbol=MARKER_SYMBOLS[k % len(MARKER_SYMBOLS)], size=6 + 3 * (count - 1 - k), color=colour
                )
                data.append(
                    dict(
                        type="scatter",
                        x=part.x,
                        y=ys,
                        mode="lines+markers" if part.markers else "lines",
                        name=f"{name} (same values as {same[name]})" if name in same else name,
                        line=dict(color=colour, width=2, dash=LINE_DASHES[k % len(LINE_DASHES)]),
                        marker=marker,
                        xaxis=xaxis,
                        yaxis=yaxis,
                    )
                )
            if part.limit is not None:
                shapes.append(
                    dict(
                        type="line",
                        xref=f"{xaxis} domain",
                        x0=0,
                        x1=1,
                        yref=yaxis,
                        y0=part.limit,
                        y1=part.limit,
                        line=dict(color="#555", dash="dash", width=1),
                    )
                )
            axis_type = "linear"
            if part.x and all(float(x).is_integer() for x in part.x):  # layers, whole seconds: no half ticks
                x_ticks = integer_ticks(max(part.x) - min(part.x))
        else:  # CellGrid
            top = max(1, len(part.class_names) - 1)
            data.append(
                dict(
                    type="heatmap",
                    z=part.classes.tolist(),
                    text=[[f"{int(n)}" for n in row] for row in part.numbers],
                    texttemplate="%{text}",
                    customdata=part.hover,
                    hovertemplate="%{customdata}<extra></extra>",
                    colorscale=[[k / top, CELL_COLOURS[k]] for k in range(top + 1)],
                    zmin=0,
                    zmax=top,
                    showscale=False,
                    x=part.col_names,
                    y=part.row_names,
                    xaxis=xaxis,
                    yaxis=yaxis,
                )
            )
            for code, name in sorted(part.class_names.items()):  # the legend: one square per class
                data.append(
                    dict(
                        type="scatter",
                        x=[None],
                        y=[None],
                        mode="markers",
                        name=name,
                        xaxis=xaxis,
                        yaxis=yaxis,
                        marker=dict(symbol="square", size=12, color=CELL_COLOURS[code]),
                        hoverinfo="skip",
                    )
                )
            axis_type = None
        x_title = getattr(part, "x_title", "")
        layout[f"xaxis{suffix}"] = dict(
            domain=domain,
            anchor=yaxis,
            **({"type": axis_type} if axis_type else {}),
            **({"title": dict(text=x_title)} if x_title else {}),
            **x_ticks,
        )
        y_axis = dict(anchor=xaxis)
        if isinstance(part, CellGrid):
            y_axis["autorange"] = "reversed"
        else:
            y_axis.update(rangemode="tozero", title=dict(text=getattr(part, "y_title", "")))
            if getattr(part, "log_y", False):
                y_axis["type"] = "log"
            y_axis.update(y_ticks)
        layout[f"yaxis{suffix}"] = y_axis
    rows = max((len(p.row_names) for p in chart.parts if isinstance(p, CellGrid)), default=0)
    height = max(280, 22 * rows + 80) if rows else 280
    legend = any(isinstance(p, CellGrid) or isinstance(p, Series) and len(p.lines) > 1 for p in chart.parts)
    below = 40 + (70 if legend else 0)  # the x axis' title, then the legend's rows under it
    top = 50 if title else 30
    layout.update(
        height=height + below - 40 + top - 30,
        margin=dict(l=50, r=20, t=top, b=below),
        template="plotly_white",
        shapes=shapes,
        showlegend=legend,
        legend=dict(orientation="h", yanchor="bottom", y=0.01, yref="container", x=0),
        title=dict(text=title, x=0, xanchor="left", font=dict(size=14)) if title else None,
    )
    return go.Figure(dict(data=data, layout=layout))


#: The file name plotly.js is written under, once per app (:func:`plotly_js_file`).
PLOTLY_JS = f"plotly-{plotly.__version__}.min.js"


def plotly_js_file(folder: str | Path) -> Path:
    """plotly.js (about 4.7 MB) written into ``folder`` once (written to a side name, then renamed, so a
    concurrent export never reads half of it); the exported charts reference it instead of carrying it."""
    path = Path(folder) / PLOTLY_JS
    if not path.exists():
        from plotly.offline import get_plotlyjs  # deferred: only the first export writes it

        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{id(path)}.part")
        part.write_text(get_plotlyjs(), encoding="utf-8")
        part.replace(path)
    return path


def figure_html(figure: go.Figure, plotly_js_url: str) -> str:
    """``figure`` as a page that loads plotly.js from ``plotly_js_url`` (the app's one copy) rather than inline:
    about 10 KB instead of 4.8 MB, so exports in a long session do not fill the served-file cache. Where plotly.js
    cannot be loaded (the app stopped, the page opened elsewhere) the page says where it draws from."""
    page = figure.to_html(include_plotlyjs=plotly_js_url, full_html=True)
    note = html.escape(
        f"This chart draws with plotly.js served by the kvdemo app ({plotly_js_url}); open it while "
        "the app runs, from the link the app gives."
    )
    fallback = f'<script>if (!window.Plotly) document.body.insertAdjacentHTML("afterbegin", "<p>{note}</p>");</script>'
    return page.replace("</body>", f"{fallback}</body>", 1)
