"""``hybridkv``: HybridKV (paper 004) adapted to a stream: heads classified static or dynamic by text-centric
attention sparsity, top-down ragged budgets, text-prior pruning for static heads, and chunk-wise retrieval
from an offload store for dynamic heads at every decode step.

The paper compresses once, at prefill, with the user's prompt present. kvdemo's streaming protocol:

- **Probe** (kvdemo's). Each compression runs :attr:`HybridKV.probe_text` ("What happens in the video?") as a
  user turn after the memory, uncommitted, and reads every layer's queries (the engine does this; the
  policy sees them as ``LayerSlice.probe``). The system prompt is not a probe: its queries were computed
  before any frame and never attended to the video.
- **Classification (Sec. 3.1, Eq. 2-3).** Per layer, the probe's queries attend over the visual tokens
  (softmax over the visual context only: the prefix's attention sinks would otherwise dominate every row);
  each text row keeps its top-``k`` mass, ``k = ceil(top_k * L)`` (kvdemo's ``top_k = 0.05``, after the
  paper's cumulative-focus study with ``k = 0.05 C``); rows are averaged into ``S_(l,h)``. Under GQA a KV
  head's score is the mean over the query heads of its group (kvdemo's). Heads with ``S > cutoff`` are
  static, the others dynamic; ``cutoff`` is the ``theta``-quantile of all heads' scores (``cutoff=quantile``,
  kvdemo's reading of the paper's "quantile-based cutoff") or ``theta`` itself (``cutoff=score``, the
  reading of the paper's App. D). Re-classified at every compression. ``classify_with=question`` (off by
  default) also runs one pass when a question arrives, with the question itself as the probe (the paper's
  own setting: classification with the user's prompt present), before answering it; that pass changes the
  memory like any compression (it is on the timeline), so the question's answer and later chunks see the
  re-classified, re-budgeted heads. By default heads keep the classes of the last compression and
  answering leaves the memory bit-identical.
- **Top-down budgets (Sec. 3.2, Eq. 4-5).** ``M``/``C`` bound each layer's visual tokens averaged over its KV
  heads, so a compression gives a layer ``C * H_kv`` in all: ``B_dyn = r * C * N_dyn`` shared uniformly by
  dynamic heads, ``B_stat`` the rest, each static head ``alpha * B_stat / N_stat + (1 - alpha) * B_stat *
  S_h / sum S`` (kvdemo's ``alpha = 0.5``; the paper gives none). A head cannot keep more than it holds: the
  excess goes to the other heads of the layer in proportion to their room (kvdemo's), so budgets always sum
  to the total. Budgets are not padded to powers of two: that is a CUDA-kernel constraint of the paper's
  implementation, and kvdemo's attention masks padding instead.
- **Static heads (Sec. 3.3, App. A).** Text-prior pruning: the probe rows' attention summed per visual token
  (SnapKV-style), averaged over each token's held spatial neighbours (kernel ``pool_kernel``, kvdemo's 3),
  after the newest ``local_ratio`` of the head's budget (the paper's "local" tokens; kvdemo's 0.125).
- **Dynamic heads (App. A).** They keep their newest tokens resident (what new chunks' prefill attends to,
  kvdemo's streaming choice) and move the rest to the memory's offload store in chunks of ``chunk`` tokens
  with a resident mean-key index. While a question is answered (its prefill, kvdemo's addition: the
  paper's prefill saw the whole context, and every decode step), inside the attention function, each
  dynamic head scores its chunks with the forward's query and attends to its top chunks together with its
  resident tokens (:mod:`kvdemo.cache.attention`). New chunks' prefill during the stream attends to the resident
  tokens only.
- **Query-time accounting.** The paper's retrieval fills a GPU buffer allocated from the head's budget: what a
  dynamic head attends to while decoding is bounded by its budget. ``accounting=budget`` (the default) keeps
  that: a dynamic head with budget ``B`` keeps ``B - R`` tokens resident and retrieves at most ``R`` (whole
  chunks), ``R = floor(retrieve_share * B / chunk) * chunk``, so resident + retrieved <= ``B`` and the memory
  counts the ``R`` toward ``M`` (the engine compresses when resident + retrievable would pass ``M``): ``M``
  bounds the query-time context. The split is kvdemo's (the paper offloads a dynamic head entirely after its
  one prefill and retrieves its whole budget; a stream needs resident tokens for the next chunk's prefill):
  ``retrieve_share = 0.5`` by default. ``accounting=resident`` is the other reading: the budget bounds
  the resident tokens and retrieval adds up to ``B`` more, so a dynamic head attends to up to ``2 B`` and ``M``
  bounds only what is held between questions. The report and the head map give each head's resident,
  retrievable and query-time tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..devices.timing import PhaseTimer
from ..errors import PolicyParameterError
from ..views import CellGrid, Chart, View, ViewContext
from .contract import LayerSlice, OffloadUpdate, Policy, Probed, Selection, SliceStack, padded_stacks
from .grid import frame_rank, pool_on_grid
from .registry import BenchDeclaration, PolicyCard, param, register
from .topk import Ranking, in_layer_order, layer_lengths, select_ranked, top_k_mask, top_k_mass, valid_counts

REASON_LOCAL, REASON_SALIENT, REASON_RESIDENT = 0, 1, 2
REASON_NAMES = {
    REASON_LOCAL: "static: local (newest)",
    REASON_SALIENT: "static: text-prior salient",
    REASON_RESIDENT: "dynamic: resident (newest)",
}
CUTOFFS = ("quantile", "score")
CLASSIFY_WITH = ("probe", "question")
ACCOUNTINGS = ("budget", "resident")


def capped_allocation(desired: torch.Tensor, cap: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Integer budgets ``[R, H]`` near ``desired`` (float ``[R, H]``), each ``<= cap [R, H]``, summing to
    ``total [R]`` per row (``<= cap`` summed): clamp, give the shortfall to heads with room in proportion to
    their room, then hand out the rounding remainder one token at a time by largest fraction."""
    alloc = torch.minimum(desired.clamp_min(0), cap.double())
    room = cap.double() - alloc
    short = (total.double() - alloc.sum(dim=1)).clamp_min(0)
    alloc = alloc + room * (short / room.sum(dim=1).clamp_min(1e-12))[:, None]
    base = torch.minimum(alloc.floor(), cap.double())
    remainder = (total.double() - base.sum(dim=1)).round().long()  # < H per row
    fraction = torch.where(base < cap, alloc - base, torch.full_like(alloc, -1.0))
    extra = top_k_mask(fraction, remainder.clamp_min(0))
    return (base.long() + extra.long()).clamp(max=cap)


CARD = PolicyCard(
    "Heads classified static/dynamic by text-centric sparsity; static heads pruned, dynamic heads retrieve chunks "
    "while decoding.",
    reasons=REASON_NAMES,
    view_titles=("Head types",),
    bench=BenchDeclaration(benchmarks=("decode",), host_reads=16),
)


@register(CARD)
@dataclass
class HybridKV(Policy, Probed):
    """Static heads pruned by text-prior attention, dynamic heads retrieving chunks at decode time."""

    name = "hybridkv"
    #: The proxy instruction each compression probes the memory with (see the module docstring).
    probe_text: ClassVar[str] = "What happens in the video?"

    theta: float = param(
        0.9,
        "classification cutoff: heads with sparsity above it are static (a quantile, or a score; see cutoff)",
        within="[0, 1]",
    )
    cutoff: str = param(
        "quantile",
        "quantile: theta is a quantile of all heads' scores; score: theta is the score itself",
        choices=CUTOFFS,
    )
    share: float = param(0.75, "r: each dynamic head gets r x C (the rest goes to static heads)", within="[0, inf)")
    alpha: float = param(
        0.5, "static heads: share of their budget split evenly (the rest in proportion to sparsity)", within="[0, 1]"
    )
    top_k: float = param(
        0.05, "fraction of the visual tokens whose attention mass makes a row's sparsity", within="[0, 1]"
    )
    local_ratio: float = param(0.125, "static heads: share of their budget kept for the newest tokens", within="[0, 1]")
    pool_kernel: int = param(
        3, "static heads: spatial pooling kernel of the text-prior scores, odd (1 = none)", within="[1, inf)"
    )
    chunk: int = param(8, "dynamic heads: tokens per offloaded chunk (one mean key each)", within="[1, inf)")
    classify_with: str = param(
        "probe",
        "probe: classify at each compression with the proxy probe; question: also run "
        "a pass with the question itself as the probe when one arrives (changes the "
        "memory)",
        choices=CLASSIFY_WITH,
    )
    accounting: str = param(
        "budget",
        "budget: a dynamic head's resident + retrieved tokens fit its budget (the "
        "paper's; M bounds what a question attends to); resident: the budget bounds "
        "resident tokens, retrieval adds up to as many",
        choices=ACCOUNTINGS,
    )
    retrieve_share: float = param(
        0.5,
        "accounting=budget: share of a dynamic head's budget kept free for chunks "
        "retrieved while answering (whole chunks; the rest stays resident)",
        within="[0, 1]",
    )
    _last: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.pool_kernel % 2 == 0:
            raise PolicyParameterError(
                f"hybridkv's pool_kernel must be odd (a kernel centred on its patch), got {self.pool_kernel}"
            )

    @property
    def compresses_on_question(self) -> bool:
        return self.classify_with == "question"

    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        """One pass over every layer at once: each device's layers are one stack padded to its longest layer
        (:func:`~.contract.padded_stacks`; the pass's launches do not grow with the layers)."""
        if any(layer_slice.probe is None for layer_slice in slices):
            raise ValueError("HybridKV needs probe queries in its slices (use StreamEngine, which runs the probe)")
        home = slices[0].keys.device
        timer = PhaseTimer()
        stacks = padded_stacks(slices)
        # The policy's own arithmetic, the probe's queries over every key, timed as two phases: the products, and the
        # softmax, top-k mass and pooling of what they give.
        scores, priors = zip(*(self.text_centric(stack, timer) for stack in stacks))
        with timer.phase("budgets", home):
            # The classification and budgets need every layer's [H] scores together: only those small vectors move
            # to the first layer's device (a model split over devices keeps each layer's tokens where they are).
            order = in_layer_order([stack.layers for stack in stacks], home)

            def every_layer(parts: list[torch.Tensor]) -> torch.Tensor:  # [layers, H], layer by layer
                joined = torch.cat([part.to(home) for part in parts])
                return joined if order is None else joined.index_select(0, order)

            sparsity = every_layer(list(scores))
            static = sparsity > self.threshold(sparsity)
            held = every_layer([valid_counts(stack) for stack in stacks])
            offloaded = every_layer(
                [torch.zeros_like(valid_counts(st)) if st.offloaded is None else st.offloaded for st in stacks]
            )
            # What a head can be given: what it holds, plus (a dynamic head whose retrieval counts) what it can retrieve.
            cap = held + offloaded if self.accounting == "budget" else held
            budgets = self.budgets(sparsity, static, torch.where(static, held, cap), keep)
            resident, retrieve = self.split(static, budgets, held)
        with timer.phase("selection", home):
            picks = [torch.tensor(stack.layers, device=home) for stack in stacks]
            rankings = [
                self.rank_stack(stack, prior, static.index_select(0, pick), resident.index_select(0, pick))
                for stack, prior, pick in zip(stacks, priors, picks)
            ]
            info = {
                "static": static,
                "budget": budgets,
                "sparsity": sparsity,
                "resident": resident,
                "retrieve": retrieve,
            }
            selection, kept = select_ranked(slices, rankings, keep, info)
        with timer.phase("offload plan", home):
            selection.offload = [
                self.offload(stack, mask, static.index_select(0, pick), retrieve.index_select(0, pick))
                for stack, mask, pick in zip(stacks, kept, picks)
            ]
        selection.info["phase_ms"] = timer.ms
        if selection.valid is None:  # every head kept as many tokens: still say which entries count
            every = torch.ones_like(selection.indices[0], dtype=torch.bool)
            selection.valid = [every for _ in selection.indices]
        # What the report and the views read, back on the host in one read.
        table = torch.stack(
            [static.double(), sparsity.double(), budgets.double(), resident.double(), retrieve.double()]
        )
        table = torch.cat([table.flatten(), self.threshold(sparsity).double().reshape(1)]).cpu()
        state = table[:-1].view(5, *static.shape)
        self._last = {
            "static": state[0].bool(),
            "sparsity": state[1].float(),
            "budget": state[2].long(),
            "resident": state[3].long(),
            "retrieve": state[4].long(),
            "cutoff": float(table[-1].float()),
        }
        return selection

    def split(
        self, static: torch.Tensor, budget: torch.Tensor, held: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's ``budget [layers, H]`` as ``(resident, retrieve)`` tokens (see "Query-time accounting" in the
        module docstring): static heads keep their budget resident and retrieve nothing; a dynamic head retrieves
        ``R = floor(retrieve_share * B / chunk) * chunk`` (more if it holds fewer than ``B - R``: ``R = B - held``)
        and keeps ``B - R`` (``accounting=budget``), or keeps ``B`` and retrieves ``B`` (``accounting=resident``)."""
        if self.accounting == "resident":
            return budget, torch.where(static, 0, budget)
        share = torch.floor(self.retrieve_share * budget.double() / self.chunk).long() * self.chunk
        retrieve = torch.where(
            static, 0, torch.maximum(share, budget - held.to(budget.device)).clamp(min=0).minimum(budget)
        )
        return budget - retrieve, retrieve

    # --- Sec. 3.1 ---------------------------------------------------------------------------
    def text_centric(self, stack: SliceStack, timer: PhaseTimer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 2-3 for the layers of ``stack`` at once: sparsity ``S [G, H]`` and the static-head prior ``[G * H,
        L]`` (the probe rows' attention summed per token, spatially pooled). ``timer``: adds the time to the phases
        ``probe products`` and ``probe softmax + mass``."""
        layers, heads, length, dim = stack.keys.shape
        device = stack.keys.device
        timer = timer or PhaseTimer()
        with timer.phase("probe products", device):
            # The query heads of a KV head's group stacked as its rows: [G * H, group * T, D].
            rows = stack.probe.to(device).reshape(layers * heads, -1, dim)
            keys = stack.keys.reshape(layers * heads, length, dim).float()
            logits = torch.matmul(rows.float(), keys.transpose(1, 2))  # [G * H, rows, L]
        with timer.phase("probe softmax + mass", device):
            return self._classify_rows(stack, logits.mul_(dim**-0.5))

    def _classify_rows(self, stack: SliceStack, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`text_centric` from the scaled logits ``[G * H, rows, L]`` (overwritten)."""
        layers, heads, length = stack.frame.shape
        valid = stack.rows("valid")
        if valid is not None:
            logits.masked_fill_(~valid[:, None, :], float("-inf"))
        attention = torch.softmax(logits, dim=-1)
        prior = attention.sum(dim=1)  # [G * H, L]
        held = valid_counts(stack)  # [G, H]
        lengths = layer_lengths(stack)  # [G]: each layer's own slots (the rest pads it to the stack's length)
        top = torch.ceil(self.top_k * held.max(dim=1).values.float())
        k = [max(1, int(t)) for t in top.tolist()]  # one read for every layer
        mass = top_k_mass(attention.view(layers, -1, length), [min(a, b) for a, b in zip(k, lengths)], lengths)
        sparsity = mass.view(layers, heads, -1).mean(-1)  # [G, H]
        if self.pool_kernel > 1:
            frame = stack.rows("frame")
            rank, _ = frame_rank(frame)
            pos = stack.rows("row").long() * stack.first.grid[1] + stack.rows("col").long()
            if min(lengths) < length:  # padding slots (no grid cell) pool among themselves, in a frame of their own
                inside = torch.arange(length, device=frame.device) < torch.tensor(lengths, device=frame.device)[:, None]
                inside = inside.repeat_interleave(heads, dim=0)
                rank, pos = torch.where(inside, rank, rank.max() + 1), torch.where(inside, pos, 0)
            prior = pool_on_grid(prior, rank, pos, stack.first.grid, self.pool_kernel)
        return sparsity, prior

    def threshold(self, sparsity: torch.Tensor) -> torch.Tensor:
        """The static/dynamic cutoff over all heads' scores ``[layers, H]``."""
        if self.cutoff == "score":
            return sparsity.new_tensor(self.theta)
        return torch.quantile(sparsity.double().flatten(), self.theta).to(sparsity.dtype)

    # --- Sec. 3.2 ---------------------------------------------------------------------------
    def budgets(self, sparsity: torch.Tensor, static: torch.Tensor, held: torch.Tensor, keep: int) -> torch.Tensor:
        """Eq. 4-5 per layer: integer budgets ``[layers, H]`` summing to ``keep * H`` (capped by what each
        head holds, see :func:`capped_allocation`)."""
        layers, heads = sparsity.shape
        total = torch.full((layers,), keep * heads, dtype=torch.long, device=sparsity.device)
        n_dyn = (~static).sum(dim=1, keepdim=True).double()
        n_stat = static.sum(dim=1, keepdim=True).double()
        b_dyn = torch.floor(self.share * keep * n_dyn)  # [layers, 1]
        b_stat = (keep * heads - b_dyn).clamp_min(0)
        score = torch.where(static, sparsity.double(), 0.0)
        weight = score / score.sum(dim=1, keepdim=True).clamp_min(1e-12)  # L1-normalised over static heads
        static_budget = self.alpha * b_stat / n_stat.clamp_min(1) + (1 - self.alpha) * b_stat * weight
        dynamic_budget = (b_dyn / n_dyn.clamp_min(1)).expand(-1, heads)
        desired = torch.where(static, static_budget, dynamic_budget)  # Eq. 4-5 floor; the remainder goes by fraction
        return capped_allocation(desired, held.to(desired.device), total)

    # --- Sec. 3.3 ---------------------------------------------------------------------------
    def rank_stack(self, stack: SliceStack, prior: torch.Tensor, static: torch.Tensor, budget: torch.Tensor) -> Ranking:
        """The ranking of ``stack``'s layers keeping ``budget [G, H]`` tokens per head (the resident share of each
        head's budget): static heads keep the newest ``local_ratio`` of it, then the probe's most attended tokens;
        dynamic heads their newest tokens. Padding last."""
        layers, heads, length = stack.frame.shape
        device = stack.keys.device
        budget, static = budget.to(device).flatten(), static.to(device).flatten()
        valid = stack.rows("valid")
        if valid is None:
            valid = torch.ones(layers * heads, length, dtype=torch.bool, device=device)
        order = torch.where(valid, stack.rows("order"), -1)  # padding is older than anything
        # Each token's place from the newest (0 = newest): the inverse of the sort, by one scatter instead of a second sort.
        newest_first = torch.argsort(order, dim=1, descending=True)
        slots = torch.arange(length, device=device).expand(layers * heads, -1)
        newest_rank = torch.empty_like(newest_first).scatter_(1, newest_first, slots)
        local = newest_rank < torch.ceil(self.local_ratio * budget.double()).long()[:, None]
        # Each layer's own slots (past them the stack pads it) set the salience's range and the recency's scale.
        span = torch.tensor(layer_lengths(stack), device=device).repeat_interleave(heads)  # [G * H]
        inside = slots < span[:, None]
        lo = torch.where(inside, prior, float("inf")).min(dim=1, keepdim=True).values
        hi = torch.where(inside, prior, float("-inf")).max(dim=1, keepdim=True).values
        salience = (prior - lo) / (hi - lo).clamp_min(1e-12)  # [0, 1]
        recency = 1.0 - newest_rank.double() / span.clamp_min(1).double()[:, None]
        priority = torch.where(static[:, None], local.double() * 2 + salience.double(), recency)
        reason = torch.where(static[:, None], torch.where(local, REASON_LOCAL, REASON_SALIENT), REASON_RESIDENT)
        return Ranking(priority.masked_fill(~valid, -1.0), reason.to(torch.int8), stack.layers, keep=budget)

    def offload(
        self, stack: SliceStack, kept: torch.Tensor, static: torch.Tensor, retrieve: torch.Tensor
    ) -> OffloadUpdate:
        """Dynamic heads of ``stack``'s layers move what they evict (``kept [G * H, L]`` the selection's mask) to the
        offload store (arrival order) and retrieve up to ``retrieve [G, H]`` tokens while answering; static heads drop
        what they evict."""
        layers, heads, length = stack.frame.shape
        device = stack.keys.device
        static, retrieve = static.to(device), retrieve.to(device)
        valid = stack.rows("valid")
        if valid is None:
            valid = torch.ones(layers * heads, length, dtype=torch.bool, device=device)
        evicted = valid & ~kept & ~static.flatten()[:, None]
        count = evicted.sum(dim=1)
        arrival = torch.where(evicted, stack.rows("order").long(), torch.iinfo(torch.int64).max)
        width = int(count.max()) if count.numel() else 0  # one read for the stack
        tokens = torch.argsort(arrival, dim=1)[:, :width]
        token_valid = torch.arange(width, device=device)[None] < count[:, None]
        return OffloadUpdate(
            layers=stack.layers,
            tokens=tokens.view(layers, heads, width),
            valid=token_valid.view(layers, heads, width),
            retrieve=torch.where(static, 0, retrieve),
            chunk=self.chunk,
            counted=self.accounting == "budget",
        )

    # --- what it shows ----------------------------------------------------------------------
    def views(self, context: ViewContext, layer: int, head: int) -> list[View]:
        """The layers x KV heads map of the last pass (static / dynamic), each cell's query-time context written in
        (resident + retrievable tokens; the hover splits it and gives the budget)."""
        if not self._last:
            return []
        static, budget, sparsity, resident, retrieve = (
            self._last[key].numpy() for key in ("static", "budget", "sparsity", "resident", "retrieve")
        )
        context_tokens = resident + retrieve
        layers, heads = static.shape
        hover = [
            [
                f"layer {l}, KV head {h}: {'static' if static[l, h] else 'dynamic'}, budget {int(budget[l, h])}: "
                f"{int(resident[l, h])} resident + up to {int(retrieve[l, h])} retrieved while answering = "
                f"{int(context_tokens[l, h])}, sparsity {float(sparsity[l, h]):.3f}"
                for h in range(heads)
            ]
            for l in range(layers)
        ]
        grid = CellGrid(
            classes=static.astype(int),
            class_names={1: "static", 0: "dynamic"},
            numbers=context_tokens,
            hover=hover,
            row_names=[f"L{l}" for l in range(layers)],
            col_names=[f"head {h}" for h in range(heads)],
        )
        bound = (
            "within each head's budget"
            if self.accounting == "budget"
            else "a dynamic head's retrieval comes on top of its budget"
        )
        caption = (
            f"static ({int(static.sum())}: pruned by the probe's attention), dynamic ({int((~static).sum())}: newest "
            f"tokens resident, the rest offloaded and retrieved while answering); numbers are the visual tokens each "
            f"head attends to while answering, resident + retrieved ({bound}; accounting={self.accounting}); "
            f"cutoff {float(self._last['cutoff']):.3f}."
        )
        return [Chart("Head types", caption, [grid])]

    def report(self) -> dict[str, Any]:
        if not self._last:
            return {"classified": False}
        static, budget, resident, retrieve = (self._last[key] for key in ("static", "budget", "resident", "retrieve"))
        context_tokens = resident + retrieve
        return {
            "classified": True,
            "cutoff": self._last["cutoff"],
            "static_heads": int(static.sum()),
            "dynamic_heads": int((~static).sum()),
            "head_class": [["static" if s else "dynamic" for s in row] for row in static.tolist()],
            "budget": budget.tolist(),
            "sparsity": [[round(x, 4) for x in row] for row in self._last["sparsity"].tolist()],
            "accounting": self.accounting,
            "resident": resident.tolist(),
            "retrieve": retrieve.tolist(),
            "query_context": context_tokens.tolist(),
            "query_context_tokens": round(float(context_tokens.double().mean(dim=1).max())),
        }
