"""What survives of each frame: counts of the (layer, KV head) copies of every patch a memory still holds,
read from provenance. Views and reports read these; the memory's write path never does."""

from __future__ import annotations

import torch

from ..cache.memory import KVMemory


def survival_counts(memory: KVMemory, layer: int | None = None, head: int | None = None) -> torch.Tensor:
    """How many (layer, head) copies of each patch survive: ``[num_grids, rows, cols]`` integer counts.

    ``layer``/``head`` restrict to one layer and/or one KV head; the maximum count is
    ``layers * heads`` of the chosen scope.
    """
    if memory.grid_shape is None:
        return torch.zeros(0, 0, 0, dtype=torch.int64)
    rows, cols = memory.grid_shape
    size = memory.num_grids * rows * cols
    layers = range(memory.num_layers) if layer is None else [layer]
    counts = torch.zeros(size, dtype=torch.int64)
    for l in layers:
        store = memory.layers[l]
        frame, row, col = (store.provenance[n][:, : store.visual_len] for n in ("frame", "row", "col"))
        held = store.valid if store.valid is not None else torch.ones_like(frame, dtype=torch.bool)
        if head is not None:
            frame, row, col, held = (t[head : head + 1] for t in (frame, row, col, held))
        flat = ((frame.long() * rows + row.long()) * cols + col.long())[held]
        counts += torch.bincount(flat.cpu(), minlength=size)
    return counts.view(memory.num_grids, rows, cols)


def survival_fraction(memory: KVMemory) -> list[float]:
    """Per temporal grid: fraction of its tokens, over all layers and KV heads, still held."""
    if memory.grid_shape is None:
        return []
    counts = survival_counts(memory).sum(dim=(1, 2)).double()
    total = memory.grid_shape[0] * memory.grid_shape[1] * memory.num_layers * memory.num_kv_heads
    return (counts / total).tolist()
