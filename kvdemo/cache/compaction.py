"""A compaction over every layer of a :class:`~kvdemo.cache.layer.LayerGroup` at once: what a policy's
:class:`~kvdemo.policies.contract.Selection` keeps, made true in the memory's buffers.

Per layer and KV head ``h``, which keeps ``c_h`` of its visual tokens, the kept tokens at slots ``>= c_h`` move into
the evicted slots ``< c_h``, the ``i``-th such token (in slot order) into the ``i``-th such slot: every byte moves
once, and at most ``M - C`` tokens per head move. Here that rule runs on the group's rows ``[G * H, L]`` (``L`` its
longest layer): one kept mask, one count of what each row keeps and moves, read back to the host once for the whole
group (it sizes the moves), one list of holes and one of movers, and one move of every layer's key and value rows
(:func:`kvdemo.tensors.move_rows`) and one of their provenance. The policy's reason codes are scattered into the
provenance first, so they move along; the key bias of layers whose heads now hold different numbers of tokens is
refreshed for the group at once. Where a policy closes the position gaps its eviction leaves
(:class:`~kvdemo.policies.contract.PositionShift`), :func:`shift_group` re-rotates the group's keys once after the
move.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tensors import flat_nonzero, move_rows
from .layer import PROVENANCE, PROVENANCE_WIDTH, LayerGroup, LayerMemory


def stack_rows(
    stores: list[LayerMemory], per_layer: list[torch.Tensor | None], length: int, fill: int | bool
) -> torch.Tensor | None:
    """Per-layer ``[H, K]`` tensors of one group stacked as ``[G, H, K]``, narrower ones padded with ``fill``; None
    when every entry is None. As many launches whatever the number of layers: one stack when they are of one width,
    else one concatenation along the width put into the padded stack by one indexed write."""
    if all(t is None for t in per_layer):
        return None
    heads, device = stores[0].heads, stores[0].keys.device
    if any(t is None for t in per_layer):  # a layer with nothing here (rare: CoRDS' uncompressed layers)
        width = max(t.shape[1] if t is not None else length for t in per_layer)
        per_layer = [
            t if t is not None else missing_rows(store, heads, width, fill) for store, t in zip(stores, per_layer)
        ]
    widths = [t.shape[1] for t in per_layer]
    if len(set(widths)) == 1:
        return torch.stack([t.to(device) for t in per_layer])
    joined = torch.cat([t.to(device) for t in per_layer], dim=1)  # [H, sum of widths]
    # Each joined column's layer and place in it, worked out on the host from the widths and copied over once.
    sizes = torch.tensor(widths)
    layer_of = torch.repeat_interleave(torch.arange(len(widths)), sizes)
    place = torch.arange(int(sizes.sum())) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    where = torch.stack([layer_of, place]).to(device)
    out = joined.new_full((len(widths), heads, max(widths)), fill)
    out[where[0][None], torch.arange(heads, device=device)[:, None], where[1][None]] = joined
    return out


def missing_rows(store: LayerMemory, heads: int, width: int, fill: int | bool) -> torch.Tensor:
    """``[H, width]`` for a layer a selection says nothing of: every entry counts (``fill`` False: a valid mask) or
    keeps its slots in order (an index)."""
    device = store.keys.device
    if fill is False:
        return torch.ones(heads, width, dtype=torch.bool, device=device)
    return torch.arange(width, device=device).clamp(max=max(store.visual_len - 1, 0)).expand(heads, -1)


def compact_group(
    group: LayerGroup,
    stores: list[LayerMemory],
    indices: list[torch.Tensor],
    valids: list[torch.Tensor | None],
    reasons: list[torch.Tensor | None],
    start: int,
    moves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> int:
    """Keep, in every layer of ``group`` (``stores`` in group order), the visual tokens ``indices[g] [H, K]`` (``valids``
    mark the entries that count when heads keep different numbers; ``reasons`` the policy's codes, stored per slot),
    as the module docstring says. The provenance moves here; the keys' and values' move is appended to ``moves``, for
    the caller to make with the other groups' (before anything reads them). Returns the key/value bytes moved."""
    layers, heads, device = len(stores), group.heads, group.kv.device
    length = max(store.visual_len for store in stores)
    index = stack_rows(stores, indices, length, 0).long()  # [G, H, K]
    valid = stack_rows(stores, valids, length, False)
    # A kept mask [G, H, L]; entries a ragged selection marks invalid point at a dummy column L.
    target = index if valid is None else index.masked_fill(~valid, length)
    kept = torch.zeros(layers, heads, length + 1, dtype=torch.bool, device=device).scatter_(2, target, True)
    kept = kept[..., :length]
    if group.valid is not None:  # slots a ragged head does not hold are never kept
        kept &= group.valid[:, :, :length]
    reason = stack_rows(stores, reasons, length, 0)
    if reason is not None:
        codes = group.packed[..., PROVENANCE["reason"]]  # [G, H, rows]
        reason = reason.to(codes.dtype)
        if valid is None:
            codes[:, :, :length].scatter_(2, index, reason)
        else:  # the same scatter, the invalid entries landing in a dummy column L
            widened = torch.empty(layers, heads, length + 1, dtype=codes.dtype, device=device)
            widened[..., :length] = codes[:, :, :length]
            codes[:, :, :length] = widened.scatter_(2, target, reason)[..., :length]
    counts = kept.sum(dim=2)  # [G, H]
    slot = torch.arange(length, device=device)
    below = slot < counts[..., None]
    hole = ~kept & below
    moving = hole.sum(dim=2)
    # The one read back for the whole group: what each row keeps (the layers' new lengths) and moves (the size of
    # the move lists).
    counted, moved_per_row = torch.stack([counts, moving]).tolist()
    total = sum(sum(row) for row in moved_per_row)
    # Both lists are sorted by row, and each row has as many holes below c_h as kept tokens above it, so the i-th
    # mover fills the i-th hole of the same row.
    holes = flat_nonzero(hole, total)  # row * L + slot
    movers = flat_nonzero(kept & ~below, total)
    row = torch.div(holes, length, rounding_mode="floor")  # g * H + h
    slot_of_hole, slot_of_mover = holes - row * length, movers - row * length
    rows = group.packed.shape[2]
    packed = group.packed.view(-1, PROVENANCE_WIDTH)
    move_rows([(packed, row * rows + slot_of_hole, row * rows + slot_of_mover)])
    # The key of row g * H + h, slot s is buffer row (g * H + h) * capacity + s; its value value_offset rows later.
    key_row = row * group.capacity + start
    kv_dst = torch.cat((key_row + slot_of_hole, key_row + slot_of_hole + group.value_offset))
    kv_src = torch.cat((key_row + slot_of_mover, key_row + slot_of_mover + group.value_offset))
    moves.append((group.rows(), kv_dst, kv_src))  # holes and movers: disjoint
    for store, kept_counts in zip(stores, counted):
        store.visual_len = max(kept_counts, default=0)
        store.ragged = any(count != store.visual_len for count in kept_counts)
    if group.valid is not None or any(store.ragged for store in stores):
        # Every layer's held slots, written for the whole group at once: head h keeps its first c_h slots.
        group.ensure_valid([store.visual_len for store in stores])[:, :, :length] = slot < counts[..., None]
    return 2 * total * group.kv.shape[-1] * group.kv.element_size()


def refresh_group_bias(group: LayerGroup, stores: list[LayerMemory], start: int) -> None:
    """The key bias of every layer of ``group`` that reads one (or now holds ragged heads): 0 on visual slots a head
    holds and on the slack, ``-inf`` on ragged padding; layers with stream text take the one-layer path
    (:meth:`LayerMemory.refresh_bias`)."""
    batch = [g for g, s in enumerate(stores) if (s.biased or s.ragged) and not s.text_len]
    for g, store in enumerate(stores):
        if store.text_len and (store.biased or store.ragged or store.text_valid is not None):
            store.refresh_bias(start)
    if not batch:
        return
    bias = group.ensure_bias()
    for g in batch:
        stores[g].biased = True
    length = max(stores[g].visual_len for g in batch)
    if len(batch) == len(stores):
        bias[:, :, start:].zero_()
    else:  # a group with layers that read no bias: only the others are refreshed, in one fill
        bias[:, :, start:].index_fill_(0, torch.tensor(batch, device=bias.device), 0)
    if any(stores[g].ragged for g in batch):  # the ragged layers' padding, for all of them at once
        ragged = [s.visual_len if g in batch and s.ragged else 0 for g, s in enumerate(stores)]
        lengths = torch.tensor(ragged, device=bias.device)
        padding = ~group.valid[:, :, :length] & (torch.arange(length, device=bias.device) < lengths[:, None, None])
        bias[:, :, start : start + length].masked_fill_(padding, float("-inf"))


def shift_group(group: LayerGroup, stores: list[LayerMemory], by_grid: torch.Tensor, rotary: Any, start: int) -> int:
    """Move every token the layers of ``group`` hold (visual and stream text) back by its grid's shift ``by_grid
    [grids]`` on every axis: its key re-rotated by ``-shift`` (RoPE composes: rotating a key cached at ``p`` by
    ``-s`` gives the key at ``p - s``; a zero shift rotates by the identity, exactly), its recorded position
    lowered (:class:`~kvdemo.policies.contract.PositionShift`). One rotation of the group's live keys ``[G, H, n,
    D]`` for every layer at once. Returns the key bytes rewritten."""
    length = max(store.visual_len + store.text_len for store in stores)
    if not length:
        return 0
    device = group.kv.device
    packed = group.packed[:, :, :length]  # [G, H, n, 8]
    delta = by_grid.to(device)[packed[..., PROVENANCE["frame"]].long()]  # [G, H, n]
    live = torch.tensor([store.visual_len + store.text_len for store in stores], device=device)
    delta = delta * (torch.arange(length, device=device) < live[:, None, None])  # slack rows stay as they are
    keys = group.kv[0, :, :, start : start + length]
    keys.copy_(rotary.rotate(keys, -delta[..., None].expand(*delta.shape, 3)))
    packed[..., PROVENANCE["position"]] -= delta[..., None].to(packed.dtype)
    return keys.nbytes
