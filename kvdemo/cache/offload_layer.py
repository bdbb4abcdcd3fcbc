"""One layer's part of a group's :class:`~kvdemo.cache.offload.OffloadStore`, read as that layer's own store: what
the views, the reports and the attention seam read of it (:attr:`kvdemo.cache.layer.LayerMemory.offload`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..policies.contract import RetrievalRule
from .offload import OffloadStore


class OffloadLayer:
    """One layer of an :class:`OffloadStore` (index ``g`` of its group), read as one layer's store: ``count``,
    ``stored`` (``tokens``), ``retrieve [H]``, ``mean_keys [H, capacity, D]``, ``retrieved [H, capacity]`` (views of
    the store's), ``last_fetched``, :meth:`fetch`, :meth:`head_chunks` and :meth:`by_head`."""

    def __init__(self, store: OffloadStore, index: int) -> None:
        self.store, self.index = store, index

    @property
    def chunk(self) -> int:
        return self.store.chunk

    @property
    def counted(self) -> bool:
        return self.store.counted

    @property
    def rule(self) -> RetrievalRule:
        return self.store.rule

    @property
    def capacity(self) -> int:
        """Chunks per head this layer's table (and mean-key index) has room for."""
        return self.store.widths[self.index]

    @property
    def count(self) -> torch.Tensor:
        """Chunks stored per head ``[H]``."""
        return self.store.count[self.index]

    @property
    def stored(self) -> torch.Tensor:
        """Tokens stored per head ``[H]``."""
        return self.store.stored[self.index]

    tokens = stored

    @property
    def retrieve(self) -> torch.Tensor:
        """Tokens each head brings back per forward while answering ``[H]``."""
        return self.store.retrieve[self.index]

    @retrieve.setter
    def retrieve(self, value: torch.Tensor) -> None:
        self.store.retrieve[self.index] = value

    @property
    def mean_keys(self) -> torch.Tensor:
        return self.store.mean_keys[self.index, :, : self.capacity]

    @property
    def retrieved(self) -> torch.Tensor:
        """``[H, capacity]`` the chunks each head brought back during the last question."""
        return self.store.retrieved[self.index, :, : self.capacity]

    @retrieved.setter
    def retrieved(self, value: torch.Tensor) -> None:
        self.store.retrieved[self.index].zero_()
        self.store.retrieved[self.index, :, : value.shape[1]] = value.to(self.store.retrieved.device)

    @property
    def last_fetched(self) -> torch.Tensor | None:
        return self.store.last_fetched[self.index]

    @property
    def nbytes(self) -> int:
        """Real bytes of this layer's stored keys and values."""
        store = self.store
        return int(self.count.sum()) * 2 * store.chunk * store.keys.shape[-1] * store.keys.element_size()

    def reserved(self) -> torch.Tensor:
        """Tokens each head may bring back while answering ``[H]``: its whole chunks of ``retrieve``, as many as it
        stores (what a forward's retrieval holds at most)."""
        return torch.minimum(self.retrieve // self.chunk, self.count) * self.chunk

    def head_chunks(self, name: str, head: int) -> torch.Tensor:
        """One head's stored ``name`` (``keys``, ``values``, ``valid`` or a provenance field), its chunks in arrival
        order: ``[count[head], chunk, ...]`` (host; gathers that head's chunks only)."""
        return self.store._pool(name)[self.store.table[self.index, head, : int(self.count[head])]]

    def by_head(self, name: str) -> torch.Tensor:
        """The stored ``name`` in each head's chunk order, ``[H, capacity, chunk, ...]`` (host; for views and tests):
        chunks past a head's count read as zeros (valid: False)."""
        table = self.store.table[self.index, :, : self.capacity]
        out = self.store._pool(name)[table]
        live = torch.arange(self.capacity, device=table.device)[None] < self.count[:, None]  # [H, chunks]
        return out.masked_fill(~live.view(*live.shape, *(1,) * (out.dim() - 2)), 0)

    def frame_tokens(self, grids: int) -> np.ndarray:
        """``[2, grids]``: this layer's stored tokens per frame (summed over heads) and of those the ones the last
        question retrieved (host; for the views)."""
        frame, valid = self.by_head("frame"), self.by_head("valid")  # [H, capacity, chunk]
        fetched = valid & self.retrieved.cpu()[..., None]
        out = np.zeros((2, grids), dtype=np.int64)
        for row, mask in enumerate((valid, fetched)):
            out[row] = torch.bincount(frame[mask].clamp(0, grids - 1), minlength=grids)[:grids].numpy()
        return out

    def fetch(
        self, query: torch.Tensor, scale: float, unrotate: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:meth:`OffloadStore.fetch` for this layer."""
        return self.store.fetch(self.index, query, scale, unrotate)
