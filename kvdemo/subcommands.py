"""Each command of ``python -m kvdemo``: its options, and the description and examples its ``--help`` prints, one
function per command (:func:`kvdemo.usage.build_parser` calls them in the order ``--help`` lists the commands).
What the commands do is :mod:`kvdemo.cli`."""

from __future__ import annotations

import argparse
from typing import Any

from .experiments.evaluation import DEFAULT_DELAYS, EVAL_KINDS, QUESTION_FORMS
from .world.synthetic import STREAM_KINDS

#: Every command's help keeps its description's and examples' line breaks.
FORMATTER = argparse.RawDescriptionHelpFormatter


class PolicyHelp:
    """What the help texts say about the registered policies: read from ``catalog`` (the :mod:`kvdemo.policies`
    module) when it is given, which only ``--help`` does (importing the policies imports torch); generic wording
    otherwise."""

    def __init__(self, catalog: Any = None) -> None:
        self.catalog = catalog
        self.policies = dict(catalog.REGISTRY) if catalog is not None else {}
        self.listed = f"one of: {', '.join(self.policies)}" if self.policies else "a registered name"
        sized_by_m = [name for name, cls in self.policies.items() if cls.bounded and not cls.takes_keep()]
        self.no_keep = (
            f"{', '.join(sized_by_m)} take{'s' if len(sized_by_m) == 1 else ''} none: sized by M alone"
            if sized_by_m
            else "a policy sized by M alone takes none"
        )
        updating = [name for name in self.policies if "update" in catalog.policy_card(name).bench.benchmarks]
        self.update_owner = ", ".join(updating) if updating else "a policy with an update benchmark"
        # What each policy keeps, from its card (the run command's help lists them above its examples).
        self.summaries = "".join(f"\n  {name:<15} {catalog.policy_card(name).summary}" for name in self.policies)

    def named(self, text: str, default: str) -> str:
        """``text`` and the catalog's ``default`` (the name of a policy it defines, or of a tuple of them)."""
        if self.catalog is None:
            return text
        value = getattr(self.catalog, default)
        return f"{text}; default {value if isinstance(value, str) else ','.join(value)}"


def add_stream_options(stream: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What run and compare share, added to ``stream`` (their parent parser): the stream (a file or the bundled
    sample), its sampling, the model, questions, output."""
    stream.add_argument(
        "--video", help="video file (mp4, mkv, mov, webm, avi...); default: the bundled sample (a generated stream)"
    )
    stream.add_argument(
        "--sample",
        choices=STREAM_KINDS,
        default="static",
        help="without --video: which bundled sample, static (fixed camera, the default) or moving (camera "
        "pans and zooms, background drifts, objects reappear)",
    )
    stream.add_argument(
        "--model", help="tiny, tiny-random, auto, or a Hugging Face id / local path (default: $KVDEMO_MODEL or auto)"
    )
    stream.add_argument("--fps", type=float, default=2.0, help="sampling fps (default 2)")
    stream.add_argument("--max-frames", type=int, help="stop after this many sampled frames")
    stream.add_argument(
        "--max-pixels", type=int, help="max pixels per frame after resize (default: the model's own range)"
    )
    stream.add_argument(
        "--min-pixels", type=int, help="min pixels per frame after resize (default: the model's own range)"
    )
    stream.add_argument(
        "--ask", action="append", default=[], metavar="QUESTION", help="question asked after the stream (repeatable)"
    )
    stream.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap (default 64)")
    stream.add_argument("--json", metavar="OUT", help="write the report here")
    return stream


RUN_DESCRIPTION = """\
Stream one video (default: the bundled sample) through one policy: the cache holds at most M visual
tokens and each compression keeps C of them. Prints progress, answers to --ask questions and a summary;
--json writes the full run report (occupancy timeline, survivors, answers)."""

RUN_EXAMPLES = """\
examples:
  python -m kvdemo run
      the bundled sample through infinipot-v with an automatic budget
  python -m kvdemo run --sample moving -M 64 -C 48 --ask "Which shape appeared first?"
      the moving-camera sample
  python -m kvdemo run --video clip.mp4 -M 6144 -C 4608 --ask "What happens at the end?" --json report.json
  python -m kvdemo run --video clip.mp4 --param alpha=1 --param tar=frame
      an InfiniPot-V ablation from the paper's Table 5 (TaR only, frame-level)
  python -m kvdemo run --video clip.mp4 --policy cords --coverage
      CoRDS, with how well the kept tokens cover a full cache"""


def add_run(commands: Any, stream: argparse.ArgumentParser, about: PolicyHelp) -> None:
    """``run``: one video through one policy."""
    run = commands.add_parser(
        "run",
        help="stream a video through one policy (and optionally ask questions)",
        parents=[stream],
        description=RUN_DESCRIPTION,
        epilog=(f"policies:{about.summaries}\n\n" if about.policies else "") + RUN_EXAMPLES,
        formatter_class=FORMATTER,
    )
    run.add_argument("--policy", help=about.named(f"compression policy, {about.listed}", "DEFAULT_POLICY"))
    # M and C are read as text and checked by the budget's one rule (1e25 is a one-line error, not argparse's).
    run.add_argument(
        "--budget", "-M", help="M: max visual tokens held (default: about a third of the stream's, at most 6144)"
    )
    run.add_argument("--keep", "-C", help=f"C: visual tokens kept by a compression (default 0.75 M; {about.no_keep})")
    run.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy parameter, value read as JSON (repeatable), e.g. --param alpha=0.3",
    )
    run.add_argument("--frames-per-chunk", type=int, default=2, help="frames per prefill chunk (default 2)")
    run.add_argument(
        "--coverage",
        action="store_true",
        help="also stream a full cache and report how well the kept tokens cover it (CoRDS Sec. 4.6)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")


COMPARE_DESCRIPTION = """\
Stream one video (default: the bundled sample) into up to four policies and the full cache at once (one vision
encoding feeds them all), ask every engine the same questions, and write one report per engine in one file:
occupancy, survivors, graded answers, and with --attribution / --fidelity what each answer looked at and how far
each policy's attention output is from the full cache's."""

COMPARE_EXAMPLES = """\
examples:
  python -m kvdemo compare --policies infinipot-v,cords,protokv,hybridkv -M 64 -C 48 \\
      --ask "What colour was the circle?" --attribution --fidelity --json compare.json
  python -m kvdemo compare --sample moving --override "hybridkv: M=96 C=72 share=0.5"
      the moving-camera sample, HybridKV with its own budget and dynamic share"""


def add_compare(commands: Any, stream: argparse.ArgumentParser, about: PolicyHelp) -> None:
    """``compare``: up to four policies and the full cache on one stream."""
    comparing = commands.add_parser(
        "compare",
        help="up to four policies and the full cache side by side on one stream",
        parents=[stream],
        description=COMPARE_DESCRIPTION,
        epilog=COMPARE_EXAMPLES,
        formatter_class=FORMATTER,
    )
    comparing.set_defaults(frames_per_chunk=2, param=[])  # what the checks shared with run read
    comparing.add_argument("--policies", help=about.named("comma-separated, at most 4", "COMPARE_POLICIES"))
    comparing.add_argument("--budget", "-M", help="M shared by every policy (default: 2/3 of the model's, 64 for tiny)")
    comparing.add_argument(
        "--keep", "-C", help="C shared by the policies that take one (default: 2/3 of the model's, 48 for tiny)"
    )
    comparing.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="'POLICY: M=.. C=.. KEY=VALUE ..'",
        help="a policy's own budget and parameters (repeatable)",
    )
    comparing.add_argument(
        "--attribution", action="store_true", help="record what each answer looked at (kvdemo.analysis.explain)"
    )
    comparing.add_argument(
        "--fidelity",
        action="store_true",
        help="per-layer attention-output error and first-token KL of each policy against the full cache, per question",
    )
    comparing.add_argument(
        "--full-cap-mb", type=float, default=2048, help="the full cache stops here (default 2048; 0: no cap)"
    )


BENCH_DESCRIPTION = """\
Stream a long synthetic video through the full cache and a bounded policy on the offline tiny model (one
shared vision encoding), print per-chunk prefill and compression times, visual tokens and cache bytes,
then time one compression pass on caches of Qwen2.5-VL-7B shape (M=6144 -> C=4608) in fp32 and bf16."""

BENCH_EXAMPLES = """\
examples:
  python -m kvdemo bench
  python -m kvdemo bench --policy infinipot-v --frames 100 --skip-pass --json bench.json
  python -m kvdemo bench --policy infinipot-v --reference ../InfiniPot-V --pass-repeats 7"""


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
    bench.add_argument("--every", type=int, default=1, help="print every Nth chunk of the table (default: all)")
    bench.add_argument("--json", metavar="OUT", help="write the benchmark results here")


EVAL_DESCRIPTION = """\
Accuracy vs query delay on held-out generated streams (ProtoKV's protocol): every episode streams once
through one engine per policy (one shared vision encoding); each question is asked of every engine at
every delay after its evidence left view; only questions askable at every delay count."""

EVAL_EXAMPLES = """\
examples:
  python -m kvdemo eval --policies full,sliding-window,uniform,infinipot-v,cords --delays 0,4,8,16,32 \\
      --episodes 200 --seed 0 --budget 64 --keep 48 --json eval.json
  python -m kvdemo eval --kind moving --budget 64 --keep 48
      the same on streams with camera motion, a drifting background and reappearing objects"""


def add_eval(commands: Any, about: PolicyHelp) -> None:
    """``eval``: accuracy vs query delay on held-out streams."""
    evaluate = commands.add_parser(
        "eval",
        help="accuracy vs query delay on held-out generated streams",
        description=EVAL_DESCRIPTION,
        epilog=EVAL_EXAMPLES,
        formatter_class=FORMATTER,
    )
    evaluate.add_argument("--policies", help=about.named("comma-separated policy names", "EVAL_POLICIES"))
    evaluate.add_argument(
        "--delays",
        default=",".join(str(d) for d in DEFAULT_DELAYS),
        help="query delays in seconds of stream time, comma-separated (default 0,4,8,16,32)",
    )
    evaluate.add_argument("--episodes", type=int, default=200, help="held-out streams (default 200)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the held-out streams (default 0)")
    evaluate.add_argument(
        "--kind",
        choices=EVAL_KINDS,
        default="static",
        help="stream kind: static (fixed camera, the default), moving (camera pans and zooms, the "
        "background drifts, objects reappear) or mixed (the two alternating)",
    )
    evaluate.add_argument(
        "--budget",
        "-M",
        default="64",
        help="M for the bounded policies (visual tokens; default 64: 4 s of a generated stream)",
    )
    evaluate.add_argument("--keep", "-C", help="C for the policies that take one (visual tokens; default 0.75 M)")
    evaluate.add_argument("--model", default="tiny", help="the model (default: the trained tiny model)")
    evaluate.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the tiny model's matrices "
        "are small, and on a busy machine more threads stall each other)",
    )
    evaluate.add_argument(
        "--questions",
        choices=QUESTION_FORMS,
        default="bare",
        help="bare questions (default) or a benchmark's multiple-choice prompt of them (answer: the letter)",
    )
    evaluate.add_argument("--json", metavar="OUT", help="write the results here")
    evaluate.add_argument(
        "--runs",
        default="runs",
        metavar="DIR",
        help="write the run folder (config, metrics, predictions) under DIR (default runs; '' for none)",
    )
    evaluate.add_argument("--quiet", action="store_true", help="no progress bar")


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
