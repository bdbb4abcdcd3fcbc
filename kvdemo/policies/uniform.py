"""``uniform``: keep whole frames at regular intervals (InfiniPot-V's "Uniform Select" baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .contract import LayerSlice, slice_stacks
from .grid import frame_rank
from .registry import PolicyCard, register
from .topk import Ranking, ScoredPolicy

REASON_FRAME, REASON_FILL = 0, 1


CARD = PolicyCard(
    "Keep whole frames at regular intervals over the stream so far.",
    reasons={REASON_FRAME: "evenly spaced frame", REASON_FILL: "newest leftover tokens"},
)


@register(CARD)
@dataclass
class UniformFrames(ScoredPolicy):
    """Of the ``F`` frames a head holds, keep ``k = keep // tokens_per_frame`` whole frames evenly spaced
    from the oldest to the newest (ranks ``round(i (F-1) / (k-1))``; the newest alone when ``k = 1``).
    Tokens left over when ``keep`` is not a whole number of frames go to the newest unchosen tokens.
    """

    name = "uniform"

    def rank(self, slices: list[LayerSlice], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        return [
            self._rank(stack.rows("frame"), stack.layers, keep, stack.first.tokens_per_frame)
            for stack in slice_stacks(slices)
        ], {}

    @staticmethod
    def _rank(frame: torch.Tensor, layers: tuple[int, ...], keep: int, tokens_per_frame: int) -> Ranking:
        """The ranking of rows ``frame [R, L]`` (every head of ``layers``, each row ranked among its own frames)."""
        rank, frames_held = frame_rank(frame)  # [R, L], [R]
        k = keep // tokens_per_frame
        is_chosen = torch.zeros_like(rank, dtype=torch.bool)
        if k > 0:
            steps = torch.arange(k, device=rank.device, dtype=torch.float64)
            last = (frames_held - 1).double()[:, None]
            chosen = (steps[None] * last / max(k - 1, 1)).round().long() if k > 1 else last.long()
            is_chosen = (rank[:, :, None] == chosen[:, None, :]).any(-1)
        # Chosen frames first; the rest ranks by recency (ties in priority go to the newer token).
        reason = torch.where(is_chosen, REASON_FRAME, REASON_FILL).to(torch.int8)
        return Ranking(is_chosen.double(), reason, layers)
