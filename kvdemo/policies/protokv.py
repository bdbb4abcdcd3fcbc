"""``protokv``: ProtoKV (paper 003): an exact near window plus a fixed-capacity prototype bank, read at
attention time through pseudo-tokens carrying a ``log n_k`` key bias.

Budget (Sec. 3, Table 5): one number ``M = W + K_max * S`` per layer and KV head, split ``W : K_max*S = 1 : 3``
with ``S = 8`` pseudo-tokens per prototype (``K_max = floor(3M / 4S)``, ``W = M - K_max S``). The memory keeps
the newest ``W`` visual tokens exactly (the near window) and reserves ``K_max * S`` summary slots.

Each compression (the engine runs one when the next chunk would overflow ``M``, i.e. when the near window
would exceed ``W``) evicts the oldest near tokens and absorbs them, per layer and KV head, into that row's
bank (Alg. 1), runs maintenance (Alg. 2), and refreshes the pseudo-tokens of the prototypes that changed
(Alg. 3-4). All ``B = layers * H_kv`` bank rows are processed at once; nothing loops over tokens, heads or
prototypes.

**Keys before RoPE** (Sec. 3.3, D.1). Centres average keys from different positions, so they are kept
pre-RoPE: evicted keys are un-rotated with their known 3-D M-RoPE positions (exact: a rotation), and a
prototype's pseudo-tokens are rotated at ``tau_k``, the position of its most recently absorbed token.

**Batching (kvdemo's).** Alg. 1 absorbs one token at a time. Here one chunk's evicted tokens (in arrival
order) are absorbed together: first, never-used slots take the first tokens, one each (as Alg. 1 would);
then every other token is assigned by Eq. 1 against the bank as it stands after those initialisations. Given
the assignments, centres, mass, recency, spatial mean and covariance follow the sequential updates exactly
(a token that is the ``r``-th of ``m`` on its prototype weighs ``a (1-a)^(m-1-r)``, the old state ``(1-a)^m``;
the covariance's deviations use the running mean, a per-prototype prefix). Two things use the chunk-start
state instead of the running one: the assignment itself, and each token's PQ residual (Alg. 1 line 13 reads
the centre right after that token's update, ``(1-a)(x - c_before)``; ``c_before`` is taken at the chunk
start). With at most one token per prototype in a chunk and assignments that do not change mid-chunk, the
batch equals Alg. 1 token by token; tests measure the drift otherwise.

**Maintenance (Alg. 2), once per chunk.** Aging multiplies the mass of prototypes idle for more than ``T_idle``
by ``1 - gamma`` (floored). Merging compares the prototypes touched in this chunk (and pairs left pending)
with all others, on L2-normalised centres (kvdemo's choice: the paper's thresholds ``(eps_K, eps_V) =
(0.20, 0.25)`` give no scale, and raw key norms vary by orders of magnitude across models and layers); a
prototype merges into the lowest-index partner that is not itself merging. Recycling refills slots that
were used and became empty (merged away, or decayed to zero mass) from the newest near-window tokens;
never-used slots wait for evicted tokens (Sec. 3.1, "Initialization").

**Residuals (Alg. 1 line 13, App. A.1).** Per row, PQ codebooks (``G`` sub-quantisers of ``C`` codewords, keys
and values separately) are trained by k-means on a warm-up reservoir of the first ``warmup`` residuals
(kvdemo's ``T_warm``: 256 residuals per row; Lloyd iterations on the whole reservoir, which is one mini-batch)
and fixed; residuals before that count in no histogram. **Pseudo-tokens (Alg. 3-4):** the top-``S`` code tuples
by beam search (``B = 4S``, run ``min(B, S)`` wide: the same tuples, see :func:`beam_search`) over the smoothed
histograms (kvdemo's ``epsilon = 0.1``), key and value modes paired by rank; ``n_res = 0`` gives zero residuals.
Each of the ``S`` pseudo-tokens carries bias ``log n_k``.

Time ``t`` (idleness, ``T_idle``) counts temporal grids (the unit a Qwen chunk adds: two sampled frames):
kvdemo's reading of the paper's "steps".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..tensors import as_words
from ..views import LOST, Chart, Histogram, PatchLabels, Series, View, ViewContext
from .base import BudgetError, LayerView, PhaseTimer, Policy, Selection, SummaryRegion, SummaryUpdate, register

REASON_NEAR = 0
REASON_NAMES = {REASON_NEAR: "near window (exact)"}
#: Regularisation added to a prototype's spatial covariance before inverting it (kvdemo's).
SIGMA_FLOOR = 1e-4


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
    reservoir_len: int = 0
    codebook_k: torch.Tensor | None = None  # [B, G, C, D/G]
    codebook_v: torch.Tensor | None = None
    pending: torch.Tensor | None = None  # [B, K] bool: a merge pair was found but not resolved
    # Views (bounded): the prototype each patch of the last ``history`` absorbed grids went to.
    assign_map: torch.Tensor | None = None  # [B, history, rows, cols] int16, -1 = not absorbed
    assign_grid: torch.Tensor | None = None  # [history] int64 grid held by each ring row, -1 = none
    # A slot's generation counts its (re)initialisations, so a patch absorbed into a prototype that was since
    # recycled reads as lost, not as represented by the slot's new occupant.
    generation: torch.Tensor | None = None  # [B, K] int32
    assign_generation: torch.Tensor | None = None  # [B, history, rows, cols] int32

    @property
    def rows(self) -> int:
        return int(self.mass.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.mass.shape[1])

    @property
    def active(self) -> torch.Tensor:
        return self.mass > 0


@register
@dataclass
class ProtoKV(Policy, SummaryRegion):
    """An exact near window of ``W`` tokens plus ``K_max`` prototypes exposed as ``S`` pseudo-tokens each."""

    name = "protokv"
    reason_names = REASON_NAMES
    benchmarks = ("update",)
    summary = "Exact near window + a prototype bank summarising evicted tokens, read through log-mass-biased pseudo-tokens."
    help = {
        "near_share": "W / M: the exact near window's share of the budget (paper: W : K_max*S = 1 : 3)",
        "pseudo_tokens": "S: pseudo-tokens per prototype at read time (K_max = (1 - near_share) M / S)",
        "lambda_sp": "weight of the spatial Mahalanobis term in the assignment (0 = no continuity)",
        "lambda_idle": "penalty for assigning to a prototype idle longer than t_idle",
        "t_idle": "idle threshold in temporal grids (aging and the idle penalty)",
        "centre_rate": "EMA rate of the key/value centres (alpha = beta)",
        "spatial_rate": "EMA rate of the spatial mean and covariance (eta)",
        "decay": "mass decay of idle prototypes per maintenance (gamma)",
        "merge_k": "merge threshold on normalised key centres (eps_K)",
        "merge_v": "merge threshold on normalised value centres (eps_V)",
        "subquantizers": "G: PQ sub-quantisers of the residual histograms",
        "codewords": "C: codewords per sub-quantiser",
        "beam": "beam width of the residual-mode search (0 = 4 S)",
        "warmup": "residuals per row collected before the PQ codebooks are trained (T_warm)",
        "smoothing": "epsilon of the smoothed PQ probabilities",
        "residuals": "decode residual modes (off = pseudo-tokens are the centres: 'w/o residual stats')",
        "mass_bias": "add log n_k to pseudo-token logits (off = 'w/o mass bias')",
        "history": "absorbed temporal grids whose prototype assignment is kept for the views",
    }

    near_share: float = 0.25
    pseudo_tokens: int = 8
    lambda_sp: float = 0.1
    lambda_idle: float = 0.01
    t_idle: int = 120
    centre_rate: float = 0.05
    spatial_rate: float = 0.05
    decay: float = 0.05
    merge_k: float = 0.20
    merge_v: float = 0.25
    subquantizers: int = 8
    codewords: int = 16
    beam: int = 0
    warmup: int = 256
    smoothing: float = 0.1
    residuals: bool = True
    mass_bias: bool = True
    history: int = 16
    _bank: ProtoBank | None = field(default=None, init=False, repr=False, compare=False)
    _last: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < float(self.near_share) < 1.0:
            raise BudgetError(f"near_share must be in (0, 1), got {self.near_share}")
        for name in ("pseudo_tokens", "subquantizers", "codewords", "warmup", "history"):
            if int(getattr(self, name)) < 1:
                raise BudgetError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("centre_rate", "decay"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise BudgetError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= float(self.spatial_rate) < 1.0:
            raise BudgetError(f"spatial_rate must be in [0, 1), got {self.spatial_rate}")
        if self.beam < 0 or self.t_idle < 0 or self.smoothing <= 0:
            raise BudgetError("beam and t_idle must be >= 0 and smoothing > 0")

    # --- budget ---------------------------------------------------------------------------
    def split(self, budget: int) -> tuple[int, int]:
        """``(W, K_max)`` for budget ``M``: ``K_max = floor((1 - near_share) M / S)``, ``W = M - K_max S``."""
        prototypes = int((1.0 - self.near_share) * budget) // self.pseudo_tokens
        near = budget - prototypes * self.pseudo_tokens
        if prototypes < 1 or near < 1:
            raise BudgetError(
                f"M={budget} is too small for ProtoKV: it needs room for a near window and at least one prototype "
                f"of S={self.pseudo_tokens} pseudo-tokens"
            )
        return near, prototypes

    def summary_slots(self, budget: int) -> int:
        return self.split(budget)[1] * self.pseudo_tokens

    window_name = "near window"

    def describe_split(self, budget: int) -> str:
        near, prototypes = self.split(budget)
        return f"a near window of {near} exact tokens + {prototypes} prototypes x {self.pseudo_tokens} pseudo-tokens"

    # --- the pass -------------------------------------------------------------------------
    def compress(self, views: list[LayerView], keep: int) -> Selection:
        """Keep the newest ``keep`` near tokens of every row, absorb the others, refresh the summary."""
        heads, dim = views[0].num_heads, views[0].keys.shape[-1]
        device = views[0].keys.device
        indices, evicted, newest = [], [], []
        for view in views:
            ranked = torch.argsort(view.order, dim=1)  # oldest first
            cut = view.length - keep
            evicted.append(ranked[:, :cut])
            indices.append(ranked[:, cut:].sort(dim=1).values)
            newest.append(ranked[:, cut:].flip(1))
        evict = torch.stack(evicted)  # [layers, H, E]
        near_newest = torch.stack(newest)  # [layers, H, keep], newest first
        if self._bank is None:
            prototypes = views[0].summary_slots // self.pseudo_tokens
            if prototypes < 1:
                raise BudgetError("ProtoKV needs a memory with a summary region (use StreamEngine, which sizes it from M)")
            self._bank = self._new_bank(len(views) * heads, prototypes, dim, views[0].grid, device)
        bank = self._bank
        t = int(views[0].newest_frame)
        timer = PhaseTimer()
        touched = torch.zeros(bank.rows, bank.capacity, dtype=torch.bool, device=device)
        if evict.shape[-1]:
            with timer.phase("gather", device):
                tokens = self._gather(views, evict)
            touched |= self.absorb(bank, *tokens, t, timer)
        with timer.phase("maintenance", device):
            touched |= self.maintain(bank, lambda count: self._gather(views, near_newest[..., :count]), t, touched)
        with timer.phase("synthesis", device):
            summary = self.synthesize(bank, touched, views[0].rotary, heads)
        reasons = [torch.full_like(index, REASON_NEAR, dtype=torch.int8) for index in indices]
        self._last = {
            "evicted": int(evict.shape[-1]),
            "touched": int(touched.sum()),
            "pending_merges": int(bank.pending.sum()),
            "ms": {name: round(ms, 3) for name, ms in timer.ms.items()},
        }
        return Selection(indices, {"reason": reasons, "touched": touched, "phase_ms": dict(self._last["ms"])}, summary=summary)

    def synthesize_all(self, rotary: Any, heads: int) -> None:
        if self._bank is not None:
            self.synthesize(self._bank, torch.ones_like(self._bank.used), rotary, heads)

    def _new_bank(self, rows: int, prototypes: int, dim: int, grid: tuple[int, int], device) -> ProtoBank:
        g, c = self.subquantizers, self.codewords
        if dim % g:
            raise BudgetError(f"head dim {dim} is not divisible by {g} PQ sub-quantisers")
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return ProtoBank(
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
            reservoir_k=zeros(rows, self.warmup, dim),
            reservoir_v=zeros(rows, self.warmup, dim),
            pending=zeros(rows, prototypes, dtype=torch.bool),
            assign_map=torch.full((rows, self.history, *grid), -1, dtype=torch.int16, device=device),
            assign_grid=torch.full((self.history,), -1, dtype=torch.int64, device=device),
            generation=zeros(rows, prototypes, dtype=torch.int32),
            assign_generation=zeros(rows, self.history, *grid, dtype=torch.int32),
        )

    @staticmethod
    def _gather(views: list[LayerView], index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tokens ``index [layers, H, E]`` of every row: keys before RoPE and values ``[B, E, D]`` (float32),
        normalised spatial coordinates ``[B, E, 2]``, positions ``[B, E, 3]``, grid and (row, col) ``[B, E]``."""
        keys, values, position, frame, row, col = [], [], [], [], [], []
        for view, idx in zip(views, index):
            expand = idx[..., None].expand(-1, -1, view.keys.shape[-1])
            keys.append(torch.gather(view.keys, 1, expand))
            values.append(torch.gather(view.values, 1, expand))
            position.append(torch.gather(view.position, 1, idx[..., None].expand(-1, -1, 3)))
            frame.append(torch.gather(view.frame, 1, idx))
            row.append(torch.gather(view.row, 1, idx))
            col.append(torch.gather(view.col, 1, idx))
        position = torch.cat(position).long()
        keys = torch.cat(keys)
        rotary = views[0].rotary
        if rotary is None:
            raise BudgetError("ProtoKV needs the model's rotation to keep keys before RoPE (views without rotary)")
        keys = rotary.unrotate(keys, position).float()
        rows, cols = views[0].grid
        row, col = torch.cat(row).float(), torch.cat(col).float()
        spatial = torch.stack([(row + 0.5) / rows, (col + 0.5) / cols], dim=-1)
        return keys, torch.cat(values).float(), spatial, position, torch.cat(frame).long(), row.long(), col.long()

    # --- Alg. 1 -----------------------------------------------------------------------------
    def absorb(
        self,
        bank: ProtoBank,
        keys: torch.Tensor,
        values: torch.Tensor,
        spatial: torch.Tensor,
        position: torch.Tensor,
        frame: torch.Tensor,
        row: torch.Tensor,
        col: torch.Tensor,
        t: int,
        timer: PhaseTimer | None = None,
    ) -> torch.Tensor:
        """Absorb evicted tokens ``[B, E, ...]`` (arrival order along ``E``) into the bank; returns the
        prototypes touched ``[B, K]``. See the module docstring for the batching. ``timer`` splits the time
        into assignment / update / residuals."""
        rows, tokens = keys.shape[:2]
        device = keys.device
        timer = timer or PhaseTimer()
        arange_rows = torch.arange(rows, device=device)[:, None]
        # 1. Never-used slots take the first tokens, one each, in slot order.
        fresh = ~bank.used
        fresh_count = fresh.sum(dim=1)  # [B]
        slot_of_rank = torch.argsort((~fresh).to(torch.int8), dim=1, stable=True)  # fresh slots first, in order
        token_rank = torch.arange(tokens, device=device)[None].expand(rows, -1)
        initialise = token_rank < fresh_count[:, None]  # [B, E]
        init_slot = torch.gather(slot_of_rank, 1, token_rank.clamp(max=bank.capacity - 1))
        r_i, e_i = arange_rows.expand(-1, tokens)[initialise], token_rank[initialise]
        s_i = init_slot[initialise]
        bank.centre_k[r_i, s_i] = keys[r_i, e_i]
        bank.centre_v[r_i, s_i] = values[r_i, e_i]
        bank.mass[r_i, s_i] = 1
        bank.used[r_i, s_i] = True
        bank.generation[r_i, s_i] += 1
        bank.tau_time[r_i, s_i] = t
        bank.tau_pos[r_i, s_i] = position[r_i, e_i]
        bank.mu[r_i, s_i] = spatial[r_i, e_i]
        bank.sigma[r_i, s_i] = torch.eye(2, device=device)
        bank.hist_k[r_i, s_i] = 0
        bank.hist_v[r_i, s_i] = 0
        bank.n_res[r_i, s_i] = 0
        assigned = torch.where(initialise, init_slot, -1)
        # 2. The others: Eq. 1 against the bank after those initialisations.
        rest = ~initialise
        if bool(rest.any()):
            with timer.phase("assignment", device):
                choice = self.assignment_cost(bank, keys, spatial, t).argmin(dim=-1)  # [B, E]
            assigned = torch.where(rest, choice, assigned)
            with timer.phase("update", device):
                cell, residual_k, residual_v = self._update(bank, keys, values, spatial, position, choice, rest, t)
            with timer.phase("residuals", device):
                self._record_residuals(bank, cell, rest, residual_k, residual_v)
        touched = torch.zeros(rows, bank.capacity, dtype=torch.bool, device=device)
        touched[arange_rows.expand(-1, tokens), assigned] = True
        self._record_assignment(bank, assigned, frame, row, col)
        return touched

    def assignment_cost(self, bank: ProtoBank, keys: torch.Tensor, spatial: torch.Tensor, t: int) -> torch.Tensor:
        """Eq. 1 for every token and prototype, ``[B, E, K]``: ``-cos(K, c_k) + lambda_sp d_Mah(s; mu_k,
        Sigma_k) + lambda_idle 1(t - tau_k > T_idle)``; empty slots cost ``+inf``."""
        unit_keys, unit_centres = F.normalize(keys, dim=-1), F.normalize(bank.centre_k, dim=-1)
        # Per-prototype terms in one [B, 1, K] row: the idle penalty, and +inf on empty slots.
        per_prototype = torch.zeros(bank.mass.shape, dtype=unit_keys.dtype, device=keys.device)
        if self.lambda_idle:
            per_prototype += self.lambda_idle * ((t - bank.tau_time) > self.t_idle).to(per_prototype.dtype)
        per_prototype.masked_fill_(~bank.active, float("inf"))
        if self.lambda_sp:
            cost = mahalanobis(spatial, bank.mu, bank.sigma).mul_(self.lambda_sp)
            cost.baddbmm_(unit_keys, unit_centres.transpose(1, 2), alpha=-1.0)  # - cos, fused into the sum
        else:
            cost = -(unit_keys @ unit_centres.transpose(1, 2))
        return cost.add_(per_prototype[:, None, :])  # [B, E, K], written in place (no [B, E, K] temporaries)

    def _update(
        self,
        bank: ProtoBank,
        keys: torch.Tensor,
        values: torch.Tensor,
        spatial: torch.Tensor,
        position: torch.Tensor,
        choice: torch.Tensor,
        mask: torch.Tensor,
        t: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Alg. 1 lines 8-12 for the tokens ``mask [B, E]`` assigned to ``choice [B, E]``: the sequential EMA
        in closed form per prototype (tokens in arrival order along ``E``). Returns each token's prototype
        cell ``row * K + k`` and its key/value residuals ``[B, E, D]`` for line 13."""
        rows, tokens = choice.shape
        capacity, dim = bank.capacity, keys.shape[-1]
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
        later = (count[flat] - 1 - rank).double()  # tokens after this one on the same prototype
        m = count.double()
        alpha, eta = self.centre_rate, self.spatial_rate
        # Chunk-start state of each token's prototype (after this chunk's initialisations).
        c_before_k = torch.gather(bank.centre_k, 1, choice[..., None].expand(-1, -1, dim))
        c_before_v = torch.gather(bank.centre_v, 1, choice[..., None].expand(-1, -1, dim))
        mu_before = torch.gather(bank.mu, 1, choice[..., None].expand(-1, -1, 2))  # chunk-start means

        def ema(state: torch.Tensor, update: torch.Tensor, rate: float) -> torch.Tensor:
            """``(1-a)^m state + sum_j a (1-a)^(later_j) update_j`` per prototype (``update`` per assigned token)."""
            inner = state.shape[2:]
            out = state.reshape(rows * capacity, -1) * ((1 - rate) ** m).to(state.dtype)[:, None]
            weight = (rate * (1 - rate) ** later).to(state.dtype)[:, None]
            return out.index_add_(0, flat, update.reshape(flat.numel(), -1) * weight).view(rows, capacity, *inner)

        # Alg. 1 line 12 reads the mean right after the token's own update: s - mu_r = (1 - eta)(s - mu_{r-1}),
        # with mu_{r-1} the running mean before it (a prefix over earlier tokens on the same prototype).
        before = running_mean_before(spatial[mask], mu_before[mask], flat, rank, count, eta)
        deviation = (1 - eta) * (spatial[mask] - before)
        bank.sigma = ema(bank.sigma, deviation[:, :, None] * deviation[:, None, :], eta)
        bank.mu = ema(bank.mu, spatial[mask], eta)
        bank.centre_k = ema(bank.centre_k, keys[mask], alpha)
        bank.centre_v = ema(bank.centre_v, values[mask], alpha)
        bank.mass.view(-1).index_add_(0, flat, torch.ones_like(flat))
        hit = (count > 0).view(rows, capacity)
        bank.tau_time[hit] = t
        newest = torch.zeros(rows * capacity, dtype=torch.long, device=device)
        newest.scatter_reduce_(0, flat, token_ids, reduce="amax", include_self=False)
        owner = torch.arange(rows * capacity, device=device) // capacity
        bank.tau_pos.view(-1, 3)[hit.view(-1)] = position[owner, newest][hit.view(-1)]
        # Residuals against the centre right after the token's update: x - c_after = (1 - a)(x - c_before).
        return cell, (1 - alpha) * (keys - c_before_k), (1 - alpha) * (values - c_before_v)

    def _record_residuals(
        self, bank: ProtoBank, cell: torch.Tensor, mask: torch.Tensor, residual_k: torch.Tensor, residual_v: torch.Tensor
    ) -> None:
        """Alg. 1 line 13 for the tokens ``mask [B, E]`` (prototype ``cell = row * K + k``), residuals
        ``[B, E, D]``: PQ-encode them into their prototype's histograms, or fill the warm-up reservoir until
        the codebooks can be trained (App. A.1)."""
        rows = bank.rows
        if bank.codebook_k is None:
            # Take each row's first assigned tokens (arrival order), as many as every row has.
            room = self.warmup - bank.reservoir_len
            take = min(int(mask.sum(dim=1).min()), room)
            if take > 0:
                first = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :take]
                dest = slice(bank.reservoir_len, bank.reservoir_len + take)
                dim = residual_k.shape[-1]
                bank.reservoir_k[:, dest] = torch.gather(residual_k, 1, first[..., None].expand(-1, -1, dim))
                bank.reservoir_v[:, dest] = torch.gather(residual_v, 1, first[..., None].expand(-1, -1, dim))
                bank.reservoir_len += take
            if bank.reservoir_len >= self.warmup:
                bank.codebook_k = train_codebooks(bank.reservoir_k, self.subquantizers, self.codewords)
                bank.codebook_v = train_codebooks(bank.reservoir_v, self.subquantizers, self.codewords)
                bank.reservoir_k = bank.reservoir_k[:, :0]
                bank.reservoir_v = bank.reservoir_v[:, :0]
            return
        g, c = self.subquantizers, self.codewords
        groups = torch.arange(g, device=cell.device)
        for residual, codebook, hist in ((residual_k, bank.codebook_k, bank.hist_k), (residual_v, bank.codebook_v, bank.hist_v)):
            codes = pq_encode(residual, codebook)  # [B, E, G]
            index = ((cell[..., None] * g + groups) * c + codes)[mask].flatten()
            hist.view(-1).index_add_(0, index, torch.ones(index.numel(), dtype=hist.dtype, device=index.device))
        flat = cell[mask]
        bank.n_res.view(-1).index_add_(0, flat, torch.ones_like(flat))

    def _record_assignment(
        self, bank: ProtoBank, assigned: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor
    ) -> None:
        """Which prototype each absorbed patch went to, for the last ``history`` absorbed grids (ring)."""
        grids = torch.unique(frame)
        ring = grids % self.history
        stale = bank.assign_grid[ring] != grids
        if bool(stale.any()):
            bank.assign_map[:, ring[stale]] = -1
        bank.assign_grid[ring] = grids
        rows = torch.arange(assigned.shape[0], device=assigned.device)[:, None].expand_as(assigned)
        bank.assign_map[rows, frame % self.history, row, col] = assigned.to(torch.int16)
        bank.assign_generation[rows, frame % self.history, row, col] = torch.gather(bank.generation, 1, assigned)

    # --- Alg. 2 -----------------------------------------------------------------------------
    def maintain(
        self, bank: ProtoBank, near: Callable[[int], tuple[torch.Tensor, ...]], t: int, changed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Aging, merging, recycling (once per chunk); returns the prototypes whose centres changed.
        ``near(n)`` gathers the newest ``n`` near-window tokens of every row (as :meth:`_gather` returns them);
        ``changed [B, K]`` marks the prototypes absorption touched (merge candidates; all when None)."""
        if changed is None:
            changed = torch.ones_like(bank.used)
        idle = bank.active & ((t - bank.tau_time) > self.t_idle)
        bank.mass = torch.where(idle, torch.floor(bank.mass.double() * (1 - self.decay)).long(), bank.mass)
        touched = self._merge(bank, changed | bank.pending)
        touched |= self._recycle(bank, near, t)
        return touched

    def _merge(self, bank: ProtoBank, candidates: torch.Tensor) -> torch.Tensor:
        """Merge prototypes whose normalised key and value centres are within (eps_K, eps_V) (Alg. 2 lines
        6-13): each merges into its lowest-index qualifying partner that is not merging itself.

        Only pairs with a candidate ``[B, K]`` (a prototype that changed this chunk, or one left pending) can
        newly qualify, so distances are computed for candidate rows only (``[B, U, K]``, not ``[B, K, K]``).
        """
        rows, capacity = bank.mass.shape
        device = bank.mass.device
        active = bank.active
        candidates = candidates & active
        width = int(candidates.sum(dim=1).max()) if rows else 0
        if width == 0:
            bank.pending = torch.zeros_like(active)
            return torch.zeros_like(active)
        chosen = torch.argsort((~candidates).to(torch.int8), dim=1, stable=True)[:, :width]  # [B, U] slot ids
        real = torch.gather(candidates, 1, chosen)
        unit_k, unit_v = F.normalize(bank.centre_k, dim=-1), F.normalize(bank.centre_v, dim=-1)
        pick = lambda unit: torch.gather(unit, 1, chosen[..., None].expand(-1, -1, unit.shape[-1]))  # noqa: E731
        # ||a - b||^2 = 2 - 2 cos for unit vectors, so ||a - b|| < eps  <=>  cos > 1 - eps^2 / 2
        close = (pick(unit_k) @ unit_k.transpose(1, 2)) > 1 - self.merge_k**2 / 2
        close &= (pick(unit_v) @ unit_v.transpose(1, 2)) > 1 - self.merge_v**2 / 2
        slots = torch.arange(capacity, device=device)
        close &= real[..., None] & active[:, None, :] & (chosen[..., None] != slots)  # [B, U, K]
        # partner(j) = lowest i < j with close(i, j); close is symmetric, so a pair appears from a candidate side.
        # int32 slot ids: the [B, U, K] temporaries are the largest tensors of a pass.
        big = torch.tensor(capacity, dtype=torch.int32, device=device)
        chosen32, slots32 = chosen.to(torch.int32)[..., None], slots.to(torch.int32)
        from_candidates = torch.where(close & (chosen32 < slots32), chosen32, big).amin(dim=1)
        own = torch.where(close & (slots32 < chosen32), slots32, big).amin(dim=2)  # candidate j's lower partners
        partner = from_candidates.long().scatter_reduce(1, chosen, torch.where(real, own, big).long(), reduce="amin")
        has_partner = partner < capacity
        root = ~has_partner
        merging = has_partner & torch.gather(torch.cat([root, root.new_zeros(rows, 1)], 1), 1, partner)
        bank.pending = has_partner & ~merging
        if not bool(merging.any()):
            return torch.zeros_like(active)
        r, j = torch.nonzero(merging, as_tuple=True)
        i = partner[r, j]
        # Mass-weighted means, computed for the merge targets only (not the whole bank).
        target = r * capacity + i
        targets, slot_of = torch.unique(target, return_inverse=True)
        source = r * capacity + j
        weight_j = bank.mass.view(-1)[source].double()
        weight_i = bank.mass.view(-1)[targets].double()
        total = weight_i.index_add(0, slot_of, weight_j)
        for name in ("centre_k", "centre_v", "mu"):
            flat = getattr(bank, name).view(rows * capacity, -1)
            summed = (flat[targets].double() * weight_i[:, None]).index_add_(0, slot_of, flat[source].double() * weight_j[:, None])
            merged = (summed / total.clamp_min(1)[:, None]).to(flat.dtype)
            flat[targets] = torch.where((total == 0)[:, None], flat[targets], merged)
        for name in ("hist_k", "hist_v", "n_res"):
            state = getattr(bank, name)
            flat = state.view(rows * capacity, -1)
            flat.index_add_(0, target, state[r, j].view(r.numel(), -1))
        bank.mass.view(-1).index_add_(0, target, bank.mass[r, j])
        bank.mass[r, j] = 0
        # Patches absorbed into a merged-away prototype are now represented by its partner (views' bookkeeping).
        successor = torch.arange(capacity, device=device).repeat(rows, 1)
        successor[r, j] = i
        lookup = bank.assign_map.long().clamp_min(0).flatten(1)
        moved = torch.gather(successor, 1, lookup).view_as(bank.assign_map)
        was_merged = (bank.assign_map >= 0) & (moved != bank.assign_map.long())
        bank.assign_map = torch.where(was_merged, moved.to(bank.assign_map.dtype), bank.assign_map)
        current = torch.gather(bank.generation, 1, moved.flatten(1)).view_as(bank.assign_generation)
        bank.assign_generation = torch.where(was_merged, current, bank.assign_generation)
        touched = torch.zeros_like(active)
        touched[r, i] = True
        touched[r, j] = True
        return touched

    def _recycle(self, bank: ProtoBank, near: Callable[[int], tuple[torch.Tensor, ...]], t: int) -> torch.Tensor:
        """Refill used slots that became empty from the newest near-window tokens (Alg. 2 lines 14-19)."""
        empty = bank.used & ~bank.active
        if not bool(empty.any()):
            return torch.zeros_like(empty)
        keys, values, spatial, position = near(int(empty.sum(dim=1).max()))[:4]
        available = keys.shape[1]
        rank = torch.cumsum(empty.long(), dim=1) - 1  # k-th empty slot of its row takes the k-th newest token
        refill = empty & (rank < available)
        r, k = torch.nonzero(refill, as_tuple=True)
        bank.generation[r, k] += 1
        e = rank[r, k]
        bank.centre_k[r, k] = keys[r, e]
        bank.centre_v[r, k] = values[r, e]
        bank.mass[r, k] = 1
        bank.tau_time[r, k] = t
        bank.tau_pos[r, k] = position[r, e]
        bank.mu[r, k] = spatial[r, e]
        bank.sigma[r, k] = torch.eye(2, device=keys.device)
        bank.hist_k[r, k] = 0
        bank.hist_v[r, k] = 0
        bank.n_res[r, k] = 0
        return refill

    # --- Alg. 3-4 ---------------------------------------------------------------------------
    def synthesize(self, bank: ProtoBank, touched: torch.Tensor, rotary: Any, heads: int) -> list[SummaryUpdate]:
        """Pseudo-tokens of the touched prototypes (rotated at ``tau_k``) and the bias of every slot, per layer."""
        rows, capacity = bank.mass.shape
        s = self.pseudo_tokens
        layers = rows // heads
        count = int(touched.sum(dim=1).max()) if rows else 0
        # Touched prototypes per row, padded by repeating the row's first touched one (rewriting a slot with
        # its own value is harmless).
        order = torch.argsort((~touched).to(torch.int8), dim=1, stable=True)[:, : max(count, 1)]
        valid = torch.gather(touched, 1, order)
        order = torch.where(valid, order, order[:, :1])
        rows_idx = torch.arange(rows, device=order.device)[:, None].expand_as(order)
        residual_k, residual_v = self.residual_modes(bank, rows_idx, order)  # [B, U, S, D], fresh tensors
        keys = residual_k.add_(bank.centre_k[rows_idx, order][:, :, None])
        values = residual_v.add_(bank.centre_v[rows_idx, order][:, :, None])
        keys = rotary.rotate(keys, bank.tau_pos[rows_idx, order][:, :, None])  # one position per prototype [B, U, 1, 3]
        slots = (order[:, :, None] * s + torch.arange(s, device=order.device)).flatten(1)  # [B, U*S]
        mass = bank.mass.double()
        bias = torch.where(mass > 0, mass.clamp_min(1).log() if self.mass_bias else torch.zeros_like(mass), float("-inf"))
        bias = bias.float().repeat_interleave(s, dim=1)  # [B, K*S]
        dim = keys.shape[-1]
        updates = []
        for layer in range(layers):
            part = slice(layer * heads, (layer + 1) * heads)
            updates.append(
                SummaryUpdate(
                    keys=keys[part].reshape(heads, -1, dim),
                    values=values[part].reshape(heads, -1, dim),
                    bias=bias[part],
                    slots=slots[part] if count else slots[part][:, :0],
                )
            )
        return updates

    def residual_modes(self, bank: ProtoBank, rows: torch.Tensor, protos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Alg. 3 for prototypes ``protos [B, U]``: decoded top-S key and value residual modes ``[B, U, S, D]``
        (zero where ``n_res = 0``, before the codebooks exist, or with ``residuals`` off)."""
        dim = bank.centre_k.shape[-1]
        shape = (*protos.shape, self.pseudo_tokens, dim)
        if bank.codebook_k is None or not self.residuals:
            return torch.zeros(shape, device=protos.device), torch.zeros(shape, device=protos.device)
        out = []
        empty = (bank.n_res[rows, protos] == 0)[:, :, None, None]
        for hist, codebook in ((bank.hist_k, bank.codebook_k), (bank.hist_v, bank.codebook_v)):
            codes = beam_search(hist[rows, protos], self.pseudo_tokens, self.beam or 4 * self.pseudo_tokens, self.smoothing)
            out.append(pq_decode(codes, codebook[rows[:, 0]]).masked_fill_(empty, 0.0))  # [B, U, S, D]
        return out[0], out[1]

    # --- what it shows ----------------------------------------------------------------------
    view_titles = ("Prototype assignments", "Prototype bank")

    def assignments(self, layer: int, head: int, heads: int) -> dict[str, Any] | None:
        """The last absorbed grids of one (layer, KV head) as plain data: ``grids`` (oldest first),
        ``prototype [n, rows, cols]`` (``UNLABELLED`` = not absorbed: still exact in the near window, or never
        held; ``LOST`` = absorbed into a prototype since recycled, so no longer represented) and ``mass [K]``."""
        bank = self._bank
        if bank is None:
            return None
        row = layer * heads + head
        grids = bank.assign_grid.cpu()
        ring = torch.nonzero(grids >= 0).flatten()
        ring = ring[torch.argsort(grids[ring])]
        proto = bank.assign_map[row, ring].long().cpu()
        born = bank.assign_generation[row, ring].cpu()
        current = torch.gather(bank.generation[row].cpu(), 0, proto.clamp_min(0).flatten()).view_as(proto)
        proto = torch.where((proto >= 0) & (born != current), LOST, proto)
        return {"grids": grids[ring].tolist(), "prototype": proto.numpy(), "mass": bank.mass[row].cpu().numpy()}

    def summarised(self, context: ViewContext, layer: int, head: int) -> np.ndarray | None:
        """Every patch is represented (exactly in the near window, or by the prototype it was absorbed into)
        except those absorbed into a prototype since recycled."""
        if context.grid_shape is None:
            return None
        represented = np.ones((context.num_grids, *context.grid_shape), dtype=bool)
        data = self.assignments(layer, head, context.num_kv_heads)
        for grid, ids in zip(data["grids"], data["prototype"]) if data else ():
            if grid < context.num_grids:
                represented[grid][ids == LOST] = False
        return represented

    def views(self, context: ViewContext, layer: int, head: int, last: int = 4) -> list[View]:
        """The prototype each patch of the newest absorbed grids went to, and the bank: its mass histogram
        and the pseudo-tokens attention can see over stream time."""
        data = self.assignments(layer, head, context.num_kv_heads)
        if data is None:
            return []
        views: list[View] = []
        shown = [(g, ids) for g, ids in zip(data["grids"][-last:], data["prototype"][-last:]) if g < context.num_grids]
        mass = data["mass"]
        if shown:
            labels = np.stack([ids for _, ids in shown])
            ids = np.unique(labels[labels >= 0])
            top = sorted(ids.tolist(), key=lambda k: -int(mass[k]))[:8]
            listed = ", ".join(f"<b>{k}</b> (mass {int(mass[k])})" for k in top)
            caption = (f"Layer {layer}, KV head {head}: each patch of these absorbed frames is represented by the prototype "
                       f"whose id it shows (same colour = same prototype); untinted = still exact in the near window"
                       + ("; dark red = its prototype was recycled since" if (labels == LOST).any() else "")
                       + (f". Heaviest here: {listed}." if listed else "."))
            frame_captions = [f"t={context.grid_times_s[g]:.1f}s  {100 * (ids >= 0).mean():.0f}% in the bank" for g, ids in shown]
            views.append(PatchLabels("Prototype assignments", caption, [g for g, _ in shown], labels, frame_captions))
        active = mass[mass > 0]
        events = context.timeline
        occupancy = Series([e.time_s for e in events], {"pseudo-tokens visible": [e.summary_active for e in events]},
                           "stream time (s)", "pseudo-tokens", limit=context.summary_slots)
        histogram = Histogram(active, f"mass n_k (layer {layer}, head {head})", "prototypes")
        caption = (f"{int(active.size)} of {len(mass)} prototypes active in this bank, total mass {int(active.sum())}; "
                   f"right: pseudo-tokens attention can see (capacity {context.summary_slots}, dashed).")
        views.append(Chart("Prototype bank", caption, [histogram, occupancy]))
        return views

    def report(self) -> dict[str, Any]:
        bank = self._bank
        if bank is None:
            return {"prototypes": 0}
        mass = bank.mass[bank.active]
        return {
            "rows": bank.rows,
            "capacity": bank.capacity,
            "active": int(bank.active.sum()),
            "active_per_row": round(float(bank.active.sum(dim=1).double().mean()), 2),
            "mass_total": int(mass.sum()),
            "mass_quantiles": {q: float(torch.quantile(mass.double(), q / 100)) for q in (10, 50, 90, 100)} if mass.numel() else {},
            "codebooks_trained": bank.codebook_k is not None,
            "residual_updates": int(bank.n_res.sum()),
            "last_pass": dict(self._last),
        }


def running_mean_before(
    values: torch.Tensor, start: torch.Tensor, group: torch.Tensor, rank: torch.Tensor, count: torch.Tensor, rate: float
) -> torch.Tensor:
    """For each token, the EMA ``mu <- (1 - rate) mu + rate x`` of its group just before the token's own update.

    ``values [N, F]`` in arrival order within groups, ``start [N, F]`` the group's state before the chunk,
    ``group [N]`` group ids, ``rank [N]`` position within the group, ``count`` group sizes (indexed by group id).
    Closed form on a padded ``[groups, max_m]`` layout (a group never mixes with another in the prefix sum):
    ``mu_r = (1-a)^(r+1) mu_0 + a (1-a)^r sum_{i<=r} (1-a)^-i x_i``, all in float64.
    """
    if values.numel() == 0:
        return values
    present = count > 0
    compact = torch.cumsum(present.long(), 0) - 1
    gid = compact[group]
    width = int(count.max())
    dense = torch.zeros(int(present.sum()), width, values.shape[1], dtype=torch.float64, device=values.device)
    steps = torch.arange(width, device=values.device, dtype=torch.float64)
    dense[gid, rank] = values.double() * (1 - rate) ** (-steps[rank])[:, None]
    prefix = torch.cumsum(dense, dim=1)  # sum_{i<=r} (1-a)^-i x_i
    previous = rank - 1  # mu_{r-1}: the mean after the previous token of the group (mu_0 for the first)
    r = previous.clamp_min(0).double()[:, None]
    after_previous = (1 - rate) ** (r + 1) * start.double() + rate * (1 - rate) ** r * prefix[gid, previous.clamp_min(0)]
    return torch.where((rank > 0)[:, None], after_previous, start.double()).to(values.dtype)


def mahalanobis(spatial: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``d_Mah(s; mu_k, Sigma_k) = sqrt((s - mu)^T Sigma^-1 (s - mu))`` for ``s [B, E, 2]``, ``mu [B, K, 2]``,
    ``sigma [B, K, 2, 2]`` -> ``[B, E, K]``, as one small matmul of quadratic features (no ``[B, E, K, 2]``
    temporary). ``Sigma + 1e-4 I`` keeps a prototype fed from one place invertible (kvdemo's floor)."""
    a, b, d = sigma[..., 0, 0] + SIGMA_FLOOR, sigma[..., 0, 1], sigma[..., 1, 1] + SIGMA_FLOOR
    det = (a * d - b * b).clamp_min(1e-12)
    ia, ib, id_ = d / det, -b / det, a / det  # inverse [[ia, ib], [ib, id]]
    mx, my = mu[..., 0], mu[..., 1]
    # (s-mu)^T A (s-mu) = ia x^2 + 2 ib x y + id y^2 - 2 x (ia mx + ib my) - 2 y (ib mx + id my) + mu^T A mu
    coef = torch.stack(
        [ia, 2 * ib, id_, -2 * (ia * mx + ib * my), -2 * (ib * mx + id_ * my), ia * mx * mx + 2 * ib * mx * my + id_ * my * my],
        dim=-1,
    )  # [B, K, 6]
    x, y = spatial[..., 0], spatial[..., 1]
    features = torch.stack([x * x, x * y, y * y, x, y, torch.ones_like(x)], dim=-1)  # [B, E, 6]
    return (features.double() @ coef.double().transpose(1, 2)).clamp_min_(0).sqrt_().float()


def train_codebooks(reservoir: torch.Tensor, groups: int, codewords: int, iterations: int = 20) -> torch.Tensor:
    """k-means per row and sub-space on the warm-up reservoir ``[B, R, D]`` -> codebooks ``[B, G, C, D/G]``.

    Deterministic: the initial codewords are reservoir points at evenly spaced indices; Lloyd iterations
    on the whole reservoir (one mini-batch); an emptied cluster keeps its codeword.
    """
    rows, count, dim = reservoir.shape
    points = reservoir.view(rows, count, groups, dim // groups).transpose(1, 2).reshape(rows * groups, count, dim // groups)
    start = torch.linspace(0, count - 1, codewords, device=reservoir.device).round().long()
    centres = points[:, start].clone()
    for _ in range(iterations):
        nearest = torch.cdist(points, centres).argmin(dim=-1)  # [BG, R]
        sums = torch.zeros_like(centres).scatter_add_(1, nearest[..., None].expand_as(points), points)
        counts = torch.zeros(centres.shape[:2], device=points.device).scatter_add_(1, nearest, torch.ones_like(nearest, dtype=torch.float32))
        centres = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centres)
    return centres.view(rows, groups, codewords, dim // groups)


def pq_encode(residual: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest codeword per sub-space: ``residual [B, E, D]``, per-row ``codebook [B, G, C, D/G]`` -> codes
    ``[B, E, G]`` (one batched distance per row and sub-space)."""
    rows, tokens, dim = residual.shape
    groups, codewords, sub = codebook.shape[1:]
    parts = residual.view(rows, tokens, groups, sub).transpose(1, 2).reshape(rows * groups, tokens, sub)
    distance = torch.cdist(parts, codebook.reshape(rows * groups, codewords, sub))  # [B*G, E, C]
    return distance.argmin(dim=-1).view(rows, groups, tokens).transpose(1, 2)


def pq_decode(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``codes [B, U, S, G]`` with per-row ``codebook [B, G, C, D/G]`` -> residuals ``[B, U, S, D]``."""
    rows, protos, modes, groups = codes.shape
    codewords, sub = codebook.shape[-2:]
    row_ids = torch.arange(rows, device=codes.device)[:, None, None, None]
    flat = ((row_ids * groups + torch.arange(groups, device=codes.device)) * codewords + codes).reshape(-1)
    # One index_select of codeword rows (as int64 words when they are whole words: see as_words).
    picked = as_words(codebook.reshape(-1, sub).contiguous()).index_select(0, flat).view(codebook.dtype)
    return picked.view(rows, protos, modes, groups * sub)


def beam_search(hist: torch.Tensor, modes: int, beam: int, smoothing: float) -> torch.Tensor:
    """Alg. 3: the top-``modes`` code tuples of the factorised distribution of ``hist [..., G, C]``
    (Eq. 3 smoothing), by beam search over sub-quantisers -> codes ``[..., modes, G]``.

    Each sub-quantiser contributes only its ``modes`` most likely codewords (a tuple with a lower-ranked
    code cannot be among the top ``modes``: swapping that code for any of the ``modes`` better ones gives
    ``modes`` better tuples), which shrinks every step's candidates without changing the result. For the same
    reason the beam never needs to be wider than ``modes``: a prefix outside the best ``modes`` prefixes has
    ``modes`` better ones, each of which completes with the same suffix to a better tuple. So ``beam`` (the
    paper's B = 4S) is honoured as an upper bound and the search runs ``min(beam, modes)`` wide, with the
    same tuples as a ``beam``-wide search. Ties go
    to lower codewords (a ramp far below the log-probability resolution), so the search is deterministic.
    """
    *lead, groups, codewords = hist.shape
    counts = hist.float()
    logp = torch.log((counts + smoothing) / (counts.sum(-1, keepdim=True) + codewords * smoothing))
    logp = logp - torch.arange(codewords, device=hist.device, dtype=torch.float32) * 1e-6
    top = min(modes, codewords)
    logp, code_ids = torch.topk(logp, top, dim=-1)  # [..., G, top], best first
    scores = torch.zeros(*lead, 1, device=hist.device)
    parents, picked = [], []  # per sub-quantiser: each beam's parent beam and its codeword [..., width]
    for g in range(groups):
        candidates = (scores[..., :, None] + logp[..., None, g, :]).flatten(-2)  # [..., width * top]
        width = min(beam, modes, candidates.shape[-1])
        scores, pick = torch.topk(candidates, width, dim=-1)  # sorted, best first
        parents.append(torch.div(pick, top, rounding_mode="floor"))
        picked.append(torch.gather(code_ids[..., g, :], -1, pick % top))
    # Backtrack the best beams through their parents (instead of copying every beam's tuple at every step).
    beams = torch.arange(min(modes, width), device=hist.device).expand(*lead, -1).contiguous()
    tuple_codes = []
    for g in reversed(range(groups)):
        tuple_codes.append(torch.gather(picked[g], -1, beams))
        beams = torch.gather(parents[g], -1, beams)
    codes = torch.stack(tuple_codes[::-1], dim=-1)  # [..., n, G]
    if codes.shape[-2] < modes:  # fewer distinct tuples than modes (tiny codebooks): repeat the best
        codes = torch.cat([codes, codes[..., :1, :].expand(*codes.shape[:-2], modes - codes.shape[-2], groups)], dim=-2)
    return codes[..., :modes, :]
