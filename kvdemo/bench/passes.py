"""One compression pass at Qwen2.5-VL-7B's cache shape against the memory-bound floor, the append cost
against transformers' ``DynamicCache``, and what compiled kernels cost over simulated streams, with their tables
(the stream through the tiny model is :mod:`.synthetic_stream`). Asserts nothing about speed."""

from __future__ import annotations

import copy
import dataclasses
import statistics
from typing import Any

import torch

from ..cache.attention import MemoryCache
from ..cache.memory import KVMemory
from ..devices.timing import Stopwatch
from ..policies import BASELINES, DEFAULT_POLICY, Policy, Probed, fused, make_policy
from ..testing import QWEN7B_SHAPE, synthetic_chunk, synthetic_memory, synthetic_positions, synthetic_probe
from .plans import bench_plan
from .simulation import simulated_stream


def _summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times)}


#: The ratio to the floor each pass should reach: the default policy (a scoring pass that reads every key and value
#: once) 1.3x, every other policy 3x (or, where its own arithmetic exceeds that, the phase split shows that
#: arithmetic's share).
FLOOR_TARGETS = {DEFAULT_POLICY: 1.3}
DEFAULT_TARGET = 3.0


def time_pass(
    policy: Policy, memory: KVMemory, keep: int, repeats: int, floor: bool = True, rotary: Any = None
) -> dict[str, Any]:
    """The whole compression pass on fresh copies of ``memory``: ``policy.compress`` (selection) and
    :meth:`KVMemory.apply` (the memory's compaction), medians and minima in ms over ``repeats`` runs
    after one warm-up (views with ``rotary``, the model's rotation, which a policy that keeps keys before RoPE
    needs), the phases the policy reports (``phases_ms``, means, plus ``apply``) and the key/value bytes ``apply``
    moved. With ``floor``, each run is preceded by one timing of the memory-bound floor
    (:func:`time_floor`) in the same process, alternating, and ``total_over_floor`` is the median of the runs'
    ratios (a loaded machine slows both alike). Timed with kvdemo's one timer (:mod:`kvdemo.devices.timing`)."""
    select, apply, total, floors, reads, ratios = [], [], [], [], [], []
    phases: dict[str, list[float]] = {}
    moved = 0
    devices = memory.devices
    probe = _probe(policy, memory)
    targets = floor_targets(memory, keep) if floor else []
    with torch.inference_mode():
        for run in range(repeats + 1):
            floor_run = time_floor(memory, keep, 1, warmup=False, targets=targets) if floor else {}
            floor_ms = floor_run.get("floor_ms", 0.0)
            fresh = copy.deepcopy(memory)
            watch = Stopwatch(devices)
            selection = policy.compress(fresh.slices(rotary, probe), keep)
            middle = watch.ms()
            moved = fresh.apply(selection)
            end = watch.ms()
            if run:
                select.append(middle)
                apply.append(end - middle)
                total.append(end)
                floors.append(floor_ms)
                reads.append(floor_run.get("read_ms", 0.0))
                ratios.append(end / floor_ms if floor_ms else 0.0)
                for name, ms in {**selection.info.get("phase_ms", {}), "apply": end - middle}.items():
                    phases.setdefault(name, []).append(ms)
    s, a, t = _summary(select), _summary(apply), _summary(total)
    out = {
        "select_ms": s["median"],
        "apply_ms": a["median"],
        "total_ms": t["median"],
        "select_min_ms": s["min"],
        "apply_min_ms": a["min"],
        "total_min_ms": t["min"],
        "moved_bytes": moved,
        "phases_ms": {name: statistics.fmean(ms) for name, ms in phases.items()},
    }
    if floor:
        out.update(
            floor_ms=statistics.median(floors),
            floor_read_ms=statistics.median(reads),
            total_over_floor=statistics.median(ratios),
        )
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64) if t.shape[-1] * t.element_size() % 8 == 0 else t


def floor_targets(memory: KVMemory, keep: int) -> list[torch.Tensor]:
    """What the floor writes: ``keep`` tokens' keys and values per layer, ``[H, keep, D]`` each, allocated and
    written once here. A pass compacts the memory's own resident buffers, so the floor writes resident memory too:
    a first write into fresh pages would time the kernel's page faults (measured here 7-9x the write itself,
    depending on whether the allocator handed back memory it had kept), not the memory."""
    slices = memory.slices()
    targets = [
        torch.empty(v.num_heads, keep, v.keys.shape[-1], dtype=v.keys.dtype, device=v.keys.device)
        for v in slices
        for _ in range(2)
    ]
    with torch.inference_mode():
        for target in targets:
            _words(target).fill_(0)
    return targets


def time_floor(
    memory: KVMemory, keep: int, repeats: int, warmup: bool = True, targets: list[torch.Tensor] | None = None
) -> dict[str, float]:
    """The memory-bound floor of any selection pass: read every visual key and value once and write ``keep``
    tokens' keys and values; median and min ms. Both are raw byte streams, whatever the dtype: the read is a
    sum over the buffers viewed as int64 words (a bfloat16 sum would time the conversion, not the memory), the
    write a fill of resident buffers (``targets`` from :func:`floor_targets`, made here when None). ``read_ms``: the
    read's share (median), what any pass that reads every key and value pays before its arithmetic."""
    slices = memory.slices()
    targets = targets if targets is not None else floor_targets(memory, keep)
    times, reads = [], []
    with torch.inference_mode():
        for run in range(repeats + int(warmup)):
            watch = Stopwatch(memory.devices)
            for layer_slice in slices:
                _words(layer_slice.keys).sum()
                _words(layer_slice.values).sum()
            read = watch.ms()
            for target in targets:
                _words(target).fill_(1)
            if run >= int(warmup):
                times.append(watch.ms())
                reads.append(read)
    s = _summary(times)
    return {"floor_ms": s["median"], "floor_min_ms": s["min"], "read_ms": statistics.median(reads)}


def time_append(memory: KVMemory, grid: tuple[int, int], repeats: int) -> dict[str, Any]:
    """One chunk (one temporal grid) appended to ``memory`` (which has room for it) versus transformers'
    ``DynamicCache`` (``torch.cat``: every append copies the whole cache); ms and bytes copied."""
    from transformers import DynamicCache  # deferred: only this comparison needs it

    chunk = synthetic_chunk(memory.num_grids, 1, grid)
    n = chunk.num_tokens
    slices = memory.slices()
    keys = [
        torch.randn(1, v.num_heads, n, v.keys.shape[-1]).to(device=v.keys.device, dtype=v.keys.dtype) for v in slices
    ]
    positions = synthetic_positions(chunk, memory.prefix_len)
    ours, theirs = [], []
    full = [(k[None], v[None]) for k, v in zip(memory.keys, memory.values)]
    with torch.inference_mode():
        for run in range(repeats + 1):
            fresh = copy.deepcopy(memory)
            dynamic = DynamicCache(ddp_cache_data=[(k[0], v[0]) for k, v in full])
            watch = Stopwatch(fresh.devices)
            cache = MemoryCache(fresh)
            for layer, k in zip(cache.layers, keys):
                layer.update(k, k)
            fresh.commit_append(chunk, positions)
            middle = watch.ms()
            for index, k in enumerate(keys):
                dynamic.update(k, k, index)
            end = watch.ms()
            if run:
                ours.append(middle)
                theirs.append(end - middle)
    chunk_bytes = n * memory.token_bytes()
    return {
        "chunk_tokens": n,
        "kvdemo": {**{f"{k}_ms": v for k, v in _summary(ours).items()}, "bytes_copied": chunk_bytes},
        "dynamic_cache": {
            **{f"{k}_ms": v for k, v in _summary(theirs).items()},
            "bytes_copied": memory.nbytes + chunk_bytes,
        },
    }


def pass_benchmark(
    policy: Policy,
    repeats: int,
    shape: dict[str, Any] | None = None,
    compiled: bool = True,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """The whole compression pass at Qwen2.5-VL-7B shape for ``policy`` and the reference policies, in fp32
    and bf16, next to the memory-bound floor (alternating, same process), and the append cost at a full-size
    memory. A policy with compiled kernels (:mod:`kvdemo.policies.fused`) is timed with them and with its eager
    code, side by side, and the two selections are compared; the compilations are reported apart.

    Returns ``{"shape", "pass_7b": {label: {dtype: {...}}}, "append_7b": {dtype: {...}}, "compile": {...}}``. A
    policy's declared variants (:func:`.plans.bench_plan`, e.g. CoRDS without its cross-layer followers) are timed
    too. ``shape`` defaults to :data:`QWEN7B_SHAPE`; a policy sized by ``M`` alone is timed in its own benchmark.
    ``compiled=False`` times the eager code alone (as where compiling is unavailable). The memories are drawn on
    the host and moved to ``device`` (on CUDA the floor is the GPU's memory bandwidth and the timer synchronises).
    """
    shape = shape or QWEN7B_SHAPE
    policies = {policy.name: policy} if type(policy).takes_keep() else {}
    if policies:
        for label, variant in bench_plan(policy).variants.items():
            policies[f"{policy.name} ({label})"] = variant
    for name in BASELINES:
        policies.setdefault(name, make_policy(name))
    args = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], shape["budget"], shape["grid"])
    results: dict[str, Any] = {"pass_7b": {}, "append_7b": {}}
    unavailable = fused.compile_unavailable() if compiled else "not asked for"
    for dtype in (torch.float32, torch.bfloat16):
        label = str(dtype).replace("torch.", "")
        memory = synthetic_memory(*args, dtype).to(device)
        for name, candidate in policies.items():
            for mode, timing in _timed_modes(candidate, memory, shape["keep"], repeats, unavailable is None).items():
                timing["target"] = FLOOR_TARGETS.get(candidate.name, DEFAULT_TARGET)
                results["pass_7b"].setdefault(name + mode, {})[label] = timing
        per_grid = shape["grid"][0] * shape["grid"][1]
        almost_full = synthetic_memory(*args, dtype, visual_tokens=shape["budget"] - per_grid).to(device)
        results["append_7b"][label] = time_append(almost_full, shape["grid"], repeats)
        del memory, almost_full
    results["compile"] = {**fused.compile_stats(), "unavailable": unavailable}
    results["shape"] = {**shape, "grid": list(shape["grid"])}
    results["device"] = str(device)
    return results


def _timed_modes(
    policy: Policy, memory: KVMemory, keep: int, repeats: int, compile_ok: bool
) -> dict[str, dict[str, Any]]:
    """``{"": timing}`` for a policy without compiled kernels; ``{" (eager)": ..., " (compiled)": ...}`` for one with
    them, each with ``same_selection`` (both kept the same tokens everywhere). The compiled run's first call
    (which compiles) is a warm-up, outside the timings."""
    before = fused.compile_stats()["calls"]
    with torch.inference_mode():
        fused.use_compiled(compile_ok)
        try:
            compiled = dataclasses.replace(policy).compress(
                copy.deepcopy(memory).slices(probe=_probe(policy, memory)), keep
            )
        finally:
            fused.use_compiled(None)
    if not compile_ok or fused.compile_stats()["calls"] == before:
        return {"": time_pass(dataclasses.replace(policy), memory, keep, repeats)}
    out = {}
    with torch.inference_mode():
        eager = dataclasses.replace(policy).compress(copy.deepcopy(memory).slices(probe=_probe(policy, memory)), keep)
    same = all(torch.equal(a, b) for a, b in zip(eager.indices, compiled.indices))
    differ = {
        "same_selection": same,
        "differing_tokens": _kept_by_one_only(compiled.indices, eager.indices),
        "kept_tokens": sum(index.numel() for index in eager.indices),
    }
    for mode in (False, True):
        fused.use_compiled(mode)
        try:
            out[" (compiled)" if mode else " (eager)"] = {
                **time_pass(dataclasses.replace(policy), memory, keep, repeats),
                **differ,
            }
        finally:
            fused.use_compiled(None)
    return out


def _kept_by_one_only(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> int:
    """How many (layer, head, token) entries of ``ours`` (``[H, keep]`` per layer) ``theirs`` does not keep."""
    count = 0
    for a, b in zip(ours, theirs):
        if a.numel() == 0:
            continue
        width = int(torch.maximum(a.max(), b.max())) + 1
        kept = torch.zeros(2, a.shape[0], width, dtype=torch.bool, device=a.device)
        kept[0].scatter_(1, a.long(), True)
        kept[1].scatter_(1, b.long().to(a.device), True)
        count += int((kept[0] & ~kept[1]).sum())
    return count


def _probe(policy: Policy, memory: KVMemory) -> list[torch.Tensor] | None:
    if not isinstance(policy, Probed):
        return None
    heads = memory.num_kv_heads * (QWEN7B_SHAPE["num_heads"] // QWEN7B_SHAPE["num_kv_heads"])
    probe = synthetic_probe(memory.num_layers, heads, memory.layers[0].keys.shape[-1], memory.layers[0].keys.dtype)
    return [p.to(d) for p, d in zip(probe, memory.devices)]


def pass_table(passes: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One row per (policy, dtype): selection, apply, total (medians, ms), the floor, total/floor (median of the
    alternating runs' ratios) against its target (PASS/FAIL), and where the time goes (the policy's phases)."""
    width = max(18, *(len(name) for name in passes))
    lines = [
        f"{'policy':<{width}} {'dtype':<9} {'select ms':>9} {'apply ms':>9} {'total ms':>9} {'floor ms':>9} "
        f"{'total/floor':>11} {'target':>7}  where the time goes (ms, mean)"
    ]
    for name, by_dtype in passes.items():
        for dtype, row in by_dtype.items():
            verdict = "PASS" if row["total_over_floor"] <= row["target"] else "FAIL"
            phases = ", ".join(f"{phase} {ms:.1f}" for phase, ms in row["phases_ms"].items())
            same = ""
            if "same_selection" in row:
                same = (
                    "; same tokens as eager"
                    if row["same_selection"]
                    else f"; {row['differing_tokens']} of {row['kept_tokens']} kept tokens differ from eager"
                )
            lines.append(
                f"{name:<{width}} {dtype:<9} {row['select_ms']:>9.1f} {row['apply_ms']:>9.1f} {row['total_ms']:>9.1f} "
                f"{row['floor_ms']:>9.1f} {row['total_over_floor']:>10.2f}x {verdict:>4} {row['target']:.1f}x  {phases}{same}"
            )
    lines.append(
        "floor: one read of every visual key and value + one write of the C kept tokens (memory-bound limit), "
        "timed before every run in the same process"
    )
    reads: dict[str, list[tuple[float, float]]] = {}
    for by_dtype in passes.values():
        for dtype, row in by_dtype.items():
            if row.get("floor_read_ms"):
                reads.setdefault(dtype, []).append((row["floor_read_ms"], row["floor_ms"]))
    if reads:
        split = ", ".join(
            f"{dtype} {statistics.median(r for r, _ in pairs):.1f} of {statistics.median(f for _, f in pairs):.1f}"
            for dtype, pairs in reads.items()
        )
        lines.append(
            f"the floor's read, ms (median over the rows): {split}; "
            "a pass that reads every key and value pays it before its arithmetic"
        )
    return "\n".join(lines)


def compile_table(stats: dict[str, Any]) -> str:
    """What compiling the kernels cost in this process (once per kernel and dtype)."""
    if stats.get("unavailable"):
        return f"compiled kernels: unavailable here ({stats['unavailable']}); eager only"
    if stats.get("error"):
        return f"compiled kernels: compiling failed ({stats['error']}); eager only"
    return (
        f"compiled kernels: {stats['compiles']} compilation(s), {stats['compile_ms'] / 1000:.1f} s in all (paid once per "
        f"process and dtype, outside the timings above), {stats['calls']} compiled calls"
    )


def append_table(appends: dict[str, dict[str, Any]]) -> str:
    """Appending one chunk to a full-size memory: kvdemo's in-place write vs DynamicCache's torch.cat."""
    lines = [f"append one chunk at a full-size memory:  {'dtype':<9} {'ms':>8} {'copied MB':>10}"]
    for dtype, row in appends.items():
        for name in ("kvdemo", "dynamic_cache"):
            entry = row[name]
            lines.append(f"  {name:<38} {dtype:<9} {entry['median_ms']:>8.2f} {entry['bytes_copied'] / 2**20:>10.1f}")
    return "\n".join(lines)


def compiled_stream(
    policy: Policy,
    grids: int = 30,
    budgets: tuple[int, ...] = (6144, 4096),
    shape: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any] | None:
    """Compilations paid over simulated streams (the engine's trigger, random keys and values, no model) at
    Qwen2.5-VL-7B's shape and each of ``budgets`` in turn, with compiled kernels on: the passes see cache lengths
    and buffer capacities change, and a kernel compiled with dynamic shapes compiles once per process and dtype.
    None for a policy without compiled kernels, or where compiling is unavailable."""
    if fused.compile_unavailable() is not None:
        return None
    shape = shape or QWEN7B_SHAPE
    before = fused.compile_stats()
    lengths: list[int] = []
    passes = 0
    fused.use_compiled(True)
    try:
        for budget in budgets:
            stream_shape = {**shape, "budget": budget, "keep": budget * 3 // 4}
            _, records = simulated_stream(dataclasses.replace(policy), grids, stream_shape, device=device)
            passes += len(records)
            lengths += sorted({r["length"] for r in records})
    finally:
        fused.use_compiled(None)
    after = fused.compile_stats()
    if after["calls"] == before["calls"]:
        return None
    return {
        "budgets": list(budgets),
        "grids": grids,
        "passes": passes,
        "kept_lengths": sorted(set(lengths)),
        "compiles": after["compiles"] - before["compiles"],
        "compile_ms": after["compile_ms"] - before["compile_ms"],
    }


def compiled_stream_table(result: dict[str, Any] | None) -> str:
    if result is None:
        return "compiled kernels over a stream: none in this policy (or compiling unavailable)"
    return (
        f"compiled kernels over {len(result['budgets'])} simulated streams (M = {', '.join(map(str, result['budgets']))}, "
        f"{result['passes']} passes, kept lengths {result['kept_lengths']}): {result['compiles']} new compilation(s) "
        f"({result['compile_ms'] / 1000:.1f} s; 0 where this process had compiled the kernel already)"
    )
