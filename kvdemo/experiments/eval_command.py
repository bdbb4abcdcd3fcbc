"""``python -m kvdemo eval`` as a command: the policies and the budget checked before the model loads, then
:func:`~kvdemo.experiments.evaluation.evaluate`, its accuracy table, the JSON report and one run folder per policy
(:mod:`kvdemo.experiments.results`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..pruning import split_entry
from .evaluation import evaluate


def accuracy_table(report: dict[str, Any]) -> str:
    """Accuracy per policy (rows) and delay (columns) with 95% intervals, chance and the question count."""
    delays = report["delays_s"]
    width = max(14, *(len(name) for name in report["accuracy"]))
    held = report.get("tokens_held", {})
    header = f"{'policy':<{width}} {'M / C':>11} {'held':>6} " + " ".join(f"{'delay ' + d + ' s':>17}" for d in delays)
    lines = [header]
    for name, row in report["accuracy"].items():
        budget = report["budgets"][name]
        size = (
            "-"
            if budget["budget"] is None
            else f"{budget['budget']}" + (f" / {budget['keep']}" if budget["keep"] else "")
        )
        cells = []
        for d in delays:
            low, high = report["interval"][name][d]
            cells.append(f"{row[d]:.2f} [{low:.2f},{high:.2f}]".rjust(17))
        lines.append(f"{name:<{width}} {size:>11} {held.get(name, 0):>6.0f} " + " ".join(cells))
    q = report["questions"]
    kind = report.get("kind", "static")
    streams = "static and moving, alternating," if kind == "mixed" else kind
    lines.append(
        f"chance {report['chance']:.3f}; {q['total']} questions ({q['colour']} colour, {q['first']} first-shape) "
        f"from {report['episodes']} held-out {streams} streams of {report['stream_pairs']} s; [95% Wilson interval]; "
        "held: mean visual tokens in the cache when asked"
    )
    if report.get("answer_ms"):
        lines.append(
            "answer ms (mean, retrieval included): " + ", ".join(f"{n} {v:.1f}" for n, v in report["answer_ms"].items())
        )
    host = {name: mb for name, mb in report.get("host_mb_per_min", {}).items() if mb}
    if host:
        lines.append("host memory, MB per minute of stream: " + ", ".join(f"{n} {v:.2f}" for n, v in host.items()))
    return "\n".join(lines)


def eval_command(args: argparse.Namespace) -> int:
    """``python -m kvdemo eval`` (arguments checked by the CLI before anything heavy loads)."""
    import torch  # deferred on purpose: the CLI checks the arguments on importing this module, before torch loads

    from ..cache.budget import DEFAULT_KEEP_RATIO, token_count  # deferred with torch
    from ..models.loading import load_model  # deferred with torch
    from ..policies import make_policy  # deferred with torch

    for name in args.policies:
        make_policy(split_entry(name)[1])  # an unknown name fails here, before the model loads
    budget = token_count("M", args.budget)  # M and C are checked by the budget's rule before the model loads
    keep = token_count("C", args.keep) if args.keep is not None else int(budget * DEFAULT_KEEP_RATIO)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    if model.notice:
        print(f"note: {model.notice}", file=sys.stderr)
    predictions: list[dict[str, Any]] = []
    report = evaluate(
        model,
        args.policies,
        args.delays,
        args.episodes,
        args.seed,
        budget,
        keep,
        progress=not args.quiet,
        kind=args.kind,
        questions=args.questions,
        predictions=predictions,
    )
    print(accuracy_table(report))
    if getattr(args, "runs", ""):
        write_policy_runs(Path(args.runs), args, report, predictions)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def write_policy_runs(
    root: Path, args: argparse.Namespace, report: dict[str, Any], predictions: list[dict[str, Any]]
) -> None:
    """One run folder per policy under ``root`` (:mod:`kvdemo.experiments.results`): the config, the report's rows of that
    policy as the metrics, its predictions."""
    from .results import new_run_folder, write_eval_run  # deferred: only when runs are written

    for name in report["accuracy"]:
        bounds = report["budgets"][name]
        prune, _ = split_entry(name)
        config = {
            "harness": "kvdemo eval",
            "model": report["model"],
            "policy": name,  # the engine's name: a pruned engine is a line of its own in the results' chart
            "prune": prune.text if prune is not None else None,
            "params": {},
            "M": bounds["budget"],
            "C": bounds["keep"],
            "fps": 2.0,
            "seed": report["seed"],
            "episodes": report["episodes"],
            "kind": report["kind"],
            "questions": report["question_form"],
            "delays_s": report["delays_s"],
        }
        own = {
            key: (value[name] if isinstance(value, dict) and name in value else value) for key, value in report.items()
        }
        folder = write_eval_run(
            new_run_folder(root, f"eval-{name}"), config, own, [p for p in predictions if p["policy"] == name]
        )
        print(f"run folder: {folder}", file=sys.stderr)
