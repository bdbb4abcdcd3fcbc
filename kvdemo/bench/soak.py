"""``python -m kvdemo.bench.soak``: a long busy session against the real app, to see that it stays flat.

Starts the app (``kvdemo.app.launch``, the trained tiny model, a fresh Gradio cache folder of its own) and, from
one ``gradio_client`` session, repeats until the time is up: the bundled sample streamed through a policy and the
full cache (``/run_sample``), a question (``/ask``), the occupancy chart exported (``/export_chart``), the
comparison of the sample (``/compare_sample``) and a question to every engine with attribution (``/compare_ask``).
Every ``--every`` seconds it records the app's resident memory (``VmRSS`` of its process, Linux) and the size and
file count of its cache folder, and prints them as they come; ``--json`` writes them.

Not a test (it runs for minutes): run it by hand, e.g. ``nice python -m kvdemo.bench.soak --minutes 10``. It asserts
nothing; a flat memory and a cache folder bounded by the sweeper's age (``KVDEMO_CACHE_TTL_S``) are what to look for.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import write_json

QUESTIONS = ("What colour was the circle?", "Which shape appeared first?", "What colour was the star?")


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid`` in MB (``/proc``; Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def folder_size(folder: Path) -> tuple[float, int]:
    """``(MB, files)`` under ``folder`` (files removed meanwhile are skipped)."""
    total, count = 0, 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total, count = total + path.stat().st_size, count + 1
        except OSError:
            continue
    return total / 2**20, count


def start_app(cache: Path, log: Path, ttl_s: float | None, model: str = "tiny") -> tuple[subprocess.Popen, str]:
    """The app on a free local port with ``model`` (the tiny model by default), its own cache folder; ``(process,
    url)`` once it answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", GRADIO_TEMP_DIR=str(cache))
    if ttl_s is not None:
        env["KVDEMO_CACHE_TTL_S"] = str(ttl_s)
    code = f"from kvdemo.app import launch; launch(port={port}, model={model!r})"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the app did not start:\n{log.read_text()[-3000:]}") from None
            time.sleep(1)


def soak(minutes: float, every_s: float, ttl_s: float | None, workdir: Path) -> dict[str, Any]:
    """Drive the app for ``minutes``; the samples and the counts of each request."""
    from gradio_client import Client  # deferred on purpose: a dev dependency, needed only here

    from ..policies import DEFAULT_POLICY  # deferred with it: the policies import torch

    cache = workdir / "gradio-cache"
    for attempt in range(3):  # on a loaded machine Gradio's own check that localhost answers can time out
        try:
            process, url = start_app(cache, workdir / "app.log", ttl_s)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    samples: list[dict[str, float]] = []
    counts = {"run_sample": 0, "ask": 0, "export_chart": 0, "compare_sample": 0, "compare_ask": 0}
    try:
        client = Client(url, download_files=False, verbose=False)
        start = time.monotonic()
        next_sample = start

        def record() -> None:
            nonlocal next_sample
            if time.monotonic() < next_sample:
                return
            size, files = folder_size(cache)
            samples.append(
                {
                    "t_s": round(time.monotonic() - start, 1),
                    "rss_mb": round(rss_mb(process.pid), 1),
                    "cache_mb": round(size, 2),
                    "cache_files": files,
                    **counts,
                }
            )
            print(
                f"{samples[-1]['t_s']:>7.0f} s  RSS {samples[-1]['rss_mb']:>7.1f} MB  cache {size:>7.2f} MB in "
                f"{files:>5} files  ({', '.join(f'{k} {v}' for k, v in counts.items())})",
                flush=True,
            )
            next_sample += every_s

        record()
        turn = 0
        while time.monotonic() - start < minutes * 60:
            question = QUESTIONS[turn % len(QUESTIONS)]
            for name, call in (
                ("run_sample", lambda: client.predict("tiny", DEFAULT_POLICY, 96, 72, 2.0, api_name="/run_sample")),
                ("ask", lambda: client.predict(question, api_name="/ask")),
                ("export_chart", lambda: client.predict(api_name="/export_chart")),
                ("compare_sample", lambda: client.predict(api_name="/compare_sample")),
                ("compare_ask", lambda: client.predict(question, True, api_name="/compare_ask")),
            ):
                call()
                counts[name] += 1
                record()
            turn += 1
        next_sample = 0.0
        record()
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    return {"minutes": minutes, "cache_ttl_s": ttl_s, "samples": samples, "requests": counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvdemo.bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to drive the app (default 10)")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples (default 30)")
    parser.add_argument("--cache-ttl", type=float, help="the app's KVDEMO_CACHE_TTL_S (default: the app's, an hour)")
    parser.add_argument("--json", metavar="OUT", help="write the samples here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvdemo-soak-") as folder:
        results = soak(args.minutes, args.every, args.cache_ttl, Path(folder))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
