"""Helpers on the frame grid that several policies share: dense frame ranks per head, the recent window
(InfiniPot-V's and CoRDS' recent frames), and pooling a per-token score over each token's spatial
neighbours in its own frame (InfiniPot-V's VaN pooling, HybridKV's text-prior pooling)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: How far a row's frame ids may spread (times its length) for :func:`frame_rank`'s bitmap; wider falls back to a sort.
RANK_SPAN = 16


def frame_rank(frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ranks of frame ids ``[H, L]`` per row: ``(rank [H, L], frames_held [H])``; rank 0 is the oldest.

    Each row (head) is ranked among its own frames. Until its first compaction the memory keeps tokens in
    stream order, frame ids are non-decreasing along a row, and the rank is a running count of changes. A
    compacted memory is not in order (kept tokens moved into evicted slots): then each row marks the frame ids
    it holds in a bitmap over the span of its ids, and a running count over the bitmap gives each id's rank
    (kvdemo's; no sort, which cost several times more at 7B shape). Ids spread over more than :data:`RANK_SPAN`
    times the row length (a long stream's oldest frames kept in a small memory) fall back to a sort.
    """
    heads, length = frame.shape
    device = frame.device
    if length == 0:
        return torch.zeros_like(frame, dtype=torch.long), torch.zeros(heads, dtype=torch.long, device=device)
    change = frame[:, 1:] != frame[:, :-1]
    if bool((frame[:, 1:] >= frame[:, :-1]).all()):
        rank = torch.cat([torch.zeros(heads, 1, dtype=torch.long, device=device), change.long().cumsum(1)], 1)
        return rank, rank[:, -1] + 1
    offset = frame.long() - frame.min(dim=1, keepdim=True).values.long()  # [H, L], 0 = the row's oldest frame
    span = int(offset.max()) + 1
    if span <= RANK_SPAN * length:
        held = torch.zeros(heads, span, dtype=torch.bool, device=device).scatter_(
            1, offset, torch.ones_like(offset, dtype=torch.bool)
        )
        rank_of = held.cumsum(1) - 1  # [H, span]: the dense rank of each id the row holds
        return torch.gather(rank_of, 1, offset), rank_of[:, -1] + 1
    order = frame.long()
    offset = order.max() + 1
    keyed = order + torch.arange(heads, device=frame.device)[:, None] * offset
    unique, inverse = torch.unique(keyed, return_inverse=True)
    counts = torch.bincount(torch.div(unique, offset, rounding_mode="floor"), minlength=heads)
    starts = torch.cumsum(counts, 0) - counts
    return inverse - starts[:, None], counts


def recent_window(
    frame: torch.Tensor, tokens_per_frame: int, keep: int, ratio: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The recent window shared by the policies that keep one (InfiniPot-V Sec. 3.1, CoRDS' recent tail).

    ``r = max(1, round(ratio * f))`` newest frames per head, ``f = L / tokens_per_frame`` the frames' worth
    of tokens held, shrunk to the whole frames that fit in ``keep`` (at least one frame).
    Returns ``(recent [H, L] bool, rank [H, L], frames_held [H], r)``.
    """
    rank, held = frame_rank(frame)
    length = frame.shape[1]
    frames = max(1, round(ratio * length / tokens_per_frame))
    frames = min(frames, max(1, keep // tokens_per_frame))
    return rank >= (held[:, None] - frames), rank, held, frames


def pool_on_grid(
    score: torch.Tensor,
    rank: torch.Tensor,
    pos: torch.Tensor,
    grid: tuple[int, int],
    kernel: int,
    frames: int | None = None,
) -> torch.Tensor:
    """Average ``score [H, L]`` over each token's ``kernel x kernel`` spatial neighbours in the same frame.

    ``rank [H, L]`` is the token's dense frame index per head (``frames``: more than the largest, when the caller
    knows it), ``pos [H, L]`` its ``row * cols + col``.
    Only neighbours that are held count: evicted ones and the grid's zero padding are left out of the
    average (kvdemo's choice; ``count_include_pad`` and the authors' code count padding as zeros).
    """
    if kernel <= 1:
        return score
    heads, length = score.shape
    rows, cols = grid
    if frames is None:  # the frames the ranks span (a caller pooling several times reads it once and passes it)
        frames = int(rank.max()) + 1 if length else 1
    # The scores and a mask of held tokens on a dense grid laid out as 2 * heads channels-last images [rows, cols] whose
    # channels are the head's frames: one head's frames share a pixel's cache lines, so the pooling reads each
    # image's neighbourhoods from cache. (All frames of all heads as channels of one image read a whole pixel of
    # heads * frames channels per neighbour, which outgrows the cache once a long stream's memory holds hundreds of
    # frames; docs/performance.md has the figures.) Zero padding and empty cells count alike in values and mask, so
    # the ratio below averages over the neighbours that exist. scatter_ / index_select rather than dense[at] = ...
    # (the same writes, several times faster on a CPU; so is a ones tensor over scatter_'s scalar overload).
    at = ((torch.arange(heads, device=score.device)[:, None] * (rows * cols) + pos) * frames + rank).flatten()
    size = heads * rows * cols * frames
    dense = torch.zeros(2, size, dtype=torch.float32, device=score.device)
    dense[0].scatter_(0, at, score.float().flatten())
    dense[1].scatter_(0, at, torch.ones(at.shape[0], dtype=torch.float32, device=score.device))
    images = dense.view(2 * heads, rows, cols, frames).permute(0, 3, 1, 2)  # [2H, frames, rows, cols], channels last
    pooled = F.avg_pool2d(images, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    pooled = pooled.permute(0, 2, 3, 1).reshape(2, size)
    sums, counts = pooled[0], pooled[1]
    return (sums.index_select(0, at) / counts.index_select(0, at).clamp_min(1e-12)).view(heads, length).to(score.dtype)
