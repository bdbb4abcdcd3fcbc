"""``python -m kvdemo bench --count``: what one compression pass asks of a GPU, counted without one.

A pass on a GPU is launch- and wait-bound long before it is memory-bound: every torch operation is a kernel launch,
and every value read back to the host (a count that sizes an output, a ``.tolist()``, a boolean index) makes the
host wait for the device. Both are counted here on kvdemo's emulated device (:mod:`kvdemo.devices.emulated_device`,
which runs the GPU code paths on the CPU and sees every operation on a device tensor), for one bfloat16 pass
(``policy.compress`` and the memory's compaction) of every bounded policy at Qwen2.5-VL-7B's per-layer cache shape
with a given number of layers. Counting is exact and noise-free: no timing, no stream. On a CUDA device the same
pass is counted by PyTorch's profiler (kernel launches and device-to-host synchronisations).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache.budget import DEFAULT_KEEP_RATIO, Budget
from ..cache.memory import KVMemory
from ..devices.emulated_device import DEVICE as EMULATED
from ..devices.emulated_device import EmulatedDevice, place_module
from ..policies import Policy, Probed, make_policy, policy_names
from ..testing import (
    QWEN7B_SHAPE,
    append_random,
    qwen7b_rotation,
    synthetic_chunk,
    synthetic_memory,
    synthetic_probe,
)
from .plans import bench_plan

#: The depths counted by default: a few layers and Qwen2.5-VL-7B's full depth.
DEFAULT_DEPTHS = (4, 28)
#: Launches at the deepest depth at most this many times those at the shallowest: a pass batched over layers does
#: not grow with them. Each policy declares its own bound on host reads per pass, and where it has one on its
#: launches in all (:class:`~kvdemo.policies.registry.BenchDeclaration`).
LAUNCH_GROWTH_TARGET = 1.5


def pass_memory(policy: Policy, layers: int, dtype: torch.dtype = torch.bfloat16) -> tuple[KVMemory, int, Any, Any]:
    """A full memory at 7B per-layer shape with ``layers`` layers for ``policy`` (its summary region when it has
    one), on the host: the memory, the pass's ``keep``, the rotation and the probe queries (None unless
    :class:`~kvdemo.policies.contract.Probed`)."""
    shape = QWEN7B_SHAPE
    per_grid = shape["grid"][0] * shape["grid"][1]
    budget = Budget.resolve(policy, shape["budget"], shape["keep"], default_ratio=DEFAULT_KEEP_RATIO)
    budget = budget.sized(policy, per_grid)
    memory = synthetic_memory(
        layers,
        shape["num_kv_heads"],
        shape["head_dim"],
        budget.window,
        shape["grid"],
        dtype,
        summary_slots=budget.summary,
    )
    probe = None
    if isinstance(policy, Probed):
        probe = synthetic_probe(layers, shape["num_heads"], shape["head_dim"], dtype)
    return memory, budget.keep_for(per_grid), qwen7b_rotation(shape["head_dim"]), probe


def count_pass(policy: Policy, layers: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Launches and host reads of one pass of ``policy`` over a memory of ``layers`` layers on the emulated device,
    in a stream's steady state: a first pass over a full memory (:func:`pass_memory`; not counted: it starts the
    policy's state, e.g. ProtoKV's bank), one temporal grid appended, and the pass that grid's successor would
    trigger, counted."""
    memory, keep, rotary, probe = pass_memory(policy, layers, dtype)
    grid = QWEN7B_SHAPE["grid"]
    place_module(rotary.rotary_emb)  # the rotation sits beside the model's weights, on the device
    with EmulatedDevice(), torch.inference_mode():  # placing the memory and the first pass are not counted
        memory.to(EMULATED)
        probe = None if probe is None else [p.to(EMULATED) for p in probe]
        memory.apply(policy.compress(memory.slices(rotary, probe), keep))
        append_random(memory, synthetic_chunk(memory.num_grids, 1, grid), torch.Generator().manual_seed(1))
    mode = EmulatedDevice()
    with mode, torch.inference_mode():
        memory.apply(policy.compress(memory.slices(rotary, probe), keep))
    return {"launches": mode.launches, "host_reads": mode.host_reads}


def count_pass_cuda(policy: Policy, layers: int, device: torch.device) -> dict[str, int]:
    """:func:`count_pass` on a CUDA device, by PyTorch's profiler: kernel launches (runtime launch calls) and
    device-to-host synchronisations (``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaMemcpy`` to the
    host) during one pass."""
    from torch.profiler import ProfilerActivity, profile  # deferred: only a CUDA count needs the profiler

    memory, keep, rotary, probe = pass_memory(policy, layers)
    rotary.rotary_emb.to(device)
    memory.to(device)
    probe = None if probe is None else [p.to(device) for p in probe]
    with torch.inference_mode():  # the first pass and one more grid, as count_pass
        memory.apply(policy.compress(memory.slices(rotary, probe), keep))
        append_random(
            memory, synthetic_chunk(memory.num_grids, 1, QWEN7B_SHAPE["grid"]), torch.Generator().manual_seed(1)
        )
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.inference_mode():
        memory.apply(policy.compress(memory.slices(rotary, probe), keep))
        torch.cuda.synchronize(device)
    launches = reads = 0
    for event in prof.events():
        name = event.name
        if name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += 1
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize") or (
            name.startswith("cudaMemcpy") and "Async" not in name
        ):
            reads += 1
    return {"launches": launches, "host_reads": max(reads - 1, 0)}  # the last synchronise is the count's own


def count_benchmark(depths: tuple[int, ...] = DEFAULT_DEPTHS, device: str = "cpu") -> dict[str, Any]:
    """``{"count": {policy: {str(depth): {"launches", "host_reads"}}}}`` for every bounded policy: on the emulated
    device for ``device="cpu"``, by the profiler on a CUDA device."""
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for name in policy_names():
        if not make_policy(name).bounded:
            continue
        for depth in depths:
            if device == "cpu":
                counted = count_pass(make_policy(name), depth)
            else:
                counted = count_pass_cuda(make_policy(name), depth, torch.device(device))
            counts.setdefault(name, {})[str(depth)] = counted
    return {"count": counts, "depths": list(depths), "device": "emulated" if device == "cpu" else device}


def count_table(result: dict[str, Any]) -> str:
    """The counts as a table against the targets (``PASS``/``FAIL`` per policy)."""
    depths = [str(d) for d in result["depths"]]
    low, high = depths[0], depths[-1]
    head = "  ".join(f"{'launches @' + d:>14}  {'reads @' + d:>9}" for d in depths)
    lines = [
        f"one bfloat16 pass at 7B per-layer shape, counted on the {result['device']} device",
        f"{'policy':<16}{head}",
    ]
    lines[-1] += f"  {'growth':>7}  target"
    for name, by_depth in result["count"].items():
        cells = "  ".join(f"{by_depth[d]['launches']:>14}  {by_depth[d]['host_reads']:>9}" for d in depths)
        growth = by_depth[high]["launches"] / max(by_depth[low]["launches"], 1)
        reads = max(by_depth[d]["host_reads"] for d in depths)
        plan = bench_plan(make_policy(name))
        ok = growth <= LAUNCH_GROWTH_TARGET and reads <= plan.host_reads
        target = f"reads <= {plan.host_reads}"
        if plan.launches is not None:
            ok = ok and max(by_depth[d]["launches"] for d in depths) <= plan.launches
            target += f", launches <= {plan.launches}"
        lines.append(f"{name:<16}{cells}  {growth:>6.2f}x  {'PASS' if ok else 'FAIL'} ({target})")
    lines.append(f"target for every policy: launches at {high} layers <= {LAUNCH_GROWTH_TARGET}x those at {low}")
    return "\n".join(lines)
