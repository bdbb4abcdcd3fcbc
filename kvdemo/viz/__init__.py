"""Figures and heatmaps: pure functions of engine state (no Gradio here). Heatmaps are numpy/PIL images (the
app sends them as JPEG); charts are Plotly figures.

Rooms: :mod:`.frames` (thumbnails, overlays, survivor strips), :mod:`.charts` (occupancy, coverage, declared
charts), :mod:`.status` (held / summarised / offloaded / retrieved per patch), :mod:`.views` (drawing the
views a policy or an answer declares).
"""

from .charts import chart_figure, coverage_figure, figure_html, occupancy_figure, plotly_js_file
from .frames import (
    EVICTED,
    NEW_COLOUR,
    REASON_COLOURS,
    drawable,
    frame_strip,
    labelled_rows,
    legend_text,
    overlay_fraction,
    overlay_reasons,
    overlay_values,
    reason_map,
    survival_fraction_map,
    survivor_gallery,
    survivor_strip,
    thumbnail,
    wrap_caption,
)
from .status import (
    HELD,
    OFFLOADED,
    RETRIEVED,
    STATUS_COLOURS,
    STATUS_NAMES,
    SUMMARISED,
    engine_gallery,
    engine_strip,
    overlay_status,
    overlay_status_fractions,
    patch_status,
    possible_statuses,
    status_fractions,
    status_legend,
    summarised,
)
from .views import Panel, draw_view, draw_views

__all__ = [
    "EVICTED",
    "HELD",
    "NEW_COLOUR",
    "OFFLOADED",
    "REASON_COLOURS",
    "RETRIEVED",
    "STATUS_COLOURS",
    "STATUS_NAMES",
    "SUMMARISED",
    "Panel",
    "chart_figure",
    "coverage_figure",
    "draw_view",
    "draw_views",
    "drawable",
    "figure_html",
    "plotly_js_file",
    "engine_gallery",
    "engine_strip",
    "frame_strip",
    "labelled_rows",
    "legend_text",
    "occupancy_figure",
    "overlay_fraction",
    "overlay_reasons",
    "overlay_status",
    "overlay_status_fractions",
    "overlay_values",
    "patch_status",
    "possible_statuses",
    "reason_map",
    "status_fractions",
    "status_legend",
    "summarised",
    "survival_fraction_map",
    "survivor_gallery",
    "survivor_strip",
    "thumbnail",
    "wrap_caption",
]
