"""One layer of the memory (:class:`kvdemo.cache.memory.KVMemory`): its buffers and provenance, and the moves that keep
them compact. Every move is one gather and one scatter of rows over all heads on the flattened buffer
(:func:`kvdemo.tensors.take_rows`, :func:`kvdemo.tensors.put_rows`; a compaction's :func:`kvdemo.tensors.move_rows`,
split across threads on a CPU); keys
(heads ``0..H-1``) and values (heads ``H..2H-1``) share one buffer so they move together. ``start`` is where the
visual slots begin (after the prefix and the summary region); the layout is in :mod:`kvdemo.cache.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..policies.contract import OffloadUpdate, SummaryUpdate
from ..tensors import flat_nonzero, move_rows, owners, put_rows, take_rows
from .offload import OffloadStore

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


@dataclass
class LayerMemory:
    """One layer's buffers (see the module docstring for the layout).

    Keys and values share one buffer ``kv [1, 2H, capacity, D]`` (keys are heads ``0..H-1``), so a
    compaction moves both with one gather; ``keys``/``values`` are its two halves (contiguous views).
    """

    kv: torch.Tensor
    packed: torch.Tensor  # [H, capacity - P - S, 8] int32 provenance, see PROVENANCE
    bias: torch.Tensor | None = (
        None  # [H, capacity] float32 additive key bias (0 = plain attention), None if never used
    )
    visual_len: int = 0  # L: visual slots in use (the fullest head's count when ragged)
    valid: torch.Tensor | None = None  # [H, L] bool when heads hold different numbers of tokens
    offload: OffloadStore | None = None  # tokens some heads keep off the device, retrieved at decode time
    text_len: int = 0  # T: stream-text slots after the visual ones (the fullest head's count when ragged)
    text_valid: torch.Tensor | None = None  # [H, T] bool when heads hold different numbers of text slots

    @property
    def heads(self) -> int:
        return int(self.kv.shape[1]) // 2

    @property
    def keys(self) -> torch.Tensor:
        """``[1, H, capacity, D]``."""
        return self.kv[:, : self.heads]

    @property
    def values(self) -> torch.Tensor:
        return self.kv[:, self.heads :]

    @property
    def provenance(self) -> dict[str, torch.Tensor]:
        """Each provenance field as a view ``[H, rows]`` (``position``: ``[H, rows, 3]``) of ``packed``."""
        return {name: self.packed[..., column] for name, column in PROVENANCE.items()}

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[2])

    # --- moves -------------------------------------------------------------------------------
    def reorder_stream_text(self, text: torch.Tensor, start: int) -> None:
        """Rows ``[L, L + T + n)`` after the visual slots hold the stream text ``T`` then a new chunk of ``n``
        tokens (``text [n]`` marks its text); reorder them to the chunk's visual tokens, the text held, the
        chunk's text (keys, values and provenance, every head alike: one gather each)."""
        held, device = self.text_len, self.kv.device
        new_visual = torch.nonzero(~text).squeeze(1) + held
        new_text = torch.nonzero(text).squeeze(1) + held
        order = torch.cat(
            [new_visual.to(device), torch.arange(held, device=device), new_text.to(device)]
        )  # source row of each target row
        width = int(order.numel())
        base = start + self.visual_len
        heads2, capacity = self.kv.shape[1], self.capacity
        flat = self.kv.view(heads2 * capacity, self.kv.shape[-1])
        offsets = torch.arange(heads2, device=device)[:, None] * capacity + base
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

    def compact(
        self,
        index: torch.Tensor,
        valid: torch.Tensor | None,
        reason: torch.Tensor | None,
        start: int,
        moves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> int:
        """Keep the visual tokens ``index [H, keep]`` (``valid`` marks the entries that count when heads keep different
        numbers; ``reason`` the policy's codes, stored per slot): kept tokens at slots ``>= c_h`` move into head
        ``h``'s evicted slots ``< c_h``, keys, values and provenance, one gather each. Returns the bytes moved.
        ``moves``: the keys' and values' move is appended there, for the caller to make with other layers'
        (:func:`kvdemo.tensors.move_rows`) before anything reads this layer's keys and values; None: made here."""
        heads = self.heads
        device = self.keys.device
        length = self.visual_len
        index = index.to(device=device, dtype=torch.long)
        # A kept mask [H, L]; entries a ragged selection marks invalid point at a dummy column L.
        target = index if valid is None else index.masked_fill(~valid.to(device), length)
        kept = torch.zeros(heads, length + 1, dtype=torch.bool, device=device).scatter_(1, target, True)[:, :length]
        if self.valid is not None:
            kept &= self.valid
        if reason is not None:
            codes = self.provenance["reason"]
            reason = reason.to(device=device, dtype=codes.dtype)
            if valid is None:
                codes[:, :length].scatter_(1, index, reason)
            else:  # the same scatter, the invalid entries landing in a dummy column L
                widened = torch.empty(heads, length + 1, dtype=codes.dtype, device=device)
                widened[:, :length] = codes[:, :length]
                codes[:, :length] = widened.scatter_(1, target, reason)[:, :length]
        counts = kept.sum(dim=1)  # [H]
        slot = torch.arange(length, device=device)
        below = slot[None] < counts[:, None]
        hole = ~kept & below
        holes = flat_nonzero(hole)  # head * L + slot, sorted
        movers = flat_nonzero(kept & ~below)
        # Both lists are sorted by head, and each head has as many holes below c_h as kept tokens above
        # it, so the i-th mover fills the i-th hole of the same head.
        # owners: the count is known, so a GPU does not wait to learn it (likewise one read of the counts below).
        head = owners(hole.sum(dim=1), holes.numel())
        slot_of_hole, slot_of_mover = holes - head * length, movers - head * length
        rows = self.packed.shape[1]
        packed = self.packed.view(heads * rows, PROVENANCE_WIDTH)
        move_rows([(packed, head * rows + slot_of_hole, head * rows + slot_of_mover)])
        # Keys (heads 0..H-1) and values (heads H..2H-1) of one buffer move with one gather.
        capacity = self.capacity
        key_dst = head * capacity + start + slot_of_hole
        key_src = head * capacity + start + slot_of_mover
        kv_dst = torch.cat((key_dst, key_dst + heads * capacity))
        kv_src = torch.cat((key_src, key_src + heads * capacity))
        kv_move = (self.kv.view(2 * heads * capacity, self.kv.shape[-1]), kv_dst, kv_src)  # holes and movers: disjoint
        if moves is None:
            move_rows([kv_move])
        else:
            moves.append(kv_move)
        held = counts.tolist()
        new_len = max(held, default=0)
        if all(count == new_len for count in held):
            self.valid = None
        else:
            self.valid = slot[None, :new_len] < counts[:, None]
        self.visual_len = new_len
        return int(kv_src.numel()) * self.kv.shape[-1] * self.kv.element_size()

    def offload_tokens(self, update: OffloadUpdate, start: int) -> int:
        """Copy the tokens ``update`` names (view indices) into the layer's offload store, before compaction."""
        heads, dim = self.keys.shape[1], self.keys.shape[-1]
        if self.offload is None:
            self.offload = OffloadStore.empty(heads, dim, update.chunk, self.keys.dtype, self.keys.device)
        self.offload.retrieve = update.retrieve.cpu().long()
        self.offload.counted = bool(update.counted)
        if update.tokens.numel() == 0:
            return 0
        index = update.tokens.to(self.kv.device)
        capacity = self.capacity
        # Rows of the buffer kv [1, 2H, capacity, D]: key (h, slot) is row h * capacity + slot, its value H rows of
        # heads later.
        key_rows = torch.arange(heads, device=index.device)[:, None] * capacity + start + index
        provenance = {
            name: torch.gather(self.provenance[name][:, : self.visual_len], 1, index)
            for name in ("frame", "row", "col", "order")
        }
        rows = self.kv.view(2 * heads * capacity, dim)
        return self.offload.add_rows(rows, key_rows, key_rows + heads * capacity, update.valid, provenance)

    def compact_stream_text(self, held: int, start: int, grids: int) -> int:
        """After a visual compaction (``held`` visual slots before it): per head, keep the stream text of the grids
        that still have a visual token in that head, moved down to follow the visual slots; returns the
        key/value bytes moved."""
        heads, device = self.packed.shape[0], self.kv.device
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
        capacity, rows = self.capacity, self.packed.shape[1]
        both = torch.tensor([0, heads], device=device)[:, None]
        flat = self.kv.view(2 * heads * capacity, self.kv.shape[-1])
        kv_src = ((h[None] + both) * capacity + start + held + j[None]).flatten()
        kv_dst = ((h[None] + both) * capacity + start + self.visual_len + target[None]).flatten()
        put_rows(flat, kv_dst, take_rows(flat, kv_src))
        packed = self.packed.view(heads * rows, PROVENANCE_WIDTH)
        put_rows(packed, h * rows + self.visual_len + target, take_rows(packed, h * rows + held + j))
        new_len = int(counts.max()) if heads else 0
        slot = torch.arange(new_len, device=device)
        self.text_valid = None if bool((counts == new_len).all()) else slot[None] < counts[:, None]
        self.text_len = new_len
        return int(kv_src.numel()) * self.kv.shape[-1] * self.kv.element_size()

    def refresh_bias(self, start: int) -> None:
        """Visual and stream-text slots: 0 where a head holds a token, ``-inf`` on ragged padding; the slack
        back to 0."""
        if self.bias is None:
            self.bias = torch.zeros(self.keys.shape[1], self.capacity, dtype=BIAS_DTYPE, device=self.keys.device)
        self.bias[:, start:].zero_()
        if self.valid is not None:
            self.bias[:, start : start + self.visual_len].masked_fill_(~self.valid, float("-inf"))
        if self.text_valid is not None:
            text = start + self.visual_len
            self.bias[:, text : text + self.text_len].masked_fill_(~self.text_valid, float("-inf"))

    def write_summary(self, summary: SummaryUpdate, prefix: int, start: int, slots: int) -> None:
        """Write a policy's summary entries: keys/values at their slots, the bias of every slot."""
        if summary.bias.shape[1] != slots:
            raise ValueError(f"summary has {summary.bias.shape[1]} slots, memory reserves {slots}")
        p, s = prefix, start
        if summary.slots is None:
            self.keys[0, :, p:s] = summary.keys.to(self.keys.dtype)
            self.values[0, :, p:s] = summary.values.to(self.values.dtype)
        elif summary.slots.numel():
            heads, capacity, dim = self.keys.shape[1], self.capacity, self.keys.shape[-1]
            rows = (torch.arange(heads, device=summary.slots.device)[:, None] * capacity + p + summary.slots).flatten()
            rows = rows.to(self.keys.device)
            put_rows(
                self.keys.view(heads * capacity, dim),
                rows,
                summary.keys.reshape(-1, dim).to(self.keys.device, self.keys.dtype),
            )
            put_rows(
                self.values.view(heads * capacity, dim),
                rows,
                summary.values.reshape(-1, dim).to(self.values.device, self.values.dtype),
            )
        self.bias[:, p:s] = summary.bias.to(self.bias.dtype)
