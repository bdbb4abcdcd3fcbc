"""Small tensor helpers shared by the memory, the offload store and the policies (a leaf module: it
imports nothing of kvdemo)."""

from __future__ import annotations

import dataclasses
from typing import Any

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


def take_rows(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows[index]``: the rows ``index [M]`` of ``rows [N, D]``, ``[M, D]`` in ``rows``' dtype, gathered with one
    ``index_select`` as int64 words where a row is whole words (:func:`as_words`). ``out`` (``[M, D]``, contiguous,
    ``rows``' dtype): written in place, straight from ``rows`` when both are on one device (no intermediate), and
    returned."""
    index = index.to(rows.device)
    words = as_words(rows)
    if out is None:
        taken = words.index_select(0, index)
        return taken.view(rows.dtype) if taken.dtype != rows.dtype else taken
    target = as_words(out)
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


def put_rows(rows: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """``rows[index] = source`` in place: row ``index[i]`` (int64, no repeats) of ``rows [N, D]`` becomes ``source[i]``
    (``[M, D]``, same dtype), moved as int64 words where a row is whole words. On a CPU through numpy's indexed
    assignment (kvdemo's choice: ``index_copy_`` copies element by element; numpy copies rows, 1.4-1.7x faster in
    the offload store's 7B-shape copy, 2-3x on rows that fit the processor's cache, single thread), elsewhere
    ``index_copy_``."""
    words, values = as_words(rows), as_words(source.contiguous())
    on_cpu = words.device.type == values.device.type == index.device.type == "cpu"
    if on_cpu and words.is_contiguous() and values.dtype == words.dtype and words.dtype not in _NOT_IN_NUMPY:
        words.detach().numpy()[index.numpy()] = values.detach().numpy()
    else:
        words.index_copy_(0, index.to(words.device), values.to(words.device))


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
