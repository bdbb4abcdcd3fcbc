"""The scored core and the one shared top-k: most policies score every token (:class:`ScoredPolicy` returns
:class:`Ranking` s: a priority and a reason per token of one or more layers' heads, as rows, optionally a count per
row) and :func:`select_ranked` turns them into a :class:`~.contract.Selection` (in the spirit of kvpress's
``ScorerPress``), one top-k per ranking whatever the number of layers it covers. The kernels below it (masks, ties to
the newer token, the stream's text counted against the budget, normalisation) are shared by every policy that
selects.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..devices.timing import PhaseTimer
from ..tensors import flat_nonzero
from .contract import LayerSlice, Policy, Selection, SliceStack, layer_rows


@dataclass
class Ranking:
    """The scores of the heads of ``layers`` as rows (layer by layer, ``R = len(layers) * H``): ``priority [R, L]``
    (higher is kept first; exact ties go to the newer token), ``reason [R, L]`` int8 code of each token, and
    ``keep [R]``, the tokens each row keeps (None: the pass's ``keep`` for every row; rows keeping different counts
    make a ragged selection). ``followers``: layers that take the selection of one of ``layers`` as theirs (follower
    -> that layer; CoRDS' follower layers)."""

    priority: torch.Tensor
    reason: torch.Tensor
    layers: tuple[int, ...]
    keep: torch.Tensor | None = None
    followers: dict[int, int] = field(default_factory=dict)


class ScoredPolicy(Policy):
    """A policy that scores every token; the shared top-k (:func:`select_ranked`) keeps the best."""

    @abc.abstractmethod
    def rank(self, slices: list[LayerSlice], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        """Rankings that cover every layer once (a ranking per stack of layers, :func:`~.contract.slice_stacks`,
        batches a pass over them) and the pass's explanation (``Selection.info``)."""

    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        """Rank, then the shared top-k; ``info["phase_ms"]`` splits the time (the phases ``rank`` reports in its
        own ``phase_ms``, else all of it as ``scoring``; the top-k is ``selection``)."""
        timer = PhaseTimer()
        device = slices[0].keys.device if slices else None
        with timer.phase("rank", device):
            rankings, info = self.rank(slices, keep)
        phases = dict(info.pop("phase_ms", None) or {"scoring": timer.ms["rank"]})
        with timer.phase("selection", device):
            selection, _ = select_ranked(slices, rankings, keep, info)
        phases["selection"] = phases.get("selection", 0.0) + timer.ms["selection"]
        selection.info["phase_ms"] = phases
        return selection


def select_ranked(
    slices: list[LayerSlice], rankings: list[Ranking], keep: int, info: dict[str, Any] | None = None
) -> tuple[Selection, list[torch.Tensor]]:
    """The shared top-k: per ranking, the ``keep`` tokens of highest priority in every row (ties to the newer token),
    in one top-k whatever the number of layers its rows cover; per layer, sorted indices ``[H, K]`` with their
    reasons in ``info["reason"]`` (views of the ranking's). A ranking with a ``keep`` per row gives a ragged selection
    (indices padded to the largest count, ``valid`` marking the real ones); where the stream carries its own text, its
    cost counts (:func:`select_with_text`). Rows keeping the pass's ``keep`` need no read of their counts (a GPU does
    not wait). Returns the selection and each ranking's kept mask ``[R, L]``."""
    info = dict(info or {})
    count = len(slices)
    indices: list[torch.Tensor | None] = [None] * count
    valids: list[torch.Tensor | None] = [None] * count
    reasons: list[torch.Tensor | None] = [None] * count
    masks: list[torch.Tensor] = []
    ragged = False
    for ranking in rankings:
        layers, heads = ranking.layers, slices[ranking.layers[0]].num_heads
        order = layer_rows(slices, layers, "order")
        grid_text = layer_rows(slices, layers, "grid_text")
        wanted = keep if ranking.keep is None else ranking.keep
        exact = None  # the count every row keeps, when known without reading it
        if grid_text is not None:
            mask = select_with_text(ranking.priority, wanted, order, layer_rows(slices, layers, "frame"), grid_text)
        elif ranking.keep is not None:
            mask = top_k_mask(ranking.priority, ranking.keep, order)
        else:
            exact = min(int(keep), ranking.priority.shape[1])
            mask = top_k_mask(ranking.priority, exact, order)
        index, valid, counts = counted_indices(mask, exact)
        ragged |= valid is not None
        reason = torch.gather(ranking.reason, 1, index)
        masks.append(mask)
        parts = (index, valid, reason)
        for position, layer in enumerate(layers):
            rows = slice(position * heads, (position + 1) * heads)
            # each layer's entries padded to its own largest count, not the stack's
            width = index.shape[1] if counts is None else max(counts[rows], default=0)
            indices[layer], valids[layer], reasons[layer] = (None if t is None else t[rows, :width] for t in parts)
        for layer, source in ranking.followers.items():  # they take their source's (read-only) tensors as theirs
            indices[layer], valids[layer], reasons[layer] = indices[source], valids[source], reasons[source]
    missing = [layer for layer in range(count) if indices[layer] is None]
    if missing:
        raise ValueError(f"the rankings cover no selection of layer(s) {missing}")
    if ragged:  # every layer says which entries count
        valids = [torch.ones_like(i, dtype=torch.bool) if v is None else v for i, v in zip(indices, valids)]
    info["reason"] = reasons
    return Selection(indices, info, valid=valids if ragged else None), masks


def kept_indices(mask: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A kept mask ``[R, L]`` as ascending indices ``[R, width]`` and, when rows keep different numbers, ``valid
    [R, width]`` (``width`` the largest count; a row keeping fewer is padded with index 0, marked invalid; None when
    every row keeps ``width``). ``count``: what every row is known to keep (no read of the counts: a GPU does not
    wait); without it the counts are read once."""
    index, valid, _ = counted_indices(mask, count)
    return index, valid


def counted_indices(
    mask: torch.Tensor, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
    """:func:`kept_indices` and each row's count as read (None when ``count`` was given or every row keeps
    ``width``)."""
    rows, length = mask.shape
    if count is None:
        counts = mask.sum(dim=1).tolist()  # one read of the counts (a GPU waits once)
        width = max(counts, default=0)
        if any(c != width for c in counts):
            slots = torch.arange(length, device=mask.device)
            index = torch.sort(torch.where(mask, slots, length), dim=1).values[:, :width]
            valid = index < length
            return index.masked_fill(~valid, 0), valid, counts
        count = width
    return mask_to_indices(mask, count), None, None


def top_k_mask(scores: torch.Tensor, k: int | torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask ``[R, L]`` of the ``k`` highest ``scores [R, L]`` per row (``k`` an int, or ``[R]``: a count per
    row).

    Exact ties go to the newer token (larger ``order [R, L]``, the tokens' arrival numbers; slot order when
    None): a ramp far below float32 resolution is added in float64, so the choice is deterministic and
    never reorders distinct scores.
    """
    rows, length = scores.shape
    key = scores.double() + tie_ramp(order, length, scores.device)
    mask = torch.zeros(rows, length, dtype=torch.bool, device=scores.device)
    if isinstance(k, torch.Tensor):
        counts = k.to(scores.device).clamp(0, length)
        wanted = counts.tolist()  # one read: rows keeping one count take the cheaper path below
        if len(set(wanted)) > 1:
            ranked = top_k_indices(key, max(wanted), ordered=True)  # best first
            return mask.scatter_(1, ranked, torch.arange(max(wanted), device=scores.device)[None] < counts[:, None])
        k = wanted[0] if wanted else 0
    k = min(int(k), length)
    if k <= 0:
        return mask
    if 2 * k > length:  # cheaper to find the (distinct, thanks to the ramp) L - k lowest and keep the rest
        return mask.fill_(True).scatter_(1, top_k_indices(key, length - k, largest=False), False)
    return mask.scatter_(1, top_k_indices(key, k), True)


def top_k_indices(x: torch.Tensor, k: int, largest: bool = True, ordered: bool = False) -> torch.Tensor:
    """Indices ``[R, k]`` of the ``k`` largest (or smallest) entries of each row of ``x [R, N]``, ``0 < k <= N``, in
    no particular order (``ordered``: best first); which of several equal entries is taken is unspecified
    (:func:`top_k_mask`'s keys are distinct, so there every exact selection gives the same indices).

    On a CPU, numpy's ``argpartition`` (a vectorised introselect; ``argsort`` when ``ordered``) instead of
    ``torch.topk`` (kvdemo's choice: measured 3-5x faster at a 7B cache's ``[112, 6144]`` rows, single thread);
    elsewhere ``torch.topk``."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_SELECTABLE or (k >= x.shape[-1] and not ordered):
        return torch.topk(x, k, dim=-1, largest=largest, sorted=ordered).indices
    rows = x.detach().contiguous().numpy()
    if ordered:
        return torch.from_numpy(np.argsort(-rows if largest else rows, axis=-1)[:, :k])
    if largest:
        return torch.from_numpy(np.argpartition(rows, rows.shape[-1] - k, axis=-1)[:, rows.shape[-1] - k :])
    return torch.from_numpy(np.argpartition(rows, k - 1, axis=-1)[:, :k])


def top_k_sum(x: torch.Tensor, k: int, overwrite: bool = False) -> torch.Tensor:
    """Sum ``[R]`` of the ``k`` largest entries of each row of ``x [R, N]`` (float32 or float64, ``0 < k <= N``),
    summed in ``x``'s dtype. On a CPU through numpy's ``partition`` (as :func:`top_k_indices`), elsewhere
    ``torch.topk``; the order of the additions differs between the two (last-bit differences). ``overwrite``: the
    caller no longer needs ``x``, so a contiguous CPU ``x`` is partitioned in place (its rows end up reordered)
    instead of copied first; the sums are the same."""
    if x.device.type != "cpu" or k >= x.shape[-1] or x.dtype not in _NUMPY_SELECTABLE:
        return torch.topk(x, k, dim=-1, sorted=False).values.sum(-1)
    writable = overwrite and x.is_contiguous()
    rows = (x.detach() if writable else x.detach().clone(memory_format=torch.contiguous_format)).numpy()
    rows.partition(rows.shape[-1] - k, axis=-1)
    return torch.from_numpy(rows[:, rows.shape[-1] - k :].sum(-1))


def top_k_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest entries of each row of ``x [..., N]``, largest first: ``[..., k]``. For many short rows of
    keys that carry their own index in their low bits (ProtoKV's beam search): on a CPU, numpy's ``sort`` of the
    values (kvdemo's choice: ``torch.topk`` or an argsort of ``[200k, 16]`` int64 rows measured 3-10x slower, single
    thread); elsewhere ``torch.topk``."""
    if x.device.type != "cpu" or x.dtype not in (torch.int64, *_NUMPY_SELECTABLE):
        return torch.topk(x, k, dim=-1).values
    ascending = np.sort(x.detach().contiguous().numpy(), axis=-1)
    return torch.from_numpy(np.ascontiguousarray(ascending[..., : -k - 1 : -1]))


def arg_min(x: torch.Tensor) -> torch.Tensor:
    """Index of the smallest entry along the last dimension of ``x [..., N]`` (the first of equal ones): ``[...]``.
    On a CPU numpy's ``argmin`` (vectorised; kvdemo's choice: ``torch.argmin`` measured 3-4x slower on ProtoKV's
    ``[112, E, 576]`` assignment costs, single thread), elsewhere ``torch.argmin``."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_SELECTABLE:
        return x.argmin(dim=-1)
    return torch.from_numpy(np.argmin(x.detach().numpy(), axis=-1))


#: The float dtypes numpy selects in (it has no bfloat16); :func:`top_k_values` also takes int64 keys.
_NUMPY_SELECTABLE = (torch.float32, torch.float64)


def select_with_text(
    priority: torch.Tensor, keep: int | torch.Tensor, order: torch.Tensor, frame: torch.Tensor, grid_text: torch.Tensor
) -> torch.Tensor:
    """Kept mask ``[H, L]`` when the stream's own text counts against the budget (kvdemo's rule).

    ``keep`` (an int or ``[H]``) bounds the visual tokens kept plus the stream-text slots of their grids
    (``grid_text [H, grids]``; ``frame [H, L]`` is each token's grid). In priority order (ties to the newer
    token, as :func:`top_k_mask`), a token costs 1, plus its grid's text when it is the first of its grid;
    the longest prefix within ``keep`` is kept, then the room left goes to the next tokens of grids already
    kept (they cost 1). Without text this is exactly :func:`top_k_mask`.
    """
    heads, length = priority.shape
    device = priority.device
    budget = (
        keep.to(device).long() if isinstance(keep, torch.Tensor) else torch.full((heads,), int(keep), device=device)
    )
    budget = budget.expand(heads)
    key = priority.double() + tie_ramp(order, length, device)
    ranked = torch.argsort(key, dim=1, descending=True)  # best first
    grid = torch.gather(frame.long(), 1, ranked)  # [H, L]
    grids = grid_text.shape[1]
    rank = torch.arange(length, device=device).expand(heads, -1)
    first_rank = torch.full((heads, grids), length, device=device).scatter_reduce(1, grid, rank, reduce="amin")
    opens = torch.gather(first_rank, 1, grid) == rank
    cost = 1 + opens.long() * torch.gather(grid_text.to(device).long(), 1, grid)
    total = torch.cumsum(cost, dim=1)
    prefix = total <= budget[:, None]
    opened = torch.zeros(heads, grids + 1, dtype=torch.bool, device=device).scatter_(
        1, torch.where(prefix, grid, grids), True
    )
    room = budget - (cost * prefix).sum(dim=1)
    later = ~prefix & torch.gather(opened, 1, grid)
    fill = later & (torch.cumsum(later.long(), dim=1) <= room[:, None])
    return torch.zeros(heads, length, dtype=torch.bool, device=device).scatter_(1, ranked, prefix | fill)


def minmax(x: torch.Tensor, valid: torch.Tensor | None = None, eps: float = 1e-12) -> torch.Tensor:
    """Per-row min-max normalisation of ``x [H, N]`` to [0, 1], over ``valid`` entries only if given
    (invalid entries come out as 0); ``eps`` keeps a constant row finite."""
    if valid is None:
        low, high = x.min(dim=-1, keepdim=True).values, x.max(dim=-1, keepdim=True).values
        return (x - low) / (high - low + eps)
    big = torch.finfo(x.dtype).max
    low = torch.where(valid, x, big).min(dim=-1, keepdim=True).values
    high = torch.where(valid, x, -big).max(dim=-1, keepdim=True).values
    return torch.where(valid, (x - low) / (high - low + eps), torch.zeros_like(x))


def mask_to_indices(mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """A mask ``[R, L]`` with the same count per row -> ascending indices ``[R, count]`` (``count`` when the caller
    knows it: no wait on a GPU)."""
    rows, length = mask.shape
    if count is None:
        count = int(mask[:1].sum()) if rows else 0
    starts = torch.arange(rows, device=mask.device)[:, None] * length  # each row's first flat position
    return flat_nonzero(mask, rows * count).to(mask.device).view(rows, count) - starts


def top_k_sorted(scores: torch.Tensor, keep: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """Indices ``[H, keep]`` of the ``keep`` highest ``scores [H, L]`` per row, in ascending order
    (ties to the newer token, see :func:`top_k_mask`)."""
    return mask_to_indices(top_k_mask(scores, min(keep, scores.shape[-1]), order))


def tie_ramp(order: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
    """A float64 ramp below 1e-9, increasing with ``order`` (``[H, L]`` or None = slot order)."""
    if order is None:
        return torch.arange(length, device=device, dtype=torch.float64) * (1e-9 / max(length, 1))
    order = order.to(device=device, dtype=torch.float64)
    low = order.min(dim=-1, keepdim=True).values if order.numel() else order
    span = (order.max(dim=-1, keepdim=True).values - low + 1) if order.numel() else order
    return (order - low) * (1e-9 / span)


def valid_counts(stack: SliceStack) -> torch.Tensor:
    """Tokens each head of each layer of ``stack`` holds ``[G, H]``."""
    if stack.valid is None:
        layers, heads, length = stack.frame.shape
        return torch.full((layers, heads), length, dtype=torch.long, device=stack.keys.device)
    return stack.valid.sum(dim=2)


def layer_lengths(stack: SliceStack) -> list[int]:
    """Each layer's own slots in ``stack`` (a padded stack pads the shorter ones to its length; no device read: the
    memory's layers know their lengths)."""
    return list(stack.lengths) if stack.lengths is not None else [stack.length] * len(stack.layers)


def in_layer_order(runs: list[tuple[int, ...]], device: torch.device) -> torch.Tensor | None:
    """The permutation that puts rows laid out stack by stack (``runs``: each stack's layers) in layer order, or None
    when they already are."""
    flat = [layer for run in runs for layer in run]
    if flat == sorted(flat):
        return None
    return torch.tensor(sorted(range(len(flat)), key=flat.__getitem__), device=device)


def top_k_mass(attention: torch.Tensor, k: list[int], lengths: list[int]) -> torch.Tensor:
    """The sum of the ``k[g]`` largest of each row of layer ``g``'s own ``lengths[g]`` slots, ``attention [G, rows,
    L]`` -> ``[G * rows]``. On a CPU (numpy's partition, :func:`~.topk.top_k_sum`) the rows of each (length, k) are
    summed as a pass over that layer alone sums them: the partition orders a row's top k by the whole row, so a
    padded row would add the same values in another order (kvdemo's: results equal the unbatched pass's bit for bit).
    Elsewhere one top-k of the largest ``k`` with each row's tail masked."""
    layers, rows, length = attention.shape
    if attention.device.type != "cpu":
        width = max(k)
        top = torch.topk(attention.reshape(-1, length), width, dim=-1, sorted=True).values  # [G * rows, width]
        wanted = torch.tensor(k, device=attention.device).repeat_interleave(rows)
        return (top * (torch.arange(width, device=attention.device)[None] < wanted[:, None])).sum(-1)
    out = torch.empty(layers, rows, dtype=attention.dtype, device=attention.device)
    for size, count in dict.fromkeys(zip(lengths, k)):
        group = [g for g in range(layers) if (lengths[g], k[g]) == (size, count)]
        part = attention[group, :, :size] if len(group) < layers or size < length else attention
        out[group] = top_k_sum(part.reshape(-1, size), count, overwrite=part is attention).view(len(group), rows)
    return out.view(-1)
