"""A declared line chart (:class:`~kvdemo.views.Series`) drawn as a PNG with PIL alone: no browser, no kaleido
(Plotly's image export needs one of them; kvdemo's requirements have neither). Used by ``kvdemo results``."""

from __future__ import annotations

import math

from PIL import Image, ImageDraw, ImageFont

from ..views import Chart, Series
from .charts import CHART_COLOURS, same_values

WIDTH, HEIGHT = 900, 520
LEFT, RIGHT, TOP, BOTTOM = 80, 220, 60, 70


def _ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round tick values covering ``[low, high]`` (steps of 1, 2 or 5 times a power of ten)."""
    span = max(high - low, 1e-9)
    raw = span / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(s * power for s in (1, 2, 5, 10) if s * power >= raw)
    first = math.floor(low / step) * step
    return [round(first + i * step, 10) for i in range(int(math.ceil((high - first) / step)) + 1)]


def _label(value: float) -> str:
    return f"{value:g}"


def _line(draw: ImageDraw.ImageDraw, a: tuple[float, float], b: tuple[float, float], colour: str, dashed: bool) -> None:
    """A segment from ``a`` to ``b``, whole or in dashes of 8 px every 14 px."""
    if not dashed:
        draw.line([a, b], fill=colour, width=3)
        return
    length = math.dist(a, b)
    for start in range(0, max(int(length), 1), 14):
        t0, t1 = start / max(length, 1e-9), min(start + 8, length) / max(length, 1e-9)
        draw.line(
            [
                (a[0] + (b[0] - a[0]) * t0, a[1] + (b[1] - a[1]) * t0),
                (a[0] + (b[0] - a[0]) * t1, a[1] + (b[1] - a[1]) * t1),
            ],
            fill=colour,
            width=3,
        )


def chart_png(chart: Chart) -> Image.Image:
    """The chart's first line part as an RGB image ``WIDTH x HEIGHT``: axes with round ticks, one coloured line
    with dots per series (gaps where a value is None), the ``limit`` as a dashed grey level, a legend on the right.
    A line with the same values as an earlier one is dashed over it with smaller dots (the earlier one's show as
    rings around them), and its legend entry says which line it repeats."""
    series = next((part for part in chart.parts if isinstance(part, Series)), None)
    if series is None:
        raise ValueError("chart_png draws line charts (a Series part)")
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    values = [v for ys in series.lines.values() for v in ys if v is not None] + (
        [series.limit] if series.limit is not None else []
    )
    y_ticks = _ticks(0.0, max(1.0, max(values, default=1.0)))
    x_low, x_high = min(series.x), max(series.x)
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    x_ticks = series.x if len(series.x) <= 8 else _ticks(x_low, x_high)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        top = y_ticks[-1] + 0.04 * (y_ticks[-1] - y_ticks[0])  # headroom: a line at the top tick stays off the frame
        return (
            LEFT + (x - x_low) / (x_high - x_low) * plot_w,
            TOP + plot_h - (y - y_ticks[0]) / (top - y_ticks[0]) * plot_h,
        )

    draw.text((LEFT, 18), chart.title, fill="black", font=font)
    draw.text((LEFT, 34), chart.caption[:110], fill="#555", font=font)
    for y in y_ticks:
        _, py = at(x_low, y)
        draw.line([(LEFT, py), (LEFT + plot_w, py)], fill="#e6e6e6")
        draw.text((LEFT - 8, py), _label(y), fill="black", font=font, anchor="rm")
    for x in x_ticks:
        px, _ = at(x, y_ticks[0])
        draw.line([(px, TOP + plot_h), (px, TOP + plot_h + 5)], fill="black")
        draw.text((px, TOP + plot_h + 8), _label(x), fill="black", font=font, anchor="mt")
    draw.rectangle([LEFT, TOP, LEFT + plot_w, TOP + plot_h], outline="black")
    draw.text((LEFT + plot_w / 2, HEIGHT - 22), series.x_title, fill="black", font=font, anchor="mm")
    draw.text((12, TOP - 14), series.y_title, fill="black", font=font)
    if series.limit is not None:
        _, py = at(x_low, series.limit)
        for start in range(LEFT, LEFT + plot_w, 12):
            draw.line([(start, py), (min(start + 6, LEFT + plot_w), py)], fill="#555", width=2)
    colours = CHART_COLOURS[1:] + CHART_COLOURS[:1]
    same = same_values(series.lines)
    legend_y = TOP + 10
    for index, (name, ys) in enumerate(series.lines.items()):
        colour = colours[index % len(colours)]
        points = [at(x, y) if y is not None else None for x, y in zip(series.x, ys)]
        for a, b in zip(points, points[1:]):
            if a is not None and b is not None:
                _line(draw, a, b, colour, name in same)
        radius = 2 if name in same else 4  # a repeated line's dots sit inside the rings of the one it repeats
        for point in points:
            if point is not None:
                draw.ellipse([point[0] - radius, point[1] - radius, point[0] + radius, point[1] + radius], fill=colour)
        _line(draw, (WIDTH - RIGHT + 20, legend_y), (WIDTH - RIGHT + 44, legend_y), colour, name in same)
        draw.text((WIDTH - RIGHT + 50, legend_y), name[:26], fill="black", font=font, anchor="lm")
        if name in same:
            legend_y += 14
            draw.text(
                (WIDTH - RIGHT + 50, legend_y), f"same values as {same[name]}"[:30], fill="#555", font=font, anchor="lm"
            )
        legend_y += 20
    if series.limit is not None:
        draw.line([(WIDTH - RIGHT + 20, legend_y), (WIDTH - RIGHT + 30, legend_y)], fill="#555", width=2)
        draw.line([(WIDTH - RIGHT + 36, legend_y), (WIDTH - RIGHT + 44, legend_y)], fill="#555", width=2)
        draw.text((WIDTH - RIGHT + 50, legend_y), "full cache", fill="black", font=font, anchor="lm")
    return image
