"""``sliding-window``: keep the newest ``C`` visual tokens (the text prefix acts as attention sink)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, Policy, Selection, register


@register
@dataclass
class SlidingWindow(Policy):
    """The memory stores tokens in stream order, so the newest ``keep`` are the last ``keep`` of every head."""

    name = "sliding-window"
    summary = "Keep the newest C visual tokens; older ones are dropped."

    def compress(self, views: list[LayerView], keep: int) -> Selection:
        return Selection(
            [torch.arange(v.length - keep, v.length, device=v.keys.device).expand(v.num_heads, -1).clone() for v in views]
        )
