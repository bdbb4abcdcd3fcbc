"""The KV memory: per-layer key/value tensors, per-head provenance of every visual token, real bytes,
and the occupancy timeline.

Layout per layer ``l``: keys/values ``[1, H_kv, P + L_l, D]`` where the first ``P`` tokens are the text
prefix (never evicted) and the rest are visual tokens in stream order, with provenance
``frame/row/col [H_kv, L_l]`` (frame = temporal grid index). A compression gathers keys, values and
provenance with the same indices, so what a heatmap shows is what the cache holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .models.base import VisualChunk
from .policies.base import LayerView, Selection


@dataclass
class OccupancyEvent:
    """One point of the timeline: the state after an ``append`` or a ``compress``."""

    frame: int  # sampled frames fed so far
    time_s: float  # stream time of the newest frame
    event: str  # "append" | "compress"
    visual_tokens: int
    cache_bytes: int
    ms: float

    def to_dict(self) -> dict:
        return asdict(self)


class KVMemory:
    """A model's KV cache under our control (see the module docstring for the layout)."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.prefix_len = 0
        self.frame: list[torch.Tensor] = []
        self.row: list[torch.Tensor] = []
        self.col: list[torch.Tensor] = []
        self.grid_times_s: list[float] = []  # stream time of each temporal grid ever fed
        self.grid_shape: tuple[int, int] | None = None
        self.timeline: list[OccupancyEvent] = []
        self.max_position = -1  # largest position ever assigned (text after the memory starts above it)

    # --- state ----------------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        return not self.keys

    @property
    def visual_tokens(self) -> int:
        """Visual tokens held by the fullest layer (the number the budget bounds)."""
        return max((f.shape[1] for f in self.frame), default=0)

    @property
    def num_grids(self) -> int:
        return len(self.grid_times_s)

    @property
    def nbytes(self) -> int:
        """Real bytes of the cached keys and values (``element_size * nelement``)."""
        return sum(t.element_size() * t.nelement() for t in (*self.keys, *self.values))

    def to_cache(self):
        """A transformers ``DynamicCache`` over the current tensors, without copying them.

        A forward extends the cache by concatenation (new tensors), so it never writes to the memory:
        this is the fork that ``ask()`` answers on.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache()
        if self.keys:
            layers = []
            for keys, values in zip(self.keys, self.values):
                layer = DynamicLayer()
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
                layers.append(layer)
            cache.layers = layers
        return cache

    # --- writes ---------------------------------------------------------------------------
    def set_prefix(self, cache, prefix_len: int) -> None:
        """Adopt the prefilled text prefix (positions ``0 .. prefix_len-1``)."""
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        self.prefix_len = prefix_len
        device = self.keys[0].device
        empty = torch.zeros(self.num_kv_heads, 0, dtype=torch.int32, device=device)
        self.frame = [empty.clone() for _ in range(self.num_layers)]
        self.row = [empty.clone() for _ in range(self.num_layers)]
        self.col = [empty.clone() for _ in range(self.num_layers)]
        self.max_position = prefix_len - 1

    def append(self, cache, chunk: VisualChunk, max_position: int) -> None:
        """Adopt ``cache`` (the memory extended by ``chunk``'s tokens) and record their provenance."""
        if self.grid_shape is None:
            self.grid_shape = (chunk.rows, chunk.cols)
        elif self.grid_shape != (chunk.rows, chunk.cols):
            raise ValueError(f"frame grid changed mid-stream: {self.grid_shape} -> {(chunk.rows, chunk.cols)}")
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        for store, source in ((self.frame, chunk.grid), (self.row, chunk.row), (self.col, chunk.col)):
            for layer in range(self.num_layers):
                new = source.to(device=store[layer].device, dtype=torch.int32).expand(self.num_kv_heads, -1)
                store[layer] = torch.cat([store[layer], new], dim=1)
        self.grid_times_s.extend(chunk.grid_times_s)
        self.max_position = max(self.max_position, max_position)

    def views(self) -> list[LayerView]:
        """Per-layer views of the visual tokens for a policy (``[H_kv, L, D]`` slices, no copies)."""
        p = self.prefix_len
        newest = self.num_grids - 1
        return [
            LayerView(
                layer=layer,
                num_layers=self.num_layers,
                keys=self.keys[layer][0, :, p:],
                values=self.values[layer][0, :, p:],
                frame=self.frame[layer],
                row=self.row[layer],
                col=self.col[layer],
                grid=self.grid_shape or (0, 0),
                newest_frame=newest,
            )
            for layer in range(self.num_layers)
        ]

    def apply(self, selection: Selection) -> None:
        """Keep, per layer and KV head, the selected visual tokens (and their provenance); prefix untouched."""
        if len(selection.indices) != self.num_layers:
            raise ValueError(f"selection covers {len(selection.indices)} layers, memory has {self.num_layers}")
        p = self.prefix_len
        for layer, index in enumerate(selection.indices):
            index = index.to(self.keys[layer].device)
            heads, keep = index.shape
            if heads != self.num_kv_heads:
                raise ValueError(f"layer {layer}: selection has {heads} heads, memory has {self.num_kv_heads}")
            gather = index[None, :, :, None].expand(1, heads, keep, self.keys[layer].shape[-1])
            for store in (self.keys, self.values):
                tensor = store[layer]
                store[layer] = torch.cat([tensor[:, :, :p], torch.gather(tensor[:, :, p:], 2, gather)], dim=2)
            for store in (self.frame, self.row, self.col):
                store[layer] = torch.gather(store[layer], 1, index.to(store[layer].device))

    def record(self, event: str, frames_fed: int, time_s: float, ms: float) -> OccupancyEvent:
        entry = OccupancyEvent(
            frame=frames_fed,
            time_s=float(time_s),
            event=event,
            visual_tokens=self.visual_tokens,
            cache_bytes=self.nbytes,
            ms=float(ms),
        )
        self.timeline.append(entry)
        return entry

    # --- what survives --------------------------------------------------------------------
    def survival_counts(self, layer: int | None = None, head: int | None = None) -> torch.Tensor:
        """How many (layer, head) copies of each patch survive: ``[num_grids, rows, cols]`` integer counts.

        ``layer``/``head`` restrict to one layer and/or one KV head; the maximum count is
        ``layers * heads`` of the chosen scope.
        """
        if self.grid_shape is None:
            return torch.zeros(0, 0, 0, dtype=torch.int64)
        rows, cols = self.grid_shape
        size = self.num_grids * rows * cols
        layers = range(self.num_layers) if layer is None else [layer]
        counts = torch.zeros(size, dtype=torch.int64)
        for l in layers:
            frame, row, col = self.frame[l], self.row[l], self.col[l]
            if head is not None:
                frame, row, col = frame[head : head + 1], row[head : head + 1], col[head : head + 1]
            flat = (frame.long() * rows + row.long()) * cols + col.long()
            counts += torch.bincount(flat.flatten().cpu(), minlength=size)
        return counts.view(self.num_grids, rows, cols)

    def survival_fraction(self) -> list[float]:
        """Per temporal grid: fraction of its tokens, over all layers and KV heads, still held."""
        if self.grid_shape is None:
            return []
        counts = self.survival_counts().sum(dim=(1, 2)).double()
        total = self.grid_shape[0] * self.grid_shape[1] * self.num_layers * self.num_kv_heads
        return (counts / total).tolist()
