"""ProtoKV's far memory (paper 003, Sec. 3.1, App. A.1): ``B`` rows (one per layer and KV head) of ``K``
prototype slots, and the operations that change them.

- :meth:`ProtoBank.seed`: (re)initialise slots from tokens (Alg. 1 line 5 for a never-used slot, Alg. 2 line 17
  for a recycled one): the one place a slot starts over;
- :meth:`ProtoBank.credit_seeds`: a recycled slot's seed token counts in its mass when it leaves the near window
  (once; see "Every token counts once" below);
- :meth:`ProtoBank.update`: Alg. 1 lines 8-12 for a chunk of assigned tokens, in closed form per prototype;
- :meth:`ProtoBank.record_residuals`: Alg. 1 line 13 (PQ histograms, or the warm-up reservoir until the
  codebooks are trained);
- :meth:`ProtoBank.age`, :meth:`ProtoBank.merge`, :meth:`ProtoBank.recycle`: Alg. 2, and
  :meth:`ProtoBank.close_pass`: the churn (merges and recyclings per row) of the last passes;
- :meth:`ProtoBank.record_assignment` / :meth:`ProtoBank.assignments`: which prototype each absorbed patch of
  the last grids went to (for the views), kept true across merges and recycling.

**Every token counts once (kvdemo's reading of ``n_k``).** The paper defines ``n_k`` as the number of tokens a
prototype summarises, and recycling seeds a slot from a token that is still exact in the near window (Alg. 2
line 17, ``n_k <- 1``). Counted at seeding, that token would count again when it leaves the window and is
absorbed (and attention would see it twice: exactly, and through the pseudo-tokens of a prototype that is only
that token). So a recycled slot starts with its seed's centre, spatial state and recency but ``n_k = 0``: it can
take evicted tokens (Eq. 1 considers it) and stays hidden from attention (``log 0 = -inf``) until it holds any.
The seed token's arrival number is recorded (``seed_order`` / ``seed_slot``); when it leaves the window it adds
1 to its slot's mass (or to the prototype that slot merged into) without a second EMA step or a residual: its
key, value and position are the slot's initial state already. Hence, with aging off, the bank's total mass
equals the tokens that left the near window (``tests/test_protokv.py`` checks it on a stream with merges and
recycling). A token already seeding a slot does not seed another.

Nothing here loops over tokens, heads or prototypes; every tensor is created on the bank's device.
"""

# Long on purpose: the bank's operations (seed, update, residuals, aging, merging, recycling) all keep one invariant
# of the same tensors (rows x K prototypes with their masses, EMAs and codes) and are read together against App. A.1;
# the codebooks are pq.py's and the EMAs ema.py's.

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ...views import LOST
from .ema import ema_closed_form, running_mean_before
from .pq import pq_encode, train_codebooks

#: Key products ``[B, u, K]`` per block of candidates in :meth:`ProtoBank.merge`, and close pairs whose value centres
#: are compared at a time (kvdemo's): what merging holds is bounded by them, whatever the bank holds. Keys of one
#: direction (random weights, a static scene) make nearly every pair close: unblocked, merging held 17 GB on a GPU
#: (measured, a full-depth stream) for ProtoKV at Qwen2.5-VL-3B's shape against a 216 MB budget.
MERGE_BLOCK = 1 << 22
MERGE_PAIRS = 1 << 16

#: Padding of :attr:`ProtoBank.seed_order` (sorts after every arrival number).
NO_SEED = torch.iinfo(torch.int64).max
#: Passes whose churn (merges, recyclings per row) the bank keeps for the views.
CHURN_HISTORY = 256


class Tokens(NamedTuple):
    """Tokens of every bank row, ``[B, E, ...]`` (as :meth:`kvdemo.policies.protokv.policy.ProtoKV._gather` returns
    them): keys before RoPE and values ``[B, E, D]`` float32, normalised spatial coordinates ``[B, E, 2]``, M-RoPE
    positions ``[B, E, 3]``, temporal grid, row and column ``[B, E]``, arrival number ``order [B, E]`` int64."""

    keys: torch.Tensor
    values: torch.Tensor
    spatial: torch.Tensor
    position: torch.Tensor
    frame: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    order: torch.Tensor


#: ``near(count)``: the newest ``count`` near-window tokens of every row, newest first (fewer if the window holds
#: fewer).
NearTokens = Callable[[int], Tokens]


@dataclass
class ProtoBank:
    """The far memory of every (layer, KV head) row: ``B`` rows of ``K`` prototypes (Sec. 3.1, App. A.1)."""

    centre_k: torch.Tensor  # [B, K, D] float32 key centres, before RoPE
    centre_v: torch.Tensor  # [B, K, D] float32 value centres
    mass: torch.Tensor  # [B, K] int64 n_k (0 = empty)
    used: torch.Tensor  # [B, K] bool: initialised at least once
    tau_time: torch.Tensor  # [B, K] int64 temporal grid of the last update (idleness)
    tau_pos: torch.Tensor  # [B, K, 3] int64 M-RoPE position of the most recently absorbed token
    mu: torch.Tensor  # [B, K, 2] spatial mean (normalised row, col)
    sigma: torch.Tensor  # [B, K, 2, 2] spatial covariance
    hist_k: torch.Tensor  # [B, K, G, C] int32 PQ histograms of key residuals
    hist_v: torch.Tensor  # [B, K, G, C] int32 PQ histograms of value residuals
    n_res: torch.Tensor  # [B, K] int64 residual updates
    reservoir_k: torch.Tensor  # [B, R, D] warm-up residuals (until the codebooks exist)
    reservoir_v: torch.Tensor
    pending: torch.Tensor  # [B, K] bool: a merge pair was found but not resolved
    # Views (bounded): the prototype each patch of the last ``history`` absorbed grids went to.
    assign_map: torch.Tensor  # [B, history, rows, cols] int16, -1 = not absorbed
    assign_grid: torch.Tensor  # [history] int64 grid held by each ring row, -1 = none
    # A slot's generation counts its (re)initialisations, so a patch absorbed into a prototype that was since
    # recycled reads as lost, not as represented by the slot's new occupant.
    generation: torch.Tensor  # [B, K] int32
    assign_generation: torch.Tensor  # [B, history, rows, cols] int32
    # Recycled slots' seed tokens still in the near window: arrival number (ascending, NO_SEED padding) and the
    # slot their mass goes to when they leave (-1 padding); see "Every token counts once".
    seed_order: torch.Tensor  # [B, P] int64
    seed_slot: torch.Tensor  # [B, P] int64
    # Churn (views and report): merges and recyclings of each row in the pass under way, and of the last
    # CHURN_HISTORY passes (a ring, oldest first) with the temporal grid each pass ran at.
    pass_churn: torch.Tensor  # [2, B] int32: merged away, recycled
    churn: torch.Tensor  # [passes, 2, B] int32
    churn_grid: torch.Tensor  # [passes] int64
    reservoir_len: int = 0
    recycled: int = 0  # slots recycled so far (all rows)
    merged: int = 0  # prototypes merged away so far (all rows)
    passes: int = 0  # maintenance passes so far
    codebook_k: torch.Tensor | None = None  # [B, G, C, D/G]
    codebook_v: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        rows: int,
        prototypes: int,
        dim: int,
        grid: tuple[int, int],
        subquantizers: int,
        codewords: int,
        warmup: int,
        history: int,
        device: torch.device,
    ) -> "ProtoBank":
        """A bank of ``rows x prototypes`` never-used slots for ``dim``-wide heads on ``device``."""
        g, c = subquantizers, codewords
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(
            centre_k=zeros(rows, prototypes, dim),
            centre_v=zeros(rows, prototypes, dim),
            mass=zeros(rows, prototypes, dtype=torch.int64),
            used=zeros(rows, prototypes, dtype=torch.bool),
            tau_time=zeros(rows, prototypes, dtype=torch.int64),
            tau_pos=zeros(rows, prototypes, 3, dtype=torch.int64),
            mu=zeros(rows, prototypes, 2),
            sigma=torch.eye(2, device=device).expand(rows, prototypes, 2, 2).clone(),
            hist_k=zeros(rows, prototypes, g, c, dtype=torch.int32),
            hist_v=zeros(rows, prototypes, g, c, dtype=torch.int32),
            n_res=zeros(rows, prototypes, dtype=torch.int64),
            reservoir_k=zeros(rows, warmup, dim),
            reservoir_v=zeros(rows, warmup, dim),
            pending=zeros(rows, prototypes, dtype=torch.bool),
            assign_map=torch.full((rows, history, *grid), -1, dtype=torch.int16, device=device),
            assign_grid=torch.full((history,), -1, dtype=torch.int64, device=device),
            generation=zeros(rows, prototypes, dtype=torch.int32),
            assign_generation=zeros(rows, history, *grid, dtype=torch.int32),
            seed_order=zeros(rows, 0, dtype=torch.int64),
            seed_slot=zeros(rows, 0, dtype=torch.int64),
            pass_churn=zeros(2, rows, dtype=torch.int32),
            churn=zeros(0, 2, rows, dtype=torch.int32),
            churn_grid=zeros(0, dtype=torch.int64),
        )

    @property
    def rows(self) -> int:
        return int(self.mass.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.mass.shape[1])

    @property
    def history(self) -> int:
        return int(self.assign_grid.shape[0])

    @property
    def active(self) -> torch.Tensor:
        """``[B, K]``: prototypes holding mass (visible to attention, merged, aged)."""
        return self.mass > 0

    @property
    def seeded(self) -> torch.Tensor:
        """``[B, K]``: slots a seed token still in the near window will credit."""
        slot = torch.where(self.seed_slot >= 0, self.seed_slot, self.capacity)
        count = torch.zeros(self.rows, self.capacity + 1, dtype=torch.int64, device=slot.device)
        return count.scatter_add_(1, slot, torch.ones_like(slot))[:, : self.capacity] > 0

    @property
    def open(self) -> torch.Tensor:
        """``[B, K]``: slots Eq. 1 may assign a token to (holding mass, or seeded and waiting for it)."""
        return self.active | self.seeded

    # --- Alg. 1 line 5, Alg. 2 line 17 ------------------------------------------------------
    def seed(
        self,
        r: torch.Tensor,
        k: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        spatial: torch.Tensor,
        position: torch.Tensor,
        t: int,
        mass: int = 1,
    ) -> None:
        """(Re)initialise slots ``(r, k)`` (``[N]`` each) from one token each (``keys/values [N, D]``, ``spatial
        [N, 2]``, ``position [N, 3]``): ``c, p <- K, V; n <- mass; mu <- s; Sigma <- I; tau <- t; R <- 0``; the
        slot's generation advances (patches absorbed into its previous occupant are lost). ``mass`` is 1 for a
        token that has left the near window, 0 for a seed still in it (see "Every token counts once")."""
        self.centre_k[r, k] = keys
        self.centre_v[r, k] = values
        self.mass[r, k] = mass
        self.used[r, k] = True
        self.generation[r, k] += 1
        self.tau_time[r, k] = t
        self.tau_pos[r, k] = position
        self.mu[r, k] = spatial
        self.sigma[r, k] = torch.eye(2, dtype=self.sigma.dtype, device=self.sigma.device)
        self.hist_k[r, k] = 0
        self.hist_v[r, k] = 0
        self.n_res[r, k] = 0

    # --- seeds still in the near window -------------------------------------------------------
    def _find_seeds(self, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For arrival numbers ``order [B, E]`` (int64): the column of each in :attr:`seed_order` and whether it is
        a pending seed there (``[B, E]`` each)."""
        if self.seed_order.shape[1] == 0:
            zero = torch.zeros(order.shape, dtype=torch.int64, device=order.device)
            return zero, zero.bool()
        column = torch.searchsorted(self.seed_order, order.contiguous()).clamp_max_(self.seed_order.shape[1] - 1)
        return column, torch.gather(self.seed_order, 1, column) == order

    def add_seeds(self, r: torch.Tensor, k: torch.Tensor, order: torch.Tensor) -> None:
        """Record that slot ``(r, k)`` was seeded by the near-window token of arrival number ``order`` (``[N]``)."""
        rank = torch.zeros_like(r)
        if r.numel():  # position of each new seed among its row's new seeds
            first = torch.searchsorted(r, r, right=False)  # r is row-major sorted (nonzero order)
            rank = torch.arange(r.numel(), device=r.device) - first
        width = int(rank.max()) + 1 if r.numel() else 0
        new_order = torch.full((self.rows, width), NO_SEED, dtype=torch.int64, device=r.device)
        new_slot = torch.full((self.rows, width), -1, dtype=torch.int64, device=r.device)
        new_order[r, rank] = order
        new_slot[r, rank] = k
        self._set_seeds(torch.cat([self.seed_order, new_order], 1), torch.cat([self.seed_slot, new_slot], 1))

    def credit_seeds(self, order: torch.Tensor) -> torch.Tensor:
        """Tokens ``order [B, E]`` leave the near window: each that seeded a slot adds 1 to that slot's mass (the
        seed's deferred ``n_k <- 1``) and leaves the record. Returns each token's credited slot, -1 if none."""
        column, hit = self._find_seeds(order)
        slot = torch.where(hit, torch.gather(self.seed_slot, 1, column) if self.seed_slot.shape[1] else column, -1)
        if bool(hit.any()):
            r, e = torch.nonzero(hit, as_tuple=True)
            self.mass.index_put_((r, slot[r, e]), torch.ones_like(r), accumulate=True)
            keep = torch.ones_like(self.seed_slot, dtype=torch.bool)
            keep[r, column[r, e]] = False
            self._set_seeds(torch.where(keep, self.seed_order, NO_SEED), torch.where(keep, self.seed_slot, -1))
        return slot

    def _set_seeds(self, order: torch.Tensor, slot: torch.Tensor) -> None:
        """Keep the seed records sorted by arrival number per row, padding last, no all-padding columns."""
        order, sort = torch.sort(order, dim=1)
        slot = torch.gather(slot, 1, sort)
        width = int((order != NO_SEED).sum(dim=1).max()) if order.numel() else 0
        self.seed_order, self.seed_slot = order[:, :width].contiguous(), slot[:, :width].contiguous()

    # --- Alg. 1 lines 8-13 --------------------------------------------------------------------
    def update(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        spatial: torch.Tensor,
        position: torch.Tensor,
        choice: torch.Tensor,
        mask: torch.Tensor,
        t: int,
        alpha: float,
        eta: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Alg. 1 lines 8-12 for the tokens ``mask [B, E]`` assigned to ``choice [B, E]`` (``keys/values [B, E, D]``
        before RoPE, ``spatial [B, E, 2]``, ``position [B, E, 3]``, arrival order along ``E``): the sequential EMA
        (centre rate ``alpha`` = beta, spatial rate ``eta``) in closed form per prototype. Returns each token's
        prototype cell ``row * K + k`` and its key/value residuals ``[B, E, D]`` for line 13."""
        rows, tokens = choice.shape
        capacity, dim = self.capacity, keys.shape[-1]
        device = choice.device
        row_ids = torch.arange(rows, device=device)[:, None].expand(-1, tokens)
        cell = row_ids * capacity + choice  # (row, prototype) of every token
        flat = cell[mask]  # assigned tokens, row-major then arrival order
        token_ids = torch.arange(tokens, device=device)[None].expand(rows, -1)[mask]
        # Rank of each token among the tokens on its prototype (arrival order), and the group sizes m_k.
        sort = torch.sort(flat * tokens + token_ids).indices
        count = torch.bincount(flat, minlength=rows * capacity)
        start = torch.cumsum(count, 0) - count
        rank = torch.empty_like(flat)
        rank[sort] = torch.arange(flat.numel(), device=device) - start[flat[sort]]
        later = count[flat] - 1 - rank  # tokens after this one on the same prototype
        # Chunk-start state of each token's prototype (after this chunk's initialisations).
        c_before_k = torch.gather(self.centre_k, 1, choice[..., None].expand(-1, -1, dim))
        c_before_v = torch.gather(self.centre_v, 1, choice[..., None].expand(-1, -1, dim))
        mu_before = torch.gather(self.mu, 1, choice[..., None].expand(-1, -1, 2))  # chunk-start means
        # Alg. 1 line 12 reads the mean right after the token's own update: s - mu_r = (1 - eta)(s - mu_{r-1}),
        # with mu_{r-1} the running mean before it (a prefix over earlier tokens on the same prototype).
        before = running_mean_before(spatial[mask], mu_before[mask], flat, rank, count, eta)
        deviation = (1 - eta) * (spatial[mask] - before)
        self.sigma = ema_closed_form(self.sigma, deviation[:, :, None] * deviation[:, None, :], flat, count, later, eta)
        self.mu = ema_closed_form(self.mu, spatial[mask], flat, count, later, eta)
        self.centre_k = ema_closed_form(self.centre_k, keys[mask], flat, count, later, alpha)
        self.centre_v = ema_closed_form(self.centre_v, values[mask], flat, count, later, alpha)
        self.mass.view(-1).index_add_(0, flat, torch.ones_like(flat))
        hit = (count > 0).view(rows, capacity)
        self.tau_time[hit] = t
        newest = torch.zeros(rows * capacity, dtype=torch.long, device=device)
        newest.scatter_reduce_(0, flat, token_ids, reduce="amax", include_self=False)
        owner = torch.arange(rows * capacity, device=device) // capacity
        self.tau_pos.view(-1, 3)[hit.view(-1)] = position[owner, newest][hit.view(-1)]
        # Residuals against the centre right after the token's update: x - c_after = (1 - a)(x - c_before).
        return cell, (1 - alpha) * (keys - c_before_k), (1 - alpha) * (values - c_before_v)

    def record_residuals(
        self, cell: torch.Tensor, mask: torch.Tensor, residual_k: torch.Tensor, residual_v: torch.Tensor
    ) -> None:
        """Alg. 1 line 13 for the tokens ``mask [B, E]`` (prototype ``cell = row * K + k``), residuals
        ``[B, E, D]``: PQ-encode them into their prototype's histograms, or fill the warm-up reservoir until
        the codebooks can be trained (App. A.1), then train them."""
        groups, codewords = self.hist_k.shape[-2:]
        if self.codebook_k is None:
            # Take each row's first assigned tokens (arrival order), as many as every row has. A residual that is
            # exactly zero (the token equals its prototype's centre) says nothing about the spread the codebooks
            # must cover, and would pull several codewords onto zero: it stays out of the reservoir.
            usable = mask & (residual_k != 0).any(dim=-1) & (residual_v != 0).any(dim=-1)
            warmup = self.reservoir_k.shape[1]
            take = min(int(usable.sum(dim=1).min()), warmup - self.reservoir_len)
            if take > 0:
                first = torch.argsort((~usable).to(torch.int8), dim=1, stable=True)[:, :take]
                dest = slice(self.reservoir_len, self.reservoir_len + take)
                dim = residual_k.shape[-1]
                self.reservoir_k[:, dest] = torch.gather(residual_k, 1, first[..., None].expand(-1, -1, dim))
                self.reservoir_v[:, dest] = torch.gather(residual_v, 1, first[..., None].expand(-1, -1, dim))
                self.reservoir_len += take
            if self.reservoir_len >= warmup:
                self.codebook_k = train_codebooks(self.reservoir_k, groups, codewords)
                self.codebook_v = train_codebooks(self.reservoir_v, groups, codewords)
                self.reservoir_k = self.reservoir_k[:, :0]
                self.reservoir_v = self.reservoir_v[:, :0]
            return
        group_ids = torch.arange(groups, device=cell.device)
        for residual, codebook, hist in (
            (residual_k, self.codebook_k, self.hist_k),
            (residual_v, self.codebook_v, self.hist_v),
        ):
            codes = pq_encode(residual, codebook)  # [B, E, G]
            index = ((cell[..., None] * groups + group_ids) * codewords + codes)[mask].flatten()
            hist.view(-1).index_add_(0, index, torch.ones(index.numel(), dtype=hist.dtype, device=index.device))
        flat = cell[mask]
        self.n_res.view(-1).index_add_(0, flat, torch.ones_like(flat))

    # --- the views' bookkeeping ---------------------------------------------------------------
    def record_assignment(
        self, assigned: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor
    ) -> None:
        """Which prototype ``assigned [B, E]`` each absorbed patch (``frame/row/col [B, E]``) went to, for the last
        ``history`` absorbed grids (a ring)."""
        history = self.history
        grids = torch.unique(frame)
        ring = grids % history
        stale = self.assign_grid[ring] != grids
        if bool(stale.any()):
            self.assign_map[:, ring[stale]] = -1
        self.assign_grid[ring] = grids
        rows = torch.arange(assigned.shape[0], device=assigned.device)[:, None].expand_as(assigned)
        self.assign_map[rows, frame % history, row, col] = assigned.to(torch.int16)
        self.assign_generation[rows, frame % history, row, col] = torch.gather(self.generation, 1, assigned)

    def assignments(self, row: int) -> dict[str, Any]:
        """Bank row ``row``'s last absorbed grids as plain data: ``grids`` (oldest first), ``prototype [n, rows,
        cols]`` (-1 = not absorbed; ``LOST`` = absorbed into a prototype since recycled) and ``mass [K]``."""
        grids = self.assign_grid.cpu()
        ring = torch.nonzero(grids >= 0).flatten()
        ring = ring[torch.argsort(grids[ring])]
        proto = self.assign_map[row, ring].long().cpu()
        born = self.assign_generation[row, ring].cpu()
        current = torch.gather(self.generation[row].cpu(), 0, proto.clamp_min(0).flatten()).view_as(proto)
        proto = torch.where((proto >= 0) & (born != current), LOST, proto)
        return {"grids": grids[ring].tolist(), "prototype": proto.numpy(), "mass": self.mass[row].cpu().numpy()}

    # --- Alg. 2 -------------------------------------------------------------------------------
    def age(self, t: int, t_idle: int, decay: float) -> None:
        """Alg. 2 lines 1-5: ``n_k <- floor((1 - gamma) n_k)`` for prototypes idle longer than ``t_idle``."""
        idle = self.active & ((t - self.tau_time) > t_idle)
        self.mass = torch.where(idle, torch.floor(self.mass.double() * (1 - decay)).long(), self.mass)

    def merge(self, candidates: torch.Tensor, eps_k: float, eps_v: float) -> torch.Tensor:
        """Merge prototypes whose normalised key and value centres are within ``(eps_k, eps_v)`` (Alg. 2 lines
        6-13): each merges into its lowest-index qualifying partner that is not merging itself. Returns the
        prototypes changed ``[B, K]``.

        Only pairs with a candidate ``[B, K]`` (a prototype that changed this chunk, or one left pending) can
        newly qualify, so distances are computed for candidate rows only (``[B, U, K]``, not ``[B, K, K]``), and
        :data:`MERGE_BLOCK` products at a time.
        """
        active = self.active
        partner = self._close_partners(candidates & active, active, eps_k, eps_v)
        if partner is None:
            self.pending = torch.zeros_like(active)
            return torch.zeros_like(active)
        has_partner = partner < self.capacity
        root = ~has_partner
        merging = has_partner & torch.gather(torch.cat([root, root.new_zeros(self.rows, 1)], 1), 1, partner)
        self.pending = has_partner & ~merging
        if not bool(merging.any()):
            return torch.zeros_like(active)
        r, j = torch.nonzero(merging, as_tuple=True)
        i = partner[r, j]
        self._fold(r, j, i)
        touched = torch.zeros_like(active)
        touched[r, i] = True
        touched[r, j] = True
        return touched

    def _close_partners(
        self, candidates: torch.Tensor, active: torch.Tensor, eps_k: float, eps_v: float
    ) -> torch.Tensor | None:
        """Each prototype's lowest-index close partner ``[B, K]`` (``K`` where it has none) among the pairs with a
        ``candidate``; None when no row has a candidate."""
        rows, capacity = self.mass.shape
        device = self.mass.device
        width = int(candidates.sum(dim=1).max()) if rows else 0
        if width == 0:
            return None
        chosen = torch.argsort((~candidates).to(torch.int8), dim=1, stable=True)[:, :width]  # [B, U] slot ids
        real = torch.gather(candidates, 1, chosen)
        unit_k, unit_v = F.normalize(self.centre_k, dim=-1), F.normalize(self.centre_v, dim=-1)
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
            b, u, k = torch.nonzero(
                (picked_k[:, start:stop] @ unit_k.transpose(1, 2)) > 1 - eps_k**2 / 2, as_tuple=True
            )
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

    def _fold(self, r: torch.Tensor, j: torch.Tensor, i: torch.Tensor) -> None:
        """Merge prototype ``j[n]`` of row ``r[n]`` into prototype ``i[n]`` of that row: mass-weighted centres and
        spatial means, summed histograms, residual counts and masses; the patches and pending seeds of ``j`` go to
        ``i``; the churn counts the merge."""
        rows, capacity = self.mass.shape
        device = self.mass.device
        # Mass-weighted means, computed for the merge targets only (not the whole bank).
        target = r * capacity + i
        targets, slot_of = torch.unique(target, return_inverse=True)
        source = r * capacity + j
        weight_j = self.mass.view(-1)[source].double()
        weight_i = self.mass.view(-1)[targets].double()
        total = weight_i.index_add(0, slot_of, weight_j)
        for name in ("centre_k", "centre_v", "mu"):
            flat = getattr(self, name).view(rows * capacity, -1)
            summed = (flat[targets].double() * weight_i[:, None]).index_add_(
                0, slot_of, flat[source].double() * weight_j[:, None]
            )
            merged = (summed / total.clamp_min(1)[:, None]).to(flat.dtype)
            flat[targets] = torch.where((total == 0)[:, None], flat[targets], merged)
        for name in ("hist_k", "hist_v", "n_res"):
            state = getattr(self, name)
            flat = state.view(rows * capacity, -1)
            flat.index_add_(0, target, state[r, j].view(r.numel(), -1))
        self.mass.view(-1).index_add_(0, target, self.mass[r, j])
        self.mass[r, j] = 0
        successor = torch.arange(capacity, device=device).repeat(rows, 1)
        successor[r, j] = i
        self._follow_merges(successor)
        # A merged-away slot's pending seeds credit its partner when they leave the window.
        self.seed_slot = torch.where(self.seed_slot >= 0, torch.gather(successor, 1, self.seed_slot.clamp_min(0)), -1)
        self.merged += int(r.numel())
        self.pass_churn[0].index_add_(0, r, torch.ones_like(r, dtype=torch.int32))

    def _follow_merges(self, successor: torch.Tensor) -> None:
        """Patches absorbed into a merged-away prototype are now represented by its partner (``successor [B, K]``:
        each slot's partner, itself if it did not merge)."""
        lookup = self.assign_map.long().clamp_min(0).flatten(1)
        moved = torch.gather(successor, 1, lookup).view_as(self.assign_map)
        was_merged = (self.assign_map >= 0) & (moved != self.assign_map.long())
        self.assign_map = torch.where(was_merged, moved.to(self.assign_map.dtype), self.assign_map)
        current = torch.gather(self.generation, 1, moved.flatten(1)).view_as(self.assign_generation)
        self.assign_generation = torch.where(was_merged, current, self.assign_generation)

    def recycle(self, near: NearTokens, t: int) -> torch.Tensor:
        """Refill used slots that became empty from the newest near-window tokens (Alg. 2 lines 14-19): the ``k``-th
        empty slot of a row takes the row's ``k``-th newest token that is not already a seed. The slot starts at
        ``n_k = 0`` and its token is recorded; the token's mass comes when it leaves the window (see "Every token
        counts once"). A slot waiting for its seed is not empty. Returns the refilled slots ``[B, K]``."""
        empty = self.used & ~self.active & ~self.seeded
        if not bool(empty.any()):
            return torch.zeros_like(empty)
        tokens = near(int(empty.sum(dim=1).max()) + self.seed_order.shape[1])
        free = ~self._find_seeds(tokens.order)[1]  # [B, n]: not seeding a slot already
        newest_free = torch.argsort((~free).to(torch.int8), dim=1, stable=True)  # free ones first, newest first
        rank = torch.cumsum(empty.long(), dim=1) - 1  # k-th empty slot of its row takes the k-th newest free token
        refill = empty & (rank < free.sum(dim=1, keepdim=True))
        r, k = torch.nonzero(refill, as_tuple=True)
        e = newest_free[r, rank[r, k]]
        self.seed(r, k, tokens.keys[r, e], tokens.values[r, e], tokens.spatial[r, e], tokens.position[r, e], t, mass=0)
        self.add_seeds(r, k, tokens.order[r, e])
        self.recycled += int(r.numel())
        self.pass_churn[1].index_add_(0, r, torch.ones_like(r, dtype=torch.int32))
        return refill

    def close_pass(self, t: int) -> None:
        """End a maintenance pass at temporal grid ``t``: its merges and recyclings per row join the ring of the
        last :data:`CHURN_HISTORY` passes."""
        self.churn = torch.cat([self.churn, self.pass_churn[None]])[-CHURN_HISTORY:]
        self.churn_grid = torch.cat([self.churn_grid, self.churn_grid.new_full((1,), t)])[-CHURN_HISTORY:]
        self.pass_churn = torch.zeros_like(self.pass_churn)
        self.passes += 1
