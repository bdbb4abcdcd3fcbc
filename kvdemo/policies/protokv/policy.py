"""``protokv``: ProtoKV (paper 003): an exact near window plus a fixed-capacity prototype bank, read at
attention time through pseudo-tokens carrying a ``log n_k`` key bias. This module orchestrates Alg. 1-4 and
declares the views and the report; the bank is :mod:`.bank`, the absorption of assigned tokens :mod:`.absorption`,
merging :mod:`.merging`, the pseudo-tokens :mod:`.synthesis`, the PQ helpers :mod:`.pq`, the running statistics
:mod:`.ema`, what a pass reads of the memory :mod:`.gathering`.

Budget (Sec. 3, Table 5): one number ``M = W + K_max * S`` per layer and KV head, split ``W : K_max*S = 1 : 3``
with ``S = 8`` pseudo-tokens per prototype (``K_max = floor(3M / 4S)``, ``W = M - K_max S``). The memory keeps
the newest ``W`` visual tokens exactly (the near window) and reserves ``K_max * S`` summary slots.

**The near window holds two chunks (kvdemo's rule).** The paper keeps a near window so that the newest tokens
stay exact; its 1 : 3 split leaves less than that at small budgets (``M = 64`` on the tiny model: ``W = 16``, one
chunk, so the chunk before the newest, where evidence that just left view sits, was already in the bank).
So ``W >= 2 x`` the chunk's visual tokens: a compression, which runs before a chunk is prefilled, keeps the
newest chunk exact, and the bank takes the rest (``K_max = floor(min(3M/4, M - 2 chunk) / S)``). The split is
fitted when the first chunk is sized (:meth:`kvdemo.cache.budget.Budget.sized`); an ``M`` that cannot hold both the
two chunks and one prototype is refused with one line naming the smallest ``M`` that can.

Each compression (the engine runs one when the next chunk would overflow ``M``, i.e. when the near window
would exceed ``W``) evicts the oldest near tokens and absorbs them, per layer and KV head, into that row's
bank (Alg. 1), runs maintenance (Alg. 2), and refreshes the pseudo-tokens of the prototypes that changed
(Alg. 3-4). All ``B = layers * H_kv`` bank rows are processed at once; nothing loops over tokens, heads or
prototypes.

**Keys before RoPE** (Sec. 3.3, D.1). Centres average keys from different positions, so they are kept
pre-RoPE: evicted keys are un-rotated with their known 3-D M-RoPE positions (exact: a rotation, computed in
float32 from the cached keys, so a bfloat16 cache's keys are not rounded again), and a prototype's pseudo-tokens
are rotated at ``tau_k``, the position of its most recently absorbed token.

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
never-used slots wait for evicted tokens (Sec. 3.1, "Initialization"). ``n_k`` counts the tokens a prototype
summarises, each once: a recycled slot's seed token is still exact in the near window, so the slot starts at
``n_k = 0`` (hidden from attention, open to assignment) and the seed adds its 1 when it leaves the window
(kvdemo's reading of Alg. 2 line 17; :mod:`.bank`, "Every token counts once").

**Residuals (Alg. 1 line 13, App. A.1).** Per row, PQ codebooks (``G`` sub-quantisers of ``C`` codewords, keys
and values separately) are trained by k-means on a warm-up reservoir of the first ``warmup`` residuals
(kvdemo's ``T_warm``: 256 residuals per row; Lloyd iterations on the whole reservoir, which is one mini-batch)
and fixed; residuals before that count in no histogram. **Pseudo-tokens (Alg. 3-4):** the top-``S`` code tuples
by beam search (``B = 4S``, run ``min(B, S)`` wide: the same tuples, see :func:`.pq.beam_search`, which also
states how tied tuples are ordered) over the smoothed histograms (kvdemo's ``epsilon = 0.1``), key and value modes
paired by rank; ``n_res = 0`` gives zero residuals. Residuals that are exactly zero stay out of the warm-up
reservoir. Each of the ``S`` pseudo-tokens carries bias ``log n_k``, computed in float64 and kept in float32 by
the memory whatever the cache dtype, and float32 up to the softmax on every device
(:func:`kvdemo.cache.attention.bias_needs_float32`).

Time ``t`` (idleness, ``T_idle``) counts temporal grids (the unit a Qwen chunk adds: two sampled frames):
kvdemo's reading of the paper's "steps".

**One pass for all layers (kvdemo's).** The pass reads the memory stack by stack (:mod:`.gathering`: every layer of a
device at once), the bank holds every layer's rows, and the summary of every layer is one update on a GPU
(:mod:`.synthesis`), so its launches do not grow with the layers. On a GPU it reads back to the host only what sizes
its tensors or guards them (the update's group sizes, the touched prototypes of the fullest row, the fullest PQ
histogram of each beam search, the warm-up's share of the reservoir while it fills), and the memory's compaction its
counts: the bank takes dense forms there (:mod:`.bank`, "Without waiting for the device"); on a CPU, where a read
costs no wait, the sparse forms stay. Both leave the same bank. The counts the report gives (``last_pass``) stay on
the device until the report is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...devices.timing import PhaseTimer
from ...errors import PolicyParameterError
from ...views import LOST, View, ViewContext
from ..contract import LayerSlice, Policy, Selection, SummaryRegion, SummaryUpdate, slice_stacks
from ..registry import BenchDeclaration, PolicyCard, param, register
from .absorption import record_residuals, update
from .assignment import assign
from .bank import NearTokens, ProtoBank
from .gathering import gather_tokens, near_window, window_with_text
from .merging import merge
from .split import near_and_bank
from .synthesis import synthesize
from .views import bank_churn, prototype_views

REASON_NEAR = 0
REASON_NAMES = {REASON_NEAR: "near window (exact)"}


def refresh_every_entry(policy: ProtoKV, rotary: Any, heads: int) -> None:
    """Recompute every pseudo-token of ``policy``'s bank at once (what synthesising at read time would cost; the
    policy itself refreshes only the prototypes a chunk changed). The benchmark times it."""
    if policy._bank is not None:
        policy.synthesize(policy._bank, torch.ones_like(policy._bank.used), rotary, heads)


CARD = PolicyCard(
    "Exact near window + a prototype bank summarising evicted tokens, read through log-mass-biased pseudo-tokens.",
    reasons=REASON_NAMES,
    view_titles=("Prototype assignments", "Prototype bank"),
    bench=BenchDeclaration(benchmarks=("update",), refresh_all=refresh_every_entry, launches=3000),
)


@register(CARD)
@dataclass
class ProtoKV(Policy, SummaryRegion):
    """An exact near window of ``W`` tokens plus ``K_max`` prototypes exposed as ``S`` pseudo-tokens each."""

    name = "protokv"
    window_name = "near window"

    near_share: float = param(
        0.25, "W / M: the exact near window's share of the budget (paper: W : K_max*S = 1 : 3)", within="(0, 1)"
    )
    pseudo_tokens: int = param(
        8, "S: pseudo-tokens per prototype at read time (K_max = (1 - near_share) M / S)", within="[1, inf)"
    )
    lambda_sp: float = param(0.1, "weight of the spatial Mahalanobis term in the assignment (0 = no continuity)")
    lambda_idle: float = param(0.01, "penalty for assigning to a prototype idle longer than t_idle")
    t_idle: int = param(120, "idle threshold in temporal grids (aging and the idle penalty)", within="[0, inf)")
    centre_rate: float = param(0.05, "EMA rate of the key/value centres (alpha = beta)", within="[0, 1]")
    spatial_rate: float = param(0.05, "EMA rate of the spatial mean and covariance (eta)", within="[0, 1)")
    decay: float = param(0.05, "mass decay of idle prototypes per maintenance (gamma)", within="[0, 1]")
    merge_k: float = param(0.20, "merge threshold on normalised key centres (eps_K)")
    merge_v: float = param(0.25, "merge threshold on normalised value centres (eps_V)")
    subquantizers: int = param(8, "G: PQ sub-quantisers of the residual histograms", within="[1, inf)")
    codewords: int = param(16, "C: codewords per sub-quantiser", within="[1, inf)")
    beam: int = param(0, "beam width of the residual-mode search (0 = 4 S; at least S)", within="[0, inf)")
    warmup: int = param(
        256, "residuals per row collected before the PQ codebooks are trained (T_warm)", within="[1, inf)"
    )
    smoothing: float = param(0.1, "epsilon of the smoothed PQ probabilities", within="(0, inf)")
    residuals: bool = param(True, "decode residual modes (off = pseudo-tokens are the centres: 'w/o residual stats')")
    mass_bias: bool = param(True, "add log n_k to pseudo-token logits (off = 'w/o mass bias')")
    history: int = param(
        16, "absorbed temporal grids whose prototype assignment is kept for the views", within="[1, inf)"
    )
    _bank: ProtoBank | None = field(default=None, init=False, repr=False, compare=False)
    _last: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if 0 < self.beam < self.pseudo_tokens:
            raise PolicyParameterError(
                f"beam={self.beam} is narrower than S={self.pseudo_tokens} pseudo-tokens (it "
                f"would repeat code tuples); use beam >= {self.pseudo_tokens}, or 0 for 4 S"
            )

    # --- budget ---------------------------------------------------------------------------
    def split(self, budget: int, chunk: int = 0) -> tuple[int, int]:
        """``(W, K_max)`` for budget ``M`` and chunks of ``chunk`` visual tokens (:func:`.split.near_and_bank`)."""
        return near_and_bank(budget, chunk, self.near_share, self.pseudo_tokens)

    def summary_slots(self, budget: int, chunk: int = 0) -> int:
        return self.split(budget, chunk)[1] * self.pseudo_tokens

    def describe_split(self, budget: int, chunk: int = 0) -> str:
        near, prototypes = self.split(budget, chunk)
        return f"a near window of {near} exact tokens + {prototypes} prototypes x {self.pseudo_tokens} pseudo-tokens"

    # --- the pass -------------------------------------------------------------------------
    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        """Keep the newest ``keep`` near tokens of every row, absorb the others, refresh the summary.

        Where the stream carries its own text (Qwen3-VL's timestamps), that text counts against the near
        window (:func:`.gathering.window_with_text`): the window keeps the newest tokens whose grids' text fits too."""
        heads, dim = slices[0].num_heads, slices[0].keys.shape[-1]
        device = slices[0].keys.device  # the bank's: the first layer's
        stacks = slice_stacks(slices)
        keep = window_with_text(stacks, keep)
        indices, reasons, evict, near_newest = near_window(stacks, len(slices), keep, device, REASON_NEAR)
        if self._bank is None:
            prototypes = slices[0].summary_slots // self.pseudo_tokens
            if prototypes < 1:
                raise ValueError("ProtoKV needs a memory with a summary region (StreamEngine sizes it from M)")
            self._bank = self._new_bank(len(slices) * heads, prototypes, dim, slices[0].grid, device)
        bank = self._bank
        t = int(slices[0].newest_frame)
        timer = PhaseTimer()
        touched = torch.zeros(bank.rows, bank.capacity, dtype=torch.bool, device=device)
        if evict.shape[-1]:
            with timer.phase("gather", device):
                tokens = gather_tokens(stacks, evict)
            touched |= self.absorb(bank, *tokens[:7], t, timer, order=tokens.order)
        with timer.phase("maintenance", device):
            touched |= self.maintain(bank, lambda count: gather_tokens(stacks, near_newest[:, :count]), t, touched)
            bank.close_pass(t, window=keep)
        with timer.phase("synthesis", device):
            summary = self.synthesize(bank, touched, slices[0].rotary, heads)
        self._last = {  # counts stay on the device until a report reads them
            "evicted": int(evict.shape[-1]),
            "touched": touched.sum(),
            "pending_merges": bank.pending.sum(),
            "ms": {name: round(ms, 3) for name, ms in timer.ms.items()},
        }
        return Selection(
            indices, {"reason": reasons, "touched": touched, "phase_ms": dict(self._last["ms"])}, summary=summary
        )

    def _new_bank(self, rows: int, prototypes: int, dim: int, grid: tuple[int, int], device: torch.device) -> ProtoBank:
        """An empty bank of ``rows x prototypes`` slots with this policy's PQ shape, warm-up and view history."""
        if dim % self.subquantizers:
            raise PolicyParameterError(f"head dim {dim} is not divisible by {self.subquantizers} PQ sub-quantisers")
        return ProtoBank.empty(
            rows, prototypes, dim, grid, self.subquantizers, self.codewords, self.warmup, self.history, device
        )

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
        order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorb evicted tokens ``[B, E, ...]`` (arrival order along ``E``, arrival numbers ``order [B, E]``) into the
        bank; returns the prototypes touched ``[B, K]``. See the module docstring for the batching. A token that
        seeded a recycled slot only adds its deferred mass there (:meth:`ProtoBank.credit_seeds`); ``order`` None
        (hand-made tokens) means none did. ``timer`` splits the time into assignment / update / residuals."""
        rows, tokens = keys.shape[:2]
        device = keys.device
        timer = timer or PhaseTimer()
        arange_rows = torch.arange(rows, device=device)[:, None]
        credited = bank.credit_seeds(order) if order is not None else torch.full((rows, tokens), -1, device=device)
        seeds = credited >= 0
        # 1. Never-used slots take the first other tokens, one each, in slot order: the q-th fresh slot of a row the
        # row's q-th token that is not a seed.
        fresh = ~bank.used
        fresh_count = fresh.sum(dim=1)  # [B]
        slot_of_rank = torch.argsort((~fresh).to(torch.int8), dim=1, stable=True)  # fresh slots first, in order
        token_rank = torch.cumsum((~seeds).long(), dim=1) - 1  # rank among the tokens that are not seeds
        initialise = ~seeds & (token_rank < fresh_count[:, None])  # [B, E]
        init_slot = torch.gather(slot_of_rank, 1, token_rank.clamp(0, bank.capacity - 1))
        fresh_rank = torch.cumsum(fresh.long(), dim=1) - 1  # [B, K]
        refill = fresh & (fresh_rank <= token_rank[:, -1:])
        token_of_rank = torch.argsort(seeds.to(torch.int8), dim=1, stable=True)  # the others first, in arrival order
        init_token = torch.gather(token_of_rank, 1, fresh_rank.clamp(0, tokens - 1))
        bank.seed_slots(refill, init_token, keys, values, spatial, position, t)
        assigned = torch.where(initialise, init_slot, credited)
        # 2. The others: Eq. 1 against the bank after those initialisations (on a GPU whether or not there are any:
        # with none, the update changes nothing, and nothing waits to learn it).
        rest = ~initialise & ~seeds
        if bank.dense or bool(rest.any()):
            with timer.phase("assignment", device):
                choice = assign(bank, keys, spatial, t, self.lambda_sp, self.lambda_idle, self.t_idle)  # [B, E]
            assigned = torch.where(rest, choice, assigned)
            with timer.phase("update", device):
                cell, residual_k, residual_v = update(
                    bank, keys, values, spatial, position, choice, rest, t, self.centre_rate, self.spatial_rate
                )
            with timer.phase("residuals", device):
                self._record_residuals(bank, cell, rest, residual_k, residual_v)
        touched = torch.zeros(rows, bank.capacity, dtype=torch.bool, device=device)
        touched[arange_rows.expand(-1, tokens), assigned] = True
        bank.record_assignment(assigned, frame, row, col)
        return touched

    def _record_residuals(
        self,
        bank: ProtoBank,
        cell: torch.Tensor,
        mask: torch.Tensor,
        residual_k: torch.Tensor,
        residual_v: torch.Tensor,
    ) -> None:
        """Alg. 1 line 13 (:func:`.absorption.record_residuals`); one seam, so a test can read the residuals."""
        record_residuals(bank, cell, mask, residual_k, residual_v)

    # --- Alg. 2 -----------------------------------------------------------------------------
    def maintain(self, bank: ProtoBank, near: NearTokens, t: int, changed: torch.Tensor | None = None) -> torch.Tensor:
        """Aging, merging, recycling (once per chunk); returns the prototypes whose centres changed.
        ``near(n)`` gathers the newest ``n`` near-window tokens of every row (as :func:`.gathering.gather_tokens`
        returns them); ``changed [B, K]`` marks the prototypes absorption touched (merge candidates; all when None)."""
        if changed is None:
            changed = torch.ones_like(bank.used)
        bank.age(t, self.t_idle, self.decay)
        touched = merge(bank, changed | bank.pending, self.merge_k, self.merge_v)
        touched |= bank.recycle(near, t)
        return touched

    # --- Alg. 3-4 ---------------------------------------------------------------------------
    def synthesize(self, bank: ProtoBank, touched: torch.Tensor, rotary: Any, heads: int) -> list[SummaryUpdate]:
        """Pseudo-tokens of the touched prototypes (rotated at ``tau_k``) and the bias of every slot, per layer
        (:func:`.synthesis.synthesize`)."""
        return synthesize(
            bank,
            touched,
            rotary,
            heads,
            self.pseudo_tokens,
            self.beam,
            self.smoothing,
            residuals=self.residuals,
            mass_bias=self.mass_bias,
        )

    # --- what it shows ----------------------------------------------------------------------
    def assignments(self, layer: int, head: int, heads: int) -> dict[str, Any] | None:
        """The last absorbed grids of one (layer, KV head) as plain data: ``grids`` (oldest first),
        ``prototype [n, rows, cols]`` (``UNLABELLED`` = not absorbed: still exact in the near window, or never
        held; ``LOST`` = absorbed into a prototype since recycled, so no longer represented) and ``mass [K]``."""
        if self._bank is None:
            return None
        return self._bank.assignments(layer * heads + head)

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
        """The prototype each patch of the newest absorbed grids went to, and the bank (:mod:`.views`)."""
        data = self.assignments(layer, head, context.num_kv_heads)
        if data is None:
            return []
        return prototype_views(data, self.churn(layer * context.num_kv_heads + head), context, layer, head, last)

    def churn(self, row: int) -> dict[str, Any]:
        """Bank row ``row``'s churn over the last passes (:func:`.views.bank_churn`)."""
        return bank_churn(self._bank, row)

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
            "mass_quantiles": {q: float(torch.quantile(mass.double(), q / 100)) for q in (10, 50, 90, 100)}
            if mass.numel()
            else {},
            "codebooks_trained": bank.codebook_k is not None,
            "residual_updates": int(bank.n_res.sum()),
            "merged": bank.merged,
            "recycled": bank.recycled,
            "passes": bank.passes,
            # churn per bank row and pass (all passes): prototypes merged away, slots recycled
            "merged_per_row_pass": round(bank.merged / max(bank.passes * bank.rows, 1), 4),
            "recycled_per_row_pass": round(bank.recycled / max(bank.passes * bank.rows, 1), 4),
            "seeds_in_window": int((bank.seed_slot >= 0).sum()),
            "last_pass": {k: int(v) if isinstance(v, torch.Tensor) else v for k, v in self._last.items()},
        }
