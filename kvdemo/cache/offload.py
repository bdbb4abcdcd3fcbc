"""HybridKV's host-memory store: one layer's offloaded visual tokens per KV head, in chunks, with a resident
index of chunk mean keys, retrieved per forward while a question is answered (:mod:`kvdemo.cache.attention`).

The memory owns one store per layer (:attr:`kvdemo.cache.memory.LayerMemory.offload`) and fills it through
:meth:`OffloadStore.add_rows` during a compression (:class:`kvdemo.policies.contract.OffloadUpdate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensors import flat_nonzero, take_rows


@dataclass
class OffloadStore:
    """One layer's offloaded visual tokens: per KV head, chunks of ``chunk`` tokens in arrival order, kept in host
    memory (pinned when the model is on CUDA), with a resident index of chunk mean keys (HybridKV).

    The chunks of every head sit in one pool, and a table says which pool chunk is each head's chunk ``c``
    (kvdemo's layout): a pass's new chunks, all heads', are one contiguous run of the pool, so the tokens a
    compression offloads are gathered straight into it, one read and one write of each (a store per head needs a
    gather into an intermediate and a scatter from it, or a loop over heads).

    keys/values ``[P, chunk, D]`` the pool (``used`` chunks in use), ``valid [P, chunk]`` (a head's last chunk of a
    pass may be partial), provenance ``frame/row/col/order [P, chunk]``, ``table [H, chunks]`` the pool chunk of
    each head's chunk (entries past ``count`` are 0 and never read as tokens), ``mean_keys [H, chunks, D]`` on the
    model's device, ``count [H]`` chunks and ``stored [H]`` tokens per head, ``retrieve [H]`` tokens each head
    brings back per decode step, ``retrieved [H, chunks]`` the chunks a head brought back during the last
    question; ``counted``: whether the tokens a head may retrieve count toward the budget (see
    :class:`kvdemo.policies.contract.OffloadUpdate`); ``last_fetched [3, H, R]`` the frame/row/col of the tokens the
    last :meth:`fetch` brought back (host; for answer attribution). :meth:`by_head` gives a field per head.
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    provenance: dict[str, torch.Tensor]
    table: torch.Tensor
    mean_keys: torch.Tensor
    count: torch.Tensor
    stored: torch.Tensor
    retrieve: torch.Tensor
    retrieved: torch.Tensor
    chunk: int = 8
    used: int = 0
    counted: bool = False
    last_fetched: torch.Tensor | None = None

    @classmethod
    def empty(cls, heads: int, dim: int, chunk: int, dtype: torch.dtype, device: torch.device) -> "OffloadStore":
        host = torch.device("cpu")
        pin = device.type == "cuda"
        return cls(
            keys=torch.zeros(0, chunk, dim, dtype=dtype, device=host, pin_memory=pin),
            values=torch.zeros(0, chunk, dim, dtype=dtype, device=host, pin_memory=pin),
            valid=torch.zeros(0, chunk, dtype=torch.bool, device=host),
            provenance={
                name: torch.zeros(0, chunk, dtype=torch.int64, device=host) for name in ("frame", "row", "col", "order")
            },
            table=torch.zeros(heads, 0, dtype=torch.long, device=host),
            mean_keys=torch.zeros(heads, 0, dim, dtype=torch.float32, device=device),
            count=torch.zeros(heads, dtype=torch.long, device=host),
            stored=torch.zeros(heads, dtype=torch.long, device=host),
            retrieve=torch.zeros(heads, dtype=torch.long, device=host),
            retrieved=torch.zeros(heads, 0, dtype=torch.bool, device=device),
            chunk=chunk,
        )

    @property
    def capacity(self) -> int:
        """Chunks per head the table (and the mean-key index) has room for."""
        return int(self.table.shape[1])

    @property
    def tokens(self) -> torch.Tensor:
        """Tokens stored per head ``[H]``."""
        return self.stored

    def reserved(self) -> torch.Tensor:
        """Tokens each head may bring back while answering ``[H]``: its whole chunks of ``retrieve``, as many as it
        stores (what a forward's retrieval buffer holds at most)."""
        return torch.minimum(self.retrieve // self.chunk, self.count) * self.chunk

    @property
    def nbytes(self) -> int:
        """Real bytes of the stored keys and values (chunks in use)."""
        per_chunk = 2 * self.chunk * self.keys.shape[-1] * self.keys.element_size()
        return int(self.count.sum()) * per_chunk

    def _pool(self, name: str) -> torch.Tensor:
        return {"keys": self.keys, "values": self.values, "valid": self.valid, **self.provenance}[name]

    def head_chunks(self, name: str, head: int) -> torch.Tensor:
        """One head's stored ``name`` (``keys``, ``values``, ``valid`` or a provenance field), its chunks in arrival
        order: ``[count[head], chunk, ...]`` (host; gathers that head's chunks only)."""
        return self._pool(name)[self.table[head, : int(self.count[head])]]

    def by_head(self, name: str) -> torch.Tensor:
        """The stored ``name`` in each head's chunk order, ``[H, chunks, chunk, ...]`` (host; for views and tests):
        chunks past a head's count read as zeros (valid: False)."""
        out = self._pool(name)[self.table]
        live = torch.arange(self.capacity, device=self.table.device)[None] < self.count[:, None]  # [H, chunks]
        return out.masked_fill(~live.view(*live.shape, *(1,) * (out.dim() - 2)), 0)

    def _grow(self, per_head: int, pool: int) -> None:
        """Room for ``per_head`` chunks in every head's table and ``pool`` chunks in the pool (1.5x, amortised)."""

        def grown(t: torch.Tensor, dim: int, size: int, zero: bool = True) -> torch.Tensor:
            # One copy of the old entries and one zeroing of the new ones (not a zero tensor then a cat).
            shape = list(t.shape)
            old, shape[dim] = shape[dim], size
            out = torch.empty(shape, dtype=t.dtype, device=t.device, pin_memory=t.is_pinned())
            out.narrow(dim, 0, old).copy_(t)
            if zero:
                out.narrow(dim, old, size - old).zero_()
            return out

        if pool > self.keys.shape[0]:
            size = max(pool, int(self.keys.shape[0] * 1.5) + 4)
            # New key/value chunks are not zeroed: add_rows writes every slot of the chunks it opens (the tokens, then
            # zeros in a partial chunk's tail).
            self.keys, self.values = grown(self.keys, 0, size, zero=False), grown(self.values, 0, size, zero=False)
            self.valid = grown(self.valid, 0, size)
            self.provenance = {name: grown(t, 0, size) for name, t in self.provenance.items()}
        if per_head > self.capacity:
            size = max(per_head, int(self.capacity * 1.5) + 4)
            self.table, self.mean_keys, self.retrieved = (
                grown(t, 1, size) for t in (self.table, self.mean_keys, self.retrieved)
            )

    def add(
        self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, provenance: dict[str, torch.Tensor]
    ) -> int:
        """Store ``keys/values [H, E, D]`` (``valid [H, E]``, arrival order) as new chunks per head; returns
        the key/value bytes copied."""
        heads, tokens, dim = keys.shape
        rows = torch.cat([keys.reshape(heads * tokens, dim), values.reshape(heads * tokens, dim)])
        index = torch.arange(heads * tokens, device=keys.device).view(heads, tokens)
        return self.add_rows(rows, index, index + heads * tokens, valid, provenance)

    def add_rows(
        self,
        rows: torch.Tensor,
        key_rows: torch.Tensor,
        value_rows: torch.Tensor,
        valid: torch.Tensor,
        provenance: dict[str, torch.Tensor],
    ) -> int:
        """:meth:`add` reading the tokens straight from ``rows [N, D]`` (a memory's key/value buffer as rows):
        token ``e`` of head ``h`` is ``rows[key_rows[h, e]]`` / ``rows[value_rows[h, e]]`` (``[H, E]``), so each
        offloaded byte is read once and written once, into the pool's next chunks. Returns the key/value bytes
        copied."""
        heads, tokens = key_rows.shape
        dim, chunk = rows.shape[-1], self.chunk
        host = torch.device("cpu")  # the store's bookkeeping and chunks live on the host
        valid = valid.cpu()
        held = valid.sum(dim=1)  # [H]
        new_chunks = (held + chunk - 1) // chunk
        total = int(new_chunks.sum())
        if total == 0:
            return 0
        self._grow(int((self.count + new_chunks).max()), self.used + total)
        # Each valid (h, e), as the flat index h * E + e (row-major, as nonzero gives them), goes to a slot of the
        # pass's new chunks: head h's after the earlier heads', in arrival order. A partial chunk's tail slots read
        # token 0 and are zeroed after the copy, so that a retrieved chunk is finite.
        picked = flat_nonzero(valid)
        head = torch.div(picked, tokens, rounding_mode="floor")
        first_chunk = torch.cumsum(new_chunks, 0) - new_chunks  # [H] the head's first chunk among the new ones
        slot = (first_chunk * chunk).index_select(0, head) + (
            torch.cumsum(valid.long(), dim=1) - 1
        ).flatten().index_select(0, picked)
        source = torch.zeros(total * chunk, dtype=torch.long, device=host).index_copy_(0, slot, picked)
        filled = torch.zeros(total * chunk, dtype=torch.bool, device=host).index_fill_(0, slot, True)
        tail = flat_nonzero(~filled)
        span = slice(self.used * chunk, (self.used + total) * chunk)
        for store, index in ((self.keys, key_rows), (self.values, value_rows)):
            out = store.view(-1, dim)[span]
            take_rows(rows, index.flatten().index_select(0, source.to(index.device)), out=out)
            out.index_fill_(0, tail, 0)
        self.valid.view(-1)[span] = filled
        for name, values_of in provenance.items():
            self.provenance[name].view(-1)[span] = (
                values_of.cpu().flatten().index_select(0, source).long().masked_fill_(~filled, 0)
            )
        # The new chunks in the heads' tables, and their mean keys (float32, on the model's device).
        new = torch.arange(total, device=host)
        chunk_head = torch.repeat_interleave(torch.arange(heads, device=host), new_chunks)  # [total]
        position = self.count.index_select(0, chunk_head) + new - first_chunk.index_select(0, chunk_head)
        self.table[chunk_head, position] = self.used + new
        sums = torch.zeros(total, dim, dtype=torch.float32, device=host).index_add_(
            0,
            torch.div(torch.arange(total * chunk, device=host), chunk, rounding_mode="floor"),
            self.keys.view(-1, dim)[span].float(),
        )
        device = self.mean_keys.device
        means = sums / filled.view(total, chunk).sum(dim=1)[:, None]
        self.mean_keys[chunk_head.to(device), position.to(device)] = means.to(device)
        self.count += new_chunks
        self.stored += held
        self.used += total
        return 2 * int(picked.numel()) * dim * rows.element_size()

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
        heads = self.table.shape[0]
        grouped = query.float().mean(dim=1).reshape(heads, -1, query.shape[-1])  # [H, group, D]
        scores = torch.einsum("hgd,hcd->hc", grouped, self.mean_keys[:, : self.capacity]) * scale
        live = torch.arange(self.capacity, device=scores.device)[None] < self.count.to(scores.device)[:, None]
        scores = scores.masked_fill(~live, float("-inf"))
        top = torch.topk(scores, width, dim=1).indices  # [H, width]
        # Which picks count: worked out on the host from the host's counts, and marked on the device by a scatter
        # (the picks of a row are distinct), so the one wait for the device is for the picks themselves.
        chosen = torch.arange(width, device="cpu")[None] < wanted[:, None]
        self.retrieved |= torch.zeros_like(self.retrieved).scatter_(1, top, chosen.to(top.device))
        slots = torch.gather(self.table, 1, top.cpu()).flatten()  # the picks' pool chunks
        # Whole chunks gathered as rows (take_rows: index_select, several times faster than advanced indexing
        # on half-precision chunks on a CPU), into fresh host tensors.
        keys, values, ok, *provenance = (
            take_rows(t.view(t.shape[0], -1), slots).view(heads, width, *t.shape[1:])
            for t in (self.keys, self.values, self.valid, *(self.provenance[n] for n in ("frame", "row", "col")))
        )
        self.last_fetched = torch.stack(provenance).reshape(3, heads, -1)
        ok &= chosen[..., None]  # [H, width, chunk]
        # What was not chosen (a head retrieving fewer chunks than the widest: its extra picks lie past its count, where
        # the table points at pool chunk 0, another head's tokens) and a partial chunk's tail read as zeros: masked by
        # the bias, and zeros keep them finite (NaN * 0 is NaN). Only those rows are written, on the host, before the
        # copy to the device.
        dim = keys.shape[-1]
        unused = flat_nonzero(~ok)
        keys.view(-1, dim).index_fill_(0, unused, 0)
        values.view(-1, dim).index_fill_(0, unused, 0)
        keys, values, ok = (t.to(query.device, non_blocking=True) for t in (keys, values, ok))
        bias = torch.zeros(ok.shape, dtype=query.dtype, device=query.device).masked_fill(~ok, float("-inf"))
        return keys.reshape(heads, -1, dim), values.reshape(heads, -1, dim), bias.reshape(heads, -1)
