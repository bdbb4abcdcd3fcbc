"""Small tensor helpers shared by the memory, the offload store and the policies (a leaf module: it
imports nothing of kvdemo)."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows [N, D]`` viewed as int64 words (same bytes) when a row is a whole number of 8-byte words.

    Moving rows is a copy of bytes: PyTorch's CPU ``index_select`` / ``index_copy_`` are several times faster
    on int64 than on float32 or bfloat16 rows (measured here: 0.26 vs 1.4 ms to gather 8800 rows of 128
    floats, 0.26 vs 0.49 ms to scatter 8800 bfloat16 rows).
    """
    if rows.dim() != 2 or rows.shape[-1] * rows.element_size() % 8 or not rows.is_contiguous():
        return rows
    return rows.view(torch.int64)


def flat_nonzero(mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Ascending int64 positions ``[N]`` of the true entries of ``mask`` (any shape) in its flattened, row-major
    order: ``torch.nonzero(mask.flatten()).squeeze(1)``. On a CPU through numpy's ``flatnonzero`` (kvdemo's choice:
    about ten times faster than ``torch.nonzero`` on a 7B cache's ``[112, 6144]`` masks, single thread). Elsewhere,
    with ``count`` (the number of true entries, known to the caller), without waiting for the device to learn the
    output's size (:func:`padded_nonzero`; ``torch.nonzero`` makes a GPU wait)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.detach().numpy())).long()
    if count is None:
        return torch.nonzero(mask.flatten()).squeeze(1)
    return padded_nonzero(mask, count)[0]


def padded_nonzero(mask: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ascending positions of the true entries of ``mask`` in its flattened order, padded to ``size`` entries
    (the caller's bound on their count) with position 0, and which of them are real: ``positions, real [size]``. A
    running count and one scatter: nothing is read back, so a GPU does not wait."""
    flat = mask.flatten()
    slot = torch.cumsum(flat, 0) - 1  # where each true entry goes; a false one goes to a spare slot past the end
    slot = torch.where(flat, slot, size)
    positions = torch.arange(flat.numel(), device=mask.device)
    out = torch.zeros(size + 1, dtype=torch.long, device=mask.device).scatter_(0, slot, positions)[:size]
    return out, torch.arange(size, device=mask.device) < flat.sum()


def owners(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Which entry of ``counts [n]`` (int64, summing to ``total``) each of ``total`` consecutive items belongs to:
    ``[total]`` int64, ``torch.repeat_interleave(arange(n), counts)``. On a CPU through numpy's ``repeat`` (kvdemo's
    choice: torch's opens a parallel region, after which its OpenMP workers spin for several milliseconds on the cores
    :func:`move_rows` shares its work with); elsewhere with ``output_size`` (a GPU does not wait to learn it)."""
    if counts.device.type == "cpu":
        return torch.from_numpy(np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts.numpy()))
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=total)


#: Moves of fewer rows than this go through PyTorch (as int64 words where a row is whole words): numpy's few
#: microseconds per call outweigh what records save on moves that small (the tiny model's are tens of rows).
RECORD_MIN_ROWS = 4096


def _records_for(rows: torch.Tensor, index: torch.Tensor) -> np.ndarray | None:
    """:func:`row_records` of ``rows`` when a move of ``index`` rows should go through them, else None."""
    if index.device.type != "cpu" or index.numel() < RECORD_MIN_ROWS:
        return None
    return row_records(rows)


def row_records(rows: torch.Tensor) -> np.ndarray | None:
    """``rows [N, D]`` on a CPU as a numpy array of ``N`` records, each one row's bytes (the same memory), or None
    where that view does not exist (another device, not 2-D or not contiguous, empty rows).

    kvdemo's choice for moving rows on a CPU: numpy moves a record with one copy of its bytes, where PyTorch's
    ``index_select`` / ``index_copy_`` and numpy's 2-D indexing loop over a row's elements (measured single-threaded
    in ``docs/performance.md``)."""
    if rows.device.type != "cpu" or rows.dim() != 2 or not rows.is_contiguous():
        return None
    if rows.shape[1] * rows.element_size() == 0:
        return None
    raw = rows.detach().view(torch.uint8)
    return raw.numpy().view(np.dtype((np.void, raw.shape[1]))).reshape(-1)


def take_rows(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows[index]``: the rows ``index [M]`` of ``rows [N, D]``, ``[M, D]`` in ``rows``' dtype. On a CPU one copy
    per row of its bytes (:func:`row_records`, from :data:`RECORD_MIN_ROWS` rows), else one ``index_select`` as int64
    words where a row is whole words (:func:`as_words`). ``out`` (``[M, D]``, contiguous, ``rows``' dtype): written
    in place, straight from ``rows`` when both are on one device (no intermediate), and returned."""
    index = index.to(rows.device)
    if out is None:
        records = _records_for(rows, index)
        if records is not None:
            taken = np.take(records, index.numpy())
            raw = taken.view(np.uint8).reshape(index.shape[0], records.dtype.itemsize)
            return torch.from_numpy(raw).view(rows.dtype)
        words = as_words(rows)
        taken = words.index_select(0, index)
        return taken.view(rows.dtype) if taken.dtype != rows.dtype else taken
    words, target = as_words(rows), as_words(out)
    if out.device == rows.device and target.dtype == words.dtype:
        torch.index_select(words, 0, index, out=target)
    else:
        out.copy_(take_rows(rows, index))
    return out


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, u]]`` for ``x [B, K, ...]`` and ``index [B, U]``: ``[B, U, ...]``, one gather of rows of
    ``x`` viewed as ``[B * K, ...]`` (:func:`take_rows`; advanced indexing with broadcast row ids selects the same,
    2-7x slower on a CPU: measured on ``[112, 576, ...]`` histograms and centres, 7B shape)."""
    batch, width = x.shape[:2]
    flat = (torch.arange(batch, device=index.device)[:, None] * width + index).flatten()
    return take_rows(x.reshape(batch * width, -1), flat).view(*index.shape, *x.shape[2:])


def rows_at(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``x[first, second]`` for ``x [A, B, D]`` and index pairs ``first, second [M]``: ``[M, D]``. Where each
    ``x[a]`` is rows of ``D`` contiguous elements and ``x[a + 1]`` starts a whole number of rows later (a strided
    view of a larger buffer, as the memory's keys are), one :func:`take_rows` over the rows of that buffer; else
    advanced indexing (the same rows, several times slower on a CPU)."""
    dim = x.shape[-1]
    whole_rows = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == dim and x.stride(0) % dim == 0
    if not whole_rows or x.shape[0] == 0 or x.shape[1] == 0:
        return x[first, second]
    per_first = x.stride(0) // dim
    rows = x.as_strided(((x.shape[0] - 1) * per_first + x.shape[1], dim), (dim, 1))
    return take_rows(rows, first * per_first + second)


def put_rows(rows: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """``rows[index] = source`` in place: row ``index[i]`` (int64, no repeats) of ``rows [N, D]`` becomes ``source[i]``
    (``[M, D]``, same dtype). On a CPU one copy per row of its bytes through numpy (:func:`row_records`, from
    :data:`RECORD_MIN_ROWS` rows), for fewer rows numpy's indexed assignment of int64 words where a row is whole
    words; ``index_copy_`` elsewhere (it copies element by element)."""
    source = source.contiguous()
    on_cpu = rows.device.type == source.device.type == index.device.type == "cpu"
    if on_cpu and source.dtype == rows.dtype and source.shape[1:] == rows.shape[1:]:
        records = _records_for(rows, index)
        moved = row_records(source) if records is not None else None
        if records is not None and moved is not None:
            records[index.numpy()] = moved
            return
    words, values = as_words(rows), as_words(source)
    if words.dtype != values.dtype:  # one of them is not whole contiguous words (a strided view): move elements
        words, values = rows, source
    if on_cpu and words.is_contiguous() and words.dtype not in _NOT_IN_NUMPY:
        words.detach().numpy()[index.numpy()] = values.detach().numpy()
    else:
        words.index_copy_(0, index.to(words.device), values.to(words.device))


#: Moves of at least this many rows on a CPU are split across torch's intra-op threads (:func:`move_rows`): numpy
#: releases the GIL while it copies, and each part's gather and scatter are one thread's (measured in
#: ``docs/performance.md``); below it a thread's hand-off costs more than it saves.
PARALLEL_MIN_ROWS = 8192
_pool: dict[str, Any] = {"pid": None, "executor": None, "lock": threading.Lock()}
if hasattr(os, "register_at_fork"):  # a forked child gets a fresh lock (the parent's may have been held at the fork)
    os.register_at_fork(after_in_child=lambda: _pool.update(pid=None, executor=None, lock=threading.Lock()))


def _in_parts(count: int, work: Callable[[slice], None]) -> None:
    """``work(part)`` over slices covering ``range(count)``: one slice per intra-op thread torch may use (at most the
    machine's cores) when ``count >= PARALLEL_MIN_ROWS``, the first on this thread; else one slice, here."""
    parts = min(torch.get_num_threads(), os.cpu_count() or 1)
    if parts < 2 or count < PARALLEL_MIN_ROWS:
        work(slice(0, count))
        return
    with _pool["lock"]:  # the app's request threads may move rows at once; one executor per process
        if _pool["pid"] != os.getpid():  # a forked child has the parent's executor object but none of its threads
            executor = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="kvdemo-rows")
            _pool.update(pid=os.getpid(), executor=executor)
        executor = _pool["executor"]
    bounds = [count * i // parts for i in range(parts + 1)]
    others = [executor.submit(work, slice(a, b)) for a, b in zip(bounds[1:-1], bounds[2:])]
    work(slice(bounds[0], bounds[1]))
    for other in others:
        other.result()


def move_rows(moves: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """For each ``(rows, dst, src)``: ``rows[dst] = rows[src]`` in place, ``rows [N, D]``, int64 ``dst, src [M]``, where
    no row is both read and written (within a move or across moves of one buffer) and ``dst`` has no repeats: a
    compaction's kept rows into evicted slots, one move per layer. On a CPU, a move of at least
    :data:`RECORD_MIN_ROWS` rows copies numpy records (:func:`row_records`); all such moves together are shared out
    across torch's intra-op threads from :data:`PARALLEL_MIN_ROWS` rows in all, each thread gathering and scattering
    its own share (the rows are disjoint, so the result does not depend on the order). The moves of a whole pass go
    together: a thread woken per layer would cost about as much as it saves. Other moves: :func:`take_rows` then
    :func:`put_rows`."""
    batch: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for rows, dst, src in moves:
        records = _records_for(rows, dst)
        if records is None or src.device.type != "cpu":
            put_rows(rows, dst, take_rows(rows, src))
        else:
            batch.append((records, dst.numpy(), src.numpy()))
    firsts = np.cumsum([0] + [len(to) for _, to, _ in batch])

    def move(part: slice) -> None:  # the rows part.start..part.stop of all the moves, one after another
        for (records, to, of), first in zip(batch, firsts.tolist()):
            a, b = max(part.start - first, 0), min(part.stop - first, len(to))
            if a < b:
                records[to[a:b]] = np.take(records, of[a:b])

    if batch:
        _in_parts(int(firsts[-1]), move)


#: Dtypes numpy has no equivalent of (rows of them that are not whole int64 words move with ``index_copy_``).
_NOT_IN_NUMPY = (torch.bfloat16, torch.float16, torch.complex32)


def move_tensors(value: Any, device: torch.device | str) -> Any:
    """``value`` with every tensor inside it (dataclass fields, dicts, lists, tuples) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            setattr(value, f.name, move_tensors(getattr(value, f.name), device))
        return value
    if isinstance(value, dict):
        return {k: move_tensors(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(move_tensors(v, device) for v in value)
    return value
