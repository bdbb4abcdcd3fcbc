"""ProtoKV's own views, as plain data (:mod:`kvdemo.views`, drawn by :mod:`kvdemo.viz`; their titles are in the
policy's card): which prototype each patch of the newest absorbed grids went to, and the bank (its mass histogram,
the pseudo-tokens attention can see over stream time, its churn)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...views import LOST, Chart, Histogram, PatchLabels, Series, View, ViewContext
from .bank import ProtoBank


def prototype_views(
    data: dict[str, Any], churn: dict[str, Any], context: ViewContext, layer: int, head: int, last: int = 4
) -> list[View]:
    """The prototype each patch of the ``last`` newest absorbed grids of one (layer, KV head) went to, and the bank:
    its mass histogram, the pseudo-tokens attention can see over stream time, and its churn. ``data``: the row's
    assignments (:meth:`.bank.ProtoBank.assignments`), ``churn``: its churn (:func:`bank_churn`)."""
    views: list[View] = []
    shown = [(g, ids) for g, ids in zip(data["grids"][-last:], data["prototype"][-last:]) if g < context.num_grids]
    mass = data["mass"]
    if shown:
        labels = np.stack([ids for _, ids in shown])
        ids = np.unique(labels[labels >= 0])
        top = sorted(ids.tolist(), key=lambda k: -int(mass[k]))[:8]
        listed = ", ".join(f"<b>{k}</b> (mass {int(mass[k])})" for k in top)
        caption = (
            f"Layer {layer}, KV head {head}: each patch of these absorbed frames is represented by the prototype "
            f"whose id it shows (same colour = same prototype); untinted = still exact in the near window"
            + ("; dark red = its prototype was recycled since" if (labels == LOST).any() else "")
            + (f". Heaviest here: {listed}." if listed else ".")
        )
        frame_captions = [
            f"t={context.grid_times_s[g]:.1f}s  {100 * (ids >= 0).mean():.0f}% in the bank" for g, ids in shown
        ]
        views.append(PatchLabels("Prototype assignments", caption, [g for g, _ in shown], labels, frame_captions))
    active = mass[mass > 0]
    events = context.timeline
    occupancy = Series(
        [e.time_s for e in events],
        {"pseudo-tokens visible": [e.summary_active for e in events]},
        "stream time (s)",
        "pseudo-tokens",
        limit=context.summary_slots,
    )
    histogram = Histogram(active, f"mass n_k (layer {layer}, head {head})", "prototypes")
    times = [context.grid_times_s[g] if g < context.num_grids else float(g) for g in churn["grids"]]
    churn_part = Series(
        times,
        {"merged away": churn["merged"], "recycled": churn["recycled"]},
        "stream time (s)",
        "slots merged / recycled per pass",
        markers=True,
    )
    # Not equal by construction: a slot merged away is empty and refilled in the same pass while the near window has a
    # free token to seed it, and slots that aging emptied (idle past t_idle) are refilled too.
    equal = churn["merged"] == churn["recycled"]
    caption = (
        f"{int(active.size)} of {len(mass)} prototypes active in this bank, total mass {int(active.sum())}; "
        f"middle: pseudo-tokens attention can see (capacity {context.summary_slots}, dashed); right: the "
        f"bank's churn, {churn['merged_per_pass']:.2f} merges and {churn['recycled_per_pass']:.2f} recyclings "
        f"per pass here over the last {len(times)} passes"
        + (
            " (the same in every pass: each slot merged away was refilled from the near window in its pass, and "
            "no slot idled past t_idle to be emptied by aging)."
            if equal and times
            else " (a slot merged away is refilled in its pass when the near window has a token to seed it; "
            "slots emptied by aging are refilled too)."
        )
    )
    views.append(Chart("Prototype bank", caption, [histogram, occupancy, churn_part]))
    return views


def bank_churn(bank: ProtoBank, row: int) -> dict[str, Any]:
    """Bank row ``row``'s churn over the last passes as plain data: ``grids`` (the temporal grid of each pass),
    ``merged`` and ``recycled`` (prototypes merged away and slots recycled in each pass), and their means."""
    counts = bank.churn[:, :, row].cpu()
    merged, recycled = counts[:, 0].tolist(), counts[:, 1].tolist()
    passes = max(len(merged), 1)
    return {
        "grids": bank.churn_grid.cpu().tolist(),
        "merged": merged,
        "recycled": recycled,
        "merged_per_pass": sum(merged) / passes,
        "recycled_per_pass": sum(recycled) / passes,
    }
