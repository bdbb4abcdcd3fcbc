"""The commands of ``python -m kvdemo`` that measure and maintain rather than stream a video: ``bench``, ``results``,
``make-tasks``, ``doctor`` and ``train-tiny``: their options, and the description and examples each ``--help``
prints, one function per command (the streaming commands are :mod:`kvdemo.subcommands`)."""

from __future__ import annotations

from typing import Any

from .subcommands import FORMATTER, PolicyHelp

BENCH_DESCRIPTION = """\
Stream a long synthetic video through the full cache and a bounded policy on the offline tiny model (one
shared vision encoding), print per-chunk prefill and compression times, visual tokens and cache bytes,
then time one compression pass on caches of Qwen2.5-VL-7B shape (M=6144 -> C=4608) in fp32 and bf16."""

BENCH_EXAMPLES = """\
examples:
  python -m kvdemo bench
  python -m kvdemo bench --policy infinipot-v --frames 100 --skip-pass --json bench.json
  python -m kvdemo bench --policy infinipot-v --reference ../InfiniPot-V --pass-repeats 7
  python -m kvdemo bench --count --layers 4,28 --json counts.json"""


def add_bench(commands: Any, about: PolicyHelp) -> None:
    """``bench``: a bounded policy against the full cache."""
    bench = commands.add_parser(
        "bench",
        help="benchmark a bounded policy against the full cache",
        description=BENCH_DESCRIPTION,
        epilog=BENCH_EXAMPLES,
        formatter_class=FORMATTER,
    )
    bench.add_argument("--policy", help=about.named(f"the bounded policy, {about.listed}", "BENCH_POLICY"))
    bench.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE", help="policy parameter (repeatable)"
    )
    bench.add_argument("--frames", type=int, default=400, help="synthetic frames to stream (default 400)")
    bench.add_argument("--budget", "-M", type=int, default=1536, help="M for the streaming run (default 1536)")
    bench.add_argument("--keep", "-C", type=int, default=1152, help="C for the streaming run (default 1152)")
    bench.add_argument("--pass-repeats", type=int, default=3, help="repeats of the 7B-shape pass timing (default 3)")
    bench.add_argument("--skip-pass", action="store_true", help="skip the 7B-shape compression pass timing")
    bench.add_argument(
        "--device",
        default="cpu",
        help="where the 7B-shape passes, the append and the long stream run: cpu (default), cuda or "
        "cuda:N (the tiny model's stream stays on the CPU)",
    )
    bench.add_argument(
        "--long-stream",
        type=int,
        default=120,
        metavar="GRIDS",
        help="also time every pass of a simulated stream this many temporal grids long at 7B shape, where "
        "later passes meet a compacted memory holding tokens of more frames (default 120; 0 skips)",
    )
    bench.add_argument(
        "--zerogpu", action="store_true", help="also measure what a ZeroGPU call pickles at Qwen2.5-VL-3B's defaults"
    )
    bench.add_argument(
        "--stream-factor",
        type=int,
        default=20,
        help=f"{about.update_owner}: also time the update on a stream this many times longer (default 20)",
    )
    bench.add_argument(
        "--reference",
        metavar="PATH",
        help="the authors' InfiniPot-V kvcache_utils.py (or a clone of aiha-lab/InfiniPot-V): time kvdemo's "
        "pass against theirs on the same 7B-shape tensors and compare the kept tokens",
    )
    bench.add_argument(
        "--prune",
        metavar="METHOD:VALUE",
        help="also stream the full cache and the policy with this pruning before the LLM in front of each, and print "
        "the prefill time it saves per chunk (evs:0.75, vidcom2:0.25)",
    )
    bench.add_argument("--every", type=int, default=1, help="print every Nth chunk of the table (default: all)")
    bench.add_argument(
        "--count",
        action="store_true",
        help="only count, for every bounded policy, the operations one bfloat16 pass at 7B per-layer shape launches "
        "and the values it reads back to the host (on the emulated device; with --device cuda, by the profiler): "
        "no stream, no timing",
    )
    bench.add_argument(
        "--layers", default="4,28", help="--count: the depths to count at, comma-separated (default 4,28)"
    )
    bench.add_argument("--json", metavar="OUT", help="write the benchmark results here")


RESULTS_DESCRIPTION = """\
Tabulate run folders side by side (written by `python -m kvdemo eval` and by lmms-eval's --model kvdemo: config,
metrics, predictions) and draw accuracy against the budget M (one line per policy, the full cache dashed) or
against the delay (one line per run), as a Plotly HTML and a PNG."""


def add_results(commands: Any) -> None:
    """``results``: run folders side by side, and their chart."""
    results = commands.add_parser(
        "results",
        help="tabulate run folders side by side and chart accuracy vs budget or delay",
        description=RESULTS_DESCRIPTION,
        formatter_class=FORMATTER,
    )
    results.add_argument(
        "folders", nargs="+", metavar="DIR", help="run folders (of kvdemo eval or of --model kvdemo in lmms-eval)"
    )
    results.add_argument(
        "--x", choices=("budget", "delay"), default="budget", help="the chart's x axis (default budget)"
    )
    results.add_argument(
        "--chart",
        default="kvdemo-results",
        metavar="PREFIX",
        help="write PREFIX.html (Plotly) and PREFIX.png (default kvdemo-results; '' for none)",
    )


MAKE_TASKS_DESCRIPTION = """\
Write offline lmms-eval tasks on generated streams into DIR: a VideoMME-format task and OVO-Bench-format
backward and forward tasks, scored by lmms-eval's own VideoMME and OVO-Bench functions, and kvdemo's bare-question
task (each question asked at a stream time). Run them with --include_path DIR and HF_HOME=DIR/hf (docs/lmms-eval.md)."""


def add_make_tasks(commands: Any) -> None:
    """``make-tasks``: offline lmms-eval tasks on generated streams."""
    tasks = commands.add_parser(
        "make-tasks",
        help="write offline lmms-eval tasks (VideoMME, OVO-Bench layouts) on generated streams",
        description=MAKE_TASKS_DESCRIPTION,
        formatter_class=FORMATTER,
    )
    tasks.add_argument("folder", metavar="DIR", help="where the tasks' data, videos and YAMLs go")
    tasks.add_argument("--streams", type=int, default=8, help="generated streams per task (default 8)")
    tasks.add_argument("--seed", type=int, default=0, help="seed of the streams (default 0)")


DOCTOR_DESCRIPTION = """\
The device checklist: every policy x the offline models of each family streamed twice on the device (bfloat16
on CUDA, float32 on the CPU): under M, memory unchanged by asking, identical across runs; every policy with the
memory's layers split across two devices (cpu + cuda:0, or cpu + an emulated device without a GPU); the SDPA
backend kvdemo's masked attention gets; timings per policy. Prints tables and writes JSON."""

DOCTOR_EXAMPLES = """\
examples:
  python -m kvdemo doctor                      # the GPU when there is one, else the CPU
  python -m kvdemo doctor --device cuda --real-shapes --json doctor.json
  python -m kvdemo doctor --device cuda --full-depth qwen2.5-vl-3b,qwen2.5-vl-7b,qwen3-vl-8b --seconds 60"""


def add_doctor(commands: Any) -> None:
    """``doctor``: the device checklist."""
    doctor = commands.add_parser(
        "doctor",
        help="the device checklist (every policy x family on this machine's device)",
        description=DOCTOR_DESCRIPTION,
        epilog=DOCTOR_EXAMPLES,
        formatter_class=FORMATTER,
    )
    doctor.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    doctor.add_argument(
        "--models", help="comma-separated offline models (default: tiny and one random model per family)"
    )
    doctor.add_argument(
        "--frames", type=int, default=24, help="frames of the bundled sample per run (default 24, at least 16)"
    )
    doctor.add_argument(
        "--real-shapes",
        action="store_true",
        help="also time one compression pass on two layers at Qwen2.5-VL-3B/-7B per-layer shapes",
    )
    doctor.add_argument(
        "--full-depth",
        metavar="MODELS",
        help="also stream every policy through random-weight checkpoints at these real configs, all layers "
        "(comma-separated: qwen2.5-vl-3b, qwen2.5-vl-7b, qwen3-vl-8b; a GPU's work)",
    )
    doctor.add_argument(
        "--seconds", type=float, default=60.0, help="with --full-depth: seconds of stream per run (default 60)"
    )
    doctor.add_argument(
        "--checkpoints",
        default="full-depth-checkpoints",
        help="with --full-depth: where the random checkpoints are written (removed after their runs)",
    )
    doctor.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="with --full-depth: keep the checkpoints (e.g. for `python app.py --model FOLDER`)",
    )
    doctor.add_argument("--json", metavar="OUT", help="write the checklist's results here")


TRAIN_DESCRIPTION = """\
Train the offline tiny model (transformers' Qwen2_5_VLForConditionalGeneration, 0.92M parameters) from
scratch on generated streams, reproducibly (about 36 min on two quiet CPU cores), check it on held-out streams
and write its weights, config and tokenizer to --out (default ./tiny-trained; a model already there is never
overwritten without --overwrite, so the bundled weights stay as they are). --from DIR instead starts from DIR's
weights and runs the choice stages D-G (VideoMME's and OVO-Bench's option-letter questions mixed in; about
50 min on a quiet machine): the bundled weights are the base stage's followed by D-G (docs/tiny-model.md)."""


def add_train_tiny(commands: Any) -> None:
    """``train-tiny``: train the offline tiny model."""
    train = commands.add_parser(
        "train-tiny",
        help="train the offline tiny model (~36 min on 2 quiet cores; writes ./tiny-trained)",
        description=TRAIN_DESCRIPTION,
        formatter_class=FORMATTER,
    )
    train.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    train.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1; fixed for reproducibility; "
        "the next step's streams are generated on a second thread meanwhile)",
    )
    train.add_argument("--out", default="tiny-trained", help="output folder (default ./tiny-trained)")
    train.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    train.add_argument(
        "--from",
        dest="start",
        metavar="DIR",
        help="start from DIR's weights and run the choice stages D-G (VideoMME/OVO-Bench option letters)",
    )
    train.add_argument(
        "--check-episodes", type=int, default=100, help="held-out streams for the final full-cache check"
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
