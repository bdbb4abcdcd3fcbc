"""``python -m kvdemo bench``: the command (the CLI parses the arguments and the policy parameters)."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any

import torch

from ..cache.budget import DEFAULT_KEEP_RATIO, Budget
from ..policies import make_policy
from ..testing import QWEN7B_SHAPE
from . import write_json
from .counts import count_benchmark, count_table
from .passes import (
    append_table,
    compile_table,
    compiled_stream,
    compiled_stream_table,
    pass_benchmark,
    pass_table,
)
from .plans import bench_plan
from .policies import BENCHMARKS, long_stream_benchmark, long_stream_table
from .pruning import pruning_benchmark, pruning_table
from .reference import load_reference, reference_benchmark, reference_table
from .synthetic_stream import stream_benchmark, stream_table
from .zerogpu import zerogpu_table, zerogpu_transfer_benchmark


def bench_command(args: argparse.Namespace, params: dict[str, Any]) -> int:
    """Run the benchmark for ``args.policy`` with its parsed ``params`` (see :mod:`kvdemo.bench`)."""
    policy = make_policy(args.policy, **params)
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
    try:
        device = torch.device(getattr(args, "device", "cpu"))
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # a bad name, no CUDA build, no such GPU
        print(f"error: --device {args.device}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    if getattr(args, "count", False):
        return count_command(args, device)
    budget = Budget.resolve(policy, args.budget, args.keep, default_ratio=DEFAULT_KEEP_RATIO)
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": _device_name(device),
        },
        "policy": policy.name,
        "params": policy.params(),
    }
    print(
        f"streaming {args.frames} synthetic frames through full and {policy.name} ({budget.describe()})",
        file=sys.stderr,
    )
    stream = stream_benchmark(policy, args.frames, budget)
    results["stream"] = stream
    print(stream_table(stream, policy.name, args.every))
    if getattr(args, "prune", None) is not None:
        print(f"\nthe same stream with {args.prune.text} before the LLM, in front of each...", file=sys.stderr)
        results["pruning"] = pruning_benchmark(policy, args.frames, budget, args.prune)
        print(pruning_table(results["pruning"], args.every))
    if getattr(args, "zerogpu", False):
        print("\nwhat a ZeroGPU call pickles at Qwen2.5-VL-3B's defaults...", file=sys.stderr)
        results["zerogpu"] = zerogpu_transfer_benchmark()
        print(zerogpu_table(results["zerogpu"]))
    for name in bench_plan(policy).benchmarks if not args.skip_pass else ():
        what, runner = BENCHMARKS[name]
        print(f"\n{policy.name}: {what}...", file=sys.stderr)
        parts, table = runner(policy, args.stream_factor)
        results.update({f"{policy.name}_{suffix}": value for suffix, value in parts.items()})
        print(table)
    if not args.skip_pass:
        shape = QWEN7B_SHAPE
        print(
            f"\none compression pass at Qwen2.5-VL-7B shape ({shape['num_layers']} layers, {shape['num_kv_heads']} KV heads,"
            f" head dim {shape['head_dim']}, M={shape['budget']} -> C={shape['keep']}) on {_device_name(device)},"
            f" median of {args.pass_repeats}:",
            file=sys.stderr,
        )
        results.update(pass_benchmark(policy, args.pass_repeats, device=device))
        print(pass_table(results["pass_7b"]))
        print(compile_table(results["compile"]))
        results["compiled_stream"] = compiled_stream(policy, device=device)
        print(compiled_stream_table(results["compiled_stream"]))
        print(append_table(results["append_7b"]))
        grids = getattr(args, "long_stream", 0)
        if grids and type(policy).takes_keep():  # a policy sized by M alone times its stream in its own benchmark
            print(f"\n{policy.name}'s passes over a {grids}-grid stream at 7B shape...", file=sys.stderr)
            results["long_stream_7b"] = long_stream_benchmark(policy, grids, device=device)
            print(long_stream_table(results["long_stream_7b"], policy.name))
    if reference is not None:
        print("\nkvdemo's InfiniPot-V against the authors' code at 7B shape...", file=sys.stderr)
        results["reference_7b"] = reference_benchmark(reference, args.pass_repeats)
        print(reference_table(results["reference_7b"]))
    if args.json:
        write_json(args.json, results)
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def count_command(args: argparse.Namespace, device: torch.device) -> int:
    """``bench --count``: launches and host reads of one pass of every bounded policy at the ``--layers`` depths
    (:mod:`.counts`), printed against the targets and written to ``--json``."""
    try:
        depths = tuple(int(d) for d in str(args.layers).split(",") if d.strip())
    except ValueError:
        depths = ()
    if not depths or min(depths) < 1:
        print(f"error: --layers takes positive layer counts, comma-separated, got {args.layers!r}", file=sys.stderr)
        return 2
    print(f"counting one pass of every bounded policy at {', '.join(map(str, depths))} layers...", file=sys.stderr)
    results = count_benchmark(depths, "cpu" if device.type == "cpu" else str(device))
    print(count_table(results))
    if args.json:
        write_json(args.json, results)
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def _device_name(device: torch.device | str) -> str:
    """``cpu``, or the GPU's own name beside its index (what a figure was measured on)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"{device} ({torch.cuda.get_device_name(device)})"
