"""``uniform``: keep whole frames at regular intervals (InfiniPot-V's "Uniform Select" baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, Policy, Selection, frame_rank, register, top_k_sorted


@register
@dataclass
class UniformFrames(Policy):
    """Of the ``F`` frames a head holds, keep ``k = keep // tokens_per_frame`` whole frames evenly spaced
    from the oldest to the newest (ranks ``round(i (F-1) / (k-1))``; the newest alone when ``k = 1``).
    Tokens left over when ``keep`` is not a whole number of frames go to the newest unchosen tokens.
    """

    name = "uniform"
    summary = "Keep whole frames at regular intervals over the stream so far."

    def compress(self, views: list[LayerView], keep: int) -> Selection:
        return Selection([self._select(view, keep) for view in views])

    @staticmethod
    def _select(view: LayerView, keep: int) -> torch.Tensor:
        rank, frames_held = frame_rank(view.frame)  # [H, L], [H]
        k = keep // view.tokens_per_frame
        recency = torch.arange(view.length, device=rank.device, dtype=torch.float64) / max(view.length, 1)
        scores = recency.expand(view.num_heads, -1).clone()
        if k > 0:
            steps = torch.arange(k, device=rank.device, dtype=torch.float64)
            last = (frames_held - 1).double()[:, None]
            chosen = (steps[None] * last / max(k - 1, 1)).round().long() if k > 1 else last.long()
            is_chosen = (rank[:, :, None] == chosen[:, None, :]).any(-1)
            scores = scores + is_chosen.double() * 2.0
        return top_k_sorted(scores, keep)
