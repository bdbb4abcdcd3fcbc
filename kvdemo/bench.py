"""``python -m kvdemo bench``: a long synthetic stream through ``full`` and a bounded policy on the tiny
model (per-chunk prefill/compression time, visual tokens, cache bytes), and measurements at Qwen2.5-VL-7B's
cache shape (28 layers, 4 KV heads, head dim 128, M=6144 -> C=4608) with random keys and values and no
model: one compression pass (selection + the memory's compaction) against the memory-bound floor, the
append cost, ProtoKV's per-chunk update split by phase over a stream and a 20x longer one, HybridKV's
classification + pruning pass and its decode-step attention against the full cache's, and (``--reference``)
kvdemo's InfiniPot-V pass against the authors' own code on the same tensors.

Prints tables and writes JSON; it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import copy
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
from .memory import KVMemory
from .models.base import VisualChunk, mrope_positions
from .models.tiny import build_tiny_model
from .policies import Policy, make_policy
from .video import synthetic_video

#: Qwen2.5-VL-7B's language model cache geometry, and InfiniPot-V's budget.
QWEN7B_SHAPE = dict(num_layers=28, num_kv_heads=4, num_heads=28, head_dim=128, budget=6144, keep=4608, grid=(16, 16))
#: Qwen2.5-VL's rope_theta; its M-RoPE sections split a head's D/2 frequencies 2 : 3 : 3 ([16, 24, 24] at D = 128).
QWEN_ROPE_THETA = 1_000_000.0
PROBE_TOKENS = 12
REFERENCE_POLICIES = ("uniform", "sliding-window")
PREFIX_TOKENS = 20


def qwen7b_rotation(head_dim: int = 128):
    """The M-RoPE rotation of a Qwen2.5-VL-shaped language model with ``head_dim`` (no weights needed)."""
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    from .models.qwen_vl import MRopeRotation

    config = Qwen2_5_VLTextConfig(
        hidden_size=head_dim * 28, num_attention_heads=28, num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN_ROPE_THETA,
                         "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
    )
    return MRopeRotation(Qwen2_5_VLRotaryEmbedding(config))


def synthetic_probe(num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Random probe queries ``[H_q, T, D]`` per layer (what the engine reads a probe text with)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_heads, PROBE_TOKENS, head_dim, generator=generator).to(dtype) for _ in range(num_layers)]


def synthetic_memory(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    budget: int,
    grid: tuple[int, int],
    dtype: torch.dtype,
    seed: int = 0,
    visual_tokens: int | None = None,
    summary_slots: int = 0,
) -> KVMemory:
    """A :class:`KVMemory` holding ``visual_tokens`` (default ``budget``) random visual tokens laid out as
    whole frames of ``grid`` after a short prefix, written the way a model writes them (through the
    memory's cache), with room for ``budget``."""
    generator = torch.Generator().manual_seed(seed)
    memory = KVMemory(num_layers, num_kv_heads, visual_capacity=budget, summary_slots=summary_slots)

    def random_kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, num_kv_heads, n, head_dim)
        return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)

    cache = memory.cache()
    for layer in cache.layers:
        layer.update(*random_kv(PREFIX_TOKENS))
    memory.commit_prefix(cache, PREFIX_TOKENS)
    tokens = budget if visual_tokens is None else visual_tokens
    append_random(memory, synthetic_chunk(0, tokens // (grid[0] * grid[1]), grid), generator)
    return memory


def append_random(memory: KVMemory, chunk: VisualChunk, generator: torch.Generator) -> None:
    """Append ``chunk``'s tokens with random keys/values through the memory's cache (as a model would)."""
    cache = memory.cache()
    for layer in cache.layers:
        store = memory.layers[layer.layer]
        shape = (1, store.keys.shape[1], chunk.num_tokens, store.keys.shape[-1])
        dtype = store.keys.dtype
        layer.update(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
    memory.commit_append(chunk, mrope_positions(chunk.grid, chunk.row, chunk.col, PREFIX_TOKENS, 1.0, 2.0))


def synthetic_chunk(first_grid: int, grids: int, grid: tuple[int, int]) -> VisualChunk:
    """Provenance of ``grids`` whole temporal grids (no embeddings: the memory only needs provenance)."""
    per_grid = grid[0] * grid[1]
    local = torch.arange(grids * per_grid)
    return VisualChunk(
        embeds=torch.empty(grids * per_grid, 0),
        grid=first_grid + local // per_grid,
        row=(local % per_grid) // grid[1],
        col=local % grid[1],
        first_grid=first_grid,
        num_grids=grids,
        rows=grid[0],
        cols=grid[1],
        grid_times_s=[float(first_grid + g) for g in range(grids)],
        frames=2 * grids,
        second_per_grid=1.0,
    )


def _summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times)}


def time_pass(policy: Policy, memory: KVMemory, keep: int, repeats: int) -> dict[str, Any]:
    """The whole compression pass on fresh copies of ``memory``: ``policy.compress`` (selection) and
    :meth:`KVMemory.apply` (the memory's compaction), medians and minima in ms over ``repeats`` runs
    after one warm-up, and the key/value bytes ``apply`` moved."""
    select, apply, total = [], [], []
    moved = 0
    shape = QWEN7B_SHAPE
    probe = None
    if policy.needs_probe:
        heads = memory.num_kv_heads * (shape["num_heads"] // shape["num_kv_heads"])
        probe = synthetic_probe(memory.num_layers, heads, memory.layers[0].keys.shape[-1], memory.layers[0].keys.dtype)
    with torch.inference_mode():
        for run in range(repeats + 1):
            fresh = copy.deepcopy(memory)
            start = time.perf_counter()
            selection = policy.compress(fresh.views(probe=probe), keep)
            middle = time.perf_counter()
            moved = fresh.apply(selection)
            end = time.perf_counter()
            if run:
                select.append((middle - start) * 1000)
                apply.append((end - middle) * 1000)
                total.append((end - start) * 1000)
    s, a, t = _summary(select), _summary(apply), _summary(total)
    return {
        "select_ms": s["median"], "apply_ms": a["median"], "total_ms": t["median"],
        "select_min_ms": s["min"], "apply_min_ms": a["min"], "total_min_ms": t["min"],
        "moved_bytes": moved,
    }


def time_floor(memory: KVMemory, keep: int, repeats: int) -> dict[str, float]:
    """The memory-bound floor of any selection pass: read every visual key and value once and write ``keep``
    tokens' keys and values; median and min ms. Both are raw byte streams, whatever the dtype: the read is a
    sum over the buffers viewed as int64 words (a bfloat16 sum would time the conversion, not the memory), the
    write a fill of preallocated buffers."""
    views = memory.views()
    targets = [torch.empty(v.num_heads, keep, v.keys.shape[-1], dtype=v.keys.dtype) for v in views for _ in range(2)]

    def words(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int64) if t.shape[-1] * t.element_size() % 8 == 0 else t

    times = []
    with torch.inference_mode():
        for run in range(repeats + 1):
            start = time.perf_counter()
            for view in views:
                words(view.keys).sum()
                words(view.values).sum()
            for target in targets:
                words(target).fill_(1)
            if run:
                times.append((time.perf_counter() - start) * 1000)
    s = _summary(times)
    return {"floor_ms": s["median"], "floor_min_ms": s["min"]}


def time_append(memory: KVMemory, grid: tuple[int, int], repeats: int) -> dict[str, Any]:
    """One chunk (one temporal grid) appended to ``memory`` (which has room for it) versus transformers'
    ``DynamicCache`` (``torch.cat``: every append copies the whole cache); ms and bytes copied."""
    from transformers import DynamicCache

    chunk = synthetic_chunk(memory.num_grids, 1, grid)
    n = chunk.num_tokens
    views = memory.views()
    keys = [torch.randn(1, v.num_heads, n, v.keys.shape[-1]).to(v.keys.dtype) for v in views]
    positions = mrope_positions(chunk.grid, chunk.row, chunk.col, memory.prefix_len, 1.0, 2.0)
    ours, theirs = [], []
    full = [(k[None], v[None]) for k, v in zip(memory.keys, memory.values)]
    with torch.inference_mode():
        for run in range(repeats + 1):
            fresh = copy.deepcopy(memory)
            dynamic = DynamicCache(ddp_cache_data=[(k[0], v[0]) for k, v in full])
            start = time.perf_counter()
            cache = fresh.cache()
            for layer, k in zip(cache.layers, keys):
                layer.update(k, k)
            fresh.commit_append(chunk, positions)
            middle = time.perf_counter()
            for index, k in enumerate(keys):
                dynamic.update(k, k, index)
            end = time.perf_counter()
            if run:
                ours.append((middle - start) * 1000)
                theirs.append((end - middle) * 1000)
    chunk_bytes = n * memory.token_bytes()
    return {
        "chunk_tokens": n,
        "kvdemo": {**{f"{k}_ms": v for k, v in _summary(ours).items()}, "bytes_copied": chunk_bytes},
        "dynamic_cache": {**{f"{k}_ms": v for k, v in _summary(theirs).items()},
                          "bytes_copied": memory.nbytes + chunk_bytes},
    }


def pass_benchmark(policy: Policy, repeats: int, shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole compression pass at Qwen2.5-VL-7B shape for ``policy`` and the reference policies, in fp32
    and bf16, next to the memory-bound floor, and the append cost at a full-size memory.

    Returns ``{"shape", "pass_7b": {policy: {dtype: {...}}}, "append_7b": {dtype: {...}}}``. A policy with a
    ``followers`` switch (CoRDS' cross-layer cascade) is also timed with it flipped. ``shape`` defaults to
    :data:`QWEN7B_SHAPE`.
    """
    shape = shape or QWEN7B_SHAPE
    policies = {policy.name: policy} if policy.uses_keep else {}
    if isinstance(getattr(policy, "followers", None), bool):
        flipped = dataclasses.replace(policy, followers=not policy.followers)
        policies[f"{policy.name} (followers={flipped.followers})"] = flipped
    for name in REFERENCE_POLICIES:
        policies.setdefault(name, make_policy(name))
    args = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], shape["budget"], shape["grid"])
    results: dict[str, Any] = {"pass_7b": {name: {} for name in policies}, "append_7b": {}}
    for dtype in (torch.float32, torch.bfloat16):
        label = str(dtype).replace("torch.", "")
        memory = synthetic_memory(*args, dtype)
        floor = time_floor(memory, shape["keep"], repeats)
        for name, candidate in policies.items():
            timing = time_pass(candidate, memory, shape["keep"], repeats)
            timing.update(floor)
            timing["total_over_floor"] = timing["total_ms"] / floor["floor_ms"]
            results["pass_7b"][name][label] = timing
        per_grid = shape["grid"][0] * shape["grid"][1]
        almost_full = synthetic_memory(*args, dtype, visual_tokens=shape["budget"] - per_grid)
        results["append_7b"][label] = time_append(almost_full, shape["grid"], repeats)
        del memory, almost_full
    results["shape"] = {**shape, "grid": list(shape["grid"])}
    return results


def simulated_stream(
    policy: Policy, grids: int, shape: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[KVMemory, list[dict[str, Any]]]:
    """Stream ``grids`` temporal grids of random keys/values into a memory managed by ``policy`` exactly as
    the engine does (compress when the next grid would overflow ``M``, then append), with no model.

    Returns the memory and one record per compression: grid, selection ms (and the policy's own phase
    split when it reports one), apply ms.
    """
    shape = shape or QWEN7B_SHAPE
    budget = shape["budget"]
    keep = shape["keep"] if policy.uses_keep else None
    generator = torch.Generator().manual_seed(seed)
    memory = KVMemory(shape["num_layers"], shape["num_kv_heads"], visual_capacity=budget,
                      summary_slots=policy.summary_slots(budget))
    cache = memory.cache()
    for layer in cache.layers:
        prefix = torch.randn(1, shape["num_kv_heads"], PREFIX_TOKENS, shape["head_dim"], generator=generator).to(dtype)
        layer.update(prefix, prefix)
    memory.commit_prefix(cache, PREFIX_TOKENS)
    rotary = qwen7b_rotation(shape["head_dim"])
    heads = shape.get("num_heads", shape["num_kv_heads"])
    per_grid = shape["grid"][0] * shape["grid"][1]
    passes = []
    with torch.inference_mode():
        for grid in range(grids):
            if memory.visual_tokens + per_grid > budget:
                probe = synthetic_probe(shape["num_layers"], heads, shape["head_dim"], dtype, grid) if policy.needs_probe else None
                start = time.perf_counter()
                selection = policy.compress(memory.views(rotary, probe), policy.keep_for(budget, keep, per_grid))
                middle = time.perf_counter()
                memory.apply(selection)
                end = time.perf_counter()
                record = {"grid": grid, "select_ms": (middle - start) * 1000, "apply_ms": (end - middle) * 1000}
                phases = getattr(policy, "_last", {}).get("ms")
                if phases:
                    record["phases_ms"] = dict(phases)
                passes.append(record)
            append_random(memory, synthetic_chunk(grid, 1, shape["grid"]), generator)
    return memory, passes


def _mean_phases(passes: list[dict[str, Any]]) -> dict[str, float]:
    names = sorted({name for p in passes for name in p.get("phases_ms", {})})
    out = {name: statistics.fmean(p["phases_ms"].get(name, 0.0) for p in passes) for name in names}
    out["apply"] = statistics.fmean(p["apply_ms"] for p in passes)
    out["total"] = statistics.fmean(p["select_ms"] + p["apply_ms"] for p in passes)
    return out


def protokv_benchmark(policy: Policy, grids: int = 48, factor: int = 20, window: int = 16,
                      shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """ProtoKV's per-chunk update at 7B shape (one pass per temporal grid once the near window is full),
    split by phase, averaged over the last ``window`` passes of a ``grids``-grid stream and of a
    ``factor`` times longer one; next to InfiniPot-V's pass amortised per grid on the same stream shape,
    and the cost of synthesising every prototype's pseudo-tokens at once (what a read-time synthesis
    would cost; kvdemo refreshes only the prototypes a chunk touched, during ingestion)."""
    shape = shape or QWEN7B_SHAPE
    out: dict[str, Any] = {"shape": {**shape, "grid": list(shape["grid"])}, "grids": grids, "factor": factor}
    for label, length in (("1x", grids), (f"{factor}x", grids * factor)):
        fresh = dataclasses.replace(policy)
        memory, passes = simulated_stream(fresh, length, shape)
        tail = passes[-window:]
        per_grid = _mean_phases(tail)
        out[label] = {"per_grid_ms": per_grid, "per_frame_ms": {k: v / 2 for k, v in per_grid.items()},
                      "passes": len(passes), "bank": fresh.report()}
        if label == "1x":
            bank = fresh._bank
            everything = torch.ones_like(bank.used)
            with torch.inference_mode():
                start = time.perf_counter()
                fresh.synthesize(bank, everything, qwen7b_rotation(shape["head_dim"]), shape["num_kv_heads"])
                out["synthesis_all_ms"] = (time.perf_counter() - start) * 1000
    reference = make_policy("infinipot-v")
    ref_shape = {**shape, "keep": shape["keep"]}
    _, passes = simulated_stream(reference, grids, ref_shape)
    spent = sum(p["select_ms"] + p["apply_ms"] for p in passes)
    first = passes[0]["grid"] if passes else grids
    out["infinipot_v"] = {"passes": len(passes), "per_grid_ms": spent / max(1, grids - first),
                          "per_frame_ms": spent / max(1, grids - first) / 2, "pass_ms": spent / max(1, len(passes))}
    return out


def protokv_table(result: dict[str, Any]) -> str:
    factor = f"{result['factor']}x"
    phases = [k for k in result["1x"]["per_frame_ms"] if k != "total"] + ["total"]
    shape = result["shape"]
    lines = [f"ProtoKV update per frame ({shape['num_layers']} layers x {shape['num_kv_heads']} KV heads x {shape['head_dim']}, "
             f"M={shape['budget']}), ms, mean of the last passes:", f"  {'phase':<12} {'1x':>9} {factor:>9}"]
    for name in phases:
        a, b = result["1x"]["per_frame_ms"].get(name, 0.0), result[factor]["per_frame_ms"].get(name, 0.0)
        lines.append(f"  {name:<12} {a:>9.1f} {b:>9.1f}")
    ref = result["infinipot_v"]
    lines.append(f"  InfiniPot-V pass amortised per frame: {ref['per_frame_ms']:.1f} ms ({ref['passes']} passes of {ref['pass_ms']:.0f} ms)")
    lines.append(f"  ProtoKV / InfiniPot-V per frame: {result['1x']['per_frame_ms']['total'] / max(ref['per_frame_ms'], 1e-9):.2f}x"
                 f" ({result['grids']} grids), {result[factor]['per_frame_ms']['total'] / max(ref['per_frame_ms'], 1e-9):.2f}x"
                 f" ({result['grids'] * result['factor']} grids)")
    lines.append(f"  synthesising every prototype's pseudo-tokens at once: {result['synthesis_all_ms']:.1f} ms "
                 "(kvdemo refreshes only the touched ones per chunk, included above; a question adds nothing)")
    return "\n".join(lines)


class _LayerStub(torch.nn.Module):
    """What the attention function reads of a transformers attention module: its layer index."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer_idx = layer


def decode_attention_ms(memory: KVMemory, num_heads: int, repeats: int, answering: bool) -> float:
    """Median ms of one decode step's attention over every layer of ``memory`` through kvdemo's attention
    function (the new token's key/value written into the slack, nothing committed)."""
    from .attention import kvdemo_attention

    generator = torch.Generator().manual_seed(9)
    stubs = [_LayerStub(layer) for layer in range(memory.num_layers)]
    dim = memory.layers[0].keys.shape[-1]
    dtype = memory.layers[0].keys.dtype
    query = torch.randn(1, num_heads, 1, dim, generator=generator).to(dtype)
    new = torch.randn(1, memory.num_kv_heads, 1, dim, generator=generator).to(dtype)
    times = []
    with torch.inference_mode():
        for run in range(repeats + 1):
            cache = memory.cache()
            cache.answering = answering
            start = time.perf_counter()
            for stub, layer in zip(stubs, cache.layers):
                keys, values = layer.update(new, new)
                kvdemo_attention(stub, query, keys[:, :, :], values, None, scaling=dim**-0.5, kvdemo=cache)
            if run:
                times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def hybridkv_decode_benchmark(policy: Policy, stream_tokens: int = 24576, budget_share: float = 0.1, repeats: int = 5,
                              shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """Decode-step attention at 7B shape with random tensors: the full cache holding ``stream_tokens`` visual
    tokens against HybridKV after one pass to ``budget_share`` of them (resident tokens + retrieval from the
    offload store), through kvdemo's attention function; and the pass itself (probe classification,
    budgets, pruning, offload)."""
    shape = shape or QWEN7B_SHAPE
    keep = int(stream_tokens * budget_share)
    args = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], stream_tokens, shape["grid"], torch.float32)
    full = synthetic_memory(*args)
    hybrid = copy.deepcopy(full)
    heads = shape.get("num_heads", shape["num_kv_heads"])
    probe = synthetic_probe(shape["num_layers"], heads, shape["head_dim"], torch.float32)
    with torch.inference_mode():
        start = time.perf_counter()
        selection = policy.compress(hybrid.views(probe=probe), keep)
        middle = time.perf_counter()
        hybrid.apply(selection)
        end = time.perf_counter()
    return {
        "stream_tokens": stream_tokens,
        "keep": keep,
        "layers": shape["num_layers"],
        "pass_ms": {"classify_and_prune": (middle - start) * 1000, "apply_and_offload": (end - middle) * 1000},
        "full_decode_attention_ms": decode_attention_ms(full, heads, repeats, answering=True),
        "hybridkv_decode_attention_ms": decode_attention_ms(hybrid, heads, repeats, answering=True),
        "full_cache_bytes": full.nbytes,
        "hybridkv_resident_bytes": hybrid.nbytes - hybrid.padding_bytes,
        "hybridkv_padding_bytes": hybrid.padding_bytes,
        "hybridkv_offloaded_bytes": hybrid.offloaded_bytes,
        "report": policy.report(),
    }


def tiny_decode_benchmark(policy: Policy, frames: int = 240, budget_share: float = 0.1, tokens: int = 32) -> dict[str, Any]:
    """The tiny model end to end: a synthetic stream into ``full`` and ``policy`` at ``budget_share`` of the
    stream's visual tokens, then one answer each; decode ms per token (after the first token)."""
    model = build_tiny_model()
    video = synthetic_video(num_frames=frames, height=224, width=336, fps=2.0, seed=1)
    per_grid = (224 // 28) * (336 // 28)
    total = frames // 2 * per_grid
    budget = max(4 * per_grid, int(total * budget_share))
    keep = int(budget * 0.75) if policy.uses_keep else None
    engines = {"full": StreamEngine(model, "full", fps=2.0, max_new_tokens=tokens),
               policy.name: StreamEngine(model, policy, budget=budget, keep=keep, fps=2.0, max_new_tokens=tokens)}
    for _ in stream_video(model, video, engines):
        pass
    model.logit_bias = None  # let answers run to the token cap (random weights stop anywhere otherwise)
    out = {"frames": frames, "stream_tokens": total, "budget": budget, "keep": keep}
    for name, engine in engines.items():
        answer = engine.answer("What moved?", max_new_tokens=tokens)
        per_token = (answer.ms - answer.ttft_ms) / max(1, answer.tokens - 1)
        out[name] = {"ttft_ms": answer.ttft_ms, "decode_ms_per_token": per_token, "tokens": answer.tokens,
                     "cache_bytes": engine.memory.nbytes, "offloaded_bytes": engine.memory.offloaded_bytes}
    return out


def hybridkv_table(decode: dict[str, Any], tiny: dict[str, Any] | None, name: str) -> str:
    lines = [
        f"HybridKV, {decode['layers']} layers, {decode['stream_tokens']} visual tokens -> {decode['keep']} per head on average:",
        f"  pass: classification + budgets + pruning {decode['pass_ms']['classify_and_prune']:.0f} ms, "
        f"apply + offload {decode['pass_ms']['apply_and_offload']:.0f} ms",
        f"  decode-step attention over {decode['layers']} layers: full {decode['full_decode_attention_ms']:.1f} ms, "
        f"hybridkv {decode['hybridkv_decode_attention_ms']:.1f} ms (resident + retrieved chunks)",
        f"  bytes: full {decode['full_cache_bytes'] / 2**20:.0f} MB; hybridkv resident "
        f"{decode['hybridkv_resident_bytes'] / 2**20:.0f} MB + padding {decode['hybridkv_padding_bytes'] / 2**20:.1f} MB, "
        f"offloaded {decode['hybridkv_offloaded_bytes'] / 2**20:.0f} MB (host)",
    ]
    if tiny:
        lines.append(f"tiny model, {tiny['frames']} frames ({tiny['stream_tokens']} visual tokens), M={tiny['budget']}:")
        for engine in ("full", name):
            row = tiny[engine]
            lines.append(f"  {engine:<10} decode {row['decode_ms_per_token']:.1f} ms/token, first token {row['ttft_ms']:.0f} ms, "
                         f"cache {row['cache_bytes'] / 2**20:.2f} MB, offloaded {row['offloaded_bytes'] / 2**20:.2f} MB")
    lines.append("(paper, Qwen2.5-VL-7B on an L40S at a 10% budget: 38.65 vs 58.94 ms/token, the whole model)")
    return "\n".join(lines)


#: Qwen2.5-VL-3B's language model cache geometry (the default real model) and the app's defaults for it.
QWEN3B_SHAPE = dict(num_layers=36, num_kv_heads=2, head_dim=128, budget=6144, keep=4608, grid=(24, 32))


def zerogpu_transfer_benchmark(seconds: tuple[int, ...] = (10, 30, 60), repeats: int = 3) -> dict[str, Any]:
    """What crosses the ZeroGPU boundary per call at Qwen2.5-VL-3B's cache shape in bf16 and the app's
    defaults (M=6144, one temporal grid of 768 tokens per second of video at 2 fps): the pickled KV memory of
    the policy engine and of the full-cache baseline after ``seconds`` of video, with the time to pickle and
    unpickle it here. A stream-segment call carries the state in and out, a question carries it in and
    returns only the dialogue (a few KB)."""
    import pickle

    shape = QWEN3B_SHAPE
    per_second = shape["grid"][0] * shape["grid"][1]
    rows = []

    def measure(label: str, tokens: int, budget: int) -> None:
        memory = synthetic_memory(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], budget, shape["grid"],
                                  torch.bfloat16, visual_tokens=tokens)
        dumps, loads, size = [], [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            blob = pickle.dumps(memory, protocol=pickle.HIGHEST_PROTOCOL)
            middle = time.perf_counter()
            pickle.loads(blob)
            dumps.append((middle - start) * 1000)
            loads.append((time.perf_counter() - middle) * 1000)
            size = len(blob)
        rows.append({"state": label, "tokens": tokens, "mb": size / 2**20, "pickle_ms": statistics.median(dumps),
                     "unpickle_ms": statistics.median(loads)})

    measure(f"policy engine at M={shape['budget']}", shape["budget"], shape["budget"])
    for second in seconds:
        measure(f"full-cache baseline after {second} s", second * per_second, second * per_second)
    return {"shape": {**shape, "grid": list(shape["grid"])}, "dtype": "bfloat16", "rows": rows}


def zerogpu_table(result: dict[str, Any]) -> str:
    lines = [f"{'state (Qwen2.5-VL-3B, bf16)':<40} {'tokens':>7} {'MB':>8} {'pickle ms':>10} {'unpickle ms':>12}"]
    for row in result["rows"]:
        lines.append(f"{row['state']:<40} {row['tokens']:>7} {row['mb']:>8.0f} {row['pickle_ms']:>10.0f} {row['unpickle_ms']:>12.0f}")
    lines.append("a stream-segment call carries its session's state in and out; a question carries it in (a few KB back)")
    return "\n".join(lines)


def load_reference(path: str | Path) -> Any:
    """The authors' ``process_kv_cache`` (github.com/aiha-lab/InfiniPot-V, ``kvcache_utils.py``), loaded from
    ``path``: that file, or a directory holding it (a clone of their repository). kvdemo ships none of their
    code; this only imports what the user points at."""
    import importlib.util

    file = Path(path)
    if file.is_dir():
        file = file / "kvcache_utils.py"
    if not file.is_file():
        raise FileNotFoundError(f"no kvcache_utils.py at {path} (give the file, or a clone of aiha-lab/InfiniPot-V)")
    spec = importlib.util.spec_from_file_location("infinipot_v_reference", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "process_kv_cache"):
        raise AttributeError(f"{file} has no process_kv_cache: not the authors' kvcache_utils.py")
    return module.process_kv_cache


def _row_keys(keys: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """A per-token fingerprint ``[H, L]`` (float64 projection of each key row) to compare kept sets."""
    return keys[0].double() @ probe


def reference_benchmark(process_kv_cache: Any, repeats: int = 5, policy: Policy | None = None, method: str = "infinipot-v",
                        shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """kvdemo's whole pass (selection + compaction) against the authors' ``process_kv_cache`` on the same
    tensors, in one process, alternating, in fp32 and bf16: median ms of each, their ratio, and how many
    (layer, KV head) rows kept exactly the same tokens (a first pass over whole frames; pooling off on both
    sides: kvdemo's ``van=plain``, their ``adaptive_pooling=False``; recent window 0.125 on both)."""
    shape = shape or QWEN7B_SHAPE
    policy = policy or make_policy("infinipot-v", van="plain")
    per_frame = shape["grid"][0] * shape["grid"][1]
    layers, heads, dim = shape["num_layers"], shape["num_kv_heads"], shape["head_dim"]
    from transformers import DynamicCache

    def theirs(memory: KVMemory) -> tuple[float, list[torch.Tensor]]:
        data = [(k.clone(), v.clone()) for k, v in zip(memory.keys, memory.values)]
        cache = DynamicCache(ddp_cache_data=data)
        # What process_kv_cache reads of a model: its layer count and the frame's side in patches.
        model = argparse.Namespace(model=argparse.Namespace(language_model=argparse.Namespace(layers=[None] * layers)),
                                   config=argparse.Namespace(height_width=shape["grid"][0]))
        start = time.perf_counter()
        process_kv_cache(cache, model, system_size=memory.prefix_len, inst_size=0, token_per_frame=per_frame,
                         compress_frame_num=shape["keep"] // per_frame, method=method, tar_ratio=0.5,
                         query_ratio=getattr(policy, "recent_ratio", 0.125), adaptive_pooling=False)
        return (time.perf_counter() - start) * 1000, [layer.keys for layer in cache.layers]

    def ours(memory: KVMemory) -> tuple[float, list[torch.Tensor]]:
        fresh = copy.deepcopy(memory)
        start = time.perf_counter()
        fresh.apply(policy.compress(fresh.views(), shape["keep"]))
        return (time.perf_counter() - start) * 1000, fresh.keys

    if shape["grid"][0] != shape["grid"][1]:
        raise ValueError("the authors' code assumes square frames")
    out: dict[str, Any] = {}
    probe = torch.randn(dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        memory = synthetic_memory(layers, heads, dim, shape["budget"], shape["grid"], dtype)
        mine, reference = [], []
        identical, common, kept = 0, 0, 0
        with torch.inference_mode():
            for run in range(repeats + 1):
                (a, kept_ours), (b, kept_theirs) = ours(memory), theirs(memory)
                if run:
                    mine.append(a)
                    reference.append(b)
            prefix = memory.prefix_len
            for ours_keys, their_keys in zip(kept_ours, kept_theirs):
                # Same tokens, in any order: kvdemo's compaction does not keep stream order.
                mine_rows, their_rows = _row_keys(ours_keys[:, :, prefix:], probe), _row_keys(their_keys[:, :, prefix:], probe)
                shared = torch.stack([torch.isin(m, t).sum() for m, t in zip(mine_rows, their_rows)])  # per KV head
                identical += int(((shared == mine_rows.shape[-1]) & (shared == their_rows.shape[-1])).sum())
                common, kept = common + int(shared.sum()), kept + their_rows.numel()
        out[str(dtype).removeprefix("torch.")] = {
            "kvdemo_ms": statistics.median(mine), "reference_ms": statistics.median(reference),
            "ratio": statistics.median(mine) / statistics.median(reference),
            "identical_rows": identical, "rows": layers * heads, "shared_token_fraction": common / max(kept, 1),
        }
    return out


def reference_table(result: dict[str, Any]) -> str:
    lines = ["kvdemo's whole pass vs the authors' process_kv_cache (same tensors, one process, alternating, pooling off):",
             f"  {'dtype':<9} {'kvdemo ms':>10} {'theirs ms':>10} {'ratio':>6}  same kept tokens"]
    for dtype, row in result.items():
        lines.append(f"  {dtype:<9} {row['kvdemo_ms']:>10.1f} {row['reference_ms']:>10.1f} {row['ratio']:>6.2f}"
                     f"  {row['identical_rows']}/{row['rows']} layer-heads identical, "
                     f"{100 * row['shared_token_fraction']:.2f}% of their kept tokens kept")
    return "\n".join(lines)


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
    reference = None
    if getattr(args, "reference", None):
        try:
            reference = load_reference(args.reference)
        except (OSError, AttributeError, ImportError, SyntaxError) as error:
            print(f"error: --reference: {error}", file=sys.stderr)
            return 2
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "policy": policy.name,
        "params": policy.params(),
    }
    keep = args.keep if policy.uses_keep else None
    sizes = f"M={args.budget}" + (f", C={keep}" if keep is not None else "")
    print(f"streaming {args.frames} synthetic frames through full and {policy.name} ({sizes})", file=sys.stderr)
    stream = stream_benchmark(policy, args.frames, args.budget, keep)
    results["stream"] = stream
    print(stream_table(stream, policy.name, args.every))
    if getattr(args, "zerogpu", False):
        print("\nwhat a ZeroGPU call pickles at Qwen2.5-VL-3B's defaults...", file=sys.stderr)
        results["zerogpu"] = zerogpu_transfer_benchmark()
        print(zerogpu_table(results["zerogpu"]))
    if not args.skip_pass and policy.name == "protokv":
        print("\nProtoKV's update at 7B shape over a simulated stream (random keys/values, no model)...", file=sys.stderr)
        results["protokv_7b"] = protokv_benchmark(make_policy(policy.name, **policy.params()), factor=args.stream_factor)
        print(protokv_table(results["protokv_7b"]))
    if not args.skip_pass and policy.name == "hybridkv":
        print("\nHybridKV's pass and decode-step attention at 7B shape, and decode on the tiny model...", file=sys.stderr)
        decode = hybridkv_decode_benchmark(make_policy(policy.name, **policy.params()))
        tiny = tiny_decode_benchmark(make_policy(policy.name, **policy.params()))
        results["hybridkv_7b"], results["hybridkv_tiny"] = decode, tiny
        print(hybridkv_table(decode, tiny, policy.name))
    if not args.skip_pass:
        shape = QWEN7B_SHAPE
        print(
            f"\none compression pass at Qwen2.5-VL-7B shape ({shape['num_layers']} layers, {shape['num_kv_heads']} KV heads,"
            f" head dim {shape['head_dim']}, M={shape['budget']} -> C={shape['keep']}), median of {args.pass_repeats}:",
            file=sys.stderr,
        )
        results.update(pass_benchmark(policy, args.pass_repeats))
        print(pass_table(results["pass_7b"]))
        print(append_table(results["append_7b"]))
    if reference is not None:
        print("\nkvdemo's InfiniPot-V against the authors' code at 7B shape...", file=sys.stderr)
        results["reference_7b"] = reference_benchmark(reference, args.pass_repeats)
        print(reference_table(results["reference_7b"]))
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


def pass_table(passes: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One row per (policy, dtype): selection, apply, total, floor (medians, ms), total/floor, bytes moved."""
    width = max(18, *(len(name) for name in passes))
    lines = [
        f"{'policy':<{width}} {'dtype':<9} {'select ms':>9} {'apply ms':>9} {'total ms':>9} {'(min)':>7} "
        f"{'floor ms':>9} {'total/floor':>11} {'apply moved MB':>14}"
    ]
    for name, by_dtype in passes.items():
        for dtype, row in by_dtype.items():
            lines.append(
                f"{name:<{width}} {dtype:<9} {row['select_ms']:>9.1f} {row['apply_ms']:>9.1f} {row['total_ms']:>9.1f} "
                f"{row['total_min_ms']:>7.1f} {row['floor_ms']:>9.1f} {row['total_over_floor']:>10.2f}x "
                f"{row['moved_bytes'] / 2**20:>14.1f}"
            )
    lines.append("floor: one read of every visual key and value + one write of the C kept tokens (memory-bound limit)")
    return "\n".join(lines)


def append_table(appends: dict[str, dict[str, Any]]) -> str:
    """Appending one chunk to a full-size memory: kvdemo's in-place write vs DynamicCache's torch.cat."""
    lines = [f"append one chunk at a full-size memory:  {'dtype':<9} {'ms':>8} {'copied MB':>10}"]
    for dtype, row in appends.items():
        for name in ("kvdemo", "dynamic_cache"):
            entry = row[name]
            lines.append(f"  {name:<38} {dtype:<9} {entry['median_ms']:>8.2f} {entry['bytes_copied'] / 2**20:>10.1f}")
    return "\n".join(lines)
