"""``sliding-window``: keep the newest ``C`` visual tokens (the text prefix acts as attention sink)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import LayerView, Ranking, ScoredPolicy, register

REASON_RECENT = 0


@register
@dataclass
class SlidingWindow(ScoredPolicy):
    """The newest ``keep`` tokens of every head by arrival order (the memory's slots are not in stream order)."""

    name = "sliding-window"
    summary = "Keep the newest C visual tokens; older ones are dropped."
    reason_names = {REASON_RECENT: "newest C tokens"}

    def rank(self, views: list[LayerView], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        return [Ranking(view.order.double(), torch.full_like(view.frame, REASON_RECENT, dtype=torch.int8)) for view in views], {}
