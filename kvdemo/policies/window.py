"""``sliding-window``: keep the newest ``C`` visual tokens (the text prefix acts as attention sink)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, Policy, Selection, register, top_k_sorted

REASON_RECENT = 0


@register
@dataclass
class SlidingWindow(Policy):
    """The newest ``keep`` tokens of every head by arrival order (the memory's slots are not in stream order)."""

    name = "sliding-window"
    summary = "Keep the newest C visual tokens; older ones are dropped."
    reason_names = {REASON_RECENT: "newest C tokens"}

    def compress(self, views: list[LayerView], keep: int) -> Selection:
        indices = [top_k_sorted(view.order.double(), keep) for view in views]
        reasons = [torch.full_like(index, REASON_RECENT, dtype=torch.int8) for index in indices]
        return Selection(indices, {"reason": reasons})
