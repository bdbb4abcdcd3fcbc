"""ProtoKV's merge decision (paper 003, Alg. 2 lines 6-13): each prototype's lowest-index close partner, among the pairs
with a candidate (a prototype that changed this chunk, or one left pending) on either side. Two prototypes are close
when their L2-normalised key centres are within ``eps_K`` and their value centres within ``eps_V`` (kvdemo's
normalisation, see :mod:`.policy`). The bank (:meth:`.bank.ProtoBank.merge`) folds the pairs this finds.

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
