"""``python -m kvdemo bench``: a long synthetic stream through ``full`` and a bounded policy on the tiny
model (per-chunk prefill/compression time, visual tokens, cache bytes), and the time of one
compression pass on caches of Qwen2.5-VL-7B shape (28 layers, 4 KV heads, head dim 128, M=6144 -> C=4608).

Prints tables and writes JSON; it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .engine import StreamEngine, stream_video
from .models.tiny import build_tiny_model
from .policies import LayerView, Policy, make_policy
from .video import synthetic_video

#: Qwen2.5-VL-7B's language model cache geometry, and InfiniPot-V's budget.
QWEN7B_SHAPE = dict(num_layers=28, num_kv_heads=4, head_dim=128, budget=6144, keep=4608, grid=(16, 16))
REFERENCE_POLICIES = ("uniform", "sliding-window")


def synthetic_views(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    budget: int,
    grid: tuple[int, int],
    dtype: torch.dtype,
    seed: int = 0,
) -> list[LayerView]:
    """Random per-layer views holding ``budget`` visual tokens laid out as whole frames of ``grid``."""
    generator = torch.Generator().manual_seed(seed)
    per_frame = grid[0] * grid[1]
    token = torch.arange(budget)
    frame = (token // per_frame).int().expand(num_kv_heads, -1).contiguous()
    row = ((token % per_frame) // grid[1]).int().expand(num_kv_heads, -1).contiguous()
    col = (token % grid[1]).int().expand(num_kv_heads, -1).contiguous()
    views = []
    for layer in range(num_layers):
        keys = torch.randn(num_kv_heads, budget, head_dim, generator=generator).to(dtype)
        values = torch.randn(num_kv_heads, budget, head_dim, generator=generator).to(dtype)
        views.append(LayerView(layer, num_layers, keys, values, frame, row, col, grid, int(frame.max())))
    return views


def time_pass(policy: Policy, views: list[LayerView], keep: int, repeats: int) -> dict[str, float]:
    """Median and min wall time (ms) of ``policy.compress(views, keep)`` after one warm-up."""
    with torch.inference_mode():
        policy.compress(views, keep)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            policy.compress(views, keep)
            times.append((time.perf_counter() - start) * 1000)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def pass_benchmark(policy: Policy, repeats: int) -> list[dict[str, Any]]:
    """One compression pass at Qwen2.5-VL-7B shape for ``policy`` and the reference policies, fp32 and bf16.

    A policy with a ``followers`` switch (CoRDS' cross-layer cascade) is also timed with it flipped.
    """
    shape = QWEN7B_SHAPE
    rows = []
    policies = [policy]
    if isinstance(getattr(policy, "followers", None), bool):
        policies.append(dataclasses.replace(policy, followers=not policy.followers))
    policies += [make_policy(name) for name in REFERENCE_POLICIES if name != policy.name]
    for dtype in (torch.float32, torch.bfloat16):
        views = synthetic_views(
            shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], shape["budget"], shape["grid"], dtype
        )
        for candidate in policies:
            timing = time_pass(candidate, views, shape["keep"], repeats)
            label = candidate.name + (f" (followers={candidate.followers})" if hasattr(candidate, "followers") else "")
            rows.append({"policy": label, "dtype": str(dtype).replace("torch.", ""), **timing})
    return rows


def stream_benchmark(policy: Policy, frames: int, budget: int, keep: int) -> dict[str, Any]:
    """Stream a synthetic video through ``full`` and ``policy`` on the tiny model (one shared encoding)."""
    model = build_tiny_model()
    video = synthetic_video(num_frames=frames, height=224, width=336, fps=2.0, seed=1)
    engines = {
        "full": StreamEngine(model, "full", fps=video.fps),
        policy.name: StreamEngine(model, policy, budget=budget, keep=keep, fps=video.fps),
    }
    encode_ms = 0.0
    for step in stream_video(model, video, engines, frames_per_chunk=2):
        encode_ms += step.chunk.encode_ms
    result: dict[str, Any] = {"frames": frames, "budget": budget, "keep": keep, "encode_ms": encode_ms, "engines": {}}
    for name, engine in engines.items():
        stats = engine.stats
        result["engines"][name] = {
            "per_chunk": stats.per_chunk,
            "peak_cache_bytes": max(row["cache_bytes"] for row in stats.per_chunk),
            "final_cache_bytes": stats.per_chunk[-1]["cache_bytes"],
            "peak_visual_tokens": max(row["visual_tokens"] for row in stats.per_chunk),
            "prefill_ms": stats.prefill_ms,
            "compress_ms": stats.compress_ms,
            "compressions": stats.compressions,
            "compress_pct_of_prefill": 100 * stats.compress_ms / stats.prefill_ms if stats.prefill_ms else 0.0,
        }
    return result


def bench_command(args: argparse.Namespace) -> int:
    from .cli import parse_param

    policy = make_policy(args.policy, **dict(parse_param(p) for p in args.param))
    if not policy.bounded:
        print("error: bench compares a bounded policy with full; pick one other than 'full'", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "policy": policy.name,
        "params": policy.params(),
    }
    print(f"streaming {args.frames} synthetic frames through full and {policy.name} (M={args.budget}, C={args.keep})", file=sys.stderr)
    stream = stream_benchmark(policy, args.frames, args.budget, args.keep)
    results["stream"] = stream
    print(stream_table(stream, policy.name, args.every))
    if not args.skip_pass:
        shape = QWEN7B_SHAPE
        print(
            f"\none compression pass at Qwen2.5-VL-7B shape ({shape['num_layers']} layers, {shape['num_kv_heads']} KV heads,"
            f" head dim {shape['head_dim']}, M={shape['budget']} -> C={shape['keep']}), median of {args.pass_repeats}:",
            file=sys.stderr,
        )
        results["pass_7b_shape"] = {"shape": {**shape, "grid": list(shape["grid"])}, "rows": pass_benchmark(policy, args.pass_repeats)}
        print(pass_table(results["pass_7b_shape"]["rows"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def stream_table(stream: dict[str, Any], name: str, every: int = 1) -> str:
    full, bounded = stream["engines"]["full"], stream["engines"][name]
    lines = [
        f"{'frame':>6} | {'full prefill ms':>15} {'full tokens':>11} {'full MB':>8} | "
        f"{name + ' prefill ms':>22} {'compress ms':>11} {'tokens':>7} {'MB':>6}"
    ]
    rows = list(zip(full["per_chunk"], bounded["per_chunk"]))
    step = max(1, every)
    for index, (f, b) in enumerate(rows):
        if index % step and index != len(rows) - 1:
            continue
        lines.append(
            f"{f['frame']:>6} | {f['prefill_ms']:>15.1f} {f['visual_tokens']:>11} {f['cache_bytes'] / 2**20:>8.2f} | "
            f"{b['prefill_ms']:>22.1f} {b['compress_ms']:>11.1f} {b['visual_tokens']:>7} {b['cache_bytes'] / 2**20:>6.2f}"
        )
    if step > 1:
        lines.append(f"(every {step}th of {len(rows)} chunks shown; the JSON has all)")
    lines.append("summary:")
    for label, engine in (("full", full), (name, bounded)):
        lines.append(
            f"  {label:<16} peak cache {engine['peak_cache_bytes'] / 2**20:8.2f} MB, peak visual tokens "
            f"{engine['peak_visual_tokens']:6}, prefill {engine['prefill_ms']:8.0f} ms, compression "
            f"{engine['compress_ms']:7.0f} ms ({engine['compress_pct_of_prefill']:.1f}% of prefill, {engine['compressions']} passes)"
        )
    ratio = full["peak_cache_bytes"] / bounded["peak_cache_bytes"] if bounded["peak_cache_bytes"] else 0
    lines.append(f"  full's peak cache is {ratio:.1f}x {name}'s; vision encoding (shared) {stream['encode_ms']:.0f} ms")
    return "\n".join(lines)


def pass_table(rows: list[dict[str, Any]]) -> str:
    width = max(18, *(len(row["policy"]) for row in rows))
    lines = [f"{'policy':<{width}} {'dtype':<9} {'median ms':>10} {'min ms':>8}"]
    for row in rows:
        lines.append(f"{row['policy']:<{width}} {row['dtype']:<9} {row['median_ms']:>10.1f} {row['min_ms']:>8.1f}")
    return "\n".join(lines)
