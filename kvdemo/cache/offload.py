"""The offload store: the tokens a policy moves off the device, kept in host memory in chunks with a resident index
of chunk mean keys, and brought back while a question is answered (:mod:`kvdemo.cache.attention`).

One store per :class:`~kvdemo.cache.layer.LayerGroup` (:attr:`LayerGroup.offload`), with a layer axis like the group's
buffers: every layer's chunks sit in one pool, per-(layer, head) tables say which pool chunk is a head's chunk ``c``,
and the mean keys are one ``[G, H, chunks, D]`` tensor on the model's device. A compression offloads every layer of a
stack at once (:meth:`OffloadStore.add`: one read of what sizes the writes, one of the keys and values, one of their
provenance); while answering, each layer's attention asks for its own rows (:meth:`OffloadStore.fetch`). The chunks
and how they come back are the policy's (:class:`~kvdemo.policies.contract.OffloadUpdate`,
:class:`~kvdemo.policies.contract.RetrievalRule`): HybridKV's runs of 8 tokens, re-chosen per head at every forward;
ReKV's blocks (a temporal grid's tokens), chosen once per question per layer for all its heads.
:class:`~kvdemo.cache.offload_layer.OffloadLayer` is one layer's part, what views, reports and the attention seam read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..policies.contract import RetrievalRule
from ..tensors import flat_nonzero, take_rows

#: The provenance fields a stored token keeps (what the views and the attribution read of it).
STORED_PROVENANCE = ("frame", "row", "col", "order")


def _grown(t: torch.Tensor, dim: int, size: int, zero: bool = True) -> torch.Tensor:
    """``t`` with ``dim`` grown to ``size``: one copy of the old entries and one zeroing of the new ones (not a zero
    tensor then a cat); pinned memory stays pinned."""
    shape = list(t.shape)
    old, shape[dim] = shape[dim], size
    out = torch.empty(shape, dtype=t.dtype, device=t.device, pin_memory=t.is_pinned())
    out.narrow(dim, 0, old).copy_(t)
    if zero:
        out.narrow(dim, old, size - old).zero_()
    return out


@dataclass(eq=False)
class OffloadStore:
    """A layer group's offloaded visual tokens (see the module docstring), ``G`` layers of ``H`` KV heads.

    keys/values ``[P, chunk, D]`` the pool in host memory (pinned when the model is on CUDA; ``used`` chunks in use),
    ``valid [P, chunk]`` (a chunk may be partial), provenance ``frame/row/col/order [P, chunk]``; ``table [G, H, C]``
    the pool chunk of each (layer, head)'s chunk ``c`` (entries past ``count`` are 0, never read as tokens);
    ``mean_keys [G, H, C, D]`` float32 on the model's device; ``count [G, H]`` chunks and ``stored [G, H]`` tokens;
    ``retrieve [G, H]`` tokens a head brings back per forward while answering; ``retrieved [G, H, C]`` the chunks
    brought back during the last question; ``widths`` each layer's table width (grown 1.5x as its own chunks need
    it; the tensors are as wide as the widest). ``counted``: whether what a head may retrieve counts toward ``M``;
    ``rule``: how chunks are chosen (:class:`~kvdemo.policies.contract.RetrievalRule`); ``last_fetched`` per layer,
    ``[3, H, R]`` frame/row/col of what its last :meth:`fetch` brought back (host; answer attribution); ``held`` per
    layer, what a per-question rule retrieved for the question being answered (device; released after it).
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
    widths: list[int]
    chunk: int = 8
    used: int = 0
    counted: bool = False
    rule: RetrievalRule = RetrievalRule()
    last_fetched: list[torch.Tensor | None] = field(default_factory=list)
    held: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def empty(
        cls, layers: int, heads: int, dim: int, chunk: int, dtype: torch.dtype, device: torch.device
    ) -> OffloadStore:
        host = torch.device("cpu")
        pin = torch.device(device).type == "cuda"
        return cls(
            keys=torch.zeros(0, chunk, dim, dtype=dtype, device=host, pin_memory=pin),
            values=torch.zeros(0, chunk, dim, dtype=dtype, device=host, pin_memory=pin),
            valid=torch.zeros(0, chunk, dtype=torch.bool, device=host),
            provenance={name: torch.zeros(0, chunk, dtype=torch.int64, device=host) for name in STORED_PROVENANCE},
            table=torch.zeros(layers, heads, 0, dtype=torch.long, device=host),
            mean_keys=torch.zeros(layers, heads, 0, dim, dtype=torch.float32, device=device),
            count=torch.zeros(layers, heads, dtype=torch.long, device=host),
            stored=torch.zeros(layers, heads, dtype=torch.long, device=host),
            retrieve=torch.zeros(layers, heads, dtype=torch.long, device=host),
            retrieved=torch.zeros(layers, heads, 0, dtype=torch.bool, device=device),
            widths=[0] * layers,
            chunk=chunk,
            last_fetched=[None] * layers,
        )

    def fork(self) -> OffloadStore:
        """A copy to answer on while later compressions add to this store: the pools are shared (a pass writes only
        chunks past ``used`` and grows a pool by reallocating it, so what the fork reads never changes), the
        bookkeeping a pass updates in place (tables, mean keys, counts, widths) and the retrieval record are the
        fork's own, and nothing is held for a question yet."""
        return replace(
            self,
            table=self.table.clone(),
            mean_keys=self.mean_keys.clone(),
            count=self.count.clone(),
            stored=self.stored.clone(),
            retrieve=self.retrieve.clone(),
            retrieved=self.retrieved.clone(),
            widths=list(self.widths),
            last_fetched=list(self.last_fetched),
            held={},
        )

    @property
    def nbytes(self) -> int:
        """Real bytes of the stored keys and values (chunks in use)."""
        return int(self.count.sum()) * 2 * self.chunk * self.keys.shape[-1] * self.keys.element_size()

    def _pool(self, name: str) -> torch.Tensor:
        return {"keys": self.keys, "values": self.values, "valid": self.valid, **self.provenance}[name]

    # --- writing ------------------------------------------------------------------------------
    def _grow(self, per_layer: list[int], pool: int) -> None:
        """Room for ``per_layer[g]`` chunks in every head's table of layer ``g`` and ``pool`` chunks in the pool
        (1.5x, amortised)."""
        if pool > self.keys.shape[0]:
            size = max(pool, int(self.keys.shape[0] * 1.5) + 4)
            # New key/value chunks are not zeroed: add writes every slot of the chunks it opens (the tokens, then zeros
            # in a partial chunk's tail).
            self.keys, self.values = _grown(self.keys, 0, size, zero=False), _grown(self.values, 0, size, zero=False)
            self.valid = _grown(self.valid, 0, size)
            self.provenance = {name: _grown(t, 0, size) for name, t in self.provenance.items()}
        for g, need in enumerate(per_layer):
            if need > self.widths[g]:
                self.widths[g] = max(need, int(self.widths[g] * 1.5) + 4)
        width = max(self.widths, default=0)
        if width > self.table.shape[2]:
            self.table, self.mean_keys, self.retrieved = (
                _grown(t, 2, width) for t in (self.table, self.mean_keys, self.retrieved)
            )

    def add_tokens(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        provenance: dict[str, torch.Tensor],
        block: torch.Tensor | None = None,
        first: int = 0,
    ) -> int:
        """Store ``keys/values [G', H, E, D]`` (``valid [G', H, E]``, arrival order; ``provenance`` each of
        :data:`STORED_PROVENANCE` ``[G', H, E]``; ``block`` as :meth:`add`'s) as new chunks of the layers ``first ..``;
        returns the key/value bytes copied. (:meth:`add` reading the tokens from given tensors, not a memory's
        buffer.)"""
        layers, heads, tokens, dim = keys.shape
        rows = torch.cat([keys.reshape(-1, dim), values.reshape(-1, dim)])
        index = torch.arange(layers * heads * tokens, device=keys.device).view(layers, heads, tokens)
        marks = torch.stack([valid.long(), valid.long() if block is None else block.long()]).cpu()
        stacked = torch.stack([provenance[name].long() for name in STORED_PROVENANCE]).cpu()
        return self.add(first, rows, index, layers * heads * tokens, marks, stacked, block is not None)

    def add(
        self,
        first: int,
        rows: torch.Tensor,
        key_rows: torch.Tensor,
        value_offset: int,
        marks: torch.Tensor,
        provenance: torch.Tensor,
        block: bool,
        index_keys: torch.Tensor | None = None,
    ) -> int:
        """Store, for the group's layers ``first .. first + G' - 1``, the tokens ``key_rows [G', H, E]`` names: token
        ``e`` of (layer, head) is key ``rows[key_rows[g, h, e]]`` and value ``value_offset`` rows later (``rows [N,
        D]``, the group's buffer as rows), so each offloaded byte is read once and written once, into the pool's next
        chunks. ``marks [2, G', H, E]`` (host) says which tokens count (``marks[0]``) and, with ``block``, the block
        each goes to (``marks[1]``: a new chunk wherever it changes along a row's tokens; else runs of ``chunk``).
        ``provenance [4, G', H, E]`` (host) their :data:`STORED_PROVENANCE`; ``index_keys [G', H, E, D]`` what a
        chunk's mean key averages (default: the stored keys). Returns the key/value bytes copied."""
        layers, heads, tokens = key_rows.shape
        dim, chunk, host = rows.shape[-1], self.chunk, torch.device("cpu")
        valid = marks[0].bool().view(layers * heads, tokens)
        held = valid.sum(dim=1)  # [R], R = G' * H rows: (layer, head) pairs
        rank = torch.cumsum(valid.long(), dim=1) - 1  # each valid token's place among its row's
        if block:
            ids = marks[1].view(layers * heads, tokens)
            slot_of = torch.arange(tokens, device=host).expand(layers * heads, -1)
            before = torch.cummax(torch.where(valid, slot_of, -1), dim=1).values  # the last valid token up to here
            previous = torch.cat([torch.full_like(before[:, :1], -1), before[:, :-1]], dim=1)
            starts = valid & ((previous < 0) | (ids != torch.gather(ids, 1, previous.clamp_min(0))))
            in_row = torch.cumsum(starts.long(), dim=1) - 1
            slot = rank - torch.cummax(torch.where(starts, rank, -1), dim=1).values
            if bool((slot[valid] >= chunk).any()):
                raise ValueError(f"a block holds more than the store's chunk of {chunk} tokens")
            new_chunks = starts.sum(dim=1)
        else:
            in_row, slot = torch.div(rank, chunk, rounding_mode="floor"), rank % chunk
            new_chunks = (held + chunk - 1) // chunk
        total = int(new_chunks.sum())
        if total == 0:
            return 0
        count = self.count[first : first + layers].view(-1)  # views: written in place
        need = (count + new_chunks).view(layers, heads).max(dim=1).values.tolist()
        self._grow([0] * first + need + [0] * (len(self.widths) - first - layers), self.used + total)
        # Each valid (row, e), as the flat index row * E + e (row-major, as nonzero gives them), goes to its slot of the
        # pass's new chunks: a row's after the earlier rows', in arrival order. A partial chunk's tail slots read
        # token 0 and are zeroed after the copy, so that a retrieved chunk is finite.
        picked = flat_nonzero(valid)
        first_chunk = torch.cumsum(new_chunks, 0) - new_chunks  # [R] the row's first chunk among the new ones
        chunk_of = first_chunk[:, None] + in_row  # [R, E]
        target = (chunk_of * chunk + slot).flatten().index_select(0, picked)
        source = torch.zeros(total * chunk, dtype=torch.long, device=host).index_copy_(0, target, picked)
        filled = torch.zeros(total * chunk, dtype=torch.bool, device=host).index_fill_(0, target, True)
        tail = flat_nonzero(~filled)
        span = slice(self.used * chunk, (self.used + total) * chunk)
        key_index = key_rows.flatten().index_select(0, source.to(key_rows.device))
        pools = (self.keys.view(-1, dim)[span], self.values.view(-1, dim)[span])
        if rows.device.type == "cpu":  # straight into the pool
            for out, index in zip(pools, (key_index, key_index + value_offset)):
                take_rows(rows, index, out=out)
        else:  # one copy back of both
            both = take_rows(rows, torch.cat([key_index, key_index + value_offset])).cpu()
            for out, part in zip(pools, both.split(key_index.shape[0])):
                out.copy_(part)
        for out in pools:
            out.index_fill_(0, tail, 0)
        self.valid.view(-1)[span] = filled
        for name, values_of in zip(STORED_PROVENANCE, provenance):
            self.provenance[name].view(-1)[span] = (
                values_of.flatten().index_select(0, source).long().masked_fill_(~filled, 0)
            )
        # The new chunks in the rows' tables, and their mean keys (float32, on the model's device).
        new = torch.arange(total, device=host)
        chunk_row = torch.repeat_interleave(torch.arange(layers * heads, device=host), new_chunks)  # [total]
        position = count.index_select(0, chunk_row) + new - first_chunk.index_select(0, chunk_row)
        self.table[first : first + layers].view(layers * heads, -1)[chunk_row, position] = self.used + new
        chunk_sizes = filled.view(total, chunk).sum(dim=1)[:, None]
        device = self.mean_keys.device
        if index_keys is None:
            sums = torch.zeros(total, dim, dtype=torch.float32, device=host).index_add_(
                0,
                torch.div(torch.arange(total * chunk, device=host), chunk, rounding_mode="floor"),
                self.keys.view(-1, dim)[span].float(),
            )
            means = (sums / chunk_sizes).to(device)
        else:
            entry = picked.to(index_keys.device)
            sums = torch.zeros(total, dim, dtype=torch.float32, device=index_keys.device).index_add_(
                0,
                chunk_of.flatten().index_select(0, picked).to(index_keys.device),
                index_keys.reshape(-1, dim).index_select(0, entry).float(),
            )
            means = (sums / chunk_sizes.to(sums.device)).to(device)
        self.mean_keys[first : first + layers].view(layers * heads, -1, dim)[
            chunk_row.to(device), position.to(device)
        ] = means
        count += new_chunks
        self.stored[first : first + layers].view(-1).add_(held)
        self.used += total
        return 2 * int(picked.numel()) * dim * rows.element_size()

    # --- answering ----------------------------------------------------------------------------
    def fetch(
        self,
        layer: int,
        query: torch.Tensor,
        scale: float,
        unrotate: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Retrieval for one forward of layer ``layer`` while answering: the forward's queries ``query [H_q, q, D]``
        (before RoPE through ``unrotate`` when the rule says so) score each chunk's mean key, averaged over the
        forward's tokens and summed over each KV head's group of query heads (kvdemo's, for a question's prefill;
        ReKV's code averages the question's queries the same way), times ``scale``; under a shared rule the scores
        are summed over the layer's heads too (one ranking). Each head brings back its top ``retrieve // chunk``
        chunks (as many as it stores), recorded in :attr:`retrieved`. Returns keys/values ``[H, R, D]`` on the
        query's device and a key bias ``[H, R]`` (0 for a retrieved token, ``-inf`` for padding), or None if no head
        retrieves. A per-question rule chooses at the question's first forward and hands the same back after."""
        count, width_of = self.count[layer], self.widths[layer]
        wanted = torch.minimum(self.retrieve[layer] // self.chunk, count)  # chunks per head
        width = int(wanted.max()) if wanted.numel() else 0
        if width == 0:
            return None
        if self.rule.per_question and layer in self.held:
            return self.held[layer]
        heads = count.shape[0]
        queries = query.float()
        if self.rule.unrotated:
            if unrotate is None:
                raise ValueError("this store scores queries before RoPE: the forward's positions are needed")
            queries = unrotate(queries)
        grouped = queries.mean(dim=1).reshape(heads, -1, query.shape[-1])  # [H, group, D]
        scores = torch.einsum("hgd,hcd->hc", grouped, self.mean_keys[layer, :, :width_of]) * scale
        live = torch.arange(width_of, device=scores.device)[None] < count.to(scores.device)[:, None]
        if self.rule.shared:  # one ranking for the layer: every head takes the same chunks
            scores = scores.masked_fill(~live, 0.0).sum(dim=0, keepdim=True)
            scores = scores.masked_fill(~live.all(dim=0, keepdim=True), float("-inf"))
            top = torch.topk(scores, width, dim=1).indices.expand(heads, -1)
        else:
            top = torch.topk(scores.masked_fill(~live, float("-inf")), width, dim=1).indices  # [H, width]
        # Which picks count: worked out on the host from the host's counts, and marked on the device by a scatter
        # (the picks of a row are distinct), so the one wait for the device is for the picks themselves.
        chosen = torch.arange(width, device="cpu")[None] < wanted[:, None]
        marks = self.retrieved[layer, :, :width_of]
        marks |= torch.zeros_like(marks).scatter_(1, top, chosen.to(top.device))
        slots = torch.gather(self.table[layer, :, :width_of], 1, top.cpu()).flatten()  # the picks' pool chunks
        # Whole chunks gathered as rows (take_rows: index_select, several times faster than advanced indexing
        # on half-precision chunks on a CPU), into fresh host tensors.
        keys, values, ok, *provenance = (
            take_rows(t.view(t.shape[0], -1), slots).view(heads, width, *t.shape[1:])
            for t in (self.keys, self.values, self.valid, *(self.provenance[n] for n in ("frame", "row", "col")))
        )
        self.last_fetched[layer] = torch.stack(provenance).reshape(3, heads, -1)
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
        fetched = keys.reshape(heads, -1, dim), values.reshape(heads, -1, dim), bias.reshape(heads, -1)
        if self.rule.per_question:
            self.held[layer] = fetched
        return fetched

    def reset_retrieved(self) -> None:
        """A new question: forget what the last one retrieved (its marks, and what a per-question rule held)."""
        self.retrieved.zero_()
        self.held.clear()

    def release(self) -> None:
        """The question is answered: what a per-question rule brought onto the device goes (its marks stay, for the
        views)."""
        self.held.clear()

    # --- copies -------------------------------------------------------------------------------
    def trimmed(self) -> OffloadStore:
        """A copy with the pool cut to the chunks in use and nothing held for a question (what crosses a process
        boundary; host tensors stay on the host)."""
        pool = {name: t[: self.used].clone() for name, t in (("keys", self.keys), ("values", self.values))}
        return replace(
            self.fork(),  # the bookkeeping copied as a fork copies it, the pools cut and copied too
            valid=self.valid[: self.used].clone(),
            provenance={name: t[: self.used].clone() for name, t in self.provenance.items()},
            **pool,
        )

    def to(self, device: torch.device | str) -> OffloadStore:
        """The store with its index on ``device`` (the pool stays in host memory)."""
        return replace(self, mean_keys=self.mean_keys.to(device), retrieved=self.retrieved.to(device), held={})

    def part(self, members: list[int]) -> OffloadStore:
        """The layers ``members`` (indices into the group) as a store of their own (its own copy of the pool)."""
        index = torch.tensor(members, device=self.table.device)
        device_index = index.to(self.mean_keys.device)
        copy = self.trimmed()
        return replace(
            copy,
            table=self.table.index_select(0, index),
            mean_keys=self.mean_keys.index_select(0, device_index),
            count=self.count.index_select(0, index),
            stored=self.stored.index_select(0, index),
            retrieve=self.retrieve.index_select(0, index),
            retrieved=self.retrieved.index_select(0, device_index),
            widths=[self.widths[g] for g in members],
            last_fetched=[self.last_fetched[g] for g in members],
        )
