"""python -m kvdemo run|compare|bench|eval|doctor|train-tiny: stream a video under a KV-cache budget from the command
line, compare policies on one stream, measure the policies' accuracy vs query delay, check a device, train the offline
tiny model. The parser is :mod:`kvdemo.usage`, each command's options and help texts :mod:`kvdemo.subcommands`.

Arguments and the video file are checked before torch, transformers or a model load, so a mistake is
reported at once. Errors a user can cause (bad file, impossible budget, unknown policy) print one line
and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bench import write_json  # light: json and pathlib
from .dialogue import QuestionError, check_question, check_question_text, clipped  # light: no torch
from .errors import StreamSettingError, UserError  # light: imports nothing
from .experiments.evaluation import QUESTION_FORMS  # light: torch loads when an evaluation runs
from .live_run import ask_schedule, is_live, run_live  # light: the live session loads with the model
from .media.video import Video, VideoFile, open_video, sampling_fps  # light: numpy and, when a file is opened, PyAV
from .pruning import entry_label, parse_prune, split_entry  # light: the choice as text
from .usage import UsageError, build_parser, one_line, parse_param  # the grammar: parser, help texts
from .world.synthetic import STREAM_KINDS, Episode, grade, sample_episode  # light: numpy

if TYPE_CHECKING:  # types only: these import torch, which the CLI loads after its checks
    from .cache.budget import Budget
    from .models.base import VideoLM
    from .policies import Policy
    from .stream.engine import StreamEngine


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
            from .experiments.eval_command import eval_command  # deferred on purpose: it loads torch and the model

            check_eval_arguments(args)
            return eval_command(args)
        if args.command == "train-tiny":
            return train_command(args)
        if args.command == "results":
            from .experiments.results import results_command  # deferred: plotly for the chart

            try:
                return results_command(args.folders, args.x, args.chart or None)
            except ValueError as exc:  # a folder that is not a run, a chart with nothing to draw
                raise UsageError(str(exc)) from None
        if args.command == "make-tasks":
            from .integrations.local_tasks import make_tasks_command  # deferred: PyAV writes the videos

            return make_tasks_command(args)
        if args.command == "doctor":
            from .bench.doctor import doctor_command  # deferred: the checklist loads torch and the models

            return doctor_command(args)
        from .bench.command import bench_command  # deferred: the benchmarks import torch and transformers
        from .policies import BENCH_POLICY  # deferred with it

        args.policy = args.policy or BENCH_POLICY
        args.prune = parse_prune(args.prune, "--prune")
        return bench_command(args, dict(parse_param(p) for p in args.param))
    except UserError as exc:
        print(f"error: {one_line(str(exc), argv)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def check_run_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """Plain checks of ``run``'s numbers; returns the policy parameters. Raises :class:`UsageError`."""
    try:
        args.fps = sampling_fps(args.fps)
    except StreamSettingError as exc:
        raise UsageError(f"--fps: {exc}") from None
    positive = {
        "--frames-per-chunk": args.frames_per_chunk,
        "--max-frames": args.max_frames,
        "--max-new-tokens": args.max_new_tokens,
        "--min-pixels": args.min_pixels,
        "--max-pixels": args.max_pixels,
    }  # M and C: the budget's rule, once the policy is known
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
    args.prune = parse_prune(args.prune, "--prune")
    ask_schedule(args)
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
    """``python -m kvdemo run``: the checks (:func:`check_run`), then the model, the stream, the answers to
    ``--ask`` and the report."""
    policy, budget, note, video, episode = check_run(args)
    from .models.catalog import caveat_for  # deferred on purpose: the budget is good, the model comes now
    from .models.loading import load_model  # deferred with it (transformers)
    from .stream.lineup import Contender, make_engines  # deferred with it

    model = load_model(args.model)
    check_questions(model, args.ask)
    studied = Contender(policy.name, policy=policy, budget=budget, prune=args.prune)
    engines = make_engines(
        model,
        [studied],
        fps=video.fps,
        max_new_tokens=args.max_new_tokens,
        baseline=bool(args.coverage and (policy.bounded or args.prune)),
    )
    engine = engines[studied.label]

    print(video.describe(), file=sys.stderr)
    print(
        f"model {model.name}; policy {policy.name}"
        + (f", {budget.describe()}{note}" if budget.bounded else "")
        + (f"; pruning before the LLM: {args.prune.text}" if args.prune else ""),
        file=sys.stderr,
    )
    if model.notice:
        elsewhere = " Its answers about this video mean little." if episode is None and not model.random_weights else ""
        print(f"note: {model.notice}{elsewhere}", file=sys.stderr)
    if caveat := caveat_for(model.family):
        print(f"note: {caveat}", file=sys.stderr)
    live = is_live(args) and run_live(args, model, video, engines, engine, episode, _progress)
    if not live:  # a live run asked the questions while the stream played
        stream_with_progress(model, video, engines, engine, args.frames_per_chunk, args.quiet)
    if video.lost_frames:
        print(f"warning: {video.describe()}", file=sys.stderr)
    return answer_and_report(args, policy, engines, engine, video, episode, live or None)


def check_run(args: argparse.Namespace) -> tuple[Policy, Budget, str, Video | VideoFile, Episode | None]:
    """``run``'s checks, cheapest first: the arguments, then the file (PyAV reads its header), then the policy and
    the budget, resolved and sized for this video's chunks (imports torch); the model is not loaded. Returns the
    policy, its budget, a note on how the budget was chosen, and :func:`open_source`'s video and episode."""
    params = check_run_arguments(args)
    if args.video:
        open_video(Path(args.video), fps=args.fps, max_frames=args.max_frames)  # a bad file fails before torch loads
    from .cache.budget import DEFAULT_KEEP_RATIO, Budget, auto_budget  # deferred: torch loads once the file is good
    from .policies import DEFAULT_POLICY, make_policy  # deferred with Budget

    policy = make_policy(args.policy or DEFAULT_POLICY, **params)
    if args.keep is not None and args.budget is None and policy.bounded:
        raise UsageError("--keep needs --budget")
    # The user's M and C, resolved once (before frames are sized); an M left out is derived from the stream below.
    typed = args.budget is not None or not policy.bounded
    budget = Budget.resolve(policy, args.budget, args.keep, default_ratio=DEFAULT_KEEP_RATIO) if typed else None

    video, episode, geometry = open_source(args)
    chunk_tokens, shape = geometry.chunk_tokens(video.size, args.frames_per_chunk)
    note = ""
    if budget is None:
        budget = auto_budget(policy, chunk_tokens, geometry.chunk_tokens(video.size, video.num_frames)[0])
        note = " (auto: about a third of this stream's visual tokens)"
    budget = budget.sized(policy, chunk_tokens, shape, args.frames_per_chunk / args.fps)  # before the model loads
    return policy, budget, note, video, episode


def stream_with_progress(
    model: VideoLM,
    video: Video | VideoFile,
    engines: dict[str, StreamEngine],
    engine: StreamEngine,
    frames_per_chunk: int,
    quiet: bool,
) -> None:
    """Stream ``video`` into ``engines`` (``engine``'s tokens and bytes on the progress bar unless ``quiet``)."""
    from .stream.streaming import stream_video  # deferred on purpose: it imports torch

    progress = _progress(video.num_frames, quiet)
    try:
        for step in stream_video(model, video, engines, frames_per_chunk):
            if progress is not None:
                progress.update(step.chunk.frames)
                progress.set_postfix(tokens=engine.memory.held_tokens, MB=f"{engine.memory.nbytes / 2**20:.1f}")
    except BaseException:
        if progress is not None:
            progress.leave = False  # an error is printed on its own line, not after a stale bar
        raise
    finally:
        if progress is not None:
            progress.close()


def answer_and_report(
    args: argparse.Namespace,
    policy: Policy,
    engines: dict[str, StreamEngine],
    engine: StreamEngine,
    video: Video | VideoFile,
    episode: Episode | None,
    live: dict[str, Any] | None = None,
) -> int:
    """Ask ``engine`` every ``--ask`` question (graded on the sample) unless a ``live`` run asked them, print the
    summary and, with ``--coverage``, how well the kept tokens cover the full cache; write ``--json``."""
    from .analysis.coverage import coverage, coverage_table  # deferred on purpose: it imports torch

    for number, question in enumerate([] if live else args.ask):
        print(f"\nQ: {clipped(question)}\nA: ", end="", flush=True)
        for piece in engine.ask(question):
            print(piece, end="", flush=True)
        answer, earlier = engine.answers[-1].answer, args.ask[:number]  # "And the diamond?" follows what was asked
        print(f"   ({grade(episode, question, answer, engine.last_time_s, earlier).note})" if episode else "")
    report = engine.report(video=video.describe(), lost_frames=video.lost_frames) | ({"live": live} if live else {})
    print(summary_table(report, engine))
    if args.coverage:
        full_memory = engines["full"].memory if "full" in engines else engine.memory
        studied = next(name for name, candidate in engines.items() if candidate is engine)
        report["coverage"] = {studied: coverage(full_memory, engine.memory)}
        if "full" in engines:
            report["coverage"]["full"] = coverage(full_memory, full_memory)
        print("\ncoverage: cosine distance of every full-cache token to its nearest kept token (lower is better)")
        print(coverage_table(report["coverage"]))
    if args.json:
        write_json(args.json, report)
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
        raise UsageError(
            f"--max-pixels must be at least {geometry.smallest_frame} (one token of "
            f"{geometry.factor}x{geometry.factor} pixels), got {max_pixels}"
        )
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
    """``python -m kvdemo compare``: the arguments, the file, the policies and budgets (torch), each budget sized for one
    chunk (the model's family sizes it), then the model (kvdemo.experiments.compare)."""
    check_run_arguments(args)
    if args.video:
        open_video(Path(args.video), fps=args.fps, max_frames=args.max_frames)  # a bad file fails before torch loads
    from .experiments.compare import (  # deferred on purpose: comparing loads torch and the model
        compare_budget,
        compare_command,
        compare_lineup,
        parse_overrides,
    )
    from .policies import COMPARE_POLICIES  # deferred with them
    from .stream.lineup import lineup_budgets  # deferred with them

    args.policies = args.policies or ",".join(COMPARE_POLICIES)
    contenders = parse_overrides(args.policies.split(","), "\n".join(args.override), args.prune)  # names, lines first
    if args.budget is not None:
        lineup_budgets(contenders, args.budget, args.keep, baseline=True)  # M and C before the family is looked up
    else:
        from .models.catalog import default_budget  # deferred: the model's family gives the default

        args.budget, default_keep = compare_budget(*default_budget(args.model)[:2])
        args.keep = default_keep if args.keep is None else args.keep
    video, episode, geometry = open_source(args)
    tokens, shape = geometry.chunk_tokens(video.size, 2)
    contenders = compare_lineup(contenders, args.budget, args.keep, tokens, shape, 2 / args.fps)  # resolved, sized
    from .models.catalog import chosen_model_name  # deferred: everything the user typed is good, the model comes now
    from .models.loading import load_model  # deferred with it

    if not args.quiet:
        print(f"loading model {chosen_model_name(args.model)}", file=sys.stderr)
    model = load_model(args.model)
    check_questions(model, args.ask)
    if model.notice:
        print(f"note: {model.notice}", file=sys.stderr)
    return compare_command(
        args, model, video, contenders, episode, None if args.quiet else lambda: _progress(video.num_frames, False)
    )


def _progress(total: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm  # deferred on purpose: only a run with a progress bar needs it

    return tqdm(total=total, unit="frame", desc="streaming", file=sys.stderr, dynamic_ncols=True)


def summary_table(report: dict[str, Any], engine) -> str:
    """The run's summary as aligned rows (``engine``: the :class:`~kvdemo.stream.engine.StreamEngine` that ran)."""
    stats, slots = engine.stats, report["summary_slots"]
    rows = [
        ("policy", report["policy"]),
        ("budget M / keep C", budget_text(report)),
        ("frames fed", report["frames"]),
        ("tokens per grid", report["tokens_per_grid"]),
        ("visual tokens held", engine.memory.held_tokens),
        ("peak visual tokens held", report["peak_visual_tokens"] - slots),
        *([("summary slots", f"{slots} reserved in M, {engine.memory.summary_active} in use")] if slots else []),
        ("peak cache", f"{report['peak_cache_bytes'] / 2**20:.2f} MB"),
        ("compressions", stats.compressions),
        ("vision encode", f"{stats.encode_ms:.0f} ms"),
        ("prefill", f"{stats.prefill_ms:.0f} ms"),
        ("compression", compression_text(stats)),
    ]
    if engine.pruning is not None:
        rows.append(("pruning before the LLM", engine.pruning.describe()))
        rows.append(("pruning selection", f"{engine.pruning.ms:.0f} ms"))
    for answer in engine.answers:
        rows.append(("answer", f"{answer.ms:.0f} ms ({answer.tokens} tokens, first after {answer.ttft_ms:.0f} ms)"))
    for key, value in report.get("policy_state", {}).items():
        rows.append((f"{report['policy']}: {key}", json.dumps(value) if isinstance(value, dict) else value))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def budget_text(report: dict[str, Any]) -> str:
    if report["budget"] is None:
        return "unbounded"
    return (
        f"{report['budget']} / {report['keep']}"
        if report["keep"] is not None
        else f"{report['budget']} (sized by M alone)"
    )


def compression_text(stats) -> str:
    """The compression row: total time, and one pass as a share of one chunk's prefill (first chunk's warm-up apart)."""
    if not stats.compressions:
        return "none"
    share = f", one pass {stats.pass_ms:.1f} ms"
    if stats.pass_share is not None:
        share += f" = {100 * stats.pass_share:.1f}% of one chunk's prefill ({stats.chunk_prefill_ms:.1f} ms"
        share += ", the first chunk's warm-up left out)" if stats.chunks > 1 else ")"
    return f"{stats.compress_ms:.0f} ms in {stats.compressions} pass(es){share}"


def check_eval_arguments(args: argparse.Namespace) -> None:
    """Plain checks of ``eval``'s arguments; ``--policies``/``--delays`` become lists. Raises :class:`UsageError`."""
    if args.policies is None:
        from .policies import EVAL_POLICIES  # deferred on purpose: the policies import torch

        args.policies = ",".join(EVAL_POLICIES)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policies:
        raise UsageError("--policies names no policy")
    shared = parse_prune(args.prune, "--prune")
    entries = [split_entry(p, "--policies") for p in args.policies]  # a bad pruning choice fails here, before torch
    args.policies = [entry_label(shared, p) if own is None else p for (own, _), p in zip(entries, args.policies)]
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

    from .experiments.evaluation import evaluate  # deferred with torch
    from .world.curriculum import CHOICE_STAGES, RECIPE  # deferred with torch (it is the trainer's)
    from .world.training import train_tiny  # deferred with torch

    if args.threads <= 0 or args.check_episodes < 0:
        raise UsageError("--threads must be positive and --check-episodes non-negative")
    out = Path(args.out)
    if (out / "model.safetensors").exists() and not args.overwrite:
        raise UsageError(f"{out} already holds a model: pass another --out, or --overwrite to replace it")
    start = Path(args.start) if args.start else None
    if start is not None and not (start / "model.safetensors").exists():
        raise UsageError(f"--from {start}: no model.safetensors there")
    stages = tuple(
        replace(stage, seed=args.seed, threads=args.threads) for stage in (CHOICE_STAGES if start else RECIPE)
    )
    load_before = os.getloadavg()
    trainer, record = train_tiny(stages, out=None, progress=not args.quiet, start=start)
    record["load_average_before"], record["load_average_after"] = list(load_before), list(os.getloadavg())
    minutes = record["train_seconds"] / 60
    print(
        f"trained in {minutes:.1f} min, {record['train_cpu_seconds'] / 60:.1f} CPU-min ({args.threads} threads; "
        f"1-min load average {load_before[0]:.2f} before, {record['load_average_after'][0]:.2f} after)",
        file=sys.stderr,
    )
    if args.check_episodes:
        torch.set_num_threads(args.threads)
        record["check"] = {}
        for kind in STREAM_KINDS:
            for questions in QUESTION_FORMS:
                # Seed + 1: other held-out streams than the benchmark's default seed 0.
                check = evaluate(
                    trainer.adapter,
                    ["full"],
                    episodes=args.check_episodes,
                    seed=args.seed + 1,
                    progress=not args.quiet,
                    kind=kind,
                    questions=questions,
                )
                key = kind if questions == "bare" else f"{kind} {questions}"
                record["check"][key] = {k: check[k] for k in ("accuracy", "by_kind", "questions", "chance", "episodes")}
                row = check["accuracy"]["full"]
                print(
                    f"held-out full-cache accuracy by delay, {kind} streams, {questions} questions: "
                    + ", ".join(f"{d} s {a:.3f}" for d, a in row.items())
                    + f" ({check['questions']['total']} questions, chance {check['chance']:.3f})"
                )
    folder = trainer.save(out, record)
    print(f"weights, config and tokenizer written to {folder}", file=sys.stderr)
    return 0
