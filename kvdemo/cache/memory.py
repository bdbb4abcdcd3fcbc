"""The KV memory: per-layer key/value buffers written in place, per-head provenance of every
visual token, an optional per-head key bias, real bytes, and the occupancy timeline.

Layout of one layer's buffers ``keys/values [1, H_kv, capacity, D]`` (slots, not stream order)::

    | prefix (P) | summary (S) | visual (L) | stream text (T) | slack ... |
    0            P             P+S          P+S+L             P+S+L+T = end   capacity

- prefix: the system text, never evicted;
- summary: synthetic entries a policy owns (ProtoKV's pseudo-tokens), laid out when the policy first writes them
  (the visual and stream-text slots move up once) and refreshed by later compressions;
- visual: real visual tokens with provenance ``frame/row/col/order/position/reason [H_kv, L]`` per slot.
  Heads may hold different numbers of tokens (ragged budgets): then ``valid [H_kv, L]`` marks real slots
  and the others carry a ``-inf`` key bias;
- stream text: text tokens the stream itself carries between grids (Qwen3-VL's ``<t seconds><|vision_start|>``
  and ``<|vision_end|>`` around every temporal grid), with provenance (their grid); they count against ``M`` and
  leave with their grid's last visual token in that layer and head (:meth:`KVMemory.apply`). Policies never see
  them: their slices hold the visual slots only, and ``LayerSlice.grid_text`` says what keeping a grid costs;
- slack: where a forward writes new tokens. A chunk's prefill writes there and is committed
  (:meth:`KVMemory.commit_append`); a question writes there and is simply not committed, so the memory
  after :meth:`~kvdemo.stream.engine.StreamEngine.ask` is bit-identical without any copy or rollback.

The layers of one device and dtype share one buffer with a layer axis (:class:`~kvdemo.cache.layer.LayerGroup`:
``[2, G, H_kv, capacity, D]``, one capacity for the group), each layer's cache a view of it, so one kernel
addresses every layer: a policy's pass scores them as one batch and a compaction moves them together (a
``device_map`` split gives one group per device).

Every byte moves once: an append copies the chunk into the slack; a compression moves only the kept tokens
that sit at or beyond slot ``C`` into the evicted slots below ``C`` (at most ``M - C`` tokens per head, one gather
and one scatter of rows of the group's flattened buffer for every layer at once: :mod:`kvdemo.cache.compaction`),
never the prefix. Keys
carry their rotation (post-RoPE), so attention does not care where a token sits: only a new chunk must
come after what it attends to, which the slack guarantees. Buffers follow what the stream holds: they grow
geometrically as chunks arrive, never past what ``M`` (and a question) needs, so an ``M`` the stream never
reaches costs nothing. The visual slots are *not* in stream order: ``order`` (arrival number) and ``frame``
say what is older.

What transformers sees is :class:`kvdemo.cache.attention.MemoryCache(memory) <kvdemo.cache.attention.MemoryCache>`, a
``Cache`` whose layers are views of the live part, built by the memory's users (the engine, the benchmarks)
and writing through :meth:`KVMemory.ensure_layer` / :meth:`KVMemory.reserve`; kvdemo's attention function
reads the key bias. HybridKV's offload store is :mod:`kvdemo.cache.offload`; what survives of each frame, which
only views and reports read, is :mod:`kvdemo.analysis.survival`.

The groups and one layer's own moves are :mod:`kvdemo.cache.layer`, the compaction :mod:`kvdemo.cache.compaction`,
what a policy sees :mod:`kvdemo.cache.slicing`. Reading order here: the timeline
event, then :class:`KVMemory`: its layout, the layer buffers, the writes, what a policy sees and decides
(``slices``/``apply``), the timeline, pickling and devices.
"""

# Long on purpose: one class, KVMemory, whose every method keeps the one slot layout drawn above (prefix | summary |
# visual | stream text | slack) true in every layer and head; a layer's buffers and their moves are already
# kvdemo/cache/layer.py, and what survives of each frame kvdemo/analysis/survival.py.

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..policies.contract import Selection, SummaryUpdate, VisualSlices
from ..tensors import move_rows
from .budget import Budget
from .chunk import VisualChunk
from .compaction import compact_group, refresh_group_bias, shift_group
from .layer import PROVENANCE, PROVENANCE_WIDTH, REASON_NEW, LayerGroup, LayerMemory
from .slicing import memory_slices

#: Slots kept free after the live part for a question and its answer (grown on demand beyond that).
TEXT_RESERVE = 256


@dataclass
class OccupancyEvent:
    """One point of the timeline: the state after an ``append`` or a ``compress``."""

    frame: int  # sampled frames fed so far
    time_s: float  # stream time of the newest frame
    event: str  # "append" | "compress"
    visual_tokens: int
    cache_bytes: int  # bytes of the live keys/values (what attention reads)
    ms: float
    allocated_bytes: int = 0  # bytes of the preallocated buffers (live + slack)
    moved_bytes: int = 0  # key/value bytes this event copied (an append: the chunk; a compression: the moved tokens)
    offloaded_bytes: int = 0  # key/value bytes in the offload store (host memory), not counted in cache_bytes
    padding_bytes: int = 0  # live bytes of ragged heads' padding slots (part of cache_bytes, attended to by nobody)
    summary_active: int = 0  # summary slots attention can see (ProtoKV's active pseudo-tokens), mean over KV heads

    def to_dict(self) -> dict:
        return asdict(self)


class KVMemory:
    """A model's KV cache (layout: the module docstring) under ``budget`` (:class:`~kvdemo.cache.budget.Budget`, read,
    never changed here: its window bounds the visual slots, its summary slots are the region a policy owns, counted
    in :attr:`visual_tokens` from the start and laid out when first written; None: unbounded, no region);
    ``layer_map``: model layer -> memory layer (None for a layer without keys and values, e.g. Qwen3.5's linear
    attention; default: one memory layer per model layer)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        budget: Budget | None = None,
        layer_map: list[int | None] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.budget = budget or Budget()
        self.summary_open = False  # the summary region is laid out in the buffers (on the policy's first write)
        self.layers: list[LayerMemory] = []
        #: The layers' buffers, one group per device and dtype (each layer a view of its group's).
        self.groups: list[LayerGroup] = []
        self.prefix_len = 0
        self.grid_times_s: list[float] = []  # stream time of each temporal grid ever fed
        self.grid_shape: tuple[int, int] | None = None
        self.timeline: list[OccupancyEvent] = []
        self.tokens_seen = 0  # visual tokens ever appended (the next token's ``order``)
        #: model layer -> memory layer; None for a layer that holds no keys and values (Qwen3.5's linear
        #: attention): the memory covers the attention layers only.
        self.layer_map: list[int | None] = list(layer_map) if layer_map is not None else list(range(num_layers))
        #: The committed state of the layers without KV (model layer -> {"conv": ..., "recurrent": ...}): fixed
        #: size whatever the stream, overwritten by every committed chunk, never by a question.
        self.linear_state: dict[int, dict[str, torch.Tensor]] = {}
        #: The model family's position cursor after the last committed token (opaque here; pickles with the memory).
        self.cursor: Any = None
        #: Positions closed so far (:class:`~kvdemo.policies.contract.PositionShift`): the tokens after the last
        #: closed gap sit this much lower on every axis than the cursor's count, and so do the next chunks and a
        #: question (the engine subtracts it); 0 when no policy closes gaps.
        self.position_shift = 0

    # --- layout and what it holds ---------------------------------------------------------
    @property
    def visual_capacity(self) -> int:
        """The most visual slots held: the budget's window (0: no bound)."""
        return self.budget.window or 0

    @property
    def summary_slots(self) -> int:
        """Slots of the summary region the policy owns (the budget's)."""
        return self.budget.summary

    @property
    def is_empty(self) -> bool:
        return not self.layers

    @property
    def visual_start(self) -> int:
        """First visual slot: after the prefix and the summary region (once it is laid out)."""
        return self.prefix_len + (self.summary_slots if self.summary_open else 0)

    def live_len(self, layer: int) -> int:
        """Slots attention reads in ``layer``: prefix + summary + visual + stream text."""
        store = self.layers[layer]
        return self.visual_start + store.visual_len + store.text_len

    def head_counts(self, layer: int) -> torch.Tensor:
        """Stream tokens (visual and stream text) each KV head of ``layer`` holds, ``[H]`` (equal unless ragged)."""
        store = self.layers[layer]
        visual = store.visual_len if store.valid is None else store.valid.sum(dim=1).cpu()
        text = store.text_len if store.text_valid is None else store.text_valid.sum(dim=1).cpu()
        return torch.zeros(self.num_kv_heads, dtype=torch.long, device="cpu") + visual + text

    def budget_counts(self, layer: int) -> torch.Tensor:
        """``[H]`` visual tokens the budget bounds: held, plus retrievable if retrieval counts (``OffloadStore.counted``)."""
        held, offload = self.head_counts(layer), self.layers[layer].offload
        return held + offload.reserved() if offload is not None and offload.counted else held

    @property
    def visual_tokens(self) -> int:
        """Visual tokens held, the number the budget bounds: per layer, the summary slots plus the mean
        stream tokens per KV head (visual and stream text; equal heads: just the count; retrieval that
        counts toward the budget included, :meth:`budget_counts`); the fullest layer counts."""
        return self.visual_tokens_in(range(self.num_layers))

    def visual_tokens_in(self, layers) -> int:
        """:attr:`visual_tokens` over the given layers only (0 if none or empty)."""
        if not self.layers:
            return 0
        return max(
            (self.summary_slots + round(float(self.budget_counts(i).double().mean())) for i in layers), default=0
        )

    @property
    def held_tokens(self) -> int:
        """Visual tokens held: :attr:`visual_tokens` less the summary slots, which count against the budget from the
        first chunk whether a policy has filled them or not (:attr:`summary_active` says how many it has)."""
        return self.visual_tokens - self.summary_slots if self.layers else 0

    @property
    def largest_head_tokens(self) -> int:
        """The most visual tokens (summary slots included) any single KV head of any layer holds."""
        if not self.layers:
            return 0
        return max(self.summary_slots + int(self.head_counts(i).max()) for i in range(self.num_layers))

    @property
    def num_grids(self) -> int:
        return len(self.grid_times_s)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer, the live keys ``[1, H, P + S + L, D]`` (views, no copies)."""
        return [store.keys[:, :, : self.live_len(i)] for i, store in enumerate(self.layers)]

    @property
    def values(self) -> list[torch.Tensor]:
        return [store.values[:, :, : self.live_len(i)] for i, store in enumerate(self.layers)]

    def _provenance(self, name: str) -> list[torch.Tensor]:
        return [store.provenance[name][:, : store.visual_len] for store in self.layers]

    @property
    def frame(self) -> list[torch.Tensor]:
        """Per layer, ``[H, L]`` temporal grid of each visual slot (views)."""
        return self._provenance("frame")

    @property
    def row(self) -> list[torch.Tensor]:
        return self._provenance("row")

    @property
    def col(self) -> list[torch.Tensor]:
        return self._provenance("col")

    @property
    def order(self) -> list[torch.Tensor]:
        return self._provenance("order")

    @property
    def reason(self) -> list[torch.Tensor]:
        return self._provenance("reason")

    @property
    def valid(self) -> list[torch.Tensor | None]:
        return [store.valid for store in self.layers]

    @property
    def nbytes(self) -> int:
        """Real bytes of the live keys and values (``element_size * nelement`` of what attention reads)."""
        return sum(t.element_size() * t.nelement() for t in (*self.keys, *self.values))

    @property
    def offloaded_bytes(self) -> int:
        """Real bytes of the keys and values in the offload stores (host memory)."""
        return sum(group.offload.nbytes for group in self.groups if group.offload is not None)

    @property
    def padding_bytes(self) -> int:
        """Live bytes in the padding slots of ragged heads (a padded layout's waste)."""
        total = 0
        for store in self.layers:
            for mask in (store.valid, store.text_valid):
                if mask is not None:
                    total += (mask.numel() - int(mask.sum())) * 2 * store.keys.element_size() * store.keys.shape[-1]
        return total

    @property
    def text_tokens(self) -> int:
        """Stream-text slots held (mean over KV heads, fullest layer); part of :attr:`visual_tokens`."""
        counts = [
            s.text_len if s.text_valid is None else round(float(s.text_valid.sum(dim=1).double().mean()))
            for s in self.layers
        ]
        return max(counts, default=0)

    @property
    def linear_state_bytes(self) -> int:
        """Real bytes of the layers without KV (their state's size does not depend on the stream)."""
        return sum(t.element_size() * t.nelement() for state in self.linear_state.values() for t in state.values())

    def reset_retrieved(self) -> None:
        """Forget which offloaded chunks were retrieved (a new question starts)."""
        for group in self.groups:
            if group.offload is not None:
                group.offload.reset_retrieved()

    def retrieved_frames(self) -> np.ndarray | None:
        """``[2, layers, grids]`` visual tokens of each frame in the offload stores (summed over heads), and of those
        the ones the last question retrieved; None when nothing is offloaded (for the views)."""
        if all(group.offload is None for group in self.groups):
            return None
        out = np.zeros((2, self.num_layers, max(self.num_grids, 1)), dtype=np.int64)
        for layer, store in enumerate(self.layers):
            if store.offload is not None:
                out[:, layer] = store.offload.frame_tokens(out.shape[2])
        return out

    def release_retrieved(self) -> None:
        """A question is answered: what it brought back from the offload stores leaves the device (which chunks it
        retrieved stays known, for the views)."""
        for group in self.groups:
            if group.offload is not None:
                group.offload.release()

    @property
    def allocated_bytes(self) -> int:
        """Real bytes of the key/value buffers, slack included."""
        return sum(group.kv.element_size() * group.kv.nelement() for group in self.groups)

    def token_bytes(self) -> int:
        """Bytes one token takes over all layers (keys and values of every KV head)."""
        return sum(2 * s.keys.element_size() * s.keys.shape[1] * s.keys.shape[3] for s in self.layers)

    # --- layer buffers (allocated on a layer's first write, grown geometrically) ---------------
    def ensure_layer(self, layer: int, key_states: torch.Tensor) -> None:
        """Give layer ``layer`` its buffers on its first write (shape, dtype and device from the model): a place in
        the group of its device and dtype, made when the first such layer writes."""
        while len(self.layers) <= layer:
            self.layers.append(None)  # type: ignore[arg-type]
        if self.layers[layer] is not None:
            return
        _, heads, n, dim = key_states.shape
        device, dtype = key_states.device, key_states.dtype
        group = next(
            (
                g
                for g in self.groups
                if g.kv.device == device and g.kv.dtype == dtype and g.heads == heads and g.kv.shape[4] == dim
            ),
            None,
        )
        if group is None:
            group = LayerGroup.empty(heads, n + TEXT_RESERVE, dim, dtype, device)  # grown as chunks arrive (reserve)
            self.groups.append(group)
        self.layers[layer] = LayerMemory(group, group.add(layer))

    def reserve(self, layer: int, end: int) -> None:
        """Make room for slots ``[0, end)`` in ``layer`` (and the layers of its group): geometric growth up to what
        ``M`` needs (its window and a question), copying everything written (the slack may hold an uncommitted
        forward's tokens)."""
        group = self.layers[layer].group
        old_capacity = group.capacity
        if end > old_capacity:
            capacity = max(end + TEXT_RESERVE, int(old_capacity * 1.5))
            if self.visual_capacity:
                capacity = max(end, min(capacity, self.visual_start + self.visual_capacity + TEXT_RESERVE))
            self._resize(group, capacity)

    def _resize(self, group: LayerGroup, capacity: int) -> None:
        """Reallocate ``group``'s buffers with ``capacity`` slots (>= what they hold), copying their content."""
        group.resize(capacity, capacity - (self.visual_start if self.prefix_len else 0))

    # --- writes ---------------------------------------------------------------------------
    @torch.inference_mode()
    def commit_prefix(self, prefix_len: int) -> None:
        """Adopt the prefilled text prefix (positions ``0 .. prefix_len-1``); the stream follows it (the summary
        region goes in between when a policy first fills it, :meth:`_open_summary`)."""
        self.prefix_len = prefix_len
        for group in self.groups:
            group.packed = group.packed[:, :, : group.capacity - self.visual_start].clone()

    def commit_linear(self, model_layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Adopt the state a chunk's forward left in model layer ``model_layer`` (one without keys and values)."""
        self.linear_state[model_layer] = {"conv": conv, "recurrent": recurrent}

    @torch.inference_mode()
    def commit_append(self, chunk: VisualChunk, positions: torch.Tensor) -> None:
        """Adopt the ``chunk.num_tokens`` tokens a forward wrote after the live part, with their provenance.

        ``positions [3, n]`` are the positions the keys were rotated at (3-D M-RoPE; three equal rows for 1-D
        RoPE). A chunk's stream text (``chunk.text``) joins the stream-text region after the visual tokens: the
        rows of that region and of the chunk are reordered once (visual tokens of the chunk, then the text held,
        then the chunk's text), so the visual slots stay one contiguous block a view can slice.
        """
        if self.grid_shape is None:
            self.grid_shape = (chunk.rows, chunk.cols)
        elif self.grid_shape != (chunk.rows, chunk.cols):
            raise ValueError(f"frame grid changed mid-stream: {self.grid_shape} -> {(chunk.rows, chunk.cols)}")
        n = chunk.num_tokens
        text = chunk.text.cpu() if chunk.text is not None else torch.zeros(n, dtype=torch.bool, device="cpu")
        visual_count = n - int(text.sum())
        rows = torch.zeros(n, PROVENANCE_WIDTH, dtype=torch.int32, device="cpu")
        rows[:, PROVENANCE["frame"]] = chunk.grid.cpu().int()
        rows[:, PROVENANCE["row"]] = chunk.row.cpu().int()
        rows[:, PROVENANCE["col"]] = chunk.col.cpu().int()
        order = torch.full((n,), -1, dtype=torch.int32, device="cpu")
        order[~text] = torch.arange(self.tokens_seen, self.tokens_seen + visual_count, dtype=torch.int32, device="cpu")
        rows[:, PROVENANCE["order"]] = order
        rows[:, PROVENANCE["position"]] = positions.t().cpu().int()
        rows[:, PROVENANCE["reason"]] = REASON_NEW
        for store in self.layers:
            start = store.visual_len + store.text_len
            store.packed[:, start : start + n] = rows.to(store.packed.device)
            if text.any() or store.text_len:
                store.reorder_stream_text(text, self.visual_start)
            if store.group.valid is not None:  # the chunk's visual tokens, held by every head
                store.group.valid[store.index, :, store.visual_len : store.visual_len + visual_count] = True
            if store.text_valid is not None:
                store.text_valid = torch.cat(
                    [store.text_valid, store.text_valid.new_ones(store.text_valid.shape[0], n - visual_count)], dim=1
                )
            store.visual_len += visual_count
            store.text_len += n - visual_count
            if store.bias is not None or store.ragged or store.text_valid is not None:
                store.refresh_bias(self.visual_start)
        self.tokens_seen += visual_count
        self.grid_times_s.extend(chunk.grid_times_s)

    # --- what a policy sees, and what it decides -------------------------------------------
    def slices(self, rotary: Any = None, probe: list[torch.Tensor] | None = None) -> VisualSlices:
        """What a policy sees: every layer's visual slots and the same as stacks of layers and each group as one stack padded to its longest layer (views of the buffers, no
        copies; :func:`kvdemo.cache.slicing.memory_slices`); ``probe`` gives each layer's probe queries ``[H_q, T,
        D]`` (see ``LayerSlice.probe``)."""
        return memory_slices(self, rotary, probe)

    @torch.inference_mode()
    def apply(self, selection: Selection) -> int:
        """Keep, per layer and KV head, the selected visual tokens (and their provenance); returns the
        key/value bytes moved.

        Compaction in place: head ``h`` keeps ``c_h`` tokens, so its kept tokens at slots ``>= c_h`` move
        into its evicted slots ``< c_h`` (one gather and one scatter of rows over all heads).
        ``selection.indices[l]`` is ``[H, keep]`` (sorted), ``selection.valid[l]`` (optional) marks the
        entries that count when heads keep different numbers. The prefix is never touched. A policy's
        reasons (``selection.info["reason"]``) are stored per slot and move along. A ``selection.summary``
        entry refreshes the summary region of the layer(s) it covers; a ``selection.shift`` closes the position gaps
        the eviction leaves (every held token moved back by its grid's shift, its key re-rotated: :func:`shift_group`),
        after the compaction.
        """
        if len(selection.indices) != self.num_layers:
            raise ValueError(f"selection covers {len(selection.indices)} layers, memory has {self.num_layers}")
        reasons = selection.info.get("reason") or [None] * self.num_layers
        valids = selection.valid or [None] * self.num_layers
        moved = 0
        if selection.summary is not None and not self.summary_open:
            moved += self._open_summary()
        for layer, index in enumerate(selection.indices):
            if index.shape[0] != self.num_kv_heads:
                raise ValueError(f"layer {layer}: selection has {index.shape[0]} heads, memory has {self.num_kv_heads}")
        for update in selection.offload or ():  # before the compaction: it reads the evicted tokens where they are
            group = self.layers[update.layers[0]].group
            first = group.layers.index(update.layers[0])
            if group.layers[first : first + len(update.layers)] != list(update.layers):
                raise ValueError(f"an offload covers layers {update.layers}, not consecutive layers of one group")
            moved += group.offload_tokens(update, first, self.visual_start)
        start = self.visual_start
        moves: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []  # every group's key/value moves, made together
        for group in self.groups:
            stores = [self.layers[layer] for layer in group.layers]
            held = [store.visual_len for store in stores]
            pick = [selection.indices[layer] for layer in group.layers]
            moved += compact_group(
                group, stores, pick, [valids[i] for i in group.layers], [reasons[i] for i in group.layers], start, moves
            )
            if any(store.text_len for store in stores):  # the stream text moves into slots the visual move may read
                move_rows(moves)
                moves.clear()
                for store, before in zip(stores, held):
                    if store.text_len:
                        moved += store.compact_stream_text(before, start, self.num_grids)
            refresh_group_bias(group, stores, start)
        if selection.summary is not None:
            self._write_summary(selection.summary, start)
        move_rows(moves)
        if selection.shift is not None:
            by_grid = selection.shift.by_grid
            for group in self.groups:
                stores = [self.layers[layer] for layer in group.layers]
                moved += shift_group(group, stores, by_grid, selection.shift.rotary, start)
            self.position_shift += int(by_grid[-1]) if by_grid.numel() else 0  # the one read: later tokens' shift
        return moved

    def _write_summary(self, updates: list[SummaryUpdate | None], start: int) -> None:
        """Write a policy's summary entries (``Selection.summary``): an update of one layer into that layer, one that
        covers several (``SummaryUpdate.layers``, the same object at each of their places) once, in one write per
        group of the layers it covers in that group; every layer written reads its bias from then on."""
        written: set[int] = set()
        for layer, update in enumerate(updates):
            if update is None or id(update) in written:
                continue
            written.add(id(update))
            if not update.layers:
                self.layers[layer].write_summary(update, self.prefix_len, start, self.summary_slots)
                continue
            for group in self.groups:
                parts = [part for part, covered in enumerate(update.layers) if covered in group.layers]
                if parts:
                    members = [group.layers.index(update.layers[part]) for part in parts]
                    group.write_summary(update, parts, members, self.prefix_len, start, self.summary_slots)
                    for part in parts:
                        self.layers[update.layers[part]].biased = True

    def _open_summary(self) -> int:
        """Lay out the summary region (every slot invisible until written) after the prefix: each layer's visual
        and stream-text slots move up by its size once. Returns the bytes moved."""
        p, size, moved = self.prefix_len, self.summary_slots, 0
        for layer, store in enumerate(self.layers):
            length = store.visual_len + store.text_len
            self.reserve(layer, p + size + length + TEXT_RESERVE)
            for half in (store.keys, store.values):
                half[:, :, p + size : p + size + length] = half[:, :, p : p + length].clone()
            old = store.bias[:, p : p + length].clone() if store.bias is not None else None
            bias = store.use_bias()
            bias.zero_()
            if old is not None:
                bias[:, p + size : p + size + length] = old
            bias[:, p : p + size] = float("-inf")
            moved += 2 * store.keys[:, :, :length].nbytes
        self.summary_open = True
        return moved

    @property
    def summary_active(self) -> int:
        """Summary slots attention can see (finite bias), mean over KV heads, in the fullest layer."""
        if not self.summary_open or not self.layers or self.layers[0].bias is None:
            return 0
        p, s = self.prefix_len, self.visual_start
        return max(round(float(torch.isfinite(store.bias[:, p:s]).sum(dim=1).double().mean())) for store in self.layers)

    # --- the timeline ---------------------------------------------------------------------
    def record(self, event: str, frames_fed: int, time_s: float, ms: float, moved_bytes: int = 0) -> OccupancyEvent:
        entry = OccupancyEvent(
            frame=frames_fed,
            time_s=float(time_s),
            event=event,
            visual_tokens=self.visual_tokens,
            cache_bytes=self.nbytes,
            ms=float(ms),
            allocated_bytes=self.allocated_bytes,
            moved_bytes=int(moved_bytes),
            offloaded_bytes=self.offloaded_bytes,
            padding_bytes=self.padding_bytes,
            summary_active=self.summary_active,
        )
        self.timeline.append(entry)
        return entry

    # --- a fork to answer on while the stream goes on ------------------------------------------
    def fork(self) -> "KVMemory":
        """The memory as it is now, in buffers of its own: a question answered on the fork writes into the fork's
        slack, while chunks keep entering this memory and compressions keep moving its slots (a live session,
        :mod:`kvdemo.stream.live`). Each group's buffers are copied (:meth:`LayerGroup.fork
        <kvdemo.cache.layer.LayerGroup.fork>`: the live slots, what a question's prefill reads anyway), so the fork
        costs as much memory as the buffers while the answer runs; the offload stores share their pools
        (:meth:`OffloadStore.fork`). The committed linear state is shared: a chunk replaces it, never writes into it."""
        twin = copy.copy(self)
        forked = {}
        for group in self.groups:
            live = max(self.live_len(layer) for layer in group.layers) if self.prefix_len else group.capacity
            forked[id(group)] = group.fork(live)
        twin.groups = [forked[id(group)] for group in self.groups]
        twin.layers = [
            dataclasses.replace(
                store,
                group=forked[id(store.group)],
                text_valid=None if store.text_valid is None else store.text_valid.clone(),
            )
            for store in self.layers
        ]
        twin.grid_times_s = list(self.grid_times_s)
        twin.timeline = list(self.timeline)
        twin.linear_state = dict(self.linear_state)
        return twin

    # --- crossing a process boundary, moving devices ----------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Pickle only the live slots (the slack and unused capacity stay behind; :meth:`__setstate__`
        restores the capacity), so a memory crosses a process boundary at the size of what it holds."""
        state = self.__dict__.copy()
        trimmed = {}
        for group in self.groups:
            stores = [self.layers[layer] for layer in group.layers]
            if self.prefix_len:
                live = max(self.live_len(layer) for layer in group.layers)
                rows = max(store.visual_len + store.text_len for store in stores)
            else:
                live, rows = group.capacity, group.packed.shape[2]
            trimmed[id(group)] = group.trimmed(live, rows)
        state["groups"] = [trimmed[id(group)] for group in self.groups]
        state["layers"] = [dataclasses.replace(store, group=trimmed[id(store.group)]) for store in self.layers]
        state["capacities"] = [group.capacity for group in self.groups]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        capacities = state.pop("capacities", [])
        self.__dict__.update(state)
        for group, capacity in zip(self.groups, capacities):
            self._resize(group, capacity)

    def to(self, device: torch.device | str | Mapping[int, torch.device | str]) -> "KVMemory":
        """Move every buffer to ``device``, or each layer to its own: ``{model layer: device}`` (a model split over
        devices keeps each layer's keys beside its weights). The offload stores' chunks stay in host memory, their
        mean-key index follows the layer; returns self."""

        def device_of(model_layer: int) -> torch.device | str:
            return device[model_layer] if isinstance(device, Mapping) else device

        placed = {
            memory_layer: model_layer
            for model_layer, memory_layer in enumerate(self.layer_map)
            if memory_layer is not None
        }
        # Each group's layers go where their device says: a group whose layers go to several devices splits.
        moved: list[LayerGroup] = []
        for group in self.groups:
            targets = [torch.device(device_of(placed.get(layer, layer))) for layer in group.layers]
            for target in dict.fromkeys(targets):
                members = [g for g, t in enumerate(targets) if t == target]
                part = group if len(members) == len(targets) else group.part(members)
                part = part.to(target)
                for index, g in enumerate(members):
                    store = self.layers[group.layers[g]]
                    store.group, store.index = part, index
                moved.append(part)
        self.groups = moved
        for store in self.layers:
            target = store.keys.device
            store.text_valid = None if store.text_valid is None else store.text_valid.to(target)
        self.linear_state = {
            layer: {name: t.to(device_of(layer)) for name, t in state.items()}
            for layer, state in self.linear_state.items()
        }
        return self

    @property
    def devices(self) -> list[torch.device]:
        """Each memory layer's device."""
        return [store.keys.device for store in self.layers]
