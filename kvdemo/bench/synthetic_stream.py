"""A long synthetic stream through the full cache and a bounded policy on the tiny random model (one shared vision
encoding): per-chunk prefill and compression times, visual tokens and cache bytes, and its table (the first part of
``python -m kvdemo bench``)."""

from __future__ import annotations

from typing import Any

from ..cache.budget import Budget
from ..models.catalog import TINY_RANDOM_NAME
from ..models.loading import load_model
from ..policies import Policy
from ..stream.lineup import Contender, make_engines
from ..stream.streaming import stream_video
from ..world.synthetic import synthetic_video


def stream_benchmark(policy: Policy, frames: int, budget: Budget) -> dict[str, Any]:
    """Stream a synthetic video through ``full`` and ``policy`` under ``budget`` on the tiny model (one shared
    encoding)."""
    model = load_model(TINY_RANDOM_NAME)
    video = synthetic_video(num_frames=frames, height=224, width=336, fps=2.0, seed=1)
    engines = make_engines(model, [Contender(policy.name, policy=policy, budget=budget)], fps=video.fps, baseline=True)
    encode_ms = 0.0
    for step in stream_video(model, video, engines, frames_per_chunk=2):
        encode_ms += step.chunk.encode_ms
    result: dict[str, Any] = {
        "frames": frames,
        "budget": budget.M,
        "keep": budget.C,
        "encode_ms": encode_ms,
        "engines": {},
    }
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


def stream_table(stream: dict[str, Any], name: str, every: int = 1) -> str:
    """Every ``every``-th chunk of the full cache and of policy ``name`` side by side (and the last), then a summary:
    peak cache, peak visual tokens, prefill and compression time."""
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
