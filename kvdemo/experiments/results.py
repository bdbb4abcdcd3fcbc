"""Run folders and ``python -m kvdemo results DIR...``: every evaluation leaves one folder, tabulated side by side.

A run folder (written by ``python -m kvdemo eval`` and by the lmms-eval model, :mod:`kvdemo.integrations.lmms_eval`)
holds:

- ``config.json``: the harness, model, policy, its parameters, ``M``/``C``, fps, seed, and the versions of
  kvdemo, torch, transformers (and lmms-eval);
- ``metrics.json``: accuracy overall, per delay (``kvdemo eval``) and per task;
- ``predictions.jsonl``: one line per answer: question, answer, truth, correct, delay, tokens held (and what the
  engine measured: peak, compressions, frames fed, model time). Under a data-parallel launch each process
  writes ``predictions.rank<r>.jsonl``; the metrics are then made from all of them when the folder is read.

``kvdemo results`` prints one row per folder and draws accuracy against the budget ``M`` (``--x budget``, one
line per policy; the full cache as a level) or against the delay (``--x delay``, one line per run), as a Plotly
HTML and a PNG (drawn with PIL: :mod:`kvdemo.viz.png`).
"""

from __future__ import annotations

import json
import platform
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ..views import Chart, Series

PREDICTIONS = "predictions*.jsonl"


def versions() -> dict[str, str]:
    """Versions of the packages a result depends on (those installed)."""
    found = {"python": platform.python_version()}
    for name in ("kvdemo", "torch", "transformers", "lmms_eval"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def new_run_folder(root: Path, name: str) -> Path:
    """A fresh folder ``root/<name>-<UTC time>`` (``-2``, ``-3``... if taken)."""
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    folder, n = Path(root) / stem, 1
    while folder.exists():
        n += 1
        folder = Path(root) / f"{stem}-{n}"
    folder.mkdir(parents=True)
    return folder


def grade_prediction(doc: dict[str, Any], answer: str) -> dict[str, Any]:
    """``truth`` and ``correct`` of an answer to an lmms-eval document: the truth is the document's ``answer``
    field, or OVO-Bench's ``gt`` option index as a letter. Right (kvdemo's rule) when the answer, stripped of
    spaces, final punctuation and case, is the truth, or when the truth is an option letter and the answer starts
    with it (``"B. blue"``). Documents with neither field have no truth (``correct`` None)."""
    truth = doc.get("answer")
    if truth is None and isinstance(doc.get("gt"), int):
        truth = chr(65 + doc["gt"])
    if truth is None:
        return {"truth": None, "correct": None}
    said, truth = (answer or "").strip().strip(".!").casefold(), str(truth).strip()
    letter = len(truth) == 1 and truth.isalpha()
    right = said == truth.casefold() or (letter and said[:1] == truth.casefold() and not said[1:2].isalpha())
    return {"truth": truth, "correct": bool(right)}


def accuracy_metrics(predictions: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy over the predictions that have a truth: overall, per delay and per task."""
    graded = [p for p in predictions if p.get("correct") is not None]
    metrics: dict[str, Any] = {
        "answers": len(predictions),
        "graded": len(graded),
        "accuracy": sum(p["correct"] for p in graded) / len(graded) if graded else None,
    }
    for key, field in (("by_delay", "delay_s"), ("by_task", "task")):
        groups: dict[str, list[bool]] = defaultdict(list)
        for p in graded:
            if p.get(field) is not None:
                groups[f"{p[field]:g}" if isinstance(p[field], (int, float)) else str(p[field])].append(p["correct"])
        if groups:
            metrics[key] = {k: sum(v) / len(v) for k, v in groups.items()}
    return metrics


class RunWriter:
    """Collects one process's predictions and writes the run folder (``config.json`` by rank 0)."""

    def __init__(self, folder: Path, rank: int = 0, world_size: int = 1) -> None:
        self.folder, self.rank, self.world_size = Path(folder), rank, world_size
        self.predictions: list[dict[str, Any]] = []

    @classmethod
    def open(cls, root: Path, name: str, config: dict[str, Any], rank: int = 0, world: int = 1) -> "RunWriter":
        """A new run folder under ``root``; with several processes (the launcher's process group) rank 0 names it."""
        folder = [str(new_run_folder(root, name)) if rank == 0 else None]
        if world > 1:
            import torch.distributed as dist  # deferred: only data-parallel launches broadcast

            dist.broadcast_object_list(folder, src=0)
        writer = cls(Path(folder[0]), rank, world)
        if rank == 0:
            (writer.folder / "config.json").write_text(json.dumps({**config, "versions": versions()}, indent=1) + "\n")
        return writer

    def add(self, record: dict[str, Any]) -> None:
        self.predictions.append(record)

    def flush(self) -> Path:
        """Write this process's predictions (and the metrics, when it is the only process)."""
        name = "predictions.jsonl" if self.world_size == 1 else f"predictions.rank{self.rank}.jsonl"
        path = self.folder / name
        path.write_text("".join(json.dumps(p) + "\n" for p in self.predictions))
        if self.world_size == 1:
            (self.folder / "metrics.json").write_text(json.dumps(accuracy_metrics(self.predictions), indent=1) + "\n")
        return path


def write_eval_run(
    folder: Path, config: dict[str, Any], report: dict[str, Any], predictions: list[dict[str, Any]]
) -> Path:
    """The run folder of ``python -m kvdemo eval``: its config, its report as the metrics, its predictions."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, "versions": versions()}, indent=1) + "\n")
    (folder / "metrics.json").write_text(
        json.dumps({**accuracy_metrics(predictions), "report": report}, indent=1) + "\n"
    )
    (folder / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in predictions))
    return folder


@dataclass
class Run:
    """One run folder as read back: ``metrics`` made from every predictions file it holds."""

    folder: Path
    config: dict[str, Any]
    metrics: dict[str, Any]
    predictions: list[dict[str, Any]]

    @property
    def label(self) -> str:
        c = self.config
        budget = (
            ""
            if c.get("M") is None or c.get("policy") == "full"
            else f" M={c['M']}" + (f" C={c['C']}" if c.get("C") else "")
        )
        return f"{c.get('policy', '?')}{budget}"


class UnfinishedRun(ValueError):
    """A run folder with its config but no predictions: the run failed or is still going."""


def read_run(folder: Path) -> Run:
    """The run in ``folder``; ValueError naming what is missing."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: not a run folder (no config.json)")
    files = sorted(folder.glob(PREDICTIONS))
    if not files:
        raise UnfinishedRun(f"{folder}: no predictions*.jsonl (did the run finish?)")
    predictions = [json.loads(line) for path in files for line in path.read_text().splitlines() if line.strip()]
    return Run(folder, json.loads((folder / "config.json").read_text()), accuracy_metrics(predictions), predictions)


def results_table(runs: list[Run]) -> str:
    """One row per run and task (a run of several lmms-eval tasks gets a row for each: their scorers differ), with
    full names: run, harness, model, policy, M / C, task, answers, accuracy, then accuracy per delay where a task
    asked at several delays, and a line under the table that says which tasks those columns belong to."""
    rows = []
    for run in runs:
        by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for prediction in run.predictions:
            by_task[str(prediction.get("task") or "-")].append(prediction)
        for task in sorted(by_task):
            rows.append((run, task, run.metrics if len(by_task) == 1 else accuracy_metrics(by_task[task])))
    delays = sorted({d for _, _, m in rows for d in m.get("by_delay", {})}, key=float)
    header = [
        "run",
        "harness",
        "model",
        "policy",
        "M / C",
        "task",
        "answers",
        "accuracy",
        *(f"d={d} s" for d in delays),
    ]
    cells = [header]
    for run, task, m in rows:
        c = run.config
        size = (
            "-"
            if c.get("M") is None or c.get("policy") == "full"
            else f"{c['M']}" + (f"/{c['C']}" if c.get("C") else "")
        )
        by_delay = m.get("by_delay", {})
        cells.append(
            [
                run.folder.name,
                str(c.get("harness", "?")),
                str(c.get("model", "?")),
                str(c.get("policy", "?")),
                size,
                task,
                str(m["answers"]),
                "-" if m["accuracy"] is None else f"{m['accuracy']:.3f}",
                *(f"{by_delay[d]:.3f}" if d in by_delay else "-" for d in delays),
            ]
        )
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]
    numbers = {"M / C", "answers", "accuracy"} | set(header[8:])
    lines = [
        " ".join(cell.rjust(w) if name in numbers else cell.ljust(w) for name, cell, w in zip(header, row, widths))
        for row in cells
    ]
    if delays:
        asked = sorted({task for _, task, m in rows if m.get("by_delay")})
        named = ", ".join("runs without a task" if task == "-" else task for task in asked)
        lines.append(
            f"d=... s: accuracy by delay after the evidence left view, for the tasks that ask at several delays "
            f"({named}); '-' where a task does not"
        )
    return "\n".join(line.rstrip() for line in lines)


def accuracy_chart(runs: list[Run], x: str = "budget") -> Chart:
    """Accuracy against the budget ``M`` (one line per policy, the full cache as a dashed level) or against the
    delay (one line per run)."""
    if x == "delay":
        delays = sorted({d for r in runs for d in r.metrics.get("by_delay", {})}, key=float)
        if not delays:
            raise ValueError("no run has answers at several delays (kvdemo eval runs do); try --x budget")
        lines = {r.label: [r.metrics.get("by_delay", {}).get(d) for d in delays] for r in runs}
        series = Series(
            [float(d) for d in delays], lines, "delay after the evidence left view (s)", "accuracy", markers=True
        )
        return Chart("Accuracy against delay", f"{len(runs)} run(s)", [series])
    bounded = [r for r in runs if r.config.get("policy") != "full" and r.config.get("M") is not None]
    budgets = sorted({int(r.config["M"]) for r in bounded})
    if not budgets:
        raise ValueError("no run of a bounded policy with a budget M; try --x delay")
    lines: dict[str, list[float | None]] = defaultdict(lambda: [None] * len(budgets))
    for run in bounded:
        lines[run.config["policy"]][budgets.index(int(run.config["M"]))] = run.metrics["accuracy"]
    full = [
        r.metrics["accuracy"] for r in runs if r.config.get("policy") == "full" and r.metrics["accuracy"] is not None
    ]
    series = Series(
        [float(b) for b in budgets],
        dict(lines),
        "budget M (visual tokens)",
        "accuracy",
        limit=max(full) if full else None,
        markers=True,
    )
    caption = f"{len(runs)} run(s)" + ("; dashed: the full cache" if full else "")
    return Chart("Accuracy against the budget", caption, [series])


def results_command(folders: list[str], x: str = "budget", out: str | None = None) -> int:
    """``python -m kvdemo results``: the table on stdout, the chart as ``<out>.html`` and ``<out>.png``."""
    import sys  # deferred: only the command prints

    runs, unfinished = [], []
    for folder in folders:
        try:
            runs.append(read_run(Path(folder)))
        except UnfinishedRun as error:  # a run that failed (lmms-eval exits 0 then) leaves its config alone
            unfinished.append(str(error))
    if not runs:
        raise ValueError("; ".join(unfinished))
    for reason in unfinished:
        print(f"skipped {reason}", file=sys.stderr)
    print(results_table(runs))
    if out is None:
        return 0
    from ..viz.charts import chart_figure  # deferred: plotly
    from ..viz.png import chart_png  # deferred: PIL

    chart = accuracy_chart(runs, x)
    html, png = Path(f"{out}.html"), Path(f"{out}.png")
    html.parent.mkdir(parents=True, exist_ok=True)
    chart_figure(chart).write_html(str(html), include_plotlyjs=True)  # self-contained: opens offline
    chart_png(chart).save(png)
    print(f"chart written to {html} and {png}", file=sys.stderr)
    return 0
