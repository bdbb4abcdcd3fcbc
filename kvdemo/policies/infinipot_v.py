"""``infinipot-v``: InfiniPot-V (paper 000, explained in 001): Temporal-axis Redundancy (TaR) plus
Value Norm (VaN) with layer-adaptive pooling, run whenever the cache reaches ``M``, keeping ``C``.

Everything is aligned by provenance, not by position in the cache. After the first pass the cache no
longer holds whole frames, so the reference implementation's reshape of the cache into
``[f, p]`` pseudo-frames would compare unrelated patches; here a token at (frame t, row i, col j) is
compared with the recent frames' tokens at the same (i, j), and VaN is pooled over the true
(frame, row, col) neighbours that are still held.

Per layer and KV head (Algorithm 2, App. A.1):

1. Recent window: the newest ``r = max(1, round(recent_ratio * f))`` frames, ``f = L / p`` the frames
   held (in frame-equivalents of ``p`` tokens). Kept whole (Eq. 5-6).
2. TaR (Eq. 4): ``s(t,i,j) = -(1/r) sum_t' cos(K(t,i,j), K(t',i,j))`` over recent frames ``t'``.
   ``I = TopK(s, alpha*C - |recent|)`` (Eq. 5, Alg. 2 line 11).
3. VaN (Sec. 3.2): ``||V||_2``, average-pooled on the (frame, row, col) grid with a per-layer kernel
   ``g(CV)`` in {7, 5, 3, 1} (CV = std/mean of the layer's VaN map, Alg. 2 lines 18-22).
4. Combination (Alg. 2 lines 24-25): TaR picks (recent window included) are forced to the top, the
   rest of ``C`` by pooled VaN. ``alpha = 0`` is VaN only (no recent window), ``alpha = 1`` TaR only.

kvdemo's own rules (the paper does not state them):

- the alignment by provenance above, and with it: the TaR sum is divided by the number of recent
  frames that hold the patch (``r`` while they are whole), a patch no recent frame holds scores 0;
- pooling averages only the neighbours that are held in the token's own frame: zero padding at the
  grid's border and evicted neighbours are left out of the average (torch's ``avg_pool2d`` default,
  and the authors' code, count the padding as zeros);
- the CV thresholds: the paper's are model-specific and unpublished. With ``cv_thresholds=None`` the
  policy calibrates on its first pass: ``tau1 < tau2 < tau3`` are the 25/50/75% quantiles of that pass's
  per-layer CVs (:func:`calibrate_cv_thresholds`), so the smoothest quarter of layers pools with 7, the
  spikiest quarter not at all; the thresholds are then fixed for the rest of the stream;
- ``tar="frame"`` (Table 5's "TaR Frame", which the paper names but does not define): every past
  token takes the mean of its frame's patch scores, so whole frames rank together;
- ``r`` rounds ``recent_ratio * f`` to the nearest integer; when the window is larger than TaR's share
  ``alpha * C`` it is still kept whole and TaR's share grows to cover it; when ``r`` whole frames do not
  fit in ``C``, ``r`` shrinks to the whole frames that fit (at least the newest frame, whose tokens are
  then ranked by pooled VaN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..devices.timing import PhaseTimer
from ..errors import PolicyParameterError
from ..tensors import as_words, flat_nonzero, padded_nonzero, rows_at
from .contract import LayerSlice, SliceStack, slice_stacks
from .fused import compiled_enabled, run_compiled, tar_and_van_terms
from .grid import pool_on_grid, recent_window
from .registry import PolicyCard, param, register
from .topk import Ranking, ScoredPolicy, minmax, top_k_mask

KERNELS = (7, 5, 3, 1)
#: Reason codes reported per kept token (``Selection.info["reason"]``).
REASON_RECENT, REASON_TAR, REASON_VAN = 0, 1, 2
REASON_NAMES = {REASON_RECENT: "recent", REASON_TAR: "TaR", REASON_VAN: "VaN"}

#: The paper's Table 5 ablation variants as parameter sets (``uniform`` is its own policy).
VARIANTS: dict[str, dict] = {
    "TaR + VaN + Pool": dict(alpha=0.5, tar="patch", van="pool"),
    "TaR": dict(alpha=1.0, tar="patch"),
    "TaR Frame": dict(alpha=1.0, tar="frame"),
    "TaR Reverse": dict(alpha=1.0, tar="reverse"),
    "VaN + Pool": dict(alpha=0.0, van="pool"),
    "VaN": dict(alpha=0.0, van="plain"),
    "VaN Reverse": dict(alpha=0.0, van="reverse"),
}


def calibrate_cv_thresholds(cvs: list[float] | torch.Tensor) -> tuple[float, float, float]:
    """``(tau1, tau2, tau3)`` = 25/50/75% quantiles of per-layer VaN coefficients of variation."""
    values = torch.as_tensor(cvs, dtype=torch.float64, device="cpu").flatten()
    if values.numel() == 0:
        raise ValueError("calibration needs at least one layer's CV")
    q = torch.quantile(values, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64, device="cpu"))
    return float(q[0]), float(q[1]), float(q[2])


def kernel_for_cv(cv: float, thresholds: tuple[float, float, float]) -> int:
    """g(CV): 7 below tau1, 5 below tau2, 3 below tau3, else 1 (App. A.1, Alg. 2 line 21)."""
    for kernel, tau in zip(KERNELS, thresholds):
        if cv < tau:
            return kernel
    return KERNELS[-1]


def value_norms(values: torch.Tensor) -> torch.Tensor:
    """The VaN map ``||V||_2``, ``[H, L, D] -> [H, L]`` float32.

    Computed in the cache's dtype (accumulated in float32 internally, rounded to that dtype, as on a
    GPU): upcasting a half-precision cache first costs more than the rest of the pass on a CPU.
    """
    return torch.linalg.vector_norm(values, dim=-1).float()


def layer_cvs(van: torch.Tensor, layers: int) -> torch.Tensor:
    """CV = std / mean of each layer's VaN map (all its heads and tokens): ``van [layers * H, L]`` -> ``[layers]``."""
    per_layer = van.reshape(layers, -1)
    return per_layer.std(dim=1, unbiased=False) / per_layer.mean(dim=1).clamp_min(1e-12)


CARD = PolicyCard(
    "TaR (temporal redundancy vs the recent frames, patch-wise) + VaN (value norm, adaptively pooled).",
    reasons=REASON_NAMES,
)


@register(CARD)
@dataclass
class InfiniPotV(ScoredPolicy):
    """InfiniPot-V: ``alpha*C`` tokens by TaR (recent window included), the rest by pooled VaN."""

    name = "infinipot-v"

    alpha: float = param(
        0.5,
        "share of C chosen by TaR (recent frames included); the rest by pooled VaN. 0 = VaN only, 1 = TaR only",
        within="[0, 1]",
    )
    recent_ratio: float = param(
        0.125, "recent window r = ratio x frames held (at least one frame), kept whole", within="(0, 1]"
    )
    tar: str = param(
        "patch",
        "TaR scoring: patch (paper), frame (whole-frame similarity), reverse (keep the most redundant)",
        choices=("patch", "frame", "reverse"),
    )
    van: str = param(
        "pool",
        "VaN scoring: pool (layer-adaptive pooling), plain (no pooling), reverse (keep the lowest norms)",
        choices=("pool", "plain", "reverse"),
    )
    cv_thresholds: tuple[float, float, float] | None = param(
        None, "tau1<tau2<tau3 mapping a layer's VaN CV to kernel 7/5/3/1; empty = calibrate on the first pass"
    )
    _calibrated: tuple[float, float, float] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cv_thresholds is not None:
            thresholds = tuple(float(t) for t in self.cv_thresholds)
            if len(thresholds) != 3 or not thresholds[0] < thresholds[1] < thresholds[2]:
                raise PolicyParameterError(f"cv_thresholds must be three increasing numbers, got {self.cv_thresholds}")
            self.cv_thresholds = thresholds

    def thresholds_for(self, cvs: list[float]) -> tuple[float, float, float]:
        """The CV thresholds in force: given ones, else calibrated once from the first pass's ``cvs``."""
        if self.cv_thresholds is not None:
            return self.cv_thresholds
        if self._calibrated is None:
            self._calibrated = calibrate_cv_thresholds(cvs)
        return self._calibrated

    def rank(self, slices: list[LayerSlice], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        # Every stack of layers (one device, one length) is scored at once, as rows [layers * H, L]: one read of
        # its keys and values (VaN and, with alpha > 0, TaR's similarities), one recent window, one pooling per kernel.
        stacks = slice_stacks(slices)
        timer = PhaseTimer()
        device = slices[0].keys.device if slices else None
        with timer.phase("scoring", device):
            scores = [self._read(stack, keep) for stack in stacks]
            cvs = [0.0] * len(slices)
            per_stack = [layer_cvs(van, len(stack.layers)) for stack, (van, _, _) in zip(stacks, scores)]
            layers = [layer for stack in stacks for layer in stack.layers]
            for layer, cv in zip(layers, torch.cat([cv.to(device) for cv in per_stack]).tolist()):  # one read
                cvs[layer] = cv
        thresholds = self.thresholds_for(cvs)
        kernels = [kernel_for_cv(cv, thresholds) if self.van == "pool" else 1 for cv in cvs]
        rankings: list[Ranking] = []
        recent_frames = [0] * len(slices)
        for stack, (van, similarity, window) in zip(stacks, scores):
            stack_kernels = [kernels[layer] for layer in stack.layers]
            priority, reason, r = self._score(stack, van, similarity, stack_kernels, keep, window, timer)
            rankings.append(Ranking(priority, reason, stack.layers))
            for layer in stack.layers:
                recent_frames[layer] = r
        info = {
            "kernel": kernels,
            "cv": cvs,
            "cv_thresholds": list(thresholds),
            "recent_frames": recent_frames,
            "phase_ms": timer.ms,
        }
        return rankings, info

    def _read(self, stack: SliceStack, keep: int) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
        """The one read of every key and value of ``stack``: its VaN map and (``alpha > 0``) TaR's similarities
        ``[R, L]`` over its rows ``R = layers * H`` (:func:`tar_and_van`), and its recent window and patch ids."""
        grid, per_frame = stack.first.grid, stack.first.tokens_per_frame
        frame = stack.rows("frame")
        pos = (stack.rows("row") * grid[1] + stack.rows("col")).long()
        window = (*recent_window(frame, per_frame, keep, self.recent_ratio), pos)
        keys, values = stack.rows("keys"), stack.rows("values")
        if self.alpha > 0:
            # at most the recent frames' tokens in every row: a GPU gathers them without waiting for their number
            bound = frame.shape[0] * min(window[3] * per_frame, frame.shape[1])
            similarity, van = tar_and_van(keys, values, window[0], pos, per_frame, bound)
            return van, similarity, window
        return value_norms(values), None, window

    def _score(
        self,
        stack: SliceStack,
        van: torch.Tensor,
        similarity: torch.Tensor | None,
        kernels: list[int],
        keep: int,
        window: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor],
        timer: PhaseTimer,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Priorities and reasons ``[R, L]`` for the rows of ``stack`` (``R = layers * H``), and the recent window
        (frames): TaR picks (the recent window included) rank above every pooled VaN score (Alg. 2 lines 24-25).
        ``van`` is the raw VaN map ``[R, L]``, ``similarity`` the mean cosine similarities to the recent frames
        (:func:`patch_similarity`; None when ``alpha = 0``), ``kernels`` each layer's pooling kernel, ``window`` the
        recent window (:func:`recent_window`) and patch ids; the time goes to ``timer``'s ``pooling`` and
        ``selection`` phases."""
        heads, grid = stack.num_heads, stack.first.grid
        order = stack.rows("order")
        recent, rank, _, recent_frames, pos = window

        with timer.phase("pooling", recent.device):
            frames = int(rank.max()) + 1 if set(kernels) - {1} and rank.numel() else 1  # one read for every kernel
            for kernel in set(kernels) - {1}:
                # the rows of the layers with this kernel, as indices made from the host's list (no boolean mask
                # to count on the device: a GPU would wait)
                layers = torch.tensor([i for i, k in enumerate(kernels) if k == kernel], device=van.device)
                rows = (layers[:, None] * heads + torch.arange(heads, device=van.device)).flatten()
                van[rows] = pool_on_grid(van[rows], rank[rows], pos[rows], grid, kernel, frames)
            van01 = minmax(-van if self.van == "reverse" else van)
        with timer.phase("selection", recent.device):
            return self._pick(van01, similarity, recent, rank, order, keep, recent_frames)

    def _pick(
        self,
        van01: torch.Tensor,
        similarity: torch.Tensor | None,
        recent: torch.Tensor,
        rank: torch.Tensor,
        order: torch.Tensor,
        keep: int,
        recent_frames: int,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """TaR's share (the recent window first) forced above the pooled VaN scores ``van01 [B, L]``."""
        tar_pick = torch.zeros_like(recent)
        if self.alpha > 0:
            score = self._tar_scores(similarity, recent, rank)
            # Recent tokens rank above every past score (|score| <= 1); among themselves by VaN.
            key = torch.where(recent, 2.0 + 1e-3 * van01, score)
            share = torch.clamp(recent.sum(dim=1), max=keep).clamp_min(round(self.alpha * keep))
            tar_pick = top_k_mask(key, share, order)
        # Codes by arithmetic on the 0/1 masks: masked_fill_ / where branch per element, slow on a CPU for a mask as
        # scattered as TaR's picks.
        reason = REASON_VAN + (REASON_TAR - REASON_VAN) * tar_pick.to(torch.int8)
        if self.alpha > 0:
            reason += (REASON_RECENT - reason) * recent.to(torch.int8)
        return tar_pick.to(van01.dtype) * 4.0 + van01, reason, recent_frames

    def _tar_scores(self, mean_cos: torch.Tensor, recent: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """TaR scores ``[B, L]`` (Eq. 4, or its frame-level / reversed variant) from the stacked layers' mean
        cosine similarities ``[B, L]``."""
        if self.tar == "reverse":
            return mean_cos
        score = -mean_cos
        if self.tar == "frame":
            # Frame-level TaR: every past token takes its frame's mean patch score.
            frames = int(rank.max()) + 1
            past = (~recent).to(score.dtype)
            sums = torch.zeros(score.shape[0], frames, dtype=score.dtype, device=score.device)
            sums.scatter_add_(1, rank, score * past)
            counts = torch.zeros_like(sums).scatter_add_(1, rank, past)
            score = torch.gather(sums / counts.clamp_min(1.0), 1, rank)
        return score


#: Tokens per block in :func:`patch_similarity` on a CPU: a block's keys and its gathered references
#: (``H x 1024 x D``) stay in the processor's cache between the ops that read them.
SIMILARITY_BLOCK = 1024


def recent_reference(
    keys: torch.Tensor, recent: torch.Tensor, row: torch.Tensor, rows: int, bound: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, patch) row: the sum of the recent frames' unit keys ``[rows, D]`` (summed in float32, rounded
    once to the cache's dtype) and how many recent frames hold it ``[rows]`` float32. ``keys [H, L, D]``,
    ``recent``/``row [H, L]`` (row = head * patches + patch). ``bound``: at most that many recent tokens in all (the
    recent frames' tokens), so a GPU gathers them without waiting to learn their number; a CPU gathers exactly them."""
    if bound is None or recent.device.type == "cpu":
        at = flat_nonzero(recent).to(keys.device)  # (head, slot) of each recent token, as head * L + slot
        real = None
    else:
        at, real = padded_nonzero(recent, bound)  # the padding gathers token 0 and adds nothing
    head = at // recent.shape[1]
    recent_keys = rows_at(keys, head, at - head * recent.shape[1]).float()
    recent_keys = recent_keys / torch.linalg.vector_norm(recent_keys, dim=-1, keepdim=True).clamp_min(1e-12)
    recent_rows = row.flatten().index_select(0, at)
    weight = torch.ones(at.shape[0], dtype=torch.float32, device=keys.device) if real is None else real.float()
    if real is not None:
        recent_keys = recent_keys * weight[:, None]
    reference = torch.zeros(rows, keys.shape[-1], dtype=torch.float32, device=keys.device)
    reference.index_add_(0, recent_rows, recent_keys)
    count = torch.zeros(rows, dtype=torch.float32, device=keys.device).index_add_(0, recent_rows, weight)
    return reference.to(keys.dtype), count


def patch_similarity(
    keys: torch.Tensor, recent: torch.Tensor, pos: torch.Tensor, per_frame: int, bound: int | None = None
) -> torch.Tensor:
    """Mean cosine similarity ``[H, L]`` of every token's key to the keys of the recent frames at the same
    patch (Eq. 4 without the sign): ``(1/r) sum_t' cos(K(t,i,j), K_recent(t',i,j))``.

    ``sum_t' cos = k_hat . sum_t' k_hat_recent(t', i, j)``: one ``index_add`` over (head, patch) rows builds
    the per-patch sum of the recent normalised keys (:func:`recent_reference`). A patch no recent frame holds
    has similarity 0. ``keys [H, L, D]`` (a strided view of the memory is read in place), ``recent``/``pos
    [H, L]`` (pos = row * cols + col).

    The keys are read once, block by block (on a CPU): each block's norms and its dot products with the
    gathered references are computed while the block sits in cache, instead of materialising a gathered
    ``[H, L, D]`` reference tensor the size of the cache. The products are taken in the cache's dtype (a
    bfloat16 cache: products and norms rounded to bfloat16, both accumulated in float32; the reference is
    summed in float32 and rounded once), as the authors' code computes in the cache dtype. This is the eager
    definition; :func:`tar_and_van` runs the compiled restatement when asked to.
    """
    heads, length, dim = keys.shape
    device = keys.device
    row = torch.arange(heads, device=device)[:, None] * per_frame + pos  # (head, patch) id [H, L]
    reference, count = recent_reference(keys, recent, row, heads * per_frame, bound)
    reference = as_words(reference)
    similarity = torch.empty(heads, length, dtype=torch.float32, device=device)
    step = length if device.type == "cuda" else SIMILARITY_BLOCK
    for start in range(0, length, step):
        block = keys[:, start : start + step]  # [H, b, D], in cache
        gathered = (
            reference.index_select(0, row[:, start : start + step].reshape(-1)).view(keys.dtype).view(block.shape)
        )
        norms = torch.linalg.vector_norm(block, dim=-1).float().clamp_min(1e-12)  # accumulated in float32
        similarity[:, start : start + step] = (block * gathered).sum(-1, dtype=torch.float32) / norms
    return similarity / count.index_select(0, row.flatten()).view(heads, length).clamp_min(1.0)


def tar_and_van(
    keys: torch.Tensor,
    values: torch.Tensor,
    recent: torch.Tensor,
    pos: torch.Tensor,
    per_frame: int,
    bound: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' TaR similarities (:func:`patch_similarity`) and VaN map (:func:`value_norms`), ``[H, L]`` each (``H`` rows:
    a layer's heads, or every head of a stack of layers); ``bound`` caps the recent tokens (:func:`recent_reference`).

    With compiled kernels on (:mod:`kvdemo.policies.fused`), both come out of one fused read of the keys and
    values (:func:`~kvdemo.policies.fused.tar_and_van_terms`, the same arithmetic); otherwise the eager
    definitions run, one after the other.
    """
    heads = keys.shape[0]
    if compiled_enabled():
        row = (torch.arange(heads, device=keys.device)[:, None] * per_frame + pos).contiguous()
        reference, count = recent_reference(keys, recent, row, heads * per_frame, bound)
        out = run_compiled(tar_and_van_terms, keys, values, reference, row, count, keys.dtype != torch.float32)
        if out is not None:
            return out
    return patch_similarity(keys, recent, pos, per_frame, bound), value_norms(values)
