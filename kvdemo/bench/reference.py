"""kvdemo's InfiniPot-V pass against the authors' own code (``kvcache_utils.py`` of a clone of
aiha-lab/InfiniPot-V, loaded from the user's path; kvdemo ships none of it) on the same 7B-shape tensors, in
one process, alternating."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..cache.memory import KVMemory
from ..policies import Policy, make_policy
from ..testing import QWEN7B_SHAPE, synthetic_memory


def load_reference(path: str | Path) -> Any:
    """The authors' ``process_kv_cache`` (github.com/aiha-lab/InfiniPot-V, ``kvcache_utils.py``), loaded from
    ``path``: that file, or a directory holding it (a clone of their repository). kvdemo ships none of their
    code; this only imports what the user points at."""
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


def reference_benchmark(
    process_kv_cache: Any,
    repeats: int = 5,
    policy: Policy | None = None,
    method: str = "infinipot-v",
    shape: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """kvdemo's whole pass (selection + compaction) against the authors' ``process_kv_cache`` on the same
    tensors, in one process, alternating, in fp32 and bf16: median ms of each, their ratio, and how many
    (layer, KV head) rows kept exactly the same tokens (a first pass over whole frames; pooling off on both
    sides: kvdemo's ``van=plain``, their ``adaptive_pooling=False``; recent window 0.125 on both)."""
    shape = shape or QWEN7B_SHAPE
    policy = policy or make_policy("infinipot-v", van="plain")
    per_frame = shape["grid"][0] * shape["grid"][1]
    layers, heads, dim = shape["num_layers"], shape["num_kv_heads"], shape["head_dim"]
    from transformers import DynamicCache  # deferred: only this comparison needs it

    def theirs(memory: KVMemory) -> tuple[float, list[torch.Tensor]]:
        data = [(k.clone(), v.clone()) for k, v in zip(memory.keys, memory.values)]
        cache = DynamicCache(ddp_cache_data=data)
        # What process_kv_cache reads of a model: its layer count and the frame's side in patches.
        model = argparse.Namespace(
            model=argparse.Namespace(language_model=argparse.Namespace(layers=[None] * layers)),
            config=argparse.Namespace(height_width=shape["grid"][0]),
        )
        start = time.perf_counter()
        process_kv_cache(
            cache,
            model,
            system_size=memory.prefix_len,
            inst_size=0,
            token_per_frame=per_frame,
            compress_frame_num=shape["keep"] // per_frame,
            method=method,
            tar_ratio=0.5,
            query_ratio=getattr(policy, "recent_ratio", 0.125),
            adaptive_pooling=False,
        )
        return (time.perf_counter() - start) * 1000, [layer.keys for layer in cache.layers]

    def ours(memory: KVMemory) -> tuple[float, list[torch.Tensor]]:
        fresh = copy.deepcopy(memory)
        start = time.perf_counter()
        fresh.apply(policy.compress(fresh.slices(), shape["keep"]))
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
                mine_rows, their_rows = (
                    _row_keys(ours_keys[:, :, prefix:], probe),
                    _row_keys(their_keys[:, :, prefix:], probe),
                )
                shared = torch.stack([torch.isin(m, t).sum() for m, t in zip(mine_rows, their_rows)])  # per KV head
                identical += int(((shared == mine_rows.shape[-1]) & (shared == their_rows.shape[-1])).sum())
                common, kept = common + int(shared.sum()), kept + their_rows.numel()
        out[str(dtype).removeprefix("torch.")] = {
            "kvdemo_ms": statistics.median(mine),
            "reference_ms": statistics.median(reference),
            "ratio": statistics.median(mine) / statistics.median(reference),
            "identical_rows": identical,
            "rows": layers * heads,
            "shared_token_fraction": common / max(kept, 1),
        }
    return out


def reference_table(result: dict[str, Any]) -> str:
    lines = [
        "kvdemo's whole pass vs the authors' process_kv_cache (same tensors, one process, alternating, pooling off):",
        f"  {'dtype':<9} {'kvdemo ms':>10} {'theirs ms':>10} {'ratio':>6}  same kept tokens",
    ]
    for dtype, row in result.items():
        lines.append(
            f"  {dtype:<9} {row['kvdemo_ms']:>10.1f} {row['reference_ms']:>10.1f} {row['ratio']:>6.2f}"
            f"  {row['identical_rows']}/{row['rows']} layer-heads identical, "
            f"{100 * row['shared_token_fraction']:.2f}% of their kept tokens kept"
        )
    return "\n".join(lines)
