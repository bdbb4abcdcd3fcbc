"""EVS, Efficient Video Sampling (Bagrov et al. 2025, arXiv 2510.14624), as vLLM defines it
(``vllm/multimodal/video_prune/evs.py``: ``compute_retention_mask``, ``compute_retained_tokens_count``).

vLLM, on a whole video of ``T`` frames (temporal grids) of ``P`` tokens: every token scores ``1 - cos`` against the
same spatial token of the previous frame; the first frame scores above any dissimilarity (vLLM writes 255), so it
is kept whole; the ``max(P, int(T * P * (1 - q)))`` highest scores are kept, ties to the earlier token (a stable
descending sort).

A stream has no whole video, so kvdemo decides each chunk's tokens as vLLM would on **the video so far**: a token
of the chunk enters iff vLLM's rule, run on every frame up to the end of this chunk, keeps it. The previous frame
crosses chunk boundaries (the last frame of the previous chunk, as encoded, whatever was pruned of it), and past
scores never change (a score depends only on its token and the frame before), so kvdemo keeps every past score
(4 bytes a token) and ranks the chunk's among them. Decisions are final: a token pruned earlier never enters
later, and one that entered stays. A stream fed as one chunk gets exactly vLLM's mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: The score of the stream's first frame: above any ``1 - cos`` (at most 2), so the first frame is kept whole.
FIRST_FRAME_SCORE = 255.0


def retained_count(tokens_per_frame: int, frames: int, rate: float) -> int:
    """vLLM's count: ``max(P, int(T * P * (1 - q)))`` tokens of ``frames`` frames of ``tokens_per_frame`` kept."""
    return max(tokens_per_frame, int(tokens_per_frame * frames * (1 - rate)))


def evs_scores(frames: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """``1 - cos(token, same token of the previous frame)`` for ``frames [T, P, D]`` (float32 ``[T, P]``).
    ``previous [P, D]`` is the frame before the first (the last of the previous chunk); None at the stream's
    start, where the first frame scores :data:`FIRST_FRAME_SCORE`."""
    x = frames.float()
    if previous is None:
        changed = 1 - F.cosine_similarity(x[1:], x[:-1], dim=-1)
        return torch.cat([torch.full_like(x[:1, :, 0], FIRST_FRAME_SCORE), changed])
    before = torch.cat([previous.to(x.device, x.dtype)[None], x[:-1]])
    return 1 - F.cosine_similarity(x, before, dim=-1)


def top_scores(scores: torch.Tensor, count: int) -> torch.Tensor:
    """``[N]`` bool: the ``count`` highest of ``scores [N]``, ties to the earlier index (what a stable descending
    sort's first ``count`` are), in O(N): the ``count``-th largest value is the threshold, and of the scores equal
    to it the earliest fill what is left."""
    total = scores.numel()
    if count >= total:
        return torch.ones(total, dtype=torch.bool, device=scores.device)
    if count <= 0:
        return torch.zeros(total, dtype=torch.bool, device=scores.device)
    threshold = torch.kthvalue(scores, total - count + 1).values
    above = scores > threshold
    tied = scores == threshold
    room = count - above.sum()
    return above | (tied & (torch.cumsum(tied, 0) <= room))


class EVS:
    """Streaming EVS at pruning rate ``rate`` (``q``): :meth:`select` one chunk's frames at a time (module docstring).
    State: the last frame seen ``[P, D]`` and every score so far ``[N]``, on the device of the frames."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self.previous: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None

    @torch.inference_mode()
    def select(self, frames: torch.Tensor) -> torch.Tensor:
        """``[T, P]`` bool: which tokens of ``frames [T, P, D]`` (the chunk's temporal grids, row-major tokens)
        enter."""
        grids, per_frame = frames.shape[:2]
        scores = evs_scores(frames, self.previous).flatten()
        history = scores if self.scores is None else torch.cat([self.scores.to(scores.device), scores])
        count = retained_count(per_frame, history.numel() // per_frame, self.rate)
        kept = top_scores(history, count)[-scores.numel() :]
        self.scores, self.previous = history, frames[-1].detach().clone()
        return kept.view(grids, per_frame)

    def to(self, device: torch.device | str) -> "EVS":
        self.previous = None if self.previous is None else self.previous.to(device)
        self.scores = None if self.scores is None else self.scores.to(device)
        return self

    def state(self) -> dict[str, Any]:
        return {"scored_tokens": 0 if self.scores is None else int(self.scores.numel())}
