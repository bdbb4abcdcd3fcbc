"""ProtoKV's far memory (paper 003, Sec. 3.1, App. A.1): ``B`` rows (one per layer and KV head) of ``K``
prototype slots, and the operations that keep its records (Alg. 1 lines 8-13 are :mod:`.absorption`'s, merging
:mod:`.merging`'s).

- :meth:`ProtoBank.seed` / :meth:`ProtoBank.seed_slots`: (re)initialise slots from tokens (Alg. 1 line 5 for a
  never-used slot, Alg. 2 line 17 for a recycled one): the one place a slot starts over;
- :meth:`ProtoBank.credit_seeds`: a recycled slot's seed token counts in its mass when it leaves the near window
  (once; see "Every token counts once" below);
- :meth:`ProtoBank.age`, :meth:`ProtoBank.recycle`: Alg. 2 (its merging: :func:`.merging.merge`, whose records
  follow the merges through :meth:`ProtoBank.follow_merges`), and :meth:`ProtoBank.close_pass`: the churn (merges
  and recyclings per row) of the last passes;
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

**Without waiting for the device (kvdemo's).** On a GPU, every count read back to the host (``nonzero``, boolean
indexing, ``.any()`` in a branch, ``int(...)``) makes the host wait for the device. A bank on a CPU keeps the sparse
forms (they cost no wait there, and touching only the few slots that change is faster); a bank elsewhere
(:attr:`ProtoBank.dense`) takes dense forms that need no count: seeding, crediting and recording seeds, merging and
recycling go through masks over every slot (:meth:`ProtoBank.seed_slots`, :func:`.merging.merge`),
counts add masked ones instead of selected ones, and a pass reads back only what sizes its tensors (the update's
group sizes, the warm-up's share of the reservoir). Both forms leave the same bank (``tests/test_protokv.py`` runs a
stream with merges, recycling and trained codebooks on the emulated device, which takes the dense forms, against the
CPU). Merges and recyclings are counted per row on the device (``churn_total``; :attr:`ProtoBank.merged` reads it).

Nothing here loops over tokens, heads or prototypes; every tensor is created on the bank's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...tensors import gather_rows
from ...views import LOST

#: Padding of :attr:`ProtoBank.seed_order` (sorts after every arrival number).
NO_SEED = torch.iinfo(torch.int64).max
#: Passes whose churn (merges, recyclings per row) the bank keeps for the views.
CHURN_HISTORY = 256


class Tokens(NamedTuple):
    """Tokens of every bank row, ``[B, E, ...]`` (as :func:`kvdemo.policies.protokv.gathering.gather_tokens` returns
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
    churn_total: torch.Tensor  # [2] int64: merged away, recycled, in every closed pass (all rows)
    reservoir_len: int = 0
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
            churn_total=zeros(2, dtype=torch.int64),
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
    def dense(self) -> bool:
        """Whether the bank takes the dense forms of its operations: not on a CPU (see "Without waiting for the
        device")."""
        return self.mass.device.type != "cpu"

    @property
    def merged(self) -> int:
        """Prototypes merged away so far (all rows; a read of the device's count)."""
        return int(self.churn_total[0] + self.pass_churn[0].sum())

    @property
    def recycled(self) -> int:
        """Slots recycled so far (all rows; a read of the device's count)."""
        return int(self.churn_total[1] + self.pass_churn[1].sum())

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

    def seed_slots(
        self,
        refill: torch.Tensor,
        token: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        spatial: torch.Tensor,
        position: torch.Tensor,
        t: int,
        mass: int = 1,
    ) -> None:
        """:meth:`seed` the slots ``refill [B, K]``, each from the token ``token [B, K]`` of its row among ``keys/values
        [B, N, D]``, ``spatial [B, N, 2]``, ``position [B, N, 3]``. On a CPU the slots are found and written; in the
        dense form every slot is written through the mask (its own state where it is not refilled), the same bank
        without a wait for how many there are."""
        if not self.dense:
            r, k = torch.nonzero(refill, as_tuple=True)
            e = token[r, k]
            self.seed(r, k, keys[r, e], values[r, e], spatial[r, e], position[r, e], t, mass)
            return
        if keys.shape[1] == 0:  # no token to seed from: nothing is refilled
            return
        token = token.clamp(0, keys.shape[1] - 1)
        fill = refill[..., None]
        self.centre_k = torch.where(fill, gather_rows(keys, token), self.centre_k)
        self.centre_v = torch.where(fill, gather_rows(values, token), self.centre_v)
        self.mass = torch.where(refill, mass, self.mass)
        self.used = self.used | refill
        self.generation = self.generation + refill.to(self.generation.dtype)
        self.tau_time = torch.where(refill, t, self.tau_time)
        self.tau_pos = torch.where(fill, gather_rows(position, token), self.tau_pos)
        self.mu = torch.where(fill, gather_rows(spatial, token), self.mu)
        self.sigma = torch.where(fill[..., None], torch.eye(2, dtype=self.sigma.dtype, device=fill.device), self.sigma)
        self.hist_k = self.hist_k.masked_fill(fill[..., None], 0)
        self.hist_v = self.hist_v.masked_fill(fill[..., None], 0)
        self.n_res = self.n_res.masked_fill(refill, 0)

    # --- seeds still in the near window -------------------------------------------------------
    def _find_seeds(self, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For arrival numbers ``order [B, E]`` (int64): the column of each in :attr:`seed_order` and whether it is
        a pending seed there (``[B, E]`` each)."""
        if self.seed_order.shape[1] == 0:
            zero = torch.zeros(order.shape, dtype=torch.int64, device=order.device)
            return zero, zero.bool()
        column = torch.searchsorted(self.seed_order, order.contiguous()).clamp_max_(self.seed_order.shape[1] - 1)
        return column, torch.gather(self.seed_order, 1, column) == order

    def add_seeds(self, refill: torch.Tensor, order: torch.Tensor) -> None:
        """Record that the slots ``refill [B, K]`` were seeded by the near-window tokens of arrival numbers ``order [B,
        K]``. In the dense form each row gains ``K`` columns (padding where a slot was not seeded; the padding past
        the near window goes at :meth:`close_pass`)."""
        if self.dense:
            slots = torch.arange(self.capacity, device=refill.device).expand_as(refill)
            new_order = torch.where(refill, order, NO_SEED)
            new_slot = torch.where(refill, slots, -1)
        else:
            r, k = torch.nonzero(refill, as_tuple=True)
            rank = torch.zeros_like(r)
            if r.numel():  # position of each new seed among its row's new seeds
                first = torch.searchsorted(r, r, right=False)  # r is row-major sorted (nonzero order)
                rank = torch.arange(r.numel(), device=r.device) - first
            width = int(rank.max()) + 1 if r.numel() else 0
            new_order = torch.full((self.rows, width), NO_SEED, dtype=torch.int64, device=r.device)
            new_slot = torch.full((self.rows, width), -1, dtype=torch.int64, device=r.device)
            new_order[r, rank] = order[r, k]
            new_slot[r, rank] = k
        self._set_seeds(torch.cat([self.seed_order, new_order], 1), torch.cat([self.seed_slot, new_slot], 1))

    def credit_seeds(self, order: torch.Tensor) -> torch.Tensor:
        """Tokens ``order [B, E]`` leave the near window: each that seeded a slot adds 1 to that slot's mass (the
        seed's deferred ``n_k <- 1``) and leaves the record. Returns each token's credited slot, -1 if none."""
        column, hit = self._find_seeds(order)
        if self.seed_slot.shape[1] == 0:
            return torch.full(order.shape, -1, dtype=torch.int64, device=order.device)
        slot = torch.where(hit, torch.gather(self.seed_slot, 1, column), -1)
        if self.dense:  # every token adds 1 or 0: no wait for which ones are seeds
            cell = torch.arange(self.rows, device=order.device)[:, None] * self.capacity + slot.clamp_min(0)
            self.mass.view(-1).index_add_(0, cell.flatten(), hit.flatten().to(self.mass.dtype))
            leaving = torch.zeros_like(self.seed_slot).scatter_add_(1, column, hit.long()) > 0
            self._set_seeds(torch.where(leaving, NO_SEED, self.seed_order), torch.where(leaving, -1, self.seed_slot))
        elif bool(hit.any()):
            r, e = torch.nonzero(hit, as_tuple=True)
            self.mass.index_put_((r, slot[r, e]), torch.ones_like(r), accumulate=True)
            keep = torch.ones_like(self.seed_slot, dtype=torch.bool)
            keep[r, column[r, e]] = False
            self._set_seeds(torch.where(keep, self.seed_order, NO_SEED), torch.where(keep, self.seed_slot, -1))
        return slot

    def _set_seeds(self, order: torch.Tensor, slot: torch.Tensor) -> None:
        """Keep the seed records sorted by arrival number per row, padding last, no all-padding columns (a read of
        their number; the dense form keeps them until :meth:`close_pass`, which needs none)."""
        order, sort = torch.sort(order, dim=1)
        slot = torch.gather(slot, 1, sort)
        width = order.shape[1]
        if not self.dense:
            width = int((order != NO_SEED).sum(dim=1).max()) if order.numel() else 0
        self.seed_order, self.seed_slot = order[:, :width].contiguous(), slot[:, :width].contiguous()

    # --- the views' bookkeeping ---------------------------------------------------------------
    def record_assignment(
        self, assigned: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor
    ) -> None:
        """Which prototype ``assigned [B, E]`` each absorbed patch (``frame/row/col [B, E]``) went to, for the last
        ``history`` absorbed grids (a ring): a ring row that a patch of another grid than the one it holds arrives in is
        cleared first, and holds the newest grid arriving there (by masks over the ring, no wait for which)."""
        history = self.history
        ring = (frame % history).flatten().long()
        frame = frame.long()
        arriving = torch.full((history,), -1, dtype=torch.int64, device=frame.device)
        arriving.scatter_reduce_(0, ring, frame.flatten(), reduce="amax")
        other = (self.assign_grid[ring] != frame.flatten()).to(torch.int64)
        stale = torch.zeros(history, dtype=torch.int64, device=frame.device).scatter_reduce_(0, ring, other, "amax") > 0
        self.assign_map.masked_fill_(stale[None, :, None, None], -1)
        self.assign_grid = torch.where(arriving >= 0, arriving, self.assign_grid)
        rows = torch.arange(assigned.shape[0], device=assigned.device)[:, None].expand_as(assigned)
        slot = ring.view_as(assigned)
        self.assign_map[rows, slot, row, col] = assigned.to(torch.int16)
        self.assign_generation[rows, slot, row, col] = torch.gather(self.generation, 1, assigned)

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

    def follow_merges(self, successor: torch.Tensor) -> None:
        """Records of a merged-away prototype go to its partner (``successor [B, K]``: each slot's partner, itself if
        it did not merge): the patches absorbed into it are represented by the partner, and its pending seeds credit
        the partner when they leave the window."""
        lookup = self.assign_map.long().clamp_min(0).flatten(1)
        moved = torch.gather(successor, 1, lookup).view_as(self.assign_map)
        was_merged = (self.assign_map >= 0) & (moved != self.assign_map.long())
        self.assign_map = torch.where(was_merged, moved.to(self.assign_map.dtype), self.assign_map)
        current = torch.gather(self.generation, 1, moved.flatten(1)).view_as(self.assign_generation)
        self.assign_generation = torch.where(was_merged, current, self.assign_generation)
        self.seed_slot = torch.where(self.seed_slot >= 0, torch.gather(successor, 1, self.seed_slot.clamp_min(0)), -1)

    def recycle(self, near: NearTokens, t: int) -> torch.Tensor:
        """Refill used slots that became empty from the newest near-window tokens (Alg. 2 lines 14-19): the ``k``-th
        empty slot of a row takes the row's ``k``-th newest token that is not already a seed. The slot starts at
        ``n_k = 0`` and its token is recorded; the token's mass comes when it leaves the window (see "Every token
        counts once"). A slot waiting for its seed is not empty. Returns the refilled slots ``[B, K]``. The dense
        form asks ``near`` for as many tokens as could be needed (every slot empty) instead of reading how many are."""
        empty = self.used & ~self.active & ~self.seeded
        if self.dense:
            wanted = self.capacity + self.seed_order.shape[1]
        elif not bool(empty.any()):
            return torch.zeros_like(empty)
        else:
            wanted = int(empty.sum(dim=1).max()) + self.seed_order.shape[1]
        tokens = near(wanted)
        count = tokens.order.shape[1]
        if count == 0:  # the window holds nothing to refill from
            return torch.zeros_like(empty)
        free = ~self._find_seeds(tokens.order)[1]  # [B, n]: not seeding a slot already
        newest_free = torch.argsort((~free).to(torch.int8), dim=1, stable=True)  # free ones first, newest first
        rank = torch.cumsum(empty.long(), dim=1) - 1  # k-th empty slot of its row takes the k-th newest free token
        refill = empty & (rank < free.sum(dim=1, keepdim=True))
        token = torch.gather(newest_free, 1, rank.clamp(0, count - 1))  # [B, K]
        self.seed_slots(refill, token, tokens.keys, tokens.values, tokens.spatial, tokens.position, t, mass=0)
        self.add_seeds(refill, torch.gather(tokens.order, 1, token))
        self.pass_churn[1] += refill.sum(dim=1).to(self.pass_churn.dtype)
        return refill

    def close_pass(self, t: int, window: int | None = None) -> None:
        """End a maintenance pass at temporal grid ``t``: its merges and recyclings per row join the ring of the
        last :data:`CHURN_HISTORY` passes and the totals. ``window``: the near-window tokens each row holds now; every
        pending seed is a distinct one of them, so seed records past that many columns are padding (the dense form
        drops them here, without reading how many are real)."""
        self.churn = torch.cat([self.churn, self.pass_churn[None]])[-CHURN_HISTORY:]
        self.churn_grid = torch.cat([self.churn_grid, self.churn_grid.new_full((1,), t)])[-CHURN_HISTORY:]
        self.churn_total += self.pass_churn.sum(dim=1)
        self.pass_churn = torch.zeros_like(self.pass_churn)
        self.passes += 1
        if window is not None and self.seed_order.shape[1] > window:
            self.seed_order = self.seed_order[:, :window].contiguous()
            self.seed_slot = self.seed_slot[:, :window].contiguous()
