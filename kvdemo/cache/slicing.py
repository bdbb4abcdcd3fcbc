"""What a policy sees of a :class:`~kvdemo.cache.memory.KVMemory`: every layer's visual slots
(:class:`~kvdemo.policies.contract.LayerSlice`, ``[H_kv, L, D]``) and the same as stacks of a group's consecutive
layers of one length (:class:`~kvdemo.policies.contract.SliceStack`, ``[G, H_kv, L, D]``), views of the memory's
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
    ``[H_kv, L, D]``) and the same as stacks of a group's consecutive layers of one length
    (:class:`~kvdemo.policies.contract.SliceStack`, ``[G, H_kv, L, D]``), views of the buffers, no copies;
    ``probe`` gives each layer's probe queries ``[H_q, T, D]`` (see ``LayerSlice.probe``)."""
    layers: list[LayerSlice | None] = [None] * len(memory.layers)
    stacks = []
    for group in memory.groups:
        run: list[int] = []
        for layer in group.layers:
            store = memory.layers[layer]
            # a run is layers of one visual length; a layer with stream text is a stack of its own (its text
            # per grid differs)
            if run and (store.text_len or store.visual_len != memory.layers[run[0]].visual_len):
                stacks.append(_stack(memory, group, run, rotary, probe, layers))
                run = []
            run.append(layer)
            if store.text_len:
                stacks.append(_stack(memory, group, run, rotary, probe, layers))
                run = []
        if run:
            stacks.append(_stack(memory, group, run, rotary, probe, layers))
    return VisualSlices(layers, stacks)


def _stack(
    memory: SlicedMemory,
    group: LayerGroup,
    run: list[int],
    rotary: Any,
    probe: list[torch.Tensor] | None,
    layers: list[LayerSlice | None],
) -> SliceStack:
    """The stack of memory layers ``run`` (consecutive in ``group``, of one visual length) as views of the
    group's buffers, and each of those layers' slice (into ``layers``) as views of the stack."""
    start, stores = memory.visual_start, [memory.layers[layer] for layer in run]
    first, length, device = group.layers.index(run[0]), stores[0].visual_len, group.kv.device
    span = slice(first, first + len(run))
    packed = group.packed[span, :, :length]
    valid = None
    if any(store.valid is not None for store in stores):
        every = torch.ones(group.heads, length, dtype=torch.bool, device=device)
        valid = torch.stack([store.valid if store.valid is not None else every for store in stores])
    offloaded = None
    if any(store.offload is not None for store in stores):
        counts = [
            store.offload.tokens
            if store.offload is not None
            else torch.zeros(group.heads, dtype=torch.long, device="cpu")
            for store in stores
        ]
        offloaded = torch.stack(counts).to(device)  # one copy for the stack (the counts live on the host)
    grid_text = _grid_text(memory, stores[0]) if stores[0].text_len else None
    fields = dict(
        keys=group.kv[0, span, :, start : start + length],
        values=group.kv[1, span, :, start : start + length],
        frame=packed[..., PROVENANCE["frame"]],
        row=packed[..., PROVENANCE["row"]],
        col=packed[..., PROVENANCE["col"]],
        order=packed[..., PROVENANCE["order"]],
        position=packed[..., PROVENANCE["position"]],
        valid=valid,
        probe=None if probe is None else torch.stack([probe[layer] for layer in run]),
        offloaded=offloaded,
        grid_text=None if grid_text is None else grid_text[None],
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
