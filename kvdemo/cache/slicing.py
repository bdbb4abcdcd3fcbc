"""What a policy sees of a :class:`~kvdemo.cache.memory.KVMemory`: every layer's visual slots
(:class:`~kvdemo.policies.contract.LayerSlice`, ``[H_kv, L, D]``) and the same as stacks of a group's consecutive
layers of one length (:class:`~kvdemo.policies.contract.SliceStack`, ``[G, H_kv, L, D]``) and each group padded
to its longest layer, views of the memory's
buffers, no copies (:func:`memory_slices`, which :meth:`KVMemory.slices` returns)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..policies.contract import LayerSlice, SliceStack, VisualSlices
from .layer import PROVENANCE, LayerGroup, LayerMemory


class SlicedMemory(Protocol):
    """What slicing reads of a :class:`~kvdemo.cache.memory.KVMemory` (which imports this module)."""

    layers: list[LayerMemory]
    groups: list[LayerGroup]
    num_layers: int
    grid_shape: tuple[int, int] | None
    grid_times_s: list[float]

    @property
    def visual_start(self) -> int: ...

    @property
    def num_grids(self) -> int: ...

    @property
    def summary_slots(self) -> int: ...


def memory_slices(memory: SlicedMemory, rotary: Any = None, probe: list[torch.Tensor] | None = None) -> VisualSlices:
    """What a policy sees: every layer's visual slots (:class:`~kvdemo.policies.contract.LayerSlice`,
    ``[H_kv, L, D]``), the same as stacks of a group's consecutive layers of one length
    (:class:`~kvdemo.policies.contract.SliceStack`, ``[G, H_kv, L, D]``) and, for a pass over layers of different
    lengths, each group as one stack padded to its longest layer (``valid`` marks what each layer's heads hold);
    views of the buffers, no copies. ``probe`` gives each layer's probe queries ``[H_q, T, D]`` (see
    ``LayerSlice.probe``)."""
    layers: list[LayerSlice | None] = [None] * len(memory.layers)
    stacks, padded = [], []
    for group in memory.groups:
        whole = _group_stack(memory, group, probe)
        padded.append(whole)
        run: list[int] = []
        for layer in group.layers:
            store = memory.layers[layer]
            # a run is layers of one visual length; a layer with stream text is a stack of its own (its text
            # per grid differs)
            if run and (store.text_len or store.visual_len != memory.layers[run[0]].visual_len):
                stacks.append(_run(memory, whole, group, run, rotary, layers))
                run = []
            run.append(layer)
            if store.text_len:
                stacks.append(_run(memory, whole, group, run, rotary, layers))
                run = []
        if run:
            stacks.append(_run(memory, whole, group, run, rotary, layers))
        whole.first = layers[group.layers[0]]
    return VisualSlices(layers, stacks, padded)


def _group_stack(memory: SlicedMemory, group: LayerGroup, probe: list[torch.Tensor] | None) -> SliceStack:
    """Every layer of ``group`` as one stack padded to its longest layer (views of the group's buffers; ``valid``
    None when every head of every layer holds every slot of one length). Its ``first`` slice is set by
    :func:`memory_slices`."""
    start, stores = memory.visual_start, [memory.layers[layer] for layer in group.layers]
    lengths = [store.visual_len for store in stores]
    length, device = max(lengths), group.kv.device
    packed = group.packed[:, :, :length]
    frame, order, valid = packed[..., PROVENANCE["frame"]], packed[..., PROVENANCE["order"]], None
    if len(set(lengths)) > 1:
        # A slot past its layer's length repeats the layer's first arrival number and frame (copies), so that
        # neither widens what a row spans (the shared top-k's tie ramp, frame ranks).
        inside = torch.arange(length, device=device) < torch.tensor(lengths, device=device)[:, None, None]
        frame, order = (torch.where(inside, t, t[..., :1]) for t in (frame, order))
        valid = inside.expand(-1, group.heads, -1)
    if any(store.ragged for store in stores):
        valid = group.valid[:, :, :length]
    grid_text = None
    if any(store.text_len for store in stores):
        none = torch.zeros(group.heads, max(memory.num_grids, 1), dtype=torch.long, device=device)
        grid_text = torch.stack([_grid_text(memory, s) if s.text_len else none for s in stores])
    return SliceStack(
        layers=tuple(group.layers),
        keys=group.kv[0, :, :, start : start + length],
        values=group.kv[1, :, :, start : start + length],
        frame=frame,
        row=packed[..., PROVENANCE["row"]],
        col=packed[..., PROVENANCE["col"]],
        order=order,
        position=packed[..., PROVENANCE["position"]],
        valid=valid,
        probe=None if probe is None else torch.stack([probe[layer] for layer in group.layers]),
        # one copy for the group (the counts live on the host)
        offloaded=None if group.offload is None else group.offload.stored.to(device),
        grid_text=grid_text,
        lengths=tuple(lengths) if len(set(lengths)) > 1 else None,
        first=None,  # type: ignore[arg-type]
    )


def _run(
    memory: SlicedMemory,
    whole: SliceStack,
    group: LayerGroup,
    run: list[int],
    rotary: Any,
    layers: list[LayerSlice | None],
) -> SliceStack:
    """The stack of memory layers ``run`` (consecutive in ``group``, of one visual length) as views of the group's
    stack ``whole``, and each of those layers' slice (into ``layers``) as views of the stack."""
    stores = [memory.layers[layer] for layer in run]
    first, length = group.layers.index(run[0]), stores[0].visual_len
    span = slice(first, first + len(run))

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[span, :, :length]

    fields = {
        name: cut(getattr(whole, name)) for name in ("keys", "values", "frame", "row", "col", "order", "position")
    }
    fields.update(
        valid=cut(whole.valid) if any(store.ragged for store in stores) else None,
        probe=None if whole.probe is None else whole.probe[span],
        offloaded=None if whole.offloaded is None else whole.offloaded[span],
        grid_text=None if whole.grid_text is None or not stores[0].text_len else whole.grid_text[span],
    )
    for g, layer in enumerate(run):
        per_layer = {name: None if t is None else t[g] for name, t in fields.items()}
        per_layer["valid"] = stores[g].valid
        layers[layer] = LayerSlice(
            layer=layer,
            num_layers=memory.num_layers,
            grid=memory.grid_shape or (0, 0),
            newest_frame=memory.num_grids - 1,
            rotary=rotary,
            summary_slots=memory.summary_slots,
            grid_times_s=memory.grid_times_s,
            **per_layer,
        )
    return SliceStack(layers=tuple(run), first=layers[run[0]], **fields)


def _grid_text(memory: SlicedMemory, store: LayerMemory) -> torch.Tensor | None:
    """Stream-text slots each head holds per temporal grid ``[H, grids]`` (None without stream text)."""
    if not store.text_len:
        return None
    heads, size = store.packed.shape[0], max(memory.num_grids, 1)
    frame = store.packed[:, store.visual_len : store.visual_len + store.text_len, PROVENANCE["frame"]].long()
    held = store.text_valid if store.text_valid is not None else torch.ones_like(frame, dtype=torch.bool)
    cell = (torch.arange(heads, device=frame.device)[:, None] * size + frame)[held]
    return torch.bincount(cell, minlength=heads * size).view(heads, size)
