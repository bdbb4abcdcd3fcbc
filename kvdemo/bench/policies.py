"""What a policy declares worth measuring about itself (:func:`.plans.bench_plan`), at Qwen2.5-VL-7B's cache
shape with random keys and values through the real memory: ``update``, the per-chunk cost over a simulated
stream and a much longer one (a policy whose pass runs at every chunk), split by the phases the policy
reports; ``decode``, one decode step's attention through kvdemo's attention function against the full
cache's, and decode per token on the tiny model."""

from __future__ import annotations

import copy
import dataclasses
import statistics
from typing import Any

import torch

from ..cache.attention import MemoryCache, kvdemo_attention
from ..cache.budget import DEFAULT_KEEP_RATIO, Budget
from ..cache.memory import KVMemory
from ..devices.timing import Stopwatch
from ..models.catalog import TINY_RANDOM_NAME
from ..models.loading import load_model
from ..policies import DEFAULT_POLICY, Policy, Probed, SummaryRegion, make_policy
from ..stream.lineup import Contender, make_engines
from ..stream.streaming import stream_video
from ..testing import (
    QWEN7B_SHAPE,
    qwen7b_rotation,
    synthetic_memory,
    synthetic_probe,
)
from ..world.synthetic import synthetic_video
from .host_store import run_store
from .plans import bench_plan
from .simulation import simulated_stream


def _mean_phases(passes: list[dict[str, Any]]) -> dict[str, float]:
    names = sorted({name for p in passes for name in p.get("phases_ms", {})})
    out = {name: statistics.fmean(p["phases_ms"].get(name, 0.0) for p in passes) for name in names}
    out["apply"] = statistics.fmean(p["apply_ms"] for p in passes)
    out["total"] = statistics.fmean(p["select_ms"] + p["apply_ms"] for p in passes)
    return out


def update_benchmark(
    policy: Policy, grids: int = 48, factor: int = 20, window: int = 16, shape: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A policy's per-chunk update at 7B shape (for one sized by ``M`` alone, one pass per temporal grid once
    its window is full), split by the phases it reports, averaged over the last ``window`` passes of a
    ``grids``-grid stream and of a ``factor`` times longer one (float32), and of the ``grids``-grid stream in bfloat16
    (``"1x bfloat16"``); next to InfiniPot-V's pass amortised per grid on the same stream shape, and, for a policy
    with a summary region, the cost of synthesising every summary entry at once (what a read-time synthesis would
    cost; the policy refreshes during ingestion)."""
    shape = shape or QWEN7B_SHAPE
    out: dict[str, Any] = {"shape": {**shape, "grid": list(shape["grid"])}, "grids": grids, "factor": factor}
    runs = (
        ("1x", grids, torch.float32),
        (f"{factor}x", grids * factor, torch.float32),
        (UPDATE_BF16, grids, torch.bfloat16),
    )
    for label, length, dtype in runs:
        fresh = dataclasses.replace(policy)
        memory, passes = simulated_stream(fresh, length, shape, dtype)
        tail = passes[-window:]
        per_grid = _mean_phases(tail)
        out[label] = {
            "per_grid_ms": per_grid,
            "per_frame_ms": {k: v / 2 for k, v in per_grid.items()},
            "passes": len(passes),
            "bank": fresh.report(),
        }
        refresh_all = bench_plan(fresh).refresh_all
        if label == "1x" and isinstance(fresh, SummaryRegion) and refresh_all is not None:
            with torch.inference_mode():
                watch = Stopwatch(memory.devices)
                refresh_all(fresh, qwen7b_rotation(shape["head_dim"]), shape["num_kv_heads"])
                out["synthesis_all_ms"] = watch.ms()
    reference = make_policy(DEFAULT_POLICY)  # the project's default policy, InfiniPot-V
    ref_shape = {**shape, "keep": shape["keep"]}
    _, passes = simulated_stream(reference, grids, ref_shape)
    spent = sum(p["select_ms"] + p["apply_ms"] for p in passes)
    first = passes[0]["grid"] if passes else grids
    out["infinipot_v"] = {
        "passes": len(passes),
        "per_grid_ms": spent / max(1, grids - first),
        "per_frame_ms": spent / max(1, grids - first) / 2,
        "pass_ms": spent / max(1, len(passes)),
    }
    return out


#: The update benchmark's bfloat16 run (the ``grids``-grid stream with a bfloat16 cache).
UPDATE_BF16 = "1x bfloat16"


def update_table(result: dict[str, Any], name: str) -> str:
    factor = f"{result['factor']}x"
    columns = ["1x", factor] + [UPDATE_BF16] * (UPDATE_BF16 in result)
    phases = [k for k in result["1x"]["per_frame_ms"] if k != "total"] + ["total"]
    shape = result["shape"]
    lines = [
        f"{name} update per frame ({shape['num_layers']} layers x {shape['num_kv_heads']} KV heads x {shape['head_dim']}, "
        f"M={shape['budget']}), ms, mean of the last passes (float32 unless named):",
        f"  {'phase':<12} " + " ".join(f"{column:>12}" for column in columns),
    ]
    for name in phases:
        lines.append(
            f"  {name:<12} " + " ".join(f"{result[column]['per_frame_ms'].get(name, 0.0):>12.1f}" for column in columns)
        )
    ref = result["infinipot_v"]
    lines.append(
        f"  InfiniPot-V pass amortised per frame: {ref['per_frame_ms']:.1f} ms ({ref['passes']} passes of {ref['pass_ms']:.0f} ms)"
    )
    lines.append(
        f"  {name} / InfiniPot-V per frame: {result['1x']['per_frame_ms']['total'] / max(ref['per_frame_ms'], 1e-9):.2f}x"
        f" ({result['grids']} grids), {result[factor]['per_frame_ms']['total'] / max(ref['per_frame_ms'], 1e-9):.2f}x"
        f" ({result['grids'] * result['factor']} grids)"
    )
    if "synthesis_all_ms" in result:
        lines.append(
            f"  synthesising every summary entry at once: {result['synthesis_all_ms']:.1f} ms "
            "(refreshed only where a chunk changed them, included above; a question adds nothing)"
        )
    return "\n".join(lines)


class _LayerStub(torch.nn.Module):
    """What the attention function reads of a transformers attention module: its layer index."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer_idx = layer


def decode_attention_ms(memory: KVMemory, num_heads: int, repeats: int, answering: bool) -> float:
    """Median ms of one decode step's attention over every layer of ``memory`` through kvdemo's attention
    function (the new token's key/value written into the slack, nothing committed)."""
    generator = torch.Generator().manual_seed(9)
    stubs = [_LayerStub(layer) for layer in range(memory.num_layers)]
    dim = memory.layers[0].keys.shape[-1]
    dtype = memory.layers[0].keys.dtype
    query = torch.randn(1, num_heads, 1, dim, generator=generator).to(dtype)
    new = torch.randn(1, memory.num_kv_heads, 1, dim, generator=generator).to(dtype)
    times = []
    with torch.inference_mode():
        for run in range(repeats + 1):
            cache = MemoryCache(memory)
            cache.answering = answering
            watch = Stopwatch(memory.devices)
            for stub, layer in zip(stubs, cache.layers):
                keys, values = layer.update(new, new)
                kvdemo_attention(stub, query, keys[:, :, :], values, None, scaling=dim**-0.5, kvdemo=cache)
            if run:
                times.append(watch.ms())
    return statistics.median(times)


def decode_benchmark(
    policy: Policy,
    stream_tokens: int = 24576,
    budget_share: float = 0.1,
    repeats: int = 5,
    shape: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decode-step attention at 7B shape with random tensors: the full cache holding ``stream_tokens`` visual
    tokens against ``policy`` after one pass to ``budget_share`` of them (what it holds, plus what it
    retrieves from the offload store while answering), through kvdemo's attention function; and the pass
    itself. Keys name the policy (``{name}_decode_attention_ms``...)."""
    shape = shape or QWEN7B_SHAPE
    keep = int(stream_tokens * budget_share)
    args = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], stream_tokens, shape["grid"], torch.float32)
    full = synthetic_memory(*args)
    compressed = copy.deepcopy(full)
    heads = shape.get("num_heads", shape["num_kv_heads"])
    probe = (
        synthetic_probe(shape["num_layers"], heads, shape["head_dim"], torch.float32)
        if isinstance(policy, Probed)
        else None
    )
    with torch.inference_mode():
        watch = Stopwatch(compressed.devices)
        selection = policy.compress(compressed.slices(probe=probe), keep)
        middle = watch.ms()
        compressed.apply(selection)
        end = watch.ms()
    name = policy.name
    return {
        "stream_tokens": stream_tokens,
        "keep": keep,
        "layers": shape["num_layers"],
        "pass_ms": {"classify_and_prune": middle, "apply_and_offload": end - middle},
        "full_decode_attention_ms": decode_attention_ms(full, heads, repeats, answering=True),
        f"{name}_decode_attention_ms": decode_attention_ms(compressed, heads, repeats, answering=True),
        "full_cache_bytes": full.nbytes,
        f"{name}_resident_bytes": compressed.nbytes - compressed.padding_bytes,
        f"{name}_padding_bytes": compressed.padding_bytes,
        f"{name}_offloaded_bytes": compressed.offloaded_bytes,
        "report": policy.report(),
    }


def tiny_decode_benchmark(
    policy: Policy, frames: int = 240, budget_share: float = 0.1, tokens: int = 32
) -> dict[str, Any]:
    """The tiny model end to end: a synthetic stream into ``full`` and ``policy`` at ``budget_share`` of the
    stream's visual tokens, then one answer each; decode ms per token (after the first token)."""
    model = load_model(TINY_RANDOM_NAME)
    video = synthetic_video(num_frames=frames, height=224, width=336, fps=2.0, seed=1)
    per_grid = (224 // 28) * (336 // 28)
    total = frames // 2 * per_grid
    budget = Budget.resolve(
        policy, max(4 * per_grid, int(total * budget_share)), None, default_ratio=DEFAULT_KEEP_RATIO
    )
    engines = make_engines(
        model, [Contender(policy.name, policy=policy, budget=budget)], fps=2.0, max_new_tokens=tokens, baseline=True
    )
    for _ in stream_video(model, video, engines):
        pass
    model.logit_bias = None  # let answers run to the token cap (random weights stop anywhere otherwise)
    out = {"frames": frames, "stream_tokens": total, "budget": budget.M, "keep": budget.C}
    for name, engine in engines.items():
        answer = engine.answer("What moved?", max_new_tokens=tokens)
        per_token = (answer.ms - answer.ttft_ms) / max(1, answer.tokens - 1)
        out[name] = {
            "ttft_ms": answer.ttft_ms,
            "decode_ms_per_token": per_token,
            "tokens": answer.tokens,
            "cache_bytes": engine.memory.nbytes,
            "offloaded_bytes": engine.memory.offloaded_bytes,
        }
    return out


def decode_table(decode: dict[str, Any], tiny: dict[str, Any] | None, name: str) -> str:
    lines = [
        f"{name}, {decode['layers']} layers, {decode['stream_tokens']} visual tokens -> {decode['keep']} per head on average:",
        f"  pass: classification + budgets + pruning {decode['pass_ms']['classify_and_prune']:.0f} ms, "
        f"apply + offload {decode['pass_ms']['apply_and_offload']:.0f} ms",
        f"  decode-step attention over {decode['layers']} layers: full {decode['full_decode_attention_ms']:.1f} ms, "
        f"{name} {decode[f'{name}_decode_attention_ms']:.1f} ms (resident + retrieved chunks)",
        f"  bytes: full {decode['full_cache_bytes'] / 2**20:.0f} MB; {name} resident "
        f"{decode[f'{name}_resident_bytes'] / 2**20:.0f} MB + padding {decode[f'{name}_padding_bytes'] / 2**20:.1f} MB, "
        f"offloaded {decode[f'{name}_offloaded_bytes'] / 2**20:.0f} MB (host)",
    ]
    if tiny:
        lines.append(
            f"tiny model, {tiny['frames']} frames ({tiny['stream_tokens']} visual tokens), M={tiny['budget']}:"
        )
        for engine in ("full", name):
            row = tiny[engine]
            lines.append(
                f"  {engine:<10} decode {row['decode_ms_per_token']:.1f} ms/token, first token {row['ttft_ms']:.0f} ms, "
                f"cache {row['cache_bytes'] / 2**20:.2f} MB, offloaded {row['offloaded_bytes'] / 2**20:.2f} MB"
            )
    return "\n".join(lines)


def long_stream_benchmark(
    policy: Policy,
    grids: int,
    shape: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Every pass of a ``grids``-grid simulated stream at 7B shape (:func:`simulated_stream`: the engine's trigger,
    random keys and values, no model): its grid, the most frames a head holds tokens of, selection and apply ms and
    the policy's phases. The pass table times a first pass, on a memory in stream order holding whole frames; later
    passes meet a compacted memory holding a few tokens of more and more frames."""
    shape = shape or QWEN7B_SHAPE
    _, passes = simulated_stream(dataclasses.replace(policy), grids, shape, dtype, device=device)
    return {
        "shape": {**shape, "grid": list(shape["grid"])},
        "grids": grids,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "passes": passes,
    }


def long_stream_table(result: dict[str, Any], name: str, rows: int = 5) -> str:
    """The first and the last pass of :func:`long_stream_benchmark` and a few evenly between them."""
    passes = result["passes"]
    if not passes:
        return f"{name} over a {result['grids']}-grid stream: no pass (the stream never reached M)"
    picks = sorted({round(i * (len(passes) - 1) / max(rows - 1, 1)) for i in range(rows)})
    lines = [
        f"{name}'s passes over a {result['grids']}-grid stream at 7B shape ({result['dtype']}"
        f"{'' if result.get('device', 'cpu') == 'cpu' else ' on ' + result['device']}, {len(passes)} passes):",
        f"{'grid':>6} {'frames held':>11} {'total ms':>9}  where the time goes (ms)",
    ]
    for index in picks:
        p = passes[index]
        phases = ", ".join(f"{k} {v:.1f}" for k, v in {**p.get("phases_ms", {}), "apply": p["apply_ms"]}.items())
        lines.append(f"{p['grid']:>6} {p['frames_held']:>11} {p['select_ms'] + p['apply_ms']:>9.1f}  {phases}")
    first, last = passes[0], passes[-1]
    ratio = (last["select_ms"] + last["apply_ms"]) / max(first["select_ms"] + first["apply_ms"], 1e-9)
    lines.append(f"last pass / first pass: {ratio:.2f}x (frames held {first['frames_held']} -> {last['frames_held']})")
    return "\n".join(lines)


def run_update(policy: Policy, factor: int) -> tuple[dict[str, Any], str]:
    result = update_benchmark(make_policy(policy.name, **policy.params()), factor=factor)
    return {"7b": result}, update_table(result, policy.name)


def run_decode(policy: Policy, factor: int) -> tuple[dict[str, Any], str]:
    decode = decode_benchmark(make_policy(policy.name, **policy.params()))
    tiny = tiny_decode_benchmark(make_policy(policy.name, **policy.params()))
    return {"7b": decode, "tiny": tiny}, decode_table(decode, tiny, policy.name)


#: The benchmarks a policy may declare (its card's ``bench.benchmarks``): name -> (what it measures, runner). A runner
#: takes the policy and ``--stream-factor`` and returns its JSON parts (``{suffix: result}``, written as
#: ``{policy}_{suffix}``) and its table.
BENCHMARKS = {
    "update": ("its per-chunk update at 7B shape over a simulated stream (random keys/values, no model)", run_update),
    "decode": ("its pass and decode-step attention at 7B shape, and decode on the tiny model", run_decode),
    "store": ("its host store over a simulated stream at 7B shape (random keys/values, no model)", run_store),
}
