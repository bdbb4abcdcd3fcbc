"""What a ZeroGPU call pickles at Qwen2.5-VL-3B's cache shape and the app's defaults."""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any

import torch

from ..testing import QWEN3B_SHAPE, synthetic_memory


def zerogpu_transfer_benchmark(seconds: tuple[int, ...] = (10, 30, 60), repeats: int = 3) -> dict[str, Any]:
    """What crosses the ZeroGPU boundary per call at Qwen2.5-VL-3B's cache shape in bf16 and the app's
    defaults (M=6144, one temporal grid of 768 tokens per second of video at 2 fps): the pickled KV memory of
    the policy engine and of the full-cache baseline after ``seconds`` of video, with the time to pickle and
    unpickle it here. A stream-segment call carries the state in and out, a question carries it in and
    returns only the dialogue (a few KB)."""
    shape = QWEN3B_SHAPE
    per_second = shape["grid"][0] * shape["grid"][1]
    rows = []

    def measure(label: str, tokens: int, budget: int) -> None:
        memory = synthetic_memory(
            shape["num_layers"],
            shape["num_kv_heads"],
            shape["head_dim"],
            budget,
            shape["grid"],
            torch.bfloat16,
            visual_tokens=tokens,
        )
        dumps, loads, size = [], [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            blob = pickle.dumps(memory, protocol=pickle.HIGHEST_PROTOCOL)
            middle = time.perf_counter()
            pickle.loads(blob)
            dumps.append((middle - start) * 1000)
            loads.append((time.perf_counter() - middle) * 1000)
            size = len(blob)
        rows.append(
            {
                "state": label,
                "tokens": tokens,
                "mb": size / 2**20,
                "pickle_ms": statistics.median(dumps),
                "unpickle_ms": statistics.median(loads),
            }
        )

    measure(f"policy engine at M={shape['budget']}", shape["budget"], shape["budget"])
    for second in seconds:
        measure(f"full-cache baseline after {second} s", second * per_second, second * per_second)
    return {"shape": {**shape, "grid": list(shape["grid"])}, "dtype": "bfloat16", "rows": rows}


def zerogpu_table(result: dict[str, Any]) -> str:
    lines = [f"{'state (Qwen2.5-VL-3B, bf16)':<40} {'tokens':>7} {'MB':>8} {'pickle ms':>10} {'unpickle ms':>12}"]
    for row in result["rows"]:
        lines.append(
            f"{row['state']:<40} {row['tokens']:>7} {row['mb']:>8.0f} {row['pickle_ms']:>10.0f} {row['unpickle_ms']:>12.0f}"
        )
    lines.append(
        "a stream-segment call carries its session's state in and out; a question carries it in (a few KB back)"
    )
    return "\n".join(lines)
