"""What kvdemo's attention calls get and cost on a device, for the doctor (:mod:`.doctor`): the SDPA backend a
masked call takes (:func:`attention_backend`), what a new key length costs each backend on CUDA
(:func:`key_length_cost`), and what each attention call holds and takes at real head shapes
(:func:`attention_memory`). Each returns rows; the doctor prints them."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cache.attention import (
    causal_mask,
    float32_attention,
    fused_needs_expanded_kv,
    grouped_sdpa,
    mask_dtype,
    sdpa_backends,
)
from ..devices.timing import Stopwatch


def attention_backend(device: torch.device) -> dict[str, Any]:
    """Which SDPA backend kvdemo's masked call gets on ``device``: on CUDA each fused backend is tried alone
    (a refusal means the math kernel would run); on the CPU, SDPA's CPU kernel."""
    if device.type != "cuda":
        return {"device": "cpu", "backend": "cpu (fused CPU kernel; masks in float32)", "expand_kv": False}
    q = torch.randn(1, 8, 64, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 2048, 128, device=device, dtype=torch.bfloat16)
    mask = torch.zeros(2, 64, 2048, device=device, dtype=torch.bfloat16)
    result = {"device": torch.cuda.get_device_name(device), "expand_kv": fused_needs_expanded_kv(q)}
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for expand in (False, True):
            try:
                with sdpa_kernel([backend]):
                    grouped_sdpa(q, k, k, mask, 0.088, expand_kv=expand)
                verdict = "runs"
            except RuntimeError as error:
                verdict = f"refused ({str(error).splitlines()[0][:60]})"
            result[f"{backend.name.lower()}{' expanded' if expand else ' grouped'}"] = verdict
    return result


def key_length_cost(device: torch.device, calls: int = 6) -> list[dict[str, Any]]:
    """What a new key length costs kvdemo's masked call on CUDA (a streaming cache meets one at every chunk and
    decoded token): median ms per call (synchronised) over ``calls`` calls that each meet a key length not seen
    before, and over as many at one repeated length, for a decode step (1 query) and a prefill chunk (256), with
    the memory-efficient and the cuDNN backend alone and with kvdemo's own choice (:func:`sdpa_backends`). bfloat16,
    16 query heads over 2 KV heads of width 128, a per-KV-head bias, 4k-25k keys. Empty off CUDA."""
    if device.type != "cuda":
        return []
    rows = []
    choices = (
        ("memory-efficient", [SDPBackend.EFFICIENT_ATTENTION]),
        ("cuDNN", [SDPBackend.CUDNN_ATTENTION]),
        ("kvdemo's choice", None),
    )
    for number, (label, backends) in enumerate(choices):
        for queries in (1, 256):
            base = 4096 + 4096 * (2 * number + (queries > 1))  # lengths no earlier row used
            row: dict[str, Any] = {
                "backend": label,
                "queries": queries,
                "keys": base,
                "kvdemo_backends": [b.name for b in sdpa_backends(device) or []] if backends is None else None,
            }
            try:
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    for name, lengths in (
                        ("new_length_ms", [base + 64 * i for i in range(calls + 1)]),
                        ("same_length_ms", [base] * (calls + 1)),
                    ):
                        times = []
                        for length in lengths:
                            q = torch.randn(1, 16, queries, 128, device=device, dtype=torch.bfloat16)
                            k = torch.randn(1, 2, length, 128, device=device, dtype=torch.bfloat16)
                            mask = torch.zeros(2, queries, length, device=device, dtype=torch.bfloat16)
                            watch = Stopwatch(device)
                            grouped_sdpa(q, k, k, mask, 0.088, expand_kv=fused_needs_expanded_kv(q))
                            times.append(watch.ms())
                        row[name] = sorted(times[1:])[calls // 2]  # the first call of each list is a warm-up
            except RuntimeError as error:
                row["error"] = str(error).splitlines()[0][:80]
            rows.append(row)
    return rows


#: Attention head shapes for :func:`attention_memory`: (label, query heads, KV heads), head width 128.
ATTENTION_SHAPES = (("3B", 16, 2), ("7B", 28, 4))


def attention_memory(
    device: torch.device,
    shapes: tuple[tuple[str, int, int], ...] = ATTENTION_SHAPES,
    chunk: int = 720,
    past: int = 6144,
    repeats: int = 5,
    block_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """kvdemo's attention calls for one chunk of ``chunk`` tokens over ``past`` cached keys at each of ``shapes``,
    bfloat16 on CUDA (float32 elsewhere): SDPA with a per-KV-head mask (a ragged memory), SDPA with the causal mask
    alone, and the float32 softmax a rounding-sensitive bias takes, in its blocks (of ``block_bytes``; default
    kvdemo's) and as one block. Per call: the device's peak allocation above what was held before it (MB, CUDA
    only) and the median ms of ``repeats``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for label, q_heads, kv_heads in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        query = torch.randn(1, q_heads, chunk, 128, generator=g, device=device).to(dtype)
        key, value = (
            torch.randn(1, kv_heads, past + chunk, 128, generator=g, device=device).to(dtype) for _ in range(2)
        )
        bias = torch.zeros(kv_heads, past, device=device)
        bias[0, past // 2 :] = float("-inf")  # one head holds fewer tokens
        ragged = torch.zeros(kv_heads, chunk, past + chunk, dtype=mask_dtype(query), device=device)
        ragged[:, :, :past] = bias[:, None]
        ragged[:, :, past:].masked_fill_(~causal_mask(chunk, chunk, device), float("-inf"))
        expand = fused_needs_expanded_kv(query)
        calls = (
            ("SDPA, per-KV-head mask", lambda: grouped_sdpa(query, key, value, ragged, 0.088, expand_kv=expand)),
            (
                "SDPA, causal mask",
                lambda: grouped_sdpa(
                    query, key, value, causal_mask(chunk, past + chunk, device), 0.088, expand_kv=expand
                ),
            ),
            (
                "float32 softmax, blocks",
                lambda: float32_attention(query, key, value, bias, None, 0.088, block_bytes=block_bytes),
            ),
            (
                "float32 softmax, one block",
                lambda: float32_attention(query, key, value, bias, None, 0.088, block_bytes=1 << 62),
            ),
        )
        outputs = {}
        for name, call in calls:
            row: dict[str, Any] = {"shape": label, "call": name, "peak_mb": None}
            try:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                outputs[name] = call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
                times = []
                for _ in range(repeats):
                    watch = Stopwatch(device)
                    call()
                    times.append(watch.ms())
                row["ms"] = sorted(times)[repeats // 2]
            except RuntimeError as error:
                row["error"] = str(error).splitlines()[0][:80]
            rows.append(row)
        if "float32 softmax, blocks" in outputs and "float32 softmax, one block" in outputs:
            # Equal up to float32 rounding: a BLAS may round a product of fewer rows differently (seen on an Intel
            # Xeon's CPU kernels: 3e-7), so bit equality would test the machine, not the blocks.
            blocks, whole = outputs["float32 softmax, blocks"].float(), outputs["float32 softmax, one block"].float()
            same = torch.allclose(blocks, whole, rtol=1e-5, atol=1e-6)
            rows[-2]["same_as_one_block"] = rows[-1]["same_as_one_block"] = same
            rows[-2]["max_abs_diff"] = rows[-1]["max_abs_diff"] = float((blocks - whole).abs().max())
    return rows
