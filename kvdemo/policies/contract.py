"""The policy contract: what every policy needs, and nothing one policy alone needs.

A policy is a dataclass of its paper's parameters (with their defaults; each field's help text in its
``metadata``) and one method, ``compress(slices, keep) -> Selection``: from per-layer slices of the visual part of
the KV cache (:class:`LayerSlice`) it chooses, per layer and KV head, the sorted indices of the tokens to keep.
Policies know nothing of models, of the UI or of the benchmarks: they see keys, values and provenance.

- :class:`Policy`: the contract (``name``, ``bounded``, ``compress``), with ``report()`` for the run report and
  ``views(context, layer, head)`` for the views it declares (:mod:`kvdemo.views`, drawn by :mod:`kvdemo.viz`; none
  by default).
- Opt-in protocols for what only some policies do: :class:`SummaryRegion` (the policy owns synthetic entries in
  the memory's summary region and is sized by ``M`` alone), :class:`Probed` (the engine runs a probe text after the
  memory before each compression and passes its queries in the slices).

The scored core most policies build on (a priority per token, one shared top-k) is :mod:`.topk`; registration by
name, parameter forms and what is said about a policy (:class:`~.registry.PolicyCard`) are :mod:`.registry`.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..tensors import move_tensors
from ..views import View, ViewContext


@dataclass
class LayerSlice:
    """What a policy sees of one layer's visual tokens.

    Every policy reads the keys, values and provenance (with ``order``, ``valid`` and ``grid_text``, which the
    shared top-k honours). The rest serve one opt-in need each and are None/0 where it does not apply:
    ``position``, ``rotary`` and ``summary_slots`` a :class:`SummaryRegion` policy (keys before RoPE, its region's
    size), ``probe`` a :class:`Probed` one, ``offloaded`` one that offloads (``Selection.offload``).

    keys, values: ``[H_kv, L, D]`` post-RoPE, exactly as cached (views of the memory's buffers).
    frame, row, col: ``[H_kv, L]`` provenance of each token: the temporal grid it came from (a pair of
    sampled frames; called "frame" as in the papers) and its merged-patch row and column.
    order: ``[H_kv, L]`` arrival number of each token in the stream (larger = newer). The memory compacts
    in place, so slots are *not* in stream order; ``None`` (hand-made slices) means slot order.
    position: ``[H_kv, L, 3]`` the 3-D M-RoPE position each key was rotated at (None if unknown).
    valid: ``[H_kv, L]`` bool when heads hold different numbers of tokens (ragged), else None.
    rotary: the model's rotation (``rotate(x, position)`` / ``unrotate(x, position)``), for policies that
    need keys before RoPE; None when the caller has no model.
    summary_slots: size of the memory's summary region the policy owns (see :meth:`SummaryRegion.summary_slots`).
    probe: ``[H_q, T, D]`` post-RoPE queries of a probe text run after the memory (for a
    :class:`Probed` policy, e.g. HybridKV's text-centric head classification); query head ``h`` reads KV head
    ``h // (H_q / H_kv)``.
    offloaded: ``[H_kv]`` tokens each head keeps in the memory's offload store (retrievable while answering);
    None when the layer has no store.
    grid_text: ``[H_kv, grids]`` stream-text slots each head holds per temporal grid (Qwen3-VL's timestamps and
    delimiters), None when the stream carries no text. They are not in the slice; they stay while a head keeps
    at least one visual token of their grid, and count against the budget: keeping the first token of a grid
    costs ``1 + grid_text`` (:func:`~.topk.select_with_text`).
    grid_times_s: stream time (s) of every temporal grid fed so far (index = ``frame``; the memory's own list, on
    the host), for a policy whose windows are in seconds; empty for hand-made slices that give none.
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
    grid_times_s: list[float] = field(default_factory=list)

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


#: The per-token fields of a :class:`LayerSlice` that a :class:`SliceStack` stacks.
STACKED_FIELDS = (
    "keys",
    "values",
    "frame",
    "row",
    "col",
    "order",
    "position",
    "valid",
    "probe",
    "offloaded",
    "grid_text",
)


@dataclass
class SliceStack:
    """Consecutive layers ``layers`` of one device and one visual length ``L``, every field of their slices stacked
    with a layer axis: ``keys``/``values [G, H, L, D]``, ``frame``/``row``/``col``/``order``/``valid [G, H, L]``,
    ``position [G, H, L, 3]``, ``probe [G, H_q, T, D]``, ``offloaded [G, H]``, ``grid_text [G, H, grids]`` (the
    optional ones None where the slices' are). Made by the memory as views of its buffers (no copies: a pass reads every layer's keys with one
    kernel); :meth:`rows` gives a field as ``[G * H, ...]`` rows, the form a policy batches over. The shared facts
    (``grid``, ``newest_frame``, ``rotary``, ``summary_slots``, ``num_layers``) are the first slice's. ``lengths``:
    each layer's own visual length when a padded stack (:func:`padded_stacks`) pads shorter layers to ``L`` (their
    slots past it carry the layer's first arrival number and frame, and ``valid`` False); None when all hold ``L``.
    """

    layers: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    frame: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    order: torch.Tensor
    first: LayerSlice
    position: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    probe: torch.Tensor | None = None
    offloaded: torch.Tensor | None = None
    grid_text: torch.Tensor | None = None
    lengths: tuple[int, ...] | None = None

    @property
    def num_heads(self) -> int:
        return int(self.keys.shape[1])

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    def rows(self, name: str) -> torch.Tensor | None:
        """Field ``name`` as rows ``[G * H, ...]`` (a view where the stack's strides allow, as the memory's do)."""
        value = getattr(self, name)
        return None if value is None else value.reshape(-1, *value.shape[2:])

    @classmethod
    def of(cls, slices: list[LayerSlice], layers: tuple[int, ...]) -> SliceStack:
        """The stack of ``slices`` (of ``layers``), by copying each field into one tensor, layers shorter than the
        longest padded (``valid`` then marks each one's own slots); a memory builds its stacks as views instead
        (:meth:`kvdemo.cache.memory.KVMemory.slices`)."""
        length = max(s.length for s in slices)
        ragged = any(s.length != length for s in slices)

        def padded(t: torch.Tensor, fill, repeat_first: bool = False) -> torch.Tensor:
            pad = length - t.shape[1]
            if not pad:
                return t
            if repeat_first and t.shape[1]:
                tail = t[:, :1].expand(-1, pad)
            else:
                tail = t.new_full((t.shape[0], pad, *t.shape[2:]), fill)
            return torch.cat([t, tail], dim=1)

        fields = {}
        for name in STACKED_FIELDS:
            values = [getattr(s, name) for s in slices]
            if all(v is None for v in values) and not (name == "valid" and ragged):
                fields[name] = None
            elif name == "valid":
                fields[name] = torch.stack(
                    [
                        padded(torch.ones_like(s.frame, dtype=torch.bool) if v is None else v, False)
                        for s, v in zip(slices, values)
                    ]
                )
            elif name == "offloaded":
                fields[name] = torch.stack(
                    [
                        torch.zeros(s.num_heads, dtype=torch.long, device=s.keys.device) if v is None else v
                        for s, v in zip(slices, values)
                    ]
                )
            elif name in ("probe", "grid_text"):
                fields[name] = torch.stack(values)
            else:
                # A padded slot repeats its row's first arrival number and frame, so neither widens what the row
                # spans (the shared top-k's tie ramp, frame ranks).
                fields[name] = torch.stack([padded(v, 0, name in ("order", "frame")) for v in values])
        lengths = tuple(s.length for s in slices) if ragged else None
        return cls(layers=layers, first=slices[0], lengths=lengths, **fields)


class VisualSlices(list):
    """What a policy sees of the memory: one :class:`LayerSlice` per layer (a list: ``slices[layer]``), ``stacks``,
    the same layers as :class:`SliceStack` (consecutive layers of one device and length together) for a pass that
    batches over layers, and ``padded``, each device's layers as one stack padded to its longest layer (``valid``
    marks what each layer's heads hold) for a pass over layers that hold different numbers of tokens."""

    def __init__(self, layers: list[LayerSlice], stacks: list[SliceStack], padded: list[SliceStack]) -> None:
        super().__init__(layers)
        self.stacks = stacks
        self.padded = padded


def _stack_key(s: LayerSlice, length: bool = True) -> tuple:
    optional = tuple(getattr(s, n) is None for n in ("position", "probe", "grid_text"))
    shape = s.keys.shape if length else (s.keys.shape[0], s.keys.shape[2])
    return s.keys.device, shape, s.keys.dtype, optional


def _runs(slices: list[LayerSlice], length: bool) -> list[list[int]]:
    """Runs of consecutive layers that stack (one device, dtype and shape; any length unless ``length``)."""
    runs: list[list[int]] = []
    for index, layer_slice in enumerate(slices):
        if runs and _stack_key(slices[runs[-1][-1]], length) == _stack_key(layer_slice, length):
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def slice_stacks(slices: list[LayerSlice]) -> list[SliceStack]:
    """The stacks of ``slices``: the memory's own (views) for :class:`VisualSlices`; for a plain list (hand-made
    slices), runs of consecutive layers of one device, length and shape copied into stacks (:meth:`SliceStack.of`)."""
    if isinstance(slices, VisualSlices):
        return slices.stacks
    return [SliceStack.of([slices[i] for i in run], tuple(run)) for run in _runs(slices, length=True)]


def padded_stacks(slices: list[LayerSlice]) -> list[SliceStack]:
    """Every layer of ``slices`` in stacks padded to their longest layer (``valid [G, H, L]`` marks the slots each
    layer's heads hold; None when every head of every layer holds all ``L``): the memory's own (views) for
    :class:`VisualSlices`, one per device; for a plain list, runs of consecutive layers of one device and shape
    copied into stacks, shorter layers padded (:meth:`SliceStack.of`)."""
    if isinstance(slices, VisualSlices):
        return slices.padded
    return [SliceStack.of([slices[i] for i in run], tuple(run)) for run in _runs(slices, length=False)]


def layer_rows(slices: list[LayerSlice], layers: tuple[int, ...], name: str) -> torch.Tensor | None:
    """Field ``name`` of ``layers`` as rows ``[len(layers) * H, ...]`` (layer by layer): a stack's own rows, a view,
    when ``layers`` is one of the slices' stacks (:func:`slice_stacks`, :func:`padded_stacks`), else the layers'
    fields stacked (a copy); None where a layer's is."""
    if len(layers) > 1:
        for stack in (*slice_stacks(slices), *padded_stacks(slices)):
            if stack.layers == layers:
                return stack.rows(name)
    values = [getattr(slices[layer], name) for layer in layers]
    if any(value is None for value in values):
        return None
    return values[0] if len(values) == 1 else torch.cat(values)


@dataclass
class SummaryUpdate:
    """A policy's synthetic entries for the summary region of one layer, or of several (ProtoKV's pseudo-tokens).
    keys, values: ``[H_kv, U, D]`` post-RoPE, as attention reads them, written at ``slots [H_kv, U]`` of the region
    (all ``S`` slots in order when ``slots`` is None); bias: ``[H_kv, S]`` additive key bias of every slot (``-inf``
    hides an unused one). ``layers``: the layers it covers when several, rows stacked layer by layer (``keys
    [len(layers) * H_kv, U, D]``...), the same object at each of their places in ``Selection.summary``, written once
    for every layer of a device (:meth:`kvdemo.cache.layer.LayerGroup.write_summary`); empty: the one layer."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    slots: torch.Tensor | None = None
    layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class RetrievalRule:
    """How a policy's offloaded chunks come back while a question is answered: each forward's queries (averaged over
    its tokens, summed over each KV head's group of query heads) score every chunk's mean key, and the top chunks are
    attended together with what the device holds (:meth:`kvdemo.cache.offload.OffloadStore.fetch`).

    shared: one ranking per layer, scores summed over its heads (ReKV); else per head (HybridKV). per_question:
    chosen at a question's prefill and kept for its decode steps (ReKV); else at every forward (HybridKV).
    unrotated: queries and mean keys (``OffloadUpdate.index_keys``) before RoPE (ReKV); else as cached."""

    shared: bool = False
    per_question: bool = False
    unrotated: bool = False


@dataclass
class OffloadUpdate:
    """The tokens of the consecutive layers ``layers`` (one stack of the slices: :func:`slice_stacks`,
    :func:`padded_stacks`) to move to the memory's offload store, and what each head retrieves while answering.

    tokens: ``[G, H, E]`` indices into each layer's slice, in arrival order; ``valid [G, H, E]`` which count. They
    are stored per head in chunks of at most ``chunk`` tokens: runs of ``chunk`` consecutive ones, or, with ``block
    [G, H, E]`` (non-decreasing along a row's valid tokens), one chunk per block id (ReKV's blocks). Each chunk has a
    resident mean key: of its keys, or of ``index_keys [G, H, E, D]`` when given (ReKV: the keys before RoPE).
    retrieve: ``[G, H]`` visual tokens each head brings back per forward while answering (0: it does not retrieve).
    counted: whether those retrieved tokens count toward the budget ``M`` (the memory's visual tokens include
    them, so a head's query-time context, resident + retrieved, stays within what the budget bounds) or come on
    top of it. rule: how they are chosen (:class:`RetrievalRule`).
    """

    layers: tuple[int, ...]
    tokens: torch.Tensor
    valid: torch.Tensor
    retrieve: torch.Tensor
    chunk: int = 8
    counted: bool = False
    block: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    rule: RetrievalRule = RetrievalRule()


@dataclass
class PositionShift:
    """Close the position gaps an eviction leaves: every token the memory holds of temporal grid ``g`` (visual and
    stream text) moves back by ``by_grid[g]`` positions on every axis, its key re-rotated by ``rotary`` (the model's
    rotation, ``LayerSlice.rotary``), and every later token (the next chunks, a question) by ``by_grid[-1]``.

    by_grid: ``[grids]`` int64, one shift per grid for every layer and head (so a question sits at one place
    relative to all of them), non-decreasing, on the device of the keys. A shift composes with the rotation each
    key carries: RoPE at ``p - s`` is RoPE at ``p`` followed by RoPE at ``-s`` on each channel's axis.
    """

    by_grid: torch.Tensor
    rotary: Any


@dataclass
class Selection:
    """Per layer, ``LongTensor [H_kv, keep]`` of sorted indices into that layer's slice.

    ``valid`` (optional, per layer ``[H_kv, keep]`` bool) marks the entries that count when heads keep
    different numbers of tokens (ragged budgets); ``summary`` (optional, per layer) refreshes the memory's
    summary region; ``offload`` (optional, one per stack of layers it covers) moves evicted tokens to the memory's
    offload store instead of dropping them, and sets what each head retrieves from it while answering; ``uncompressed``
    lists the layers this pass left whole (every index kept): they do not count toward ``M`` (CoRDS'
    ``above=keep``), so the engine does not compress again because of them. ``shift`` (optional) closes the
    position gaps the eviction leaves (:class:`PositionShift`: StreamingVLM's contiguous positions).
    """

    indices: list[torch.Tensor]
    #: Optional per-layer extras a policy reports for explanation (e.g. why each kept token was kept).
    info: dict[str, Any] = field(default_factory=dict)
    valid: list[torch.Tensor] | None = None
    summary: list[SummaryUpdate | None] | None = None
    offload: list[OffloadUpdate] | None = None
    uncompressed: tuple[int, ...] = ()
    shift: PositionShift | None = None


@dataclass
class Policy(abc.ABC):
    """Base of every policy: a dataclass of its paper's parameters, registered by ``name``
    (:func:`~.registry.register`)."""

    name: ClassVar[str] = ""
    #: False for ``full``: the engine never compresses.
    bounded: ClassVar[bool] = True

    @abc.abstractmethod
    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        """Choose ``keep`` tokens per layer and KV head from ``slices`` (one per layer)."""

    @classmethod
    def takes_keep(cls) -> bool:
        """Whether the budget has a ``C`` (a bounded policy that is not sized by ``M`` alone)."""
        return cls.bounded and not issubclass(cls, SummaryRegion)

    def check_stream(self, chunk_seconds: float) -> None:
        """Raise :class:`~kvdemo.errors.BudgetError` (one line, advising values that are accepted) when chunks of
        ``chunk_seconds`` of video cannot work with this policy's parameters (a window in seconds shorter than one
        chunk); any chunk works by default. :meth:`kvdemo.cache.budget.Budget.sized` runs it where the front ends
        size the budget, before the model loads."""

    def check_window(self, keep: int | None, chunk_tokens: int) -> None:
        """As :meth:`check_stream`, for chunks of ``chunk_tokens`` visual tokens kept to ``keep`` (``C``, or None)."""

    def params(self) -> dict[str, Any]:
        """The policy's parameters (its own state, fields starting with ``_``, left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}

    def report(self) -> dict[str, Any]:
        """What the policy's own state looks like now (for the run report); ``{}`` for a stateless policy."""
        return {}

    def views(self, context: ViewContext, layer: int, head: int) -> list[View]:
        """The policy's own views of its state for one layer and KV head (their titles are declared in its
        :class:`~.registry.PolicyCard`); none by default."""
        return []

    def to(self, device: torch.device | str) -> "Policy":
        """Move the policy's own state (its ``_``-fields: tensors, and dataclasses/containers of them) to
        ``device``; returns self."""
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                setattr(self, f.name, move_tensors(getattr(self, f.name), device))
        return self


# --- opt-in protocols --------------------------------------------------------------------------------


class SummaryRegion(abc.ABC):
    """A policy that owns synthetic entries in the memory's summary region (ProtoKV's pseudo-tokens). It is
    sized by ``M`` alone: ``M`` = its summary slots + the real visual tokens it holds exactly; each
    compression keeps the newest real tokens that leave room for the incoming chunk
    (:meth:`kvdemo.cache.budget.Budget.keep_for`). The split may depend on the chunk size, which the budget learns when
    chunks are sized (:meth:`kvdemo.cache.budget.Budget.sized`)."""

    #: What messages call the exact tokens it holds (e.g. "near window").
    window_name: ClassVar[str] = "window"

    @abc.abstractmethod
    def summary_slots(self, budget: int, chunk: int = 0) -> int:
        """Slots of the memory's summary region this policy owns under budget ``M`` for chunks of ``chunk`` visual
        tokens (0 = not known yet); raises :class:`~kvdemo.errors.BudgetError` when ``M`` cannot be split as the
        policy needs."""

    def describe_split(self, budget: int, chunk: int = 0) -> str:
        """``M``'s split in words (for the settings line and messages)."""
        slots = self.summary_slots(budget, chunk)
        return f"{budget - slots} exact tokens + {slots} summary slots"

    def summarised(self, context: ViewContext, layer: int, head: int) -> np.ndarray | None:
        """``[grids, rows, cols]`` bool: the patches the summary still represents (whether or not they are
        also held exactly), for the views; None when nothing is summarised yet."""
        return None


class Probed(abc.ABC):
    """A policy that reads the memory with a probe: before each compression the engine asks
    :attr:`probe_text` after the memory (uncommitted) and passes each layer's queries as ``LayerSlice.probe``."""

    #: The text the memory is probed with (a proxy for a question).
    probe_text: ClassVar[str] = ""

    @property
    def compresses_on_question(self) -> bool:
        """True when a question first runs one more pass with itself as the probe (it changes the memory);
        answering alone never does."""
        return False
