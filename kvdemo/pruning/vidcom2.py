"""VidCom2, Video Compression Commander (Liu et al., EMNLP 2025, arXiv 2505.14454), as vLLM defines it
(``vllm/multimodal/video_prune/vidcom2.py``: ``compute_retention_mask``, ``compute_retained_tokens_count``).

vLLM, on a whole video of ``T`` frames (temporal grids) of ``P`` tokens at pruning rate ``q``:

1. the lowest-variance half of the channels (variance over every token of the video), each token normalised there;
2. ``similarity = G(x, video centre) + G(x, its frame's centre)``, ``G`` a sum of Gaussian kernels
   ``exp(-||x - c||^2 / (2 a))`` over ``a`` in 1/8 .. 2, the centres the means of the normalised tokens;
3. a budget per frame: ``k_t = clamp(round(P (1 - q)(1 + p_t - mean p)), 1, P)``, ``p = softmax(-mean_t G(x, video
   centre) / 0.01)`` (frames least like the video get more);
4. the ``k_t`` least similar tokens of each frame kept;
5. reconciled to exactly ``max(T, min(int(T P (1 - q)), T P))`` tokens: the surplus of most similar kept tokens
   dropped, or the deficit of least similar others added.

A stream has no whole video. The video centre can only be the video so far: kvdemo keeps the running mean of
every normalised token since the stream began (this chunk's included). The channels are chosen once, on the
first chunk: choosing them again later would leave the running centre in channels its earlier tokens were never
normalised over. Steps 2-5 run on each chunk (its frames' budgets share the chunk's count, so with one temporal
grid per chunk every grid keeps the same share; more frames per chunk let distinctive frames take more). A stream
fed as one chunk gets exactly vLLM's mask. Per frame, the top-k is one sort of every frame at once (no loop).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: The Gaussian kernels' bandwidths (vLLM's ``_ALPHAS``, from the authors' code): 1/8, 1/4, 1/2, 1, 2.
BANDWIDTHS = tuple(2.0**k for k in range(-3, 2))
#: The share of channels, lowest variance first, the similarities are measured in.
LOW_VARIANCE_SHARE = 0.5
#: The softmax temperature of the frames' budgets.
TEMPERATURE = 0.01


def retained_count(tokens_per_frame: int, frames: int, rate: float) -> int:
    """vLLM's count: ``max(T, min(int(T * P * (1 - q)), T * P))`` (at least one token a frame)."""
    total = tokens_per_frame * frames
    return max(frames, min(int(total * (1.0 - rate)), total))


def low_variance_channels(tokens: torch.Tensor) -> torch.Tensor:
    """The indices of the lowest-variance half of the channels of ``tokens [N, D]`` (population variance)."""
    variance = tokens.var(dim=0, unbiased=False)
    return torch.topk(variance, k=max(1, int(tokens.shape[-1] * LOW_VARIANCE_SHARE)), largest=False).indices


def gaussian_similarity(features: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """``sum_a exp(-||x - c||^2 / (2 a))`` over :data:`BANDWIDTHS`: ``features [T, P, C]``, ``centre`` broadcast
    against them (``[C]`` or ``[T, 1, C]``) -> ``[T, P]``."""
    distance = ((features - centre) ** 2).sum(dim=-1)
    return sum(torch.exp(-distance / (2.0 * a)) for a in BANDWIDTHS)


def frame_budgets(video_similarity: torch.Tensor, rate: float) -> torch.Tensor:
    """``[T]`` tokens each frame keeps (step 3) from ``G(x, video centre) [T, P]``."""
    per_frame = video_similarity.shape[1]
    distinct = -video_similarity.mean(dim=-1)
    share = F.softmax((distinct - distinct.max()) / TEMPERATURE, dim=0)
    scale = ((1.0 - rate) * (1.0 + share - share.mean())).clamp(max=1.0)
    return (scale * per_frame).round().long().clamp(min=1, max=per_frame)


def least_similar(similarity: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """``[T, P]`` bool: the ``budgets[t]`` smallest of each frame's ``similarity [T, P]`` (step 4), every frame
    ranked by one sort."""
    rank = similarity.argsort(dim=1, stable=True).argsort(dim=1)
    return rank < budgets.to(rank.device)[:, None]


def reconcile(kept: torch.Tensor, similarity: torch.Tensor, target: int) -> torch.Tensor:
    """``kept [T, P]`` brought to exactly ``target`` tokens by ``similarity`` (step 5): the most similar kept ones
    dropped, or the least similar others added."""
    flat, scores = kept.flatten().clone(), similarity.flatten()
    surplus = int(flat.sum()) - target  # one read: it sizes the change
    if surplus > 0:
        worst = torch.topk(scores.masked_fill(~flat, float("-inf")), surplus).indices
        flat[worst] = False
    elif surplus < 0:
        best = torch.topk(scores.masked_fill(flat, float("inf")), -surplus, largest=False).indices
        flat[best] = True
    return flat.view_as(kept)


class VidCom2:
    """Streaming VidCom2 at pruning rate ``rate`` (``q``; retention ``1 - q``): :meth:`select` one chunk's frames at a
    time (module docstring). State: the channels ``[C]`` chosen on the first chunk, the running video centre ``[C]``
    and how many tokens it averages."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self.channels: torch.Tensor | None = None
        self.centre: torch.Tensor | None = None
        self.seen = 0

    @torch.inference_mode()
    def select(self, frames: torch.Tensor) -> torch.Tensor:
        """``[T, P]`` bool: which tokens of ``frames [T, P, D]`` enter."""
        grids, per_frame = frames.shape[:2]
        x = frames.float()
        if self.channels is None:
            self.channels = low_variance_channels(x.reshape(-1, x.shape[-1]))
        features = F.normalize(x.index_select(-1, self.channels.to(x.device)), dim=-1)
        count = grids * per_frame
        total = self.seen + count
        mean = features.mean(dim=(0, 1))
        # A running mean: the first chunk's centre is its own mean exactly (vLLM's, when the stream is one chunk).
        self.centre = (
            mean if self.centre is None else self.centre.to(mean.device) * (self.seen / total) + mean * (count / total)
        )
        self.seen = total
        to_video = gaussian_similarity(features, self.centre)
        similarity = to_video + gaussian_similarity(features, features.mean(dim=1, keepdim=True))
        kept = least_similar(similarity, frame_budgets(to_video, self.rate))
        return reconcile(kept, similarity, retained_count(per_frame, grids, self.rate))

    def to(self, device: torch.device | str) -> "VidCom2":
        self.channels = None if self.channels is None else self.channels.to(device)
        self.centre = None if self.centre is None else self.centre.to(device)
        return self

    def state(self) -> dict[str, Any]:
        return {"centre_tokens": self.seen}
