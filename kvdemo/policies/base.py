"""The policy interface: a pure ``compress(views, keep) -> Selection`` over per-layer views of the
visual part of the KV cache, and a registry by name.

Policies know nothing of models or of the UI; they see keys, values and provenance, and return, per
layer and KV head, the sorted indices of the tokens to keep.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


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
    probe: ``[H_q, T, D]`` post-RoPE queries of a probe text run after the memory (for policies with
    ``needs_probe``, e.g. HybridKV's text-centric head classification); query head ``h`` reads KV head
    ``h // (H_q / H_kv)``.
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
    """

    tokens: torch.Tensor
    valid: torch.Tensor
    retrieve: torch.Tensor
    chunk: int = 8


@dataclass
class Selection:
    """Per layer, ``LongTensor [H_kv, keep]`` of sorted indices into that layer's view.

    ``valid`` (optional, per layer ``[H_kv, keep]`` bool) marks the entries that count when heads keep
    different numbers of tokens (ragged budgets); ``summary`` (optional, per layer) refreshes the memory's
    summary region; ``offload`` (optional, per layer) moves evicted tokens to the memory's offload store
    instead of dropping them, and sets what each head retrieves from it at decode time.
    """

    indices: list[torch.Tensor]
    #: Optional per-layer extras a policy reports for explanation (e.g. why each kept token was kept).
    info: dict[str, Any] = field(default_factory=dict)
    valid: list[torch.Tensor] | None = None
    summary: list[SummaryUpdate | None] | None = None
    offload: list[OffloadUpdate | None] | None = None


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
    #: False for a policy sized by ``M`` alone (ProtoKV): it takes no ``C``.
    uses_keep: ClassVar[bool] = True
    #: The policy's own views (names :mod:`kvdemo.viz` knows how to draw from the policy's plain-data methods);
    #: the app lays out whatever the chosen policy declares.
    panels: ClassVar[tuple[str, ...]] = ()
    #: True for a policy that needs probe queries in its views: the engine runs ``probe_text`` as a question
    #: after the memory (uncommitted) before each compression and passes each layer's queries.
    needs_probe: ClassVar[bool] = False
    probe_text: ClassVar[str] = ""

    @property
    def compresses_on_question(self) -> bool:
        """True when a question first runs one more pass with itself as the probe (HybridKV's
        ``classify_with=question``); answering alone never changes the memory."""
        return False

    @abc.abstractmethod
    def compress(self, views: list[LayerView], keep: int) -> Selection:
        """Choose ``keep`` tokens per layer and KV head from ``views`` (one per layer)."""

    def params(self) -> dict[str, Any]:
        """The policy's parameters (its own state, fields starting with ``_``, left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}

    def summary_slots(self, budget: int) -> int:
        """Slots of the memory's summary region this policy owns under budget ``M`` (0: a pure selection)."""
        return 0

    def keep_for(self, budget: int, keep: int | None, incoming: int) -> int:
        """Real visual tokens a compression keeps when ``incoming`` tokens are about to arrive (``C``)."""
        return int(keep)

    def check_fits(self, budget: int, keep: int | None, tokens: int, shape: str = "") -> None:
        """Raise :class:`BudgetError` if chunks of ``tokens`` visual tokens can never fit (``M`` below one
        chunk, or ``M - C`` too small to take one after a compression)."""
        shape = f" = {shape}" if shape else ""
        if tokens > budget:
            raise BudgetError(
                f"M={budget} is smaller than one chunk ({tokens} visual tokens{shape}); "
                "raise M, or lower max pixels / frames per chunk"
            )
        if budget - keep < tokens:
            raise BudgetError(
                f"M - C = {budget - keep} leaves no room for one chunk ({tokens} visual tokens{shape}); "
                f"lower C to at most {budget - tokens} or raise M"
            )

    def report(self) -> dict[str, Any]:
        """What the policy's own state looks like now (for the run report); ``{}`` for a stateless policy."""
        return {}

    def to(self, device: torch.device | str) -> "Policy":
        """Move the policy's own state (its ``_``-fields: tensors, and dataclasses/containers of them) to
        ``device``; returns self."""
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                setattr(self, f.name, move_tensors(getattr(self, f.name), device))
        return self


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
    cls = REGISTRY[name]
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


def make_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy with its defaults overridden by ``params``."""
    if name not in REGISTRY:
        raise BudgetError(f"unknown policy {name!r}; choose one of: {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    known = {f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}  # not internal state
    unknown = set(params) - known
    if unknown:
        raise BudgetError(
            f"policy {name!r} has no parameter(s) {', '.join(sorted(unknown))}"
            + (f"; it takes: {', '.join(sorted(known))}" if known else "; it takes none")
        )
    return cls(**params)


# --- shared helpers for policies ---------------------------------------------------------


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows [N, D]`` viewed as int64 words (same bytes) when a row is a whole number of 8-byte words.

    Moving rows is a copy of bytes: PyTorch's CPU ``index_select`` / ``index_copy_`` are several times faster
    on int64 than on float32 or bfloat16 rows (measured here: 0.26 vs 1.4 ms to gather 8800 rows of 128
    floats, 0.26 vs 0.49 ms to scatter 8800 bfloat16 rows).
    """
    if rows.dim() != 2 or rows.shape[-1] * rows.element_size() % 8 or not rows.is_contiguous():
        return rows
    return rows.view(torch.int64)


def move_tensors(value: Any, device: torch.device | str) -> Any:
    """``value`` with every tensor inside it (dataclass fields, dicts, lists, tuples) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            setattr(value, f.name, move_tensors(getattr(value, f.name), device))
        return value
    if isinstance(value, dict):
        return {k: move_tensors(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(move_tensors(v, device) for v in value)
    return value


class PhaseTimer:
    """Wall time per named phase of a policy pass, in ms (CUDA is synchronised around each phase, so the
    split is true on a GPU too; the benchmark reads it)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1000


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


def frame_rank(frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ranks of frame ids ``[H, L]`` per row: ``(rank [H, L], frames_held [H])``; rank 0 is the oldest.

    Each row (head) is ranked among its own frames. The memory keeps tokens in stream order, so frame
    ids are non-decreasing along a row and the rank is a running count of changes; any other order
    falls back to a sort.
    """
    heads, length = frame.shape
    if length == 0:
        return torch.zeros_like(frame, dtype=torch.long), torch.zeros(heads, dtype=torch.long, device=frame.device)
    change = frame[:, 1:] != frame[:, :-1]
    if bool((frame[:, 1:] >= frame[:, :-1]).all()):
        rank = torch.cat([torch.zeros(heads, 1, dtype=torch.long, device=frame.device), change.long().cumsum(1)], 1)
        return rank, rank[:, -1] + 1
    order = frame.long()
    offset = order.max() + 1
    keyed = order + torch.arange(heads, device=frame.device)[:, None] * offset
    unique, inverse = torch.unique(keyed, return_inverse=True)
    counts = torch.bincount(torch.div(unique, offset, rounding_mode="floor"), minlength=heads)
    starts = torch.cumsum(counts, 0) - counts
    return inverse - starts[:, None], counts


def recent_window(
    frame: torch.Tensor, tokens_per_frame: int, keep: int, ratio: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The recent window shared by the policies that keep one (InfiniPot-V Sec. 3.1, CoRDS' recent tail).

    ``r = max(1, round(ratio * f))`` newest frames per head, ``f = L / tokens_per_frame`` the frames' worth
    of tokens held, shrunk to the whole frames that fit in ``keep`` (at least one frame).
    Returns ``(recent [H, L] bool, rank [H, L], frames_held [H], r)``.
    """
    rank, held = frame_rank(frame)
    length = frame.shape[1]
    frames = max(1, round(ratio * length / tokens_per_frame))
    frames = min(frames, max(1, keep // tokens_per_frame))
    return rank >= (held[:, None] - frames), rank, held, frames
