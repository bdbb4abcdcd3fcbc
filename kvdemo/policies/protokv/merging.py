"""ProtoKV's merge decision (paper 003, Alg. 2 lines 6-13): each prototype's lowest-index close partner, among the pairs
with a candidate (a prototype that changed this chunk, or one left pending) on either side. Two prototypes are close
when their L2-normalised key centres are within ``eps_K`` and their value centres within ``eps_V`` (kvdemo's
normalisation, see :mod:`.policy`); :func:`merge` folds each into its partner (mass-weighted centres and spatial
means, summed histograms and masses).

Two forms that find the same partners:

- :func:`close_partners_blocked`, on a CPU: the key products of the candidates only (``[B, U, K]``, blocks of
  :data:`MERGE_BLOCK`), then the few close pairs' positions and the value products of those pairs alone, then sparse
  minimum scatters. Boolean indexing and ``nonzero`` cost a CPU nothing, and there are few close pairs;
- :func:`close_partners_dense`, elsewhere (a GPU): every pair of a row at once, ``[B, K, K]`` key and value products
  and masks, reduced to each prototype's lowest partner: a fixed number of launches and no read back to the host,
  where the blocked form reads the size of every block's pairs. Its products are matrix products where the blocked
  form's value similarity is a dot product per pair, so a similarity within a rounding of the threshold could decide
  differently: never seen in the tests that compare the forms, and harmless either way (both are the threshold test).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .bank import ProtoBank

#: Key products ``[B, u, K]`` per block of candidates in :func:`close_partners_blocked`, and close pairs whose value
#: centres are compared at a time (kvdemo's): what merging holds is bounded by them, whatever the bank holds. Keys of
#: one direction (random weights, a static scene) make nearly every pair close: unblocked, merging held 17 GB on a GPU
#: (measured, a full-depth stream) for ProtoKV at Qwen2.5-VL-3B's shape against a 216 MB budget.
MERGE_BLOCK = 1 << 22
MERGE_PAIRS = 1 << 16
#: Bytes :func:`close_partners_dense` holds at once (kvdemo's): bank rows go in blocks of what fits, at about
#: :data:`DENSE_PAIR_BYTES` per pair of prototypes (two float32 products and byte masks). One block at Qwen2.5-VL-7B's
#: shape (112 rows of 576 prototypes: 0.6 GB).
DENSE_BYTES = 1 << 30
DENSE_PAIR_BYTES = 16


def close_partners_blocked(
    centre_k: torch.Tensor,
    centre_v: torch.Tensor,
    candidates: torch.Tensor,
    active: torch.Tensor,
    eps_k: float,
    eps_v: float,
) -> torch.Tensor | None:
    """Each prototype's lowest-index close partner ``[B, K]`` (``K`` where it has none) among the pairs with a
    ``candidate [B, K]`` (active ones only), from the centres ``[B, K, D]``; None when no row has a candidate.
    Distances are computed for candidate rows only (``[B, U, K]``, not ``[B, K, K]``), :data:`MERGE_BLOCK` products
    at a time."""
    rows, capacity = active.shape
    device = active.device
    width = int(candidates.sum(dim=1).max()) if rows else 0
    if width == 0:
        return None
    unit_k, unit_v = F.normalize(centre_k, dim=-1), F.normalize(centre_v, dim=-1)
    chosen = torch.argsort((~candidates).to(torch.int8), dim=1, stable=True)[:, :width]  # [B, U] slot ids
    real = torch.gather(candidates, 1, chosen)
    picked_k = torch.gather(unit_k, 1, chosen[..., None].expand(-1, -1, unit_k.shape[-1]))
    # partner(j) = lowest i < j with close(i, j); close is symmetric, so a pair appears from a candidate side:
    # slot k's lowest candidate partner below it, and candidate j's lowest partner below it (any slot). Both are
    # minima, gathered block by block of candidates (see MERGE_BLOCK).
    from_candidates = torch.full((rows, capacity), capacity, dtype=torch.long, device=device)
    own = torch.full(chosen.shape, capacity, dtype=torch.long, device=device)
    step = max(1, MERGE_BLOCK // max(rows * capacity, 1))
    for start in range(0, width, step):
        stop = min(start + step, width)
        # ||a - b||^2 = 2 - 2 cos for unit vectors, so ||a - b|| < eps  <=>  cos > 1 - eps^2 / 2
        b, u, k = torch.nonzero((picked_k[:, start:stop] @ unit_k.transpose(1, 2)) > 1 - eps_k**2 / 2, as_tuple=True)
        u = u + start
        j = chosen[b, u]
        b, u, k, j = (x[real[b, u] & active[b, k] & (j != k)] for x in (b, u, k, j))
        close = torch.cat(
            [  # value centres for those pairs only, MERGE_PAIRS pairs at a time
                (
                    unit_v[b[i : i + MERGE_PAIRS], j[i : i + MERGE_PAIRS]]
                    * unit_v[b[i : i + MERGE_PAIRS], k[i : i + MERGE_PAIRS]]
                ).sum(-1)
                > 1 - eps_v**2 / 2
                for i in range(0, max(b.numel(), 1), MERGE_PAIRS)
            ]
        )
        b, u, k, j = (x[close] for x in (b, u, k, j))
        below = j < k
        from_candidates.view(-1).scatter_reduce_(0, (b * capacity + k)[below], j[below], reduce="amin")
        above = k < j
        own.view(-1).scatter_reduce_(0, (b * width + u)[above], k[above], reduce="amin")
    return from_candidates.scatter_reduce(1, chosen, own, reduce="amin")


def close_partners_dense(
    centre_k: torch.Tensor,
    centre_v: torch.Tensor,
    candidates: torch.Tensor,
    active: torch.Tensor,
    eps_k: float,
    eps_v: float,
) -> torch.Tensor:
    """:func:`close_partners_blocked` over every pair of a row at once (see the module docstring): ``[B, K]``, ``K``
    where a prototype has no partner (also when no row has a candidate). Bank rows go in blocks of at most
    :data:`DENSE_BYTES`."""
    rows, capacity = active.shape
    unit_k, unit_v = F.normalize(centre_k, dim=-1), F.normalize(centre_v, dim=-1)
    slot = torch.arange(capacity, device=active.device)
    below = slot[:, None] < slot[None, :]  # [i, x]: i < x
    partner = torch.empty(rows, capacity, dtype=torch.long, device=active.device)
    step = max(1, DENSE_BYTES // max(capacity * capacity * DENSE_PAIR_BYTES, 1))
    for start in range(0, rows, step):
        part = slice(start, start + step)
        # close[b, a, c]: a's centres close to c's, computed from a's side (as the blocked form computes a pair from its
        # candidate's side), kept where a is a candidate; then a pair with a candidate on either side, both active.
        close = (unit_k[part] @ unit_k[part].transpose(1, 2)) > 1 - eps_k**2 / 2
        close &= (unit_v[part] @ unit_v[part].transpose(1, 2)) > 1 - eps_v**2 / 2
        close &= candidates[part, :, None]
        close |= close.transpose(1, 2).clone()
        close &= active[part, :, None] & active[part, None, :] & below
        # the lowest i < x close to x: the first True along i (argmax of bytes returns the first maximum)
        first = close.to(torch.uint8).argmax(dim=1)
        partner[part] = torch.where(close.any(dim=1), first, capacity)
    return partner


def merge(bank: ProtoBank, candidates: torch.Tensor, eps_k: float, eps_v: float) -> torch.Tensor:
    """Merge prototypes whose normalised key and value centres are within ``(eps_k, eps_v)`` (Alg. 2 lines
    6-13): each merges into its lowest-index qualifying partner that is not merging itself. Returns the
    prototypes changed ``[B, K]``.

    Only pairs with a candidate ``[B, K]`` (a prototype that changed this chunk, or one left pending) can
    newly qualify; the partners are :func:`close_partners_blocked`'s on a CPU (the candidates' rows only, in blocks)
    and :func:`close_partners_dense`'s in the bank's dense form (:attr:`.bank.ProtoBank.dense`: every pair at once),
    which also folds every slot through masks (:func:`_fold_dense`).
    """
    active = bank.active
    if bank.dense:
        partner = close_partners_dense(bank.centre_k, bank.centre_v, candidates & active, active, eps_k, eps_v)
    else:
        partner = close_partners_blocked(bank.centre_k, bank.centre_v, candidates & active, active, eps_k, eps_v)
        if partner is None:
            bank.pending = torch.zeros_like(active)
            return torch.zeros_like(active)
    has_partner = partner < bank.capacity
    root = ~has_partner
    merging = has_partner & torch.gather(torch.cat([root, root.new_zeros(bank.rows, 1)], 1), 1, partner)
    bank.pending = has_partner & ~merging
    if bank.dense:
        return _fold_dense(bank, merging, partner)
    if not bool(merging.any()):
        return torch.zeros_like(active)
    r, j = torch.nonzero(merging, as_tuple=True)
    i = partner[r, j]
    _fold(bank, r, j, i)
    touched = torch.zeros_like(active)
    touched[r, i] = True
    touched[r, j] = True
    return touched


def _fold(bank: ProtoBank, r: torch.Tensor, j: torch.Tensor, i: torch.Tensor) -> None:
    """Merge prototype ``j[n]`` of row ``r[n]`` into prototype ``i[n]`` of that row: mass-weighted centres and
    spatial means, summed histograms, residual counts and masses; the patches and pending seeds of ``j`` go to
    ``i`` (:meth:`.bank.ProtoBank.follow_merges`); the churn counts the merge."""
    rows, capacity = bank.mass.shape
    device = bank.mass.device
    # Mass-weighted means, computed for the merge targets only (not the whole bank).
    target = r * capacity + i
    targets, slot_of = torch.unique(target, return_inverse=True)
    source = r * capacity + j
    weight_j = bank.mass.view(-1)[source].double()
    weight_i = bank.mass.view(-1)[targets].double()
    total = weight_i.index_add(0, slot_of, weight_j)
    for name in ("centre_k", "centre_v", "mu"):
        flat = getattr(bank, name).view(rows * capacity, -1)
        summed = (flat[targets].double() * weight_i[:, None]).index_add_(
            0, slot_of, flat[source].double() * weight_j[:, None]
        )
        merged = (summed / total.clamp_min(1)[:, None]).to(flat.dtype)
        flat[targets] = torch.where((total == 0)[:, None], flat[targets], merged)
    for name in ("hist_k", "hist_v", "n_res"):
        state = getattr(bank, name)
        flat = state.view(rows * capacity, -1)
        flat.index_add_(0, target, state[r, j].view(r.numel(), -1))
    bank.mass.view(-1).index_add_(0, target, bank.mass[r, j])
    bank.mass[r, j] = 0
    successor = torch.arange(capacity, device=device).repeat(rows, 1)
    successor[r, j] = i
    bank.follow_merges(successor)
    bank.pass_churn[0].index_add_(0, r, torch.ones_like(r, dtype=torch.int32))


def _fold_dense(bank: ProtoBank, merging: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
    """:func:`_fold` of every prototype ``merging [B, K]`` into its ``partner [B, K]``, through masks over every
    slot (the dense form): the same sums in the same order on a CPU (a slot that does not merge adds into a spare cell
    past the end, or adds 0 where the sum is of integers). Returns the prototypes changed ``[B, K]``."""
    rows, capacity = bank.mass.shape
    cells = rows * capacity
    device = bank.mass.device
    own = torch.arange(cells, device=device)
    flat_merging = merging.flatten()
    target = torch.where(flat_merging, (own // capacity) * capacity + partner.flatten(), cells)  # spare: cells
    receives = torch.zeros(cells + 1, dtype=torch.bool, device=device).index_fill_(0, target, True)[:cells]
    weight = bank.mass.view(-1).double()
    total = torch.cat([weight, weight.new_zeros(1)]).index_add_(0, target, weight)[:cells]
    for name in ("centre_k", "centre_v", "mu"):
        flat = getattr(bank, name).view(cells, -1)
        weighted = flat.double() * weight[:, None]
        summed = torch.cat([weighted, weighted.new_zeros(1, weighted.shape[1])]).index_add_(0, target, weighted)
        merged = (summed[:cells] / total.clamp_min(1)[:, None]).to(flat.dtype)
        flat.copy_(torch.where((receives & (total != 0))[:, None], merged, flat))
    into = torch.where(flat_merging, target, own)
    for name in ("hist_k", "hist_v", "n_res", "mass"):
        flat = getattr(bank, name).view(cells, -1)
        flat.index_add_(0, into, flat * flat_merging[:, None].to(flat.dtype))
    bank.mass = bank.mass.masked_fill(merging, 0)
    successor = torch.where(merging, partner, torch.arange(capacity, device=device))
    bank.follow_merges(successor)
    bank.pass_churn[0] += merging.sum(dim=1).to(bank.pass_churn.dtype)
    return merging | receives.view(rows, capacity)
