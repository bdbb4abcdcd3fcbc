"""Drawing the declared views (:mod:`kvdemo.views`), whoever declares them (a policy's own state, an
answer's attribution): by their kind, never by who declared them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..views import LOST, UNLABELLED, Chart, PatchLabels, View
from .charts import chart_figure
from .frames import _grid_lines, _upsample, drawable, frame_strip, overlay_values


@dataclass
class Panel:
    """One drawn view: a title, ``kind`` "image" (numpy RGB) or "plot" (Plotly figure), the drawn value and a
    caption (markdown)."""

    title: str
    kind: str
    value: Any
    caption: str = ""


#: Distinct colours for integer labels (e.g. prototype ids; label modulo the palette).
LABEL_COLOURS = np.array(
    [
        (230, 25, 75),
        (60, 180, 75),
        (255, 225, 25),
        (0, 130, 200),
        (245, 130, 48),
        (145, 30, 180),
        (70, 240, 240),
        (240, 50, 230),
        (210, 245, 60),
        (250, 190, 212),
        (0, 128, 128),
        (220, 190, 255),
        (170, 110, 40),
        (255, 250, 200),
        (128, 0, 0),
        (170, 255, 195),
        (128, 128, 0),
        (255, 215, 180),
        (0, 0, 128),
        (128, 128, 128),
    ],
    dtype=np.float32,
)
LOST_COLOUR = (120, 0, 0)


def draw_view(view: View, thumbnails: list[np.ndarray]) -> Panel | None:
    """Draw one declared view (frames come from ``thumbnails``, one per temporal grid); None if it shows no
    frame this session has."""
    if isinstance(view, Chart):
        return Panel(view.title, "plot", chart_figure(view), view.caption)
    have = set(drawable([g for g in view.grids if g >= 0], thumbnails))
    shown = [i for i, g in enumerate(view.grids) if g in have]
    if not shown:
        return None
    if isinstance(view, PatchLabels):
        tiles = [_label_tile(thumbnails[view.grids[i]], view.labels[i]) for i in shown]
    else:
        tiles = [overlay_values(thumbnails[view.grids[i]], view.values[i]) for i in shown]
    return Panel(view.title, "image", frame_strip(tiles, [view.frame_captions[i] for i in shown]), view.caption)


def draw_views(views: list[View], thumbnails: list[np.ndarray]) -> list[Panel]:
    return [panel for panel in (draw_view(view, thumbnails) for view in views) if panel is not None]


def _label_tile(frame: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each patch tinted by its label's colour with the label written in; unlabelled patches as they are (not
    dimmed: next to a survivor strip, dark reads as evicted), lost ones dark red."""
    height, width = frame.shape[:2]
    rows, cols = ids.shape
    colour = LABEL_COLOURS[np.clip(ids, 0, None) % len(LABEL_COLOURS)]
    colour[ids == LOST] = LOST_COLOUR
    labelled = _upsample((ids != UNLABELLED).astype(np.float32), (height, width))[..., None]
    cell = _upsample(np.arange(rows * cols).reshape(rows, cols).astype(np.float32), (height, width)).astype(np.int64)
    tint = colour[cell // cols, cell % cols]
    image = frame.astype(np.float32) * (1 - 0.55 * labelled) + tint * 0.55 * labelled
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
