"""The memory's buffers (:class:`kvdemo.cache.memory.KVMemory`): one :class:`LayerGroup` per device and dtype holds
its layers' keys, values, provenance and key bias with a layer axis, so one kernel can address every layer of the
group (a compaction's moves, :mod:`kvdemo.cache.compaction`; a policy's batched scoring); each
:class:`LayerMemory` is one layer's view of its group, with the moves that only one layer makes (a chunk's stream
text reordered, tokens offloaded, a policy's summary written). Every move is one gather and one scatter of rows over
all heads on the flattened buffer (:func:`kvdemo.tensors.take_rows`, :func:`kvdemo.tensors.put_rows`); keys and
values share one buffer (keys first, then values, each ``[G, H, capacity, D]``) so they move together, and every
layer's keys are one ``[G * H, capacity, D]`` batch without a copy. ``start`` is where the visual slots begin (after
the prefix and the summary region); the layout is in :mod:`kvdemo.cache.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..policies.contract import OffloadUpdate, SummaryUpdate
from ..tensors import put_rows, take_rows
from .offload import OffloadStore
from .offload_layer import OffloadLayer

#: Reason code of a visual slot appended since the last compression (no policy reason yet).
REASON_NEW = -2
#: Provenance kept per visual slot, packed in one int32 tensor ``[H, rows, 8]`` (a compaction moves it with
#: one gather): field -> its columns. ``order`` is the arrival number of the token in the stream, ``position``
#: the 3-D M-RoPE position its key was rotated at, ``reason`` why the last compression kept it (the policy's
#: code) or ``REASON_NEW``.
PROVENANCE = {"frame": 0, "row": 1, "col": 2, "order": 3, "position": slice(4, 7), "reason": 7}
PROVENANCE_WIDTH = 8
#: The key bias is kept in float32 whatever the cache dtype: a bfloat16 ``log n_k`` is off by up to half an ulp
#: (0.0156 for n_k in [55, 2980], an effective mass 1.6% off). The attention seam keeps it float32 up to the softmax
#: on every device (:func:`kvdemo.cache.attention.mask_dtype`, :func:`kvdemo.cache.attention.bias_needs_float32`).
BIAS_DTYPE = torch.float32


@dataclass(eq=False)
class LayerGroup:
    """The buffers of the memory layers that share a device and a dtype, with a layer axis (index ``g`` holds memory
    layer ``layers[g]``): ``kv [2, G, H, capacity, D]`` (``kv[0]`` the keys, ``kv[1]`` the values),
    ``packed [G, H, rows, 8]`` int32 provenance (:data:`PROVENANCE`; ``rows = capacity - P - S`` once the prefix is
    committed), ``bias [G, H, capacity]`` float32 additive key bias (allocated, zero, when a layer first needs one;
    a layer reads it only once it uses one, :attr:`LayerMemory.bias`), ``valid [G, H, rows]`` bool: which visual
    slots each head of each layer holds, exact for every layer of the group once a compaction first leaves a layer's
    heads holding different numbers (None before: every head holds every slot below its layer's length), so a pass
    reads every layer's held slots as one view whatever their lengths; ``offload``: the group's offload store
    (:class:`~kvdemo.cache.offload.OffloadStore`), None until a policy first offloads."""

    kv: torch.Tensor
    packed: torch.Tensor
    layers: list[int]
    bias: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    offload: OffloadStore | None = None

    @property
    def heads(self) -> int:
        return int(self.kv.shape[2])

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[3])

    def rows(self) -> torch.Tensor:
        """The buffer as rows ``[2 * G * H * capacity, D]``: key ``(g, h, slot)`` is row ``(g * H + h) * capacity +
        slot``, its value :meth:`value_offset` rows later."""
        return self.kv.view(-1, self.kv.shape[-1])

    @property
    def value_offset(self) -> int:
        return int(self.kv.shape[1]) * self.heads * self.capacity

    @classmethod
    def empty(cls, heads: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device) -> LayerGroup:
        """A group of no layers yet (:meth:`add` appends them)."""
        return cls(
            kv=torch.zeros(2, 0, heads, capacity, dim, dtype=dtype, device=device),
            packed=torch.zeros(0, heads, capacity, PROVENANCE_WIDTH, dtype=torch.int32, device=device),
            layers=[],
        )

    def add(self, layer: int) -> int:
        """Room for memory layer ``layer`` (zeros) after the group's layers; returns its index."""
        self.kv = torch.cat([self.kv, self.kv.new_zeros(2, 1, *self.kv.shape[2:])], dim=1)
        self.packed = torch.cat([self.packed, self.packed.new_zeros(1, *self.packed.shape[1:])])
        if self.bias is not None:
            self.bias = torch.cat([self.bias, self.bias.new_zeros(1, *self.bias.shape[1:])])
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_zeros(1, *self.valid.shape[1:])])
        self.layers.append(layer)
        return len(self.layers) - 1

    def resize(self, capacity: int, rows: int) -> None:
        """Reallocate every layer's buffers with ``capacity`` slots and ``rows`` provenance rows (>= what they hold),
        copying their content."""
        old, kept = self.capacity, min(rows, self.packed.shape[2])  # provenance rows past the stream hold nothing
        kv = self.kv.new_zeros(*self.kv.shape[:3], capacity, self.kv.shape[4])
        kv[:, :, :, : min(old, capacity)] = self.kv[:, :, :, :capacity]
        packed = self.packed.new_zeros(*self.packed.shape[:2], rows, PROVENANCE_WIDTH)
        packed[:, :, :kept] = self.packed[:, :, :kept]
        self.kv, self.packed = kv, packed
        if self.valid is not None:
            valid = self.valid.new_zeros(*self.valid.shape[:2], rows)
            valid[:, :, :kept] = self.valid[:, :, :kept]
            self.valid = valid
        if self.bias is not None:
            bias = self.bias.new_zeros(*self.bias.shape[:2], capacity)
            bias[:, :, : min(old, capacity)] = self.bias[:, :, :capacity]
            self.bias = bias

    def write_summary(
        self, summary: SummaryUpdate, parts: list[int], members: list[int], prefix: int, start: int, slots: int
    ) -> None:
        """Write a policy's summary entries into the summary region ``[prefix, start)`` of the group's layers
        ``members`` (indices into the group), which are the layers ``parts`` of ``summary`` (its rows ``[part * H,
        (part + 1) * H)``): its keys and values at their slots in one put of rows each, the bias of every slot in one
        write (``slots`` is the size of the region the memory reserves). The caller marks those layers as reading
        their bias."""
        heads, capacity, dim, device = self.heads, self.capacity, self.kv.shape[-1], self.kv.device
        if summary.bias.shape[1] != slots:
            raise ValueError(f"summary has {summary.bias.shape[1]} slots, memory reserves {slots}")
        keys, values, bias, where = (
            _rows_of(t, parts, heads) for t in (summary.keys, summary.values, summary.bias, summary.slots)
        )
        if where is None:  # every slot in order
            where = torch.arange(keys.shape[1], device=device).expand(keys.shape[0], -1)
        if where.numel():
            first = _rows_of(torch.arange(self.kv.shape[1] * heads, device=device), members, heads) * capacity
            rows = (first[:, None] + prefix + where.to(device)).flatten()
            flat = self.rows()
            put_rows(flat, rows, keys.reshape(-1, dim).to(device, self.kv.dtype))
            put_rows(flat, rows + self.value_offset, values.reshape(-1, dim).to(device, self.kv.dtype))
        target = self.ensure_bias()
        bias = bias.view(len(members), heads, -1).to(device, target.dtype)
        if members == list(range(members[0], members[0] + len(members))):
            target[members[0] : members[0] + len(members), :, prefix:start] = bias
        else:
            target[torch.tensor(members, device=device), :, prefix:start] = bias

    def ensure_bias(self) -> torch.Tensor:
        """The group's key bias, allocated (zero) on first use."""
        if self.bias is None:
            shape = (self.kv.shape[1], self.heads, self.capacity)
            self.bias = torch.zeros(shape, dtype=BIAS_DTYPE, device=self.kv.device)
        return self.bias

    def ensure_valid(self, lengths: list[int]) -> torch.Tensor:
        """The group's held-slot mask, allocated on first use as every head holding every slot below its layer's
        length (``lengths``, one per layer)."""
        if self.valid is None:
            rows = torch.arange(self.packed.shape[2], device=self.kv.device)
            held = torch.tensor(lengths, device=self.kv.device)
            self.valid = (rows < held[:, None]).unsqueeze(1).expand(-1, self.heads, -1).contiguous()
        return self.valid

    def offload_tokens(self, update: OffloadUpdate, first: int, start: int) -> int:
        """Copy the tokens ``update`` names (slice indices of the group's layers ``first ..``, consecutive) into the
        group's offload store, before the compaction moves them: every layer of the update in one gather of key and
        value rows and one of their provenance, with one read of what sizes the writes (which tokens count, their
        blocks, what each head retrieves). Returns the key/value bytes copied."""
        layers, heads, dim = len(update.layers), self.heads, self.kv.shape[-1]
        if self.offload is None:
            self.offload = OffloadStore.empty(len(self.layers), heads, dim, update.chunk, self.kv.dtype, self.kv.device)
        store = self.offload
        store.counted, store.rule = bool(update.counted), update.rule
        index = update.tokens.to(self.kv.device).long()
        sizes = [update.valid.long().flatten(), update.retrieve.long().flatten().to(self.kv.device)]
        if update.block is not None:
            sizes.append(update.block.long().flatten().to(self.kv.device))
        read = torch.cat(sizes).cpu()  # the one read of what sizes the writes
        cells = index.numel()
        store.retrieve[first : first + layers] = read[cells : cells + layers * heads].view(layers, heads)
        if cells == 0:
            return 0
        marks = read[:cells].view(1, *index.shape)
        if update.block is not None:
            marks = torch.stack([marks[0], read[cells + layers * heads :].view(index.shape)])
        slot0 = (first + torch.arange(layers, device=index.device))[:, None] * heads + torch.arange(
            heads, device=index.device
        )
        key_rows = slot0[..., None] * self.capacity + start + index  # [G', H, E] rows of self.rows()
        packed = self.packed[first : first + layers]  # [G', H, rows, 8]
        taken = torch.gather(packed, 2, index[..., None].expand(-1, -1, -1, PROVENANCE_WIDTH))
        columns = [PROVENANCE[name] for name in ("frame", "row", "col", "order")]
        provenance = taken[..., columns].permute(3, 0, 1, 2).cpu()  # [4, G', H, E]
        return store.add(
            first,
            self.rows(),
            key_rows,
            self.value_offset,
            marks,
            provenance,
            update.block is not None,
            update.index_keys,
        )

    def trimmed(self, live: int, rows: int) -> LayerGroup:
        """A copy holding the first ``live`` slots and ``rows`` provenance rows (what crosses a process boundary)."""
        bias = None if self.bias is None else self.bias[:, :, :live].clone()
        valid = None if self.valid is None else self.valid[:, :, :rows].clone()
        offload = None if self.offload is None else self.offload.trimmed()
        return LayerGroup(
            self.kv[:, :, :, :live].clone(),
            self.packed[:, :, :rows].clone(),
            list(self.layers),
            bias,
            valid,
            offload,
        )

    def fork(self, live: int) -> LayerGroup:
        """A copy with the same capacity whose first ``live`` slots (what attention reads) hold this group's, its
        slack zero, for a question to write into while this group goes on taking chunks (:meth:`KVMemory.fork
        <kvdemo.cache.memory.KVMemory.fork>`)."""
        kv = torch.zeros_like(self.kv)
        kv[:, :, :, :live] = self.kv[:, :, :, :live]
        return LayerGroup(
            kv,
            self.packed.clone(),
            list(self.layers),
            None if self.bias is None else self.bias.clone(),
            None if self.valid is None else self.valid.clone(),
            None if self.offload is None else self.offload.fork(),
        )

    def to(self, device: torch.device | str) -> LayerGroup:
        return LayerGroup(
            self.kv.to(device),
            self.packed.to(device),
            list(self.layers),
            None if self.bias is None else self.bias.to(device),
            None if self.valid is None else self.valid.to(device),
            None if self.offload is None else self.offload.to(device),
        )

    def part(self, members: list[int]) -> LayerGroup:
        """The layers ``members`` (indices into this group) as a group of their own (copies)."""
        index = torch.tensor(members, device=self.kv.device)
        return LayerGroup(
            self.kv.index_select(1, index),
            self.packed.index_select(0, index),
            [self.layers[g] for g in members],
            None if self.bias is None else self.bias.index_select(0, index),
            None if self.valid is None else self.valid.index_select(0, index),
            None if self.offload is None else self.offload.part(members),
        )


@dataclass(eq=False)
class LayerMemory:
    """One layer's view of its group's buffers (see the module docstring for the layout): ``keys``/``values``
    ``[1, H, capacity, D]``, ``packed [H, rows, 8]`` its provenance, ``bias [H, capacity]`` its key bias once it uses
    one (None before: plain attention)."""

    group: LayerGroup
    index: int
    visual_len: int = 0  # L: visual slots in use (the fullest head's count when ragged)
    ragged: bool = False  # whether its heads hold different numbers of tokens (then ``valid`` says which)
    text_len: int = 0  # T: stream-text slots after the visual ones (the fullest head's count when ragged)
    text_valid: torch.Tensor | None = None  # [H, T] bool when heads hold different numbers of text slots
    biased: bool = False  # whether attention reads this layer's bias (a ragged head, a summary region)

    @property
    def packed(self) -> torch.Tensor:
        """``[H, rows, 8]`` int32 provenance, see :data:`PROVENANCE`."""
        return self.group.packed[self.index]

    @property
    def valid(self) -> torch.Tensor | None:
        """``[H, L]`` bool, the slots each head holds, when its heads hold different numbers of tokens (a view of the
        group's mask); None when every head holds every slot."""
        return self.group.valid[self.index, :, : self.visual_len] if self.ragged else None

    @property
    def offload(self) -> OffloadLayer | None:
        """This layer's part of its group's offload store (tokens some heads keep off the device, retrieved while
        answering), None while the group offloads nothing."""
        return None if self.group.offload is None else OffloadLayer(self.group.offload, self.index)

    @property
    def bias(self) -> torch.Tensor | None:
        """``[H, capacity]`` float32 additive key bias (0 = plain attention), None if this layer never used one."""
        return self.group.bias[self.index] if self.biased else None

    def use_bias(self) -> torch.Tensor:
        """This layer's bias, from now on read by attention."""
        self.biased = True
        return self.group.ensure_bias()[self.index]

    @property
    def heads(self) -> int:
        return self.group.heads

    @property
    def keys(self) -> torch.Tensor:
        """``[1, H, capacity, D]``."""
        return self.group.kv[0, self.index : self.index + 1]

    @property
    def values(self) -> torch.Tensor:
        return self.group.kv[1, self.index : self.index + 1]

    def head_rows(self, device: torch.device) -> torch.Tensor:
        """``[2H]`` the group buffer's row (:meth:`LayerGroup.rows`) of slot 0 of each of this layer's key heads, then
        of each value head."""
        first = (self.index * self.heads + torch.arange(self.heads, device=device)) * self.capacity
        return torch.cat([first, first + self.group.value_offset])

    @property
    def provenance(self) -> dict[str, torch.Tensor]:
        """Each provenance field as a view ``[H, rows]`` (``position``: ``[H, rows, 3]``) of ``packed``."""
        return {name: self.packed[..., column] for name, column in PROVENANCE.items()}

    @property
    def capacity(self) -> int:
        return self.group.capacity

    # --- moves -------------------------------------------------------------------------------
    def reorder_stream_text(self, text: torch.Tensor, start: int) -> None:
        """Rows ``[L, L + T + n)`` after the visual slots hold the stream text ``T`` then a new chunk of ``n``
        tokens (``text [n]`` marks its text); reorder them to the chunk's visual tokens, the text held, the
        chunk's text (keys, values and provenance, every head alike: one gather each)."""
        held, device = self.text_len, self.keys.device
        new_visual = torch.nonzero(~text).squeeze(1) + held
        new_text = torch.nonzero(text).squeeze(1) + held
        order = torch.cat(
            [new_visual.to(device), torch.arange(held, device=device), new_text.to(device)]
        )  # source row of each target row
        width = int(order.numel())
        base = start + self.visual_len
        flat = self.group.rows()
        offsets = self.head_rows(device)[:, None] + base
        put_rows(
            flat, (offsets + torch.arange(width, device=device)).flatten(), take_rows(flat, (offsets + order).flatten())
        )
        heads, rows = self.packed.shape[:2]
        packed = self.packed.view(heads * rows, PROVENANCE_WIDTH)
        offsets = torch.arange(heads, device=device)[:, None] * rows + self.visual_len
        put_rows(
            packed,
            (offsets + torch.arange(width, device=device)).flatten(),
            take_rows(packed, (offsets + order).flatten()),
        )

    def compact_stream_text(self, held: int, start: int, grids: int) -> int:
        """After a visual compaction (``held`` visual slots before it): per head, keep the stream text of the grids
        that still have a visual token in that head, moved down to follow the visual slots; returns the
        key/value bytes moved."""
        heads, device = self.packed.shape[0], self.keys.device
        frame_of = self.packed[..., PROVENANCE["frame"]]
        size = max(grids, 1)
        visual = frame_of[:, : self.visual_len].long()
        shown = self.valid if self.valid is not None else torch.ones_like(visual, dtype=torch.bool)
        has_visual = torch.zeros(heads, size + 1, dtype=torch.bool, device=device)
        has_visual.scatter_(1, torch.where(shown, visual, size), True)
        text_frame = frame_of[:, held : held + self.text_len].long()
        keep = torch.gather(has_visual, 1, text_frame)
        if self.text_valid is not None:
            keep &= self.text_valid
        counts = keep.sum(dim=1)
        h, j = torch.nonzero(keep, as_tuple=True)
        target = torch.cumsum(keep.long(), dim=1)[h, j] - 1
        rows = self.packed.shape[1]
        first = self.head_rows(device).view(2, heads)[:, h]  # [2, n]: each kept text slot's key and value head row
        flat = self.group.rows()
        kv_src = (first + start + held + j[None]).flatten()
        kv_dst = (first + start + self.visual_len + target[None]).flatten()
        put_rows(flat, kv_dst, take_rows(flat, kv_src))
        packed = self.packed.view(heads * rows, PROVENANCE_WIDTH)
        put_rows(packed, h * rows + self.visual_len + target, take_rows(packed, h * rows + held + j))
        new_len = int(counts.max()) if heads else 0
        slot = torch.arange(new_len, device=device)
        self.text_valid = None if bool((counts == new_len).all()) else slot[None] < counts[:, None]
        self.text_len = new_len
        return int(kv_src.numel()) * self.keys.shape[-1] * self.keys.element_size()

    def refresh_bias(self, start: int) -> None:
        """Visual and stream-text slots: 0 where a head holds a token, ``-inf`` on ragged padding; the slack
        back to 0."""
        bias = self.use_bias()
        bias[:, start:].zero_()
        if self.valid is not None:
            bias[:, start : start + self.visual_len].masked_fill_(~self.valid, float("-inf"))
        if self.text_valid is not None:
            text = start + self.visual_len
            bias[:, text : text + self.text_len].masked_fill_(~self.text_valid, float("-inf"))

    def write_summary(self, summary: SummaryUpdate, prefix: int, start: int, slots: int) -> None:
        """Write a policy's summary entries for this layer (``summary`` of one layer): keys/values at their slots, the
        bias of every slot (:meth:`LayerGroup.write_summary`); attention reads the bias from now on."""
        self.group.write_summary(summary, [0], [self.index], prefix, start, slots)
        self.biased = True


def _rows_of(t: torch.Tensor | None, parts: list[int], heads: int) -> torch.Tensor | None:
    """Rows ``[part * heads, (part + 1) * heads)`` of ``t [n * heads, ...]`` for each of ``parts``, in that order: a view
    when they are consecutive, else one gather (None for None)."""
    if t is None:
        return None
    if parts == list(range(parts[0], parts[0] + len(parts))):
        return t[parts[0] * heads : (parts[0] + len(parts)) * heads]
    index = torch.tensor(parts, device=t.device)[:, None] * heads + torch.arange(heads, device=t.device)
    return t.index_select(0, index.flatten())
