"""The policy interface: a pure ``compress(views, keep) -> Selection`` over per-layer views of the visual
part of the KV cache, a scored core shared by the selection policies, opt-in protocols for what only some
policies do, and a registry by name.

Policies know nothing of models or of the UI; they see keys, values and provenance, and return, per
layer and KV head, the sorted indices of the tokens to keep.

- :class:`Policy`: the contract. ``compress(views, keep) -> Selection``; its parameters (a dataclass of the
  paper's defaults); ``report()`` for the run report; ``views(context, layer, head)`` for the views it
  declares (:mod:`kvdemo.views`, drawn by :mod:`kvdemo.viz`; nothing by default).
- :class:`ScoredPolicy`: a policy that scores tokens. It returns one :class:`Ranking` per layer (a
  priority and a reason per token, optionally a per-head count) and the one shared top-k
  (:func:`select_ranked`) turns rankings into a :class:`Selection` (in the spirit of kvpress's ``ScorerPress``).
- Opt-in protocols: :class:`SummaryRegion` (the policy owns synthetic entries in the memory's summary
  region and is sized by ``M`` alone), :class:`Probed` (the engine runs a probe text after the memory before
  each compression and passes its queries in the views).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..tensors import move_tensors
from ..timing import PhaseTimer  # noqa: F401 (policies time their phases with it)
from ..views import View, ViewContext


@dataclass
class LayerView:
    """What a policy sees of one layer's visual tokens.

    keys, values: ``[H_kv, L, D]`` post-RoPE, exactly as cached (views of the memory's buffers).
    frame, row, col: ``[H_kv, L]`` provenance of each token: the temporal grid it came from (a pair of
    sampled frames; called "frame" as in the papers) and its merged-patch row and column.
    order: ``[H_kv, L]`` arrival number of each token in the stream (larger = newer). The memory compacts
    in place, so slots are *not* in stream order; ``None`` (hand-made views) means slot order.
    position: ``[H_kv, L, 3]`` the 3-D M-RoPE position each key was rotated at (None if unknown).
    valid: ``[H_kv, L]`` bool when heads hold different numbers of tokens (ragged), else None.
    rotary: the model's rotation (``rotate(x, position)`` / ``unrotate(x, position)``), for policies that
    need keys before RoPE; None when the caller has no model.
    summary_slots: size of the memory's summary region the policy owns (see :meth:`Policy.summary_slots`).
    probe: ``[H_q, T, D]`` post-RoPE queries of a probe text run after the memory (for a
    :class:`Probed` policy, e.g. HybridKV's text-centric head classification); query head ``h`` reads KV head
    ``h // (H_q / H_kv)``.
    offloaded: ``[H_kv]`` tokens each head keeps in the memory's offload store (retrievable while answering);
    None when the layer has no store.
    grid_text: ``[H_kv, grids]`` stream-text slots each head holds per temporal grid (Qwen3-VL's timestamps and
    delimiters), None when the stream carries no text. They are not in the view; they stay while a head keeps
    at least one visual token of their grid, and count against the budget: keeping the first token of a grid
    costs ``1 + grid_text`` (:func:`select_with_text`).
    """

    layer: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    frame: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    grid: tuple[int, int]
    newest_frame: int
    order: torch.Tensor | None = None
    position: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    rotary: Any = None
    summary_slots: int = 0
    probe: torch.Tensor | None = None
    offloaded: torch.Tensor | None = None
    grid_text: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.order is None:
            self.order = torch.arange(self.keys.shape[1], device=self.keys.device).expand(self.keys.shape[0], -1)

    @property
    def num_heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[0] * self.grid[1]


@dataclass
class SummaryUpdate:
    """A policy's synthetic entries for one layer's summary region (ProtoKV's pseudo-tokens).

    keys, values: ``[H_kv, U, D]`` post-RoPE, as attention reads them, written at ``slots [H_kv, U]`` of the
    region (all ``S`` slots in order when ``slots`` is None); bias: ``[H_kv, S]`` additive key bias of every
    slot (``-inf`` hides an unused one).
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    slots: torch.Tensor | None = None


@dataclass
class OffloadUpdate:
    """One layer's tokens to move to the offload store, and what each head retrieves at decode time.

    tokens: ``[H_kv, E]`` indices into the layer's view (arrival order), ``valid [H_kv, E]`` which count;
    they are stored in chunks of ``chunk`` tokens per head with a resident mean-key index.
    retrieve: ``[H_kv]`` visual tokens each head brings back per decode step (0: it does not retrieve).
    counted: whether those retrieved tokens count toward the budget ``M`` (the memory's visual tokens include
    them, so a head's query-time context, resident + retrieved, stays within what the budget bounds) or come on
    top of it.
    """

    tokens: torch.Tensor
    valid: torch.Tensor
    retrieve: torch.Tensor
    chunk: int = 8
    counted: bool = False


@dataclass
class Selection:
    """Per layer, ``LongTensor [H_kv, keep]`` of sorted indices into that layer's view.

    ``valid`` (optional, per layer ``[H_kv, keep]`` bool) marks the entries that count when heads keep
    different numbers of tokens (ragged budgets); ``summary`` (optional, per layer) refreshes the memory's
    summary region; ``offload`` (optional, per layer) moves evicted tokens to the memory's offload store
    instead of dropping them, and sets what each head retrieves from it at decode time; ``uncompressed``
    lists the layers this pass left whole (every index kept): they do not count toward ``M`` (CoRDS'
    ``above=keep``), so the engine does not compress again because of them.
    """

    indices: list[torch.Tensor]
    #: Optional per-layer extras a policy reports for explanation (e.g. why each kept token was kept).
    info: dict[str, Any] = field(default_factory=dict)
    valid: list[torch.Tensor] | None = None
    summary: list[SummaryUpdate | None] | None = None
    offload: list[OffloadUpdate | None] | None = None
    uncompressed: tuple[int, ...] = ()


class BudgetError(ValueError):
    """An impossible budget (the message says which numbers and why)."""


@dataclass
class Policy(abc.ABC):
    """Base of every policy: a dataclass of its paper's parameters, registered by ``name``."""

    name: ClassVar[str] = ""
    #: False for ``full``: the engine never compresses.
    bounded: ClassVar[bool] = True
    #: One line for CLI and UI help.
    summary: ClassVar[str] = ""
    #: Per-parameter help texts (field name -> text) for the CLI and UI.
    help: ClassVar[dict[str, str]] = {}
    #: Allowed values of text parameters (field name -> choices), for the CLI and UI.
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Reason codes this policy reports per kept token in ``Selection.info["reason"]`` (code -> name).
    reason_names: ClassVar[dict[int, str]] = {}
    #: Titles of the views :meth:`views` may return (the app makes room for as many as any policy declares).
    view_titles: ClassVar[tuple[str, ...]] = ()
    #: What ``python -m kvdemo bench`` should measure about this policy beyond its pass (names in
    #: :data:`kvdemo.bench.policies.BENCHMARKS`), and parameter variants its pass is also timed with.
    benchmarks: ClassVar[tuple[str, ...]] = ()
    bench_variants: ClassVar[dict[str, dict[str, Any]]] = {}

    @abc.abstractmethod
    def compress(self, views: list[LayerView], keep: int) -> Selection:
        """Choose ``keep`` tokens per layer and KV head from ``views`` (one per layer)."""

    @classmethod
    def takes_keep(cls) -> bool:
        """Whether the budget has a ``C`` (a bounded policy that is not sized by ``M`` alone)."""
        return cls.bounded and not issubclass(cls, SummaryRegion)

    def params(self) -> dict[str, Any]:
        """The policy's parameters (its own state, fields starting with ``_``, left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}

    def report(self) -> dict[str, Any]:
        """What the policy's own state looks like now (for the run report); ``{}`` for a stateless policy."""
        return {}

    def views(self, context: ViewContext, layer: int, head: int) -> list[View]:
        """The policy's own views of its state for one layer and KV head (titles from :attr:`view_titles`);
        none by default."""
        return []

    def to(self, device: torch.device | str) -> "Policy":
        """Move the policy's own state (its ``_``-fields: tensors, and dataclasses/containers of them) to
        ``device``; returns self."""
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                setattr(self, f.name, move_tensors(getattr(self, f.name), device))
        return self


# --- the scored core -------------------------------------------------------------------------------


@dataclass
class Ranking:
    """One layer's scores: ``priority [H, L]`` (higher is kept first; exact ties go to the newer token),
    ``reason [H, L]`` int8 code of each token, and ``keep``: the tokens each head keeps (``None``: the pass's
    ``keep``; an int; or ``[H]`` per head, a ragged selection)."""

    priority: torch.Tensor
    reason: torch.Tensor
    keep: int | torch.Tensor | None = None


class ScoredPolicy(Policy):
    """A policy that scores every token; the shared top-k (:func:`select_ranked`) keeps the best."""

    @abc.abstractmethod
    def rank(self, views: list[LayerView], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        """One :class:`Ranking` per layer (layers may share one object) and the pass's explanation
        (``Selection.info``)."""

    def compress(self, views: list[LayerView], keep: int) -> Selection:
        """Rank, then the shared top-k; ``info["phase_ms"]`` splits the time (the phases ``rank`` reports in its
        own ``phase_ms``, else all of it as ``scoring``; the top-k is ``selection``)."""
        timer = PhaseTimer()
        device = views[0].keys.device if views else None
        with timer.phase("rank", device):
            rankings, info = self.rank(views, keep)
        phases = dict(info.pop("phase_ms", None) or {"scoring": timer.ms["rank"]})
        with timer.phase("selection", device):
            selection, _ = select_ranked(views, rankings, keep, info)
        phases["selection"] = phases.get("selection", 0.0) + timer.ms["selection"]
        selection.info["phase_ms"] = phases
        return selection


def select_ranked(
    views: list[LayerView], rankings: list[Ranking], keep: int, info: dict[str, Any] | None = None
) -> tuple[Selection, list[torch.Tensor]]:
    """The shared top-k: per layer, the ``keep`` tokens of highest priority per head (ties to the newer
    token), as sorted indices with their reasons in ``info["reason"]``; a ranking with a per-head ``keep``
    gives a ragged selection (indices padded to the largest count, ``valid`` marking the real ones).
    Layers sharing a ranking object are ranked once; layers of equal length are ranked together as one
    ``[layers * H, L]`` batch (per device, when a model's layers sit on several). Returns the selection and each
    layer's kept mask ``[H, L]``."""
    info = dict(info or {})
    unique: dict[int, int] = {}
    for layer, ranking in enumerate(rankings):
        unique.setdefault(id(ranking), layer)
    kept: dict[int, torch.Tensor] = {}
    batches: dict[tuple[int, int, torch.device], list[int]] = {}
    for first in unique.values():
        ranking = rankings[first]
        count = keep if ranking.keep is None else ranking.keep
        view = views[first]
        if view.grid_text is not None:
            kept[first] = select_with_text(ranking.priority, count, view.order, view.frame, view.grid_text)
        elif isinstance(count, torch.Tensor) and count.numel() > 1:
            kept[first] = top_k_mask(ranking.priority, count, view.order)
        else:
            batches.setdefault((view.length, int(count), ranking.priority.device), []).append(first)
    for (length, count, _), members in batches.items():
        priority = torch.cat([rankings[m].priority for m in members])
        order = torch.cat([views[m].order.to(priority.device) for m in members])
        masks = top_k_mask(priority, min(count, length), order).chunk(len(members))
        kept.update(zip(members, masks))
    indices, valids, reasons = [], [], []
    ragged = False
    done: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for ranking in rankings:
        first = unique[id(ranking)]
        if first not in done:  # layers sharing a ranking share its (read-only) indices
            index, valid = kept_indices(kept[first])
            done[first] = index, valid, torch.gather(ranking.reason, 1, index)
        index, valid, reason = done[first]
        ragged |= not bool(valid.all())
        indices.append(index)
        valids.append(valid)
        reasons.append(reason)
    info["reason"] = reasons
    selection = Selection(indices, info, valid=valids if ragged else None)
    return selection, [kept[unique[id(r)]] for r in rankings]


def kept_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A kept mask ``[H, L]`` as ascending indices ``[H, width]`` (``width`` the largest count) and ``valid
    [H, width]``; a row keeping fewer is padded with index 0, marked invalid. Rows keeping the same count (the
    usual case) are one ``nonzero``; ragged rows are sorted."""
    heads, length = mask.shape
    counts = mask.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    if heads and bool((counts == width).all()):
        return mask_to_indices(mask), torch.ones(heads, width, dtype=torch.bool, device=mask.device)
    slots = torch.arange(length, device=mask.device)
    index = torch.sort(torch.where(mask, slots, length), dim=1).values[:, :width]
    valid = index < length
    return index.masked_fill(~valid, 0), valid


# --- opt-in protocols --------------------------------------------------------------------------------


class SummaryRegion(abc.ABC):
    """A policy that owns synthetic entries in the memory's summary region (ProtoKV's pseudo-tokens). It is
    sized by ``M`` alone: ``M`` = its summary slots + the real visual tokens it holds exactly; each
    compression keeps the newest real tokens that leave room for the incoming chunk
    (:meth:`kvdemo.budget.Budget.keep_for`). The split may depend on the chunk size, which the budget learns when
    chunks are sized (:meth:`kvdemo.budget.Budget.fit_chunk`)."""

    @abc.abstractmethod
    def summary_slots(self, budget: int, chunk: int = 0) -> int:
        """Slots of the memory's summary region this policy owns under budget ``M`` for chunks of ``chunk`` visual
        tokens (0 = not known yet); raises :class:`BudgetError` when ``M`` cannot be split as the policy needs."""

    def describe_split(self, budget: int, chunk: int = 0) -> str:
        """``M``'s split in words (for the settings line and messages)."""
        slots = self.summary_slots(budget, chunk)
        return f"{budget - slots} exact tokens + {slots} summary slots"

    @abc.abstractmethod
    def synthesize_all(self, rotary: Any, heads: int) -> None:
        """Recompute every summary entry at once (what synthesising at read time would cost: the benchmark
        times it; the policy itself refreshes only what a chunk changed)."""

    def summarised(self, context: ViewContext, layer: int, head: int) -> np.ndarray | None:
        """``[grids, rows, cols]`` bool: the patches the summary still represents (whether or not they are
        also held exactly), for the views; None when nothing is summarised yet."""
        return None


class Probed(abc.ABC):
    """A policy that reads the memory with a probe: before each compression the engine asks
    :attr:`probe_text` after the memory (uncommitted) and passes each layer's queries as ``LayerView.probe``."""

    #: The text the memory is probed with (a proxy for a question).
    probe_text: ClassVar[str] = ""

    @property
    def compresses_on_question(self) -> bool:
        """True when a question first runs one more pass with itself as the probe (it changes the memory);
        answering alone never does."""
        return False


@dataclass(frozen=True)
class ParamSpec:
    """One policy parameter as a form field: name, default, kind (bool/float/int/choice/numbers), help."""

    name: str
    default: Any
    kind: str
    help: str = ""
    choices: tuple[str, ...] = ()


def policy_params(name: str) -> list[ParamSpec]:
    """The parameters of a registered policy, with their paper defaults and help texts."""
    cls = policy_class(name)
    specs = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        default = f.default
        if f.name in cls.choices:
            kind = "choice"
        elif isinstance(default, bool):
            kind = "bool"
        elif isinstance(default, int):
            kind = "int"
        elif isinstance(default, float):
            kind = "float"
        else:
            kind = "numbers"  # an optional list of numbers (e.g. CV thresholds)
        specs.append(ParamSpec(f.name, default, kind, cls.help.get(f.name, ""), tuple(cls.choices.get(f.name, ()))))
    return specs


REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available by ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return list(REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The registered policy class called ``name`` (:class:`BudgetError` naming the choices if none is)."""
    if name not in REGISTRY:
        raise BudgetError(f"unknown policy {name!r}; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def coerce_param(policy: str, spec: ParamSpec, value: Any) -> Any:
    """``value`` as parameter ``spec`` of ``policy`` takes it (a number from text, a list of numbers from
    "0.1, 0.2"; blank numbers mean "none"); :class:`BudgetError` naming the parameter if it cannot be."""
    try:
        if spec.kind == "numbers":
            if value is None or isinstance(value, (list, tuple)):
                return None if value is None else [float(x) for x in value]
            text = str(value).strip().strip("[]()")
            return [float(x) for x in text.replace(";", ",").split(",") if x.strip()] if text else None
        if spec.kind == "bool":
            if isinstance(value, str):
                if value.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.strip().lower() in ("true", "1", "yes")
            return bool(value)
        if spec.kind == "int":
            number = float(value)
            if number != int(number):
                raise ValueError(value)
            return int(number)
        if spec.kind == "float":
            return float(value)
        value = str(value)
        if spec.choices and value not in spec.choices:
            raise BudgetError(f"{policy}'s {spec.name} must be one of {', '.join(spec.choices)}, got {value!r}")
        return value
    except (TypeError, ValueError, OverflowError):
        kind = {"numbers": "numbers separated by commas", "bool": "true or false"}.get(spec.kind, f"a number ({spec.kind})")
        raise BudgetError(f"{policy}'s {spec.name} takes {kind}, got {value!r}") from None


def make_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy with its defaults overridden by ``params`` (each coerced to the
    parameter's kind, so ``alpha="abc"`` is a one-line :class:`BudgetError`, not a crash later)."""
    specs = {spec.name: spec for spec in policy_params(policy_class(name).name)}
    unknown = set(params) - set(specs)
    if unknown:
        raise BudgetError(
            f"policy {name!r} has no parameter(s) {', '.join(sorted(unknown))}"
            + (f"; it takes: {', '.join(sorted(specs))}" if specs else "; it takes none")
        )
    return REGISTRY[name](**{key: coerce_param(name, specs[key], value) for key, value in params.items()})


# --- shared helpers --------------------------------------------------------------------------


def top_k_mask(scores: torch.Tensor, k: int | torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask ``[H, L]`` of the ``k`` highest ``scores [H, L]`` per row (``k`` an int or ``[H]`` per row).

    Exact ties go to the newer token (larger ``order [H, L]``, the tokens' arrival numbers; slot order when
    None): a ramp far below float32 resolution is added in float64, so the choice is deterministic and
    never reorders distinct scores.
    """
    heads, length = scores.shape
    key = scores.double() + tie_ramp(order, length, scores.device)
    mask = torch.zeros(heads, length, dtype=torch.bool, device=scores.device)
    if isinstance(k, torch.Tensor) and k.numel() > 1 and bool((k != k.flatten()[0]).any()):
        k = k.to(scores.device).clamp(0, length)
        order = torch.topk(key, int(k.max()), dim=-1, sorted=True).indices
        return mask.scatter_(1, order, torch.arange(order.shape[1], device=scores.device)[None] < k[:, None])
    k = min(int(k.flatten()[0]) if isinstance(k, torch.Tensor) else int(k), length)
    if k <= 0:
        return mask
    if 2 * k > length:  # cheaper to find the (distinct, thanks to the ramp) L - k lowest and keep the rest
        return mask.fill_(True).scatter_(1, torch.topk(key, length - k, dim=-1, largest=False, sorted=False).indices, False)
    return mask.scatter_(1, torch.topk(key, k, dim=-1, sorted=False).indices, True)


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
    budget = (keep.to(device).long() if isinstance(keep, torch.Tensor) else torch.full((heads,), int(keep), device=device))
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
    opened = torch.zeros(heads, grids + 1, dtype=torch.bool, device=device).scatter_(1, torch.where(prefix, grid, grids), True)
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


def mask_to_indices(mask: torch.Tensor) -> torch.Tensor:
    """A mask ``[H, L]`` with the same count per row -> ascending indices ``[H, count]``."""
    return torch.nonzero(mask, as_tuple=False)[:, 1].view(mask.shape[0], -1)


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
