"""HybridKV's host-memory store: one layer's offloaded visual tokens per KV head, in chunks, with a resident
index of chunk mean keys, retrieved per forward while a question is answered (:mod:`kvdemo.cache.attention`).

The memory owns one store per layer (:attr:`kvdemo.cache.memory.LayerMemory.offload`) and fills it through
:meth:`OffloadStore.add_rows` during a compression (:class:`kvdemo.policies.contract.OffloadUpdate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensors import gather_rows, put_rows, take_rows


@dataclass
class OffloadStore:
    """One layer's offloaded visual tokens: per KV head, chunks of ``chunk`` tokens in arrival order, kept in
    host memory (pinned when the model is on CUDA), with a resident index of chunk mean keys (HybridKV).

    keys/values ``[H, chunks, chunk, D]``, ``valid [H, chunks, chunk]`` (a head's last chunk of a pass may be
    partial), provenance ``frame/row/col/order [H, chunks, chunk]``, ``mean_keys [H, chunks, D]`` on the
    model's device, ``count [H]`` chunks per head, ``retrieve [H]`` tokens each head brings back per decode
    step, ``retrieved [H, chunks]`` the chunks a head brought back during the last question; ``counted``: whether
    the tokens a head may retrieve count toward the budget (see :class:`kvdemo.policies.contract.OffloadUpdate`);
    ``last_fetched [3, H, R]`` the frame/row/col of the tokens the last :meth:`fetch` brought back (host; for answer
    attribution).
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    provenance: dict[str, torch.Tensor]
    mean_keys: torch.Tensor
    count: torch.Tensor
    retrieve: torch.Tensor
    retrieved: torch.Tensor
    chunk: int = 8
    counted: bool = False
    last_fetched: torch.Tensor | None = None

    @classmethod
    def empty(cls, heads: int, dim: int, chunk: int, dtype: torch.dtype, device: torch.device) -> "OffloadStore":
        host = torch.device("cpu")
        pin = device.type == "cuda"
        return cls(
            keys=torch.zeros(heads, 0, chunk, dim, dtype=dtype, device=host, pin_memory=pin),
            values=torch.zeros(heads, 0, chunk, dim, dtype=dtype, device=host, pin_memory=pin),
            valid=torch.zeros(heads, 0, chunk, dtype=torch.bool, device=host),
            provenance={name: torch.zeros(heads, 0, chunk, dtype=torch.int64, device=host) for name in ("frame", "row", "col", "order")},
            mean_keys=torch.zeros(heads, 0, dim, dtype=torch.float32, device=device),
            count=torch.zeros(heads, dtype=torch.long, device=host),
            retrieve=torch.zeros(heads, dtype=torch.long, device=host),
            retrieved=torch.zeros(heads, 0, dtype=torch.bool, device=device),
            chunk=chunk,
        )

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])

    @property
    def tokens(self) -> torch.Tensor:
        """Tokens stored per head ``[H]``."""
        return self.valid.sum(dim=(1, 2))

    def reserved(self) -> torch.Tensor:
        """Tokens each head may bring back while answering ``[H]``: its whole chunks of ``retrieve``, as many as it
        stores (what a forward's retrieval buffer holds at most)."""
        return torch.minimum(self.retrieve // self.chunk, self.count) * self.chunk

    @property
    def nbytes(self) -> int:
        """Real bytes of the stored keys and values (chunks in use)."""
        per_chunk = 2 * self.chunk * self.keys.shape[-1] * self.keys.element_size()
        return int(self.count.sum()) * per_chunk

    def _grow(self, chunks: int) -> None:
        if chunks <= self.capacity:
            return
        capacity = max(chunks, int(self.capacity * 1.5) + 4)

        def grown(t: torch.Tensor, zero: bool = True) -> torch.Tensor:
            # One copy of the old chunks and one zeroing of the new ones (not a zero tensor then a cat).
            out = torch.empty(t.shape[0], capacity, *t.shape[2:], dtype=t.dtype, device=t.device,
                              pin_memory=t.is_pinned())
            out[:, : t.shape[1]] = t
            if zero:
                out[:, t.shape[1] :] = 0
            return out

        # New key/value chunks are not zeroed: add_rows writes every slot of the chunks it opens (the tokens, then
        # zeros in a partial chunk's tail), and fetch zeroes whatever it gathers that it did not choose.
        self.keys, self.values, self.valid = grown(self.keys, zero=False), grown(self.values, zero=False), grown(self.valid)
        self.provenance = {name: grown(t) for name, t in self.provenance.items()}
        self.mean_keys, self.retrieved = grown(self.mean_keys), grown(self.retrieved)

    def add(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, provenance: dict[str, torch.Tensor]) -> int:
        """Store ``keys/values [H, E, D]`` (``valid [H, E]``, arrival order) as new chunks per head; returns
        the key/value bytes copied."""
        heads, tokens, dim = keys.shape
        rows = torch.cat([keys.reshape(heads * tokens, dim), values.reshape(heads * tokens, dim)])
        index = torch.arange(heads * tokens, device=keys.device).view(heads, tokens)
        return self.add_rows(rows, index, index + heads * tokens, valid, provenance)

    def add_rows(self, rows: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor, valid: torch.Tensor,
                 provenance: dict[str, torch.Tensor]) -> int:
        """:meth:`add` reading the tokens straight from ``rows [N, D]`` (a memory's key/value buffer as rows):
        token ``e`` of head ``h`` is ``rows[key_rows[h, e]]`` / ``rows[value_rows[h, e]]`` (``[H, E]``), so each
        offloaded byte is read once and written once. Returns the key/value bytes copied."""
        heads, tokens = key_rows.shape
        dim = rows.shape[-1]
        valid = valid.cpu()
        rank = torch.cumsum(valid.long(), dim=1) - 1  # position among the head's valid tokens
        new_chunks = (valid.sum(dim=1) + self.chunk - 1) // self.chunk
        self._grow(int((self.count + new_chunks).max()) if heads else 0)
        # The valid (h, e) as flat indices h * E + e (row-major, as nonzero gives them): 1-D gathers below.
        picked = torch.nonzero(valid.flatten()).squeeze(1)
        h = torch.div(picked, tokens, rounding_mode="floor")
        slot = rank.flatten().index_select(0, picked)  # place among its head's new tokens: chunk slot // chunk
        new_chunk = torch.div(slot, self.chunk, rounding_mode="floor")  # 0.. among the head's new chunks
        first = (torch.arange(heads, device=valid.device) * self.capacity + self.count) * self.chunk  # [H] first new slot
        dest = first.index_select(0, h) + slot
        # The tail of each head's last new chunk (a partial chunk): zeros, so that a retrieved chunk is finite.
        opened = new_chunks * self.chunk
        tail_head, tail_slot = torch.nonzero(torch.arange(self.chunk, device=valid.device)[None] < (opened - valid.sum(dim=1))[:, None], as_tuple=True)
        tail = (tail_head * self.capacity + self.count[tail_head]) * self.chunk + opened[tail_head] - 1 - tail_slot
        moved = {}
        for name, store, index in (("keys", self.keys, key_rows), ("values", self.values, value_rows)):
            moved[name] = take_rows(rows, index.cpu().flatten().index_select(0, picked)).cpu()
            put_rows(store.view(-1, dim), dest, moved[name])
            store.view(-1, dim)[tail] = 0
        self.valid.view(-1)[dest] = True
        for name, values_of in provenance.items():
            put_rows(self.provenance[name].view(-1, 1), dest, values_of.cpu().flatten().index_select(0, picked).long()[:, None])
        # Mean keys of the new chunks only (float32), on the model's device.
        width = int(new_chunks.max()) if heads else 0
        cell = h * width + new_chunk
        new_keys = moved["keys"].float()
        sums = torch.zeros(heads * width, dim, dtype=torch.float32, device="cpu").index_add_(0, cell, new_keys)
        counts = torch.bincount(cell, minlength=heads * width)
        fresh = counts > 0
        head_of, chunk_of = torch.nonzero(fresh.view(heads, width), as_tuple=True)
        device = self.mean_keys.device
        means = (sums[fresh] / counts[fresh][:, None]).to(device)
        self.mean_keys[head_of.to(device), (self.count[head_of] + chunk_of).to(device)] = means
        self.count += new_chunks
        return 2 * int(h.numel()) * dim * rows.element_size()

    def fetch(self, query: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Retrieval for one forward while answering: each head scores its chunks by the forward's queries
        against the mean keys (summed over the head's group of query heads and, for a question's prefill,
        averaged over its tokens: kvdemo's), brings back its top ``retrieve // chunk`` chunks, and records
        them. ``query [H_q, q, D]`` -> keys/values ``[H, R, D]`` on the query's device and a key bias
        ``[H, R]`` (0 for a retrieved token, ``-inf`` for padding), or None if no head retrieves."""
        wanted = torch.minimum(self.retrieve // self.chunk, self.count)  # chunks per head
        width = int(wanted.max()) if wanted.numel() else 0
        if width == 0:
            return None
        heads = self.keys.shape[0]
        grouped = query.float().mean(dim=1).reshape(heads, -1, query.shape[-1])  # [H, group, D]
        scores = torch.einsum("hgd,hcd->hc", grouped, self.mean_keys[:, : self.capacity]) * scale
        live = torch.arange(self.capacity, device=scores.device)[None] < self.count.to(scores.device)[:, None]
        scores = scores.masked_fill(~live, float("-inf"))
        top = torch.topk(scores, width, dim=1).indices  # [H, width]
        # Which picks count: worked out on the host from the host's counts, and marked on the device by a scatter
        # (the picks of a row are distinct), so the one wait for the device is for the picks themselves.
        chosen = torch.arange(width, device="cpu")[None] < wanted[:, None]
        self.retrieved |= torch.zeros_like(self.retrieved).scatter_(1, top, chosen.to(top.device))
        top_host = top.cpu()
        # Whole chunks gathered as rows (gather_rows: index_select, several times faster than advanced indexing
        # on half-precision chunks on a CPU), into fresh host tensors.
        keys, values = gather_rows(self.keys, top_host), gather_rows(self.values, top_host)  # [H, width, chunk, D]
        self.last_fetched = torch.stack([gather_rows(self.provenance[name], top_host) for name in ("frame", "row", "col")]).reshape(3, heads, -1)
        ok = gather_rows(self.valid, top_host) & chosen[..., None]  # [H, width, chunk]
        # What was not chosen (a head retrieving fewer chunks than the widest: its extra picks may lie past its count,
        # never written) and a partial chunk's tail read as zeros: masked by the bias, but NaN * 0 is NaN. Only those
        # rows are written, on the host, before the copy to the device.
        dim = keys.shape[-1]
        unused = torch.nonzero(~ok.flatten()).squeeze(1)
        keys.view(-1, dim).index_fill_(0, unused, 0)
        values.view(-1, dim).index_fill_(0, unused, 0)
        keys, values, ok = (t.to(query.device, non_blocking=True) for t in (keys, values, ok))
        bias = torch.zeros(ok.shape, dtype=query.dtype, device=query.device).masked_fill(~ok, float("-inf"))
        return keys.reshape(heads, -1, dim), values.reshape(heads, -1, dim), bias.reshape(heads, -1)
