"""``full``: no compression, the baseline every other policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contract import LayerSlice, Policy, Selection
from .registry import PolicyCard, register

CARD = PolicyCard("No compression: the cache grows with the stream (the reference).")


@register(CARD)
@dataclass
class FullCache(Policy):
    """Keeps every token; the engine never triggers it (``bounded = False``)."""

    name = "full"
    bounded = False

    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        return Selection([torch.arange(v.length, device=v.keys.device).expand(v.num_heads, -1).clone() for v in slices])
