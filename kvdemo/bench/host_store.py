"""``store``: what a policy that offloads keeps in host memory over a stream (ReKV's store of every block that left its
window), at Qwen2.5-VL-7B's cache shape with random keys and values through the real memory and its offload store:
the store's bytes after every pass, its growth per minute of stream, and what stays on the device beside it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..policies import Policy, make_policy
from ..testing import QWEN7B_SHAPE
from .simulation import simulated_stream

#: Seconds of stream one temporal grid holds at kvdemo's default sampling (2 fps, two frames a grid).
SECONDS_PER_GRID = 1.0


def host_store_benchmark(
    policy: Policy,
    grids: int = 120,
    shape: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seconds_per_grid: float = SECONDS_PER_GRID,
) -> dict[str, Any]:
    """Stream ``grids`` temporal grids (:func:`.simulation.simulated_stream`: the engine's trigger, no model) into
    ``policy``'s memory in ``dtype`` and record, after each pass, the stream seconds fed and the bytes in the offload
    store. ``mb_per_minute`` is the store's growth between the first and the last pass (1e6 bytes per minute of
    stream); ``device_tokens`` the visual tokens the memory holds at the end (its retrieval reserve included, what a
    question may attend to); ``token_bytes`` one token's keys and values over every layer; ``report`` the policy's."""
    shape = shape or QWEN7B_SHAPE
    fresh = dataclasses.replace(policy)
    memory, passes = simulated_stream(fresh, grids, shape, dtype)
    per_grid = shape["grid"][0] * shape["grid"][1]
    records = [
        {"grid": p["grid"], "stream_s": p["grid"] * seconds_per_grid, "offloaded_bytes": p["offloaded_bytes"]}
        for p in passes
    ]
    rate = 0.0
    if len(records) > 1 and records[-1]["stream_s"] > records[0]["stream_s"]:
        first, last = records[0], records[-1]
        rate = (last["offloaded_bytes"] - first["offloaded_bytes"]) / (last["stream_s"] - first["stream_s"]) * 60 / 1e6
    return {
        "shape": {**shape, "grid": list(shape["grid"])},
        "dtype": str(dtype).replace("torch.", ""),
        "grids": grids,
        "seconds_per_grid": seconds_per_grid,
        "stream_tokens": grids * per_grid,
        "token_bytes": memory.token_bytes(),
        "full_cache_bytes": grids * per_grid * memory.token_bytes(),
        "offloaded_bytes": memory.offloaded_bytes,
        "device_tokens": memory.visual_tokens,
        "mb_per_minute": rate,
        "passes": records,
        "report": fresh.report(),
    }


def host_store_table(result: dict[str, Any], name: str, rows: int = 5) -> str:
    """The store after the first and the last pass and a few evenly between them, and its growth per minute."""
    shape = result["shape"]
    passes = result["passes"]
    lines = [
        f"{name}'s host store over a {result['grids']}-grid stream ({result['seconds_per_grid']:g} s a grid) at 7B shape "
        f"({shape['num_layers']} layers x {shape['num_kv_heads']} KV heads x {shape['head_dim']}, {result['dtype']}, "
        f"M={shape['budget']}, C={shape['keep']}):"
    ]
    if not passes:
        return lines[0] + " no pass (the stream never reached M)"
    lines.append(f"{'grid':>6} {'stream s':>9} {'host MB':>9}")
    picks = sorted({round(i * (len(passes) - 1) / max(rows - 1, 1)) for i in range(rows)})
    for index in picks:
        p = passes[index]
        lines.append(f"{p['grid']:>6} {p['stream_s']:>9.0f} {p['offloaded_bytes'] / 1e6:>9.1f}")
    lines.append(
        f"  host store grows {result['mb_per_minute']:.4g} MB per minute of stream "
        f"({result['mb_per_minute'] * 60 / 1e3:.1f} GB per hour); at the end {result['offloaded_bytes'] / 1e6:.0f} MB "
        f"in host memory, {result['device_tokens']} visual tokens on the device "
        f"(the full cache: {result['full_cache_bytes'] / 1e6:.0f} MB, {result['stream_tokens']} tokens)"
    )
    return "\n".join(lines)


def run_store(policy: Policy, factor: int) -> tuple[dict[str, Any], str]:
    """The bench's runner (:data:`.policies.BENCHMARKS`): the default stream in bfloat16 (``factor`` unused)."""
    result = host_store_benchmark(make_policy(policy.name, **policy.params()))
    return {"store_7b": result}, host_store_table(result, policy.name)
