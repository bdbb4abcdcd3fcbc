"""python -m kvdemo run|compare|bench|eval|doctor|train-tiny: stream a video under a KV-cache budget from the command
line, compare policies on one stream, measure the policies' accuracy vs query delay, check a device, train the offline
tiny model. The help texts are :mod:`kvdemo.usage`.

Arguments and the video file are checked before torch, transformers or a model load, so a mistake is
reported at once. Errors a user can cause (bad file, impossible budget, unknown policy) print one line
and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .dialogue import ECHO_LIMIT, QuestionError, check_question, check_question_text, clipped  # light: no torch
from .evaluation import DEFAULT_DELAYS, EVAL_KINDS, QUESTION_FORMS  # light: torch loads when an evaluation runs
from .synthetic import STREAM_KINDS, grade, sample_episode  # light: numpy
from .usage import (  # help texts
    BENCH_DESCRIPTION,
    BENCH_EXAMPLES,
    COMPARE_DESCRIPTION,
    COMPARE_EXAMPLES,
    DESCRIPTION,
    DOCTOR_DESCRIPTION,
    DOCTOR_EXAMPLES,
    EVAL_DESCRIPTION,
    EVAL_EXAMPLES,
    MAKE_TASKS_DESCRIPTION,
    RESULTS_DESCRIPTION,
    RUN_DESCRIPTION,
    RUN_EXAMPLES,
    TRAIN_DESCRIPTION,
)
from .video import VideoError, open_video  # light: numpy and, when a file is opened, PyAV


class UsageError(ValueError):
    """A command-line argument that cannot work (the message names it)."""


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions a user can cause, from the kvdemo modules loaded so far (an error class of a
    module that is not loaded cannot have been raised, and loading one here would cost seconds)."""
    errors: list[type[Exception]] = [UsageError, VideoError]
    for module, name in (("kvdemo.policies.base", "BudgetError"), ("kvdemo.engine", "EngineError"),
                         ("kvdemo.models.base", "ModelError")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def one_line(message: str, argv: list[str]) -> str:
    """An error ``message`` as one line in which every long argument of ``argv`` (and the value after its ``=``)
    it repeats, quoted or not, and any other long quoted text is :func:`clipped`."""
    pieces = {piece for arg in argv for piece in (arg, arg.split("=", 1)[-1]) if len(piece) > ECHO_LIMIT or "\n" in piece}
    for piece in sorted(pieces, key=len, reverse=True):
        for form in (repr(piece), repr(piece)[1:-1], piece):
            message = message.replace(form, repr(clipped(piece)) if form == repr(piece) else clipped(piece))
    message = re.sub(f"'([^']{{{ECHO_LIMIT + 1},}})'", lambda quoted: repr(quoted.group(1)[:ECHO_LIMIT] + "..."), message)
    return " ".join(message.split())


class Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors kept to one line that repeats no long argument (argparse echoes an
    invalid choice whole)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {one_line(message, [])}\n")


def parse_param(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as JSON when it parses (numbers, true/false), else as text."""
    if "=" not in text:
        raise UsageError(f"--param takes key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().replace("-", "_"), value


def build_parser(catalog: Any = None) -> argparse.ArgumentParser:
    """The argument parser; ``catalog`` (the :mod:`kvdemo.policies` module: the registered classes and the
    defaults) only for the help text, which is the one place that needs them before the arguments are checked
    (importing the policies imports torch)."""
    policies = dict(catalog.REGISTRY) if catalog is not None else {}
    named = (lambda text, default: f"{text}; default {default}") if catalog is not None else (lambda text, default: text)
    listed = f"one of: {', '.join(policies)}" if policies else "a registered name"
    sized_by_m = [name for name, cls in (policies or {}).items() if cls.bounded and not cls.takes_keep()]
    no_keep = f"{', '.join(sized_by_m)} take{'s' if len(sized_by_m) == 1 else ''} none: sized by M alone" if sized_by_m else \
        "a policy sized by M alone takes none"
    updating = [name for name, cls in (policies or {}).items() if "update" in cls.benchmarks]
    update_owner = ", ".join(updating) if updating else "a policy with an update benchmark"
    formatter = argparse.RawDescriptionHelpFormatter
    parser = Parser(
        prog="kvdemo" if Path(sys.argv[0]).name == "kvdemo" else "python -m kvdemo", description=DESCRIPTION, formatter_class=formatter,
        epilog="Run 'python -m kvdemo <command> --help' for a command's options and examples.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,compare,bench,eval,results,make-tasks,doctor,train-tiny}")

    # What run and compare share: the stream (a file or the bundled sample), its sampling, the model, questions, output.
    stream = Parser(add_help=False)
    stream.add_argument("--video", help="video file (mp4, mkv, mov, webm, avi...); default: the bundled sample (a generated stream)")
    stream.add_argument("--sample", choices=STREAM_KINDS, default="static",
                        help="without --video: which bundled sample, static (fixed camera, the default) or moving (camera "
                             "pans and zooms, background drifts, objects reappear)")
    stream.add_argument("--model", help="tiny, tiny-random, auto, or a Hugging Face id / local path (default: $KVDEMO_MODEL or auto)")
    stream.add_argument("--fps", type=float, default=2.0, help="sampling fps (default 2)")
    stream.add_argument("--max-frames", type=int, help="stop after this many sampled frames")
    stream.add_argument("--max-pixels", type=int, help="max pixels per frame after resize (default: the model's own range)")
    stream.add_argument("--min-pixels", type=int, help="min pixels per frame after resize (default: the model's own range)")
    stream.add_argument("--ask", action="append", default=[], metavar="QUESTION", help="question asked after the stream (repeatable)")
    stream.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap (default 64)")
    stream.add_argument("--json", metavar="OUT", help="write the report here")

    run = commands.add_parser("run", help="stream a video through one policy (and optionally ask questions)", parents=[stream],
                              description=RUN_DESCRIPTION, epilog=RUN_EXAMPLES, formatter_class=formatter)
    run.add_argument("--policy", help=named(f"compression policy, {listed}", catalog and catalog.DEFAULT_POLICY))
    # M and C are read as text and checked by the budget's one rule (1e25 is a one-line error, not argparse's).
    run.add_argument("--budget", "-M", help="M: max visual tokens held (default: about a third of the stream's, at most 6144)")
    run.add_argument("--keep", "-C", help=f"C: visual tokens kept by a compression (default 0.75 M; {no_keep})")
    run.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                     help="policy parameter, value read as JSON (repeatable), e.g. --param alpha=0.3")
    run.add_argument("--frames-per-chunk", type=int, default=2, help="frames per prefill chunk (default 2)")
    run.add_argument("--coverage", action="store_true",
                     help="also stream a full cache and report how well the kept tokens cover it (CoRDS Sec. 4.6)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    comparing = commands.add_parser("compare", help="up to four policies and the full cache side by side on one stream",
                                    parents=[stream], description=COMPARE_DESCRIPTION, epilog=COMPARE_EXAMPLES,
                                    formatter_class=formatter)
    comparing.set_defaults(frames_per_chunk=2, param=[])  # what the checks shared with run read
    comparing.add_argument("--policies", help=named("comma-separated, at most 4", catalog and ",".join(catalog.COMPARE_POLICIES)))
    comparing.add_argument("--budget", "-M", help="M shared by every policy (default: 2/3 of the model's, 64 for tiny)")
    comparing.add_argument("--keep", "-C", help="C shared by the policies that take one (default: 2/3 of the model's, 48 for tiny)")
    comparing.add_argument("--override", action="append", default=[], metavar="'POLICY: M=.. C=.. KEY=VALUE ..'",
                           help="a policy's own budget and parameters (repeatable)")
    comparing.add_argument("--attribution", action="store_true", help="record what each answer looked at (kvdemo.explain)")
    comparing.add_argument("--fidelity", action="store_true", help="per-layer attention-output error and first-token KL "
                           "of each policy against the full cache, per question")
    comparing.add_argument("--full-cap-mb", type=float, default=2048, help="the full cache stops here (default 2048; 0: no cap)")

    bench = commands.add_parser("bench", help="benchmark a bounded policy against the full cache",
                                description=BENCH_DESCRIPTION, epilog=BENCH_EXAMPLES, formatter_class=formatter)
    bench.add_argument("--policy", help=named(f"the bounded policy, {listed}", catalog and catalog.BENCH_POLICY))
    bench.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="policy parameter (repeatable)")
    bench.add_argument("--frames", type=int, default=400, help="synthetic frames to stream (default 400)")
    bench.add_argument("--budget", "-M", type=int, default=1536, help="M for the streaming run (default 1536)")
    bench.add_argument("--keep", "-C", type=int, default=1152, help="C for the streaming run (default 1152)")
    bench.add_argument("--pass-repeats", type=int, default=3, help="repeats of the 7B-shape pass timing (default 3)")
    bench.add_argument("--skip-pass", action="store_true", help="skip the 7B-shape compression pass timing")
    bench.add_argument("--zerogpu", action="store_true",
                       help="also measure what a ZeroGPU call pickles at Qwen2.5-VL-3B's defaults")
    bench.add_argument("--stream-factor", type=int, default=20,
                       help=f"{update_owner}: also time the update on a stream this many times longer (default 20)")
    bench.add_argument("--reference", metavar="PATH",
                       help="the authors' InfiniPot-V kvcache_utils.py (or a clone of aiha-lab/InfiniPot-V): time kvdemo's "
                            "pass against theirs on the same 7B-shape tensors and compare the kept tokens")
    bench.add_argument("--every", type=int, default=1, help="print every Nth chunk of the table (default: all)")
    bench.add_argument("--json", metavar="OUT", help="write the benchmark results here")

    evaluate = commands.add_parser("eval", help="accuracy vs query delay on held-out generated streams",
                                   description=EVAL_DESCRIPTION, epilog=EVAL_EXAMPLES, formatter_class=formatter)
    evaluate.add_argument("--policies", help=named("comma-separated policy names", catalog and ",".join(catalog.EVAL_POLICIES)))
    evaluate.add_argument("--delays", default=",".join(str(d) for d in DEFAULT_DELAYS),
                          help="query delays in seconds of stream time, comma-separated (default 0,4,8,16,32)")
    evaluate.add_argument("--episodes", type=int, default=200, help="held-out streams (default 200)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the held-out streams (default 0)")
    evaluate.add_argument("--kind", choices=EVAL_KINDS, default="static",
                          help="stream kind: static (fixed camera, the default), moving (camera pans and zooms, the "
                               "background drifts, objects reappear) or mixed (the two alternating)")
    evaluate.add_argument("--budget", "-M", default="64",
                          help="M for the bounded policies (visual tokens; default 64: 4 s of a generated stream)")
    evaluate.add_argument("--keep", "-C", help="C for the policies that take one (visual tokens; default 0.75 M)")
    evaluate.add_argument("--model", default="tiny", help="the model (default: the trained tiny model)")
    evaluate.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the tiny model's matrices "
                          "are small, and on a busy machine more threads stall each other)")
    evaluate.add_argument("--questions", choices=QUESTION_FORMS, default="bare",
                          help="bare questions (default) or a benchmark's multiple-choice prompt of them (answer: the letter)")
    evaluate.add_argument("--json", metavar="OUT", help="write the results here")
    evaluate.add_argument("--runs", default="runs", metavar="DIR",
                          help="write the run folder (config, metrics, predictions) under DIR (default runs; '' for none)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bar")

    results = commands.add_parser("results", help="tabulate run folders side by side and chart accuracy vs budget or delay",
                                  description=RESULTS_DESCRIPTION, formatter_class=formatter)
    results.add_argument("folders", nargs="+", metavar="DIR", help="run folders (of kvdemo eval or of --model kvdemo in lmms-eval)")
    results.add_argument("--x", choices=("budget", "delay"), default="budget", help="the chart's x axis (default budget)")
    results.add_argument("--chart", default="kvdemo-results", metavar="PREFIX",
                         help="write PREFIX.html (Plotly) and PREFIX.png (default kvdemo-results; '' for none)")

    tasks = commands.add_parser("make-tasks", help="write offline lmms-eval tasks (VideoMME, OVO-Bench layouts) on generated streams",
                                description=MAKE_TASKS_DESCRIPTION, formatter_class=formatter)
    tasks.add_argument("folder", metavar="DIR", help="where the tasks' data, videos and YAMLs go")
    tasks.add_argument("--streams", type=int, default=8, help="generated streams per task (default 8)")
    tasks.add_argument("--seed", type=int, default=0, help="seed of the streams (default 0)")

    doctor = commands.add_parser("doctor", help="the device checklist (every policy x family on this machine's device)",
                                 description=DOCTOR_DESCRIPTION, epilog=DOCTOR_EXAMPLES, formatter_class=formatter)
    doctor.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    doctor.add_argument("--models", help="comma-separated offline models (default: tiny and one random model per family)")
    doctor.add_argument("--frames", type=int, default=24, help="frames of the bundled sample per run (default 24)")
    doctor.add_argument("--real-shapes", action="store_true",
                        help="also time one compression pass on two layers at Qwen2.5-VL-3B/-7B per-layer shapes")
    doctor.add_argument("--json", metavar="OUT", help="write the checklist's results here")

    train = commands.add_parser("train-tiny", help="train the offline tiny model (~36 min on 2 quiet cores; writes ./tiny-trained)",
                                description=TRAIN_DESCRIPTION, formatter_class=formatter)
    train.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    train.add_argument("--threads", type=int, default=1, help="torch threads (default 1; fixed for reproducibility; "
                       "the next step's streams are generated on a second thread meanwhile)")
    train.add_argument("--out", default="tiny-trained", help="output folder (default ./tiny-trained)")
    train.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    train.add_argument("--from", dest="start", metavar="DIR",
                       help="start from DIR's weights and run the choice stages (VideoMME/OVO-Bench option letters; experimental)")
    train.add_argument("--check-episodes", type=int, default=100, help="held-out streams for the final full-cache check")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    catalog = None
    if "-h" in argv or "--help" in argv:
        from . import policies as catalog  # deferred on purpose: listing the policies imports torch
    args = build_parser(catalog).parse_args(argv)
    try:
        if args.command == "run":
            return run_command(args)
        if args.command == "compare":
            return compare(args)
        if args.command == "eval":
            from .evaluation import eval_command  # deferred on purpose: it loads torch and the model

            check_eval_arguments(args)
            return eval_command(args)
        if args.command == "train-tiny":
            return train_command(args)
        if args.command == "results":
            from .results import results_command  # deferred: plotly for the chart

            try:
                return results_command(args.folders, args.x, args.chart or None)
            except ValueError as exc:  # a folder that is not a run, a chart with nothing to draw
                raise UsageError(str(exc)) from None
        if args.command == "make-tasks":
            from .integrations.local_tasks import make_tasks  # deferred: PyAV writes the videos

            if args.streams <= 0:
                raise UsageError(f"--streams must be positive, got {args.streams}")
            counts = make_tasks(args.folder, args.streams, args.seed)
            folder = Path(args.folder).resolve()
            print(", ".join(f"{task}: {n} rows" for task, n in counts.items()))
            print(f"run: HF_HOME={folder / 'hf'} HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m lmms_eval --model kvdemo "
                  f"--tasks kvdemo_videomme --include_path {folder} --output_path {folder / 'results'}")
            return 0
        if args.command == "doctor":
            from .bench.doctor import doctor  # deferred: the checklist loads torch and the models

            models = [m.strip() for m in args.models.split(",")] if args.models else None
            return 0 if doctor(args.device, models, args.frames, args.real_shapes, json_path=args.json)["ok"] else 1
        from .bench.command import bench_command  # deferred: the benchmarks import torch and transformers
        from .policies import BENCH_POLICY  # deferred with it

        args.policy = args.policy or BENCH_POLICY
        return bench_command(args, dict(parse_param(p) for p in args.param))
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise
        print(f"error: {one_line(str(exc), argv)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def check_run_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """Plain checks of ``run``'s numbers; returns the policy parameters. Raises :class:`UsageError`."""
    positive = {"--fps": args.fps, "--frames-per-chunk": args.frames_per_chunk, "--max-frames": args.max_frames,
                "--max-new-tokens": args.max_new_tokens, "--min-pixels": args.min_pixels,
                "--max-pixels": args.max_pixels}  # M and C: the budget's rule, once the policy is known
    for flag, value in positive.items():
        if value is not None and not value > 0:  # not > 0: also nan
            raise UsageError(f"{flag} must be positive, got {value}")
    # The model's pixel range applies where none is given (checked once the model's family is known).
    if args.min_pixels is not None and args.max_pixels is not None and args.min_pixels > args.max_pixels:
        raise UsageError(f"--min-pixels ({args.min_pixels}) must not exceed --max-pixels ({args.max_pixels})")
    for number, question in enumerate(args.ask, 1):  # the length in tokens is checked once the tokenizer is loaded
        try:
            args.ask[number - 1] = check_question_text(question)
        except QuestionError as exc:
            raise UsageError(f"--ask, question {number}: {exc}") from None
    return dict(parse_param(p) for p in args.param)


def check_questions(model, questions: list[str]) -> None:
    """Each question's length in ``model``'s tokens, checked before the stream (after the model loads: the
    tokenizer comes with it). Raises :class:`UsageError`."""
    for number, question in enumerate(questions, 1):
        try:
            check_question(model, question)
        except QuestionError as exc:
            raise UsageError(f"--ask, question {number}: {exc}") from None


def run_command(args: argparse.Namespace) -> int:
    # Cheapest checks first: the arguments, then the file (PyAV reads its header), then the policy and the
    # budget against one chunk of this video (imports torch), and only then the model (seconds to minutes).
    params = check_run_arguments(args)
    if args.video:
        open_video(Path(args.video), fps=args.fps, max_frames=args.max_frames)  # a bad file fails before torch loads
    from .budget import DEFAULT_KEEP_RATIO, Budget  # deferred from here on: torch loads only once the file is good
    from .policies import DEFAULT_POLICY, make_policy  # deferred with Budget

    policy = make_policy(args.policy or DEFAULT_POLICY, **params)
    if args.keep is not None and args.budget is None and policy.bounded:
        raise UsageError("--keep needs --budget")
    if args.budget is not None:
        Budget.from_user(policy, args.budget, args.keep, DEFAULT_KEEP_RATIO)  # its own rule, before frames are sized

    video, episode, geometry = open_source(args)
    chunk_tokens, shape = geometry.chunk_tokens(video.size, args.frames_per_chunk)
    note = ""
    if policy.bounded and args.budget is None:
        stream_tokens, _ = geometry.chunk_tokens(video.size, video.num_frames)
        budget = Budget.auto(policy, chunk_tokens, stream_tokens)
        note = " (auto: about a third of this stream's visual tokens)"
    else:
        budget = Budget.from_user(policy, args.budget, args.keep, DEFAULT_KEEP_RATIO)
    budget.check_chunk(chunk_tokens, shape)

    from .coverage import coverage, coverage_table  # deferred on purpose: the budget is good, the model comes now
    from .engine import StreamEngine  # deferred with it
    from .models.catalog import caveat_for  # deferred with it
    from .models.loading import load_model  # deferred with it (transformers)
    from .streaming import stream_video  # deferred with it

    model = load_model(args.model)
    check_questions(model, args.ask)
    engine = StreamEngine(model, policy, budget=budget, fps=video.fps, max_new_tokens=args.max_new_tokens)

    print(video.describe(), file=sys.stderr)
    print(f"model {model.name}; policy {policy.name}" + (f", {budget.describe()}{note}" if budget.bounded else ""), file=sys.stderr)
    if model.notice:
        elsewhere = " Its answers about this video mean little." if episode is None and not model.random_weights else ""
        print(f"note: {model.notice}{elsewhere}", file=sys.stderr)
    if caveat := caveat_for(model.family):
        print(f"note: {caveat}", file=sys.stderr)
    engines = {"policy": engine}
    if args.coverage and policy.bounded:
        engines["full"] = StreamEngine(model, "full", fps=video.fps)
    progress = _progress(video.num_frames, args.quiet)
    try:
        for step in stream_video(model, video, engines, args.frames_per_chunk):
            if progress is not None:
                progress.update(step.chunk.frames)
                progress.set_postfix(tokens=engine.memory.visual_tokens, MB=f"{engine.memory.nbytes / 2**20:.1f}")
    except BaseException:
        if progress is not None:
            progress.leave = False  # an error is printed on its own line, not after a stale bar
        raise
    finally:
        if progress is not None:
            progress.close()
    if video.lost_frames:
        print(f"warning: {video.describe()}", file=sys.stderr)

    for question in args.ask:
        print(f"\nQ: {clipped(question)}\nA: ", end="", flush=True)
        for piece in engine.ask(question):
            print(piece, end="", flush=True)
        print(f"   ({grade(episode, question, engine.answers[-1].answer, engine.last_time_s).note})" if episode else "")
    report = engine.report(video=video.describe(), lost_frames=video.lost_frames)
    print(summary_table(report, engine))
    if args.coverage:
        full_memory = engines["full"].memory if "full" in engines else engine.memory
        report["coverage"] = {policy.name: coverage(full_memory, engine.memory)}
        if policy.bounded:
            report["coverage"]["full"] = coverage(full_memory, full_memory)
        print("\ncoverage: cosine distance of every full-cache token to its nearest kept token (lower is better)")
        print(coverage_table(report["coverage"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"report written to {args.json}", file=sys.stderr)
    return 0


def open_source(args: argparse.Namespace):
    """The stream ``args`` name (``--video`` or the bundled ``--sample``), sampled at ``--fps``, cut at
    ``--max-frames`` and sized as ``--model`` sizes frames within the user's pixel range (the trained tiny model
    saw 112 x 112): ``(video, episode or None, geometry)``. The model itself is not loaded."""
    from .models.catalog import geometry_for  # deferred on purpose: the catalog imports torch

    geometry = geometry_for(args.model)
    max_pixels = args.max_pixels or geometry.max_pixels
    if max_pixels < geometry.smallest_frame:
        raise UsageError(f"--max-pixels must be at least {geometry.smallest_frame} (one token of "
                         f"{geometry.factor}x{geometry.factor} pixels), got {max_pixels}")
    if args.min_pixels is not None and args.min_pixels > max_pixels:
        raise UsageError(f"--min-pixels ({args.min_pixels}) must not exceed --max-pixels (the model's {max_pixels})")
    geometry = geometry.with_pixels(args.min_pixels or min(geometry.min_pixels, max_pixels), max_pixels)
    episode = None if args.video else sample_episode(args.sample)
    if episode is None:
        video = open_video(Path(args.video), fps=args.fps, max_frames=args.max_frames, geometry=geometry)
    else:
        video = episode.video.sampled(args.fps).head(args.max_frames).resized(geometry)
    return video, episode, geometry


def compare(args: argparse.Namespace) -> int:
    """``python -m kvdemo compare``: the arguments and the stream checked, then the model loaded (kvdemo.compare)."""
    check_run_arguments(args)
    if args.video:
        open_video(Path(args.video), fps=args.fps, max_frames=args.max_frames)  # a bad file fails before torch loads
    from .compare import (  # deferred on purpose: comparing loads torch and the model
        compare_budget,
        compare_command,
        parse_overrides,
    )
    from .models.catalog import default_budget  # deferred with them
    from .models.loading import load_model  # deferred with it
    from .policies import COMPARE_POLICIES  # deferred with them

    args.policies = args.policies or ",".join(COMPARE_POLICIES)
    if args.budget is None:
        args.budget, default_keep = compare_budget(*default_budget(args.model)[:2])
        args.keep = default_keep if args.keep is None else args.keep
    parse_overrides(args.policies.split(","), "\n".join(args.override))  # a bad choice fails before the model loads
    video, episode, _ = open_source(args)
    model = load_model(args.model)
    check_questions(model, args.ask)
    if model.notice:
        print(f"note: {model.notice}", file=sys.stderr)
    return compare_command(args, model, video, episode)


def _progress(total: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm  # deferred on purpose: only a run with a progress bar needs it

    return tqdm(total=total, unit="frame", desc="streaming", file=sys.stderr, dynamic_ncols=True)


def summary_table(report: dict[str, Any], engine) -> str:
    """The run's summary as aligned rows (``engine``: the :class:`~kvdemo.engine.StreamEngine` that ran)."""
    stats = engine.stats
    rows = [
        ("policy", report["policy"]),
        ("budget M / keep C", budget_text(report)),
        ("frames fed", report["frames"]),
        ("tokens per grid", report["tokens_per_grid"]),
        ("visual tokens now", engine.memory.visual_tokens),
        ("peak visual tokens", report["peak_visual_tokens"]),
        ("peak cache", f"{report['peak_cache_bytes'] / 2**20:.2f} MB"),
        ("compressions", stats.compressions),
        ("vision encode", f"{stats.encode_ms:.0f} ms"),
        ("prefill", f"{stats.prefill_ms:.0f} ms"),
        ("compression", f"{stats.compress_ms:.0f} ms ({_percent(stats.compress_ms, stats.prefill_ms)} of prefill)"),
    ]
    for answer in engine.answers:
        rows.append(("answer", f"{answer.ms:.0f} ms ({answer.tokens} tokens, first after {answer.ttft_ms:.0f} ms)"))
    for key, value in report.get("policy_state", {}).items():
        rows.append((f"{report['policy']}: {key}", json.dumps(value) if isinstance(value, dict) else value))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def budget_text(report: dict[str, Any]) -> str:
    if report["budget"] is None:
        return "unbounded"
    return f"{report['budget']} / {report['keep']}" if report["keep"] is not None else f"{report['budget']} (sized by M alone)"


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def check_eval_arguments(args: argparse.Namespace) -> None:
    """Plain checks of ``eval``'s arguments; ``--policies``/``--delays`` become lists. Raises :class:`UsageError`."""
    if args.policies is None:
        from .policies import EVAL_POLICIES  # deferred on purpose: the policies import torch

        args.policies = ",".join(EVAL_POLICIES)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policies:
        raise UsageError("--policies names no policy")
    try:
        args.delays = tuple(float(d) for d in args.delays.split(",") if d.strip())
    except ValueError:
        raise UsageError(f"--delays takes seconds separated by commas, got {args.delays!r}") from None
    if not args.delays or min(args.delays) < 0:
        raise UsageError(f"--delays must be non-negative seconds, got {args.delays}")
    for flag, value in {"--episodes": args.episodes, "--threads": args.threads}.items():
        if value is not None and value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")


def train_command(args: argparse.Namespace) -> int:
    """Train the tiny model, check it on held-out streams (full cache, every default delay, bare and
    multiple-choice questions), save it."""
    import torch  # deferred on purpose (as every heavy import of the CLI): training loads torch and transformers

    from .evaluation import evaluate  # deferred with torch
    from .training import CHOICE_STAGES, RECIPE, train_tiny  # deferred with torch

    if args.threads <= 0 or args.check_episodes < 0:
        raise UsageError("--threads must be positive and --check-episodes non-negative")
    out = Path(args.out)
    if (out / "model.safetensors").exists() and not args.overwrite:
        raise UsageError(f"{out} already holds a model: pass another --out, or --overwrite to replace it")
    start = Path(args.start) if args.start else None
    if start is not None and not (start / "model.safetensors").exists():
        raise UsageError(f"--from {start}: no model.safetensors there")
    stages = tuple(replace(stage, seed=args.seed, threads=args.threads) for stage in (CHOICE_STAGES if start else RECIPE))
    load_before = os.getloadavg()
    trainer, record = train_tiny(stages, out=None, progress=not args.quiet, start=start)
    record["load_average_before"], record["load_average_after"] = list(load_before), list(os.getloadavg())
    minutes = record["train_seconds"] / 60
    print(f"trained in {minutes:.1f} min, {record['train_cpu_seconds'] / 60:.1f} CPU-min ({args.threads} threads; "
          f"1-min load average {load_before[0]:.2f} before, {record['load_average_after'][0]:.2f} after)", file=sys.stderr)
    if args.check_episodes:
        torch.set_num_threads(args.threads)
        record["check"] = {}
        for kind in STREAM_KINDS:
            for questions in QUESTION_FORMS:
                # Seed + 1: other held-out streams than the benchmark's default seed 0.
                check = evaluate(trainer.adapter, ["full"], episodes=args.check_episodes, seed=args.seed + 1,
                                 progress=not args.quiet, kind=kind, questions=questions)
                key = kind if questions == "bare" else f"{kind} {questions}"
                record["check"][key] = {k: check[k] for k in ("accuracy", "by_kind", "questions", "chance", "episodes")}
                row = check["accuracy"]["full"]
                print(f"held-out full-cache accuracy by delay, {kind} streams, {questions} questions: "
                      + ", ".join(f"{d} s {a:.3f}" for d, a in row.items())
                      + f" ({check['questions']['total']} questions, chance {check['chance']:.3f})")
    folder = trainer.save(out, record)
    print(f"weights, config and tokenizer written to {folder}", file=sys.stderr)
    return 0
