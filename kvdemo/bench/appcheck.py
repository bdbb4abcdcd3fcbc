"""``python -m kvdemo.bench.appcheck``: the app on this machine's device, driven as a user drives it.

Starts the app (``kvdemo.app.launch``) with ``--model`` (e.g. a random-weight checkpoint folder that
``python -m kvdemo doctor --full-depth`` writes) and, from one ``gradio_client`` session: the bundled sample streamed
through every bounded policy beside the full cache (``/run_sample``) with a question asked while the stream runs
(its row says so when the stream was already over) and another after it (``/ask``),
then the comparison page with four policies and the full cache (``/compare_sample``, ``/compare_ask`` with
attribution). Per step: wall time, whether it raised, and from the run report the model's work per second of
stream (prefill and compression, ms per second); all along, the app process's peak GPU memory (``nvidia-smi``,
sampled every half second; None without a GPU). Prints a table, writes JSON with ``--json``; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import write_json
from .soak import start_app

QUESTION = "What colour was the circle?"


def gpu_memory_mb(pid: int) -> float | None:
    """GPU memory ``nvidia-smi`` reports for process ``pid`` (MB; None without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [float(line.split(",")[1]) for line in out.splitlines() if line.split(",")[0].strip() == str(pid)]
    return sum(used) if used else 0.0


class PeakMemory(threading.Thread):
    """Polls :func:`gpu_memory_mb` of ``pid`` until stopped; ``peak`` is the largest seen."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s, self.peak, self.done = pid, every_s, None, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            used = gpu_memory_mb(self.pid)
            if used is not None:
                self.peak = max(self.peak or 0.0, used)
            self.done.wait(self.every_s)


def _report_of(outputs: Any) -> dict[str, Any] | None:
    """The run report among a call's outputs (the downloaded JSON file), if any."""
    for item in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
        path = item.get("path") if isinstance(item, dict) else item
        if isinstance(path, str) and path.endswith(".json") and Path(path).is_file():
            return json.loads(Path(path).read_text())
    return None


def _work(report: dict[str, Any] | None) -> float | None:
    """Model work (prefill and compression, ms) per second of stream in a run report."""
    if not report or not report.get("timeline"):
        return None
    seconds = max(e.get("time_s", 0.0) for e in report["timeline"]) + 1 / float(report.get("fps") or 2.0)
    return sum(e.get("ms", 0.0) for e in report["timeline"]) / max(seconds, 1e-9)


def check(model: str, policies: list[str], compare: list[str], workdir: Path) -> dict[str, Any]:
    """Drive the app (see the module docstring); the rows and the peak memory."""
    from gradio_client import Client  # deferred on purpose: a dev dependency, needed only here

    process, url = start_app(workdir / "gradio-cache", workdir / "app.log", None, model=model)
    sampler = PeakMemory(process.pid)
    sampler.start()
    rows: list[dict[str, Any]] = []

    def step(name: str, policy: str, call) -> Any:
        start, error, out = time.monotonic(), None, None
        try:
            out = call()
        except Exception as exc:  # noqa: BLE001 (every failure is a row of the check)
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        report = _report_of(out) if out is not None else None
        rows.append(
            {
                "step": name,
                "policy": policy,
                "s": round(time.monotonic() - start, 2),
                "error": error,
                "work_ms_per_s": _work(report),
                "peak_visual_tokens": (report or {}).get("peak_visual_tokens"),
                "answer": str(out[1])[:60] if name.startswith("ask") and isinstance(out, (list, tuple)) else None,
            }
        )
        work, peak = rows[-1]["work_ms_per_s"], sampler.peak
        print(
            f"{name:<16} {policy:<16} {rows[-1]['s']:>7.1f} s  work {'-' if work is None else f'{work:.1f}':>7} ms/s  "
            f"GPU peak {'-' if peak is None else f'{peak:.0f}':>8} MB  {error or ''}",
            flush=True,
        )
        return out

    try:
        client = Client(url, verbose=False)
        for policy in policies:
            job = client.submit(model=model, policy=policy, api_name="/run_sample")
            time.sleep(2.0)
            # a short stream may be over by now: the row says whether the question met it still running
            step(
                "ask mid-stream" if not job.done() else "ask (stream over)",
                policy,
                lambda: client.predict(QUESTION, api_name="/ask"),
            )
            step("run_sample", policy, job.result)
            step("ask after", policy, lambda: client.predict(QUESTION, api_name="/ask"))
        step(
            "compare_sample",
            ",".join(compare),
            lambda: client.predict(model=model, policies=compare, api_name="/compare_sample"),
        )
        step("compare_ask", ",".join(compare), lambda: client.predict(QUESTION, True, api_name="/compare_ask"))
    finally:
        sampler.done.set()
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    log = (workdir / "app.log").read_text()[-4000:]
    return {"model": model, "rows": rows, "gpu_peak_mb": sampler.peak, "app_log_tail": log}


def main(argv: list[str] | None = None) -> int:
    from ..policies import COMPARE_POLICIES, make_policy, policy_names  # deferred: the policies import torch

    parser = argparse.ArgumentParser(
        prog="python -m kvdemo.bench.appcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="tiny", help="the app's model (default tiny)")
    parser.add_argument("--json", metavar="OUT", help="write the rows here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvdemo-appcheck-") as folder:
        results = check(
            args.model, [p for p in policy_names() if make_policy(p).bounded], list(COMPARE_POLICIES)[:4], Path(folder)
        )
    print(
        f"app peak GPU memory: {results['gpu_peak_mb']} MB; {sum(r['error'] is not None for r in results['rows'])} "
        f"step(s) raised"
    )
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
