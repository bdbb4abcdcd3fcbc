"""``python -m kvdemo bench --prune evs:0.75``: what pruning before the LLM saves in prefill. One synthetic stream
feeds, through one shared encoding, the full cache and the bounded policy, each with and without the pruning in
front of it (four engines, every chunk fed to each in turn, so a busy machine slows them alike). Per chunk: the
visual tokens offered and entered, each engine's prefill time, and what the pruned engines saved; the selection's
own time is counted against them."""

from __future__ import annotations

import statistics
from typing import Any

from ..cache.budget import Budget
from ..models.catalog import TINY_RANDOM_NAME
from ..models.loading import load_model
from ..policies import Policy, make_policy
from ..pruning import PruneSpec
from ..stream.lineup import FULL, Contender, make_engines
from ..stream.streaming import stream_video
from ..world.synthetic import synthetic_video


def pruning_benchmark(policy: Policy, frames: int, budget: Budget, prune: PruneSpec) -> dict[str, Any]:
    """Stream ``frames`` synthetic frames into the full cache and ``policy`` (under ``budget``), each alone and behind
    ``prune``; per engine its per-chunk rows, prefill and selection times."""
    model = load_model(TINY_RANDOM_NAME)
    video = synthetic_video(num_frames=frames, height=224, width=336, fps=2.0, seed=1)
    fresh = make_policy(policy.name, **policy.params())  # the pruned engine's own policy state
    lineup = [
        Contender(FULL),
        Contender(FULL, prune=prune),
        Contender(policy.name, policy=policy, budget=budget),
        Contender(policy.name, policy=fresh, budget=budget, prune=prune),
    ]
    engines = make_engines(model, lineup, fps=video.fps)
    for _ in stream_video(model, video, engines, frames_per_chunk=2):
        pass
    result: dict[str, Any] = {
        "frames": frames,
        "prune": prune.text,
        "budget": budget.M,
        "keep": budget.C,
        "engines": {},
    }
    for name, engine in engines.items():
        rows = engine.stats.per_chunk
        result["engines"][name] = {
            "per_chunk": rows,
            "prefill_ms": engine.stats.prefill_ms,
            "median_prefill_ms": statistics.median(row["prefill_ms"] for row in rows),
            "prune_ms": engine.pruning.ms if engine.pruning is not None else 0.0,
            "offered": sum(row["offered_tokens"] for row in rows),
            "entered": sum(row["entered_tokens"] for row in rows),
        }
    pairs = [(FULL, lineup[1].label), (policy.name, lineup[3].label)]
    result["saved"] = {
        pruned: {
            "prefill_ms": result["engines"][plain]["prefill_ms"] - result["engines"][pruned]["prefill_ms"],
            "per_chunk_median_ms": statistics.median(
                a["prefill_ms"] - b["prefill_ms"]
                for a, b in zip(result["engines"][plain]["per_chunk"], result["engines"][pruned]["per_chunk"])
            ),
            "net_of_selection_ms": result["engines"][plain]["prefill_ms"]
            - result["engines"][pruned]["prefill_ms"]
            - result["engines"][pruned]["prune_ms"],
        }
        for plain, pruned in pairs
    }
    return result


def pruning_table(result: dict[str, Any], every: int = 1) -> str:
    """Per chunk (every ``every``-th): tokens offered and entered, and each engine's prefill ms; then per engine its
    totals and what pruning saved."""
    engines = result["engines"]
    names = list(engines)
    pruned = names[1]
    width = max(12, *(len(n) for n in names))
    lines = [
        f"{'frame':>6} {'offered':>8} {'entered':>8} | " + " ".join(f"{n + ' ms':>{width + 3}}" for n in names),
    ]
    rows = list(zip(*(engines[n]["per_chunk"] for n in names)))
    for index, row in enumerate(rows):
        if index % max(1, every) and index != len(rows) - 1:
            continue
        lines.append(
            f"{row[0]['frame']:>6} {row[1]['offered_tokens']:>8} {row[1]['entered_tokens']:>8} | "
            + " ".join(f"{r['prefill_ms']:>{width + 3}.1f}" for r in row)
        )
    lines.append(f"summary ({result['frames']} frames, {pruned.split('+')[0]} before the LLM):")
    for name, engine in engines.items():
        selection = f", selection {engine['prune_ms']:.0f} ms" if engine["prune_ms"] else ""
        lines.append(
            f"  {name:<{width}} {engine['entered']:>6} of {engine['offered']} visual tokens entered, prefill "
            f"{engine['prefill_ms']:7.0f} ms (median {engine['median_prefill_ms']:.1f} ms a chunk){selection}"
        )
    for name, saved in result["saved"].items():
        lines.append(
            f"  {name}: prefill {saved['prefill_ms']:.0f} ms less in all, {saved['per_chunk_median_ms']:.1f} ms a chunk "
            f"(median), {saved['net_of_selection_ms']:.0f} ms net of the selection"
        )
    return "\n".join(lines)
