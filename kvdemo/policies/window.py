"""``sliding-window``: keep the newest ``C`` visual tokens (the text prefix acts as attention sink)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .contract import LayerSlice, slice_stacks
from .registry import PolicyCard, register
from .topk import Ranking, ScoredPolicy

REASON_RECENT = 0


CARD = PolicyCard(
    "Keep the newest C visual tokens; older ones are dropped.", reasons={REASON_RECENT: "newest C tokens"}
)


@register(CARD)
@dataclass
class SlidingWindow(ScoredPolicy):
    """The newest ``keep`` tokens of every head by arrival order (the memory's slots are not in stream order)."""

    name = "sliding-window"

    def rank(self, slices: list[LayerSlice], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        rankings = []
        for stack in slice_stacks(slices):  # every layer of a stack at once: rows [G * H, L]
            order = stack.rows("order")
            rankings.append(
                Ranking(order.double(), torch.full_like(order, REASON_RECENT, dtype=torch.int8), stack.layers)
            )
        return rankings, {}
