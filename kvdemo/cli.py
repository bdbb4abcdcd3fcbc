"""``python -m kvdemo run|bench``: stream a video under a KV budget from the command line.

Errors a user can cause (bad file, impossible budget, unknown policy) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .coverage import coverage, coverage_table
from .engine import EngineError, StreamEngine, auto_budget, stream_video
from .evaluation import DEFAULT_DELAYS, DEFAULT_POLICIES
from .models.qwen_vl import ModelError, load_model
from .models.tiny import TRAINED_DIR
from .policies import BudgetError, make_policy, policy_names
from .synthetic import grade, sample_episode
from .video import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, VideoError, open_video, tokens_per_grid

USER_ERRORS = (VideoError, BudgetError, EngineError, ModelError)


def parse_param(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as JSON when it parses (numbers, true/false), else as text."""
    if "=" not in text:
        raise BudgetError(f"--param takes key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().replace("-", "_"), value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvdemo", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="stream a video through one policy (and optionally ask questions)")
    run.add_argument("--video", help="video file (mp4, mkv, mov, webm, avi); default: the bundled sample (a generated stream)")
    run.add_argument("--policy", default="uniform", help=f"one of: {', '.join(policy_names())} (default uniform)")
    run.add_argument("--budget", "-M", type=int, help="M: max visual tokens held (default: auto for this video)")
    run.add_argument("--keep", "-C", type=int, help="C: visual tokens kept by a compression (default 0.75 M)")
    run.add_argument("--param", action="append", default=[], help="policy parameter key=value (repeatable)")
    run.add_argument("--model", help="tiny, auto, or a Hugging Face id / local path (default: $KVDEMO_MODEL or auto)")
    run.add_argument("--fps", type=float, default=2.0, help="sampling fps (default 2)")
    run.add_argument("--max-frames", type=int, help="stop after this many sampled frames")
    run.add_argument("--max-pixels", type=int, help=f"max pixels per frame after resize (default: the model's; Qwen {DEFAULT_MAX_PIXELS})")
    run.add_argument("--min-pixels", type=int, help=f"min pixels per frame after resize (default: the model's; Qwen {DEFAULT_MIN_PIXELS})")
    run.add_argument("--frames-per-chunk", type=int, default=2, help="frames per prefill chunk (default 2)")
    run.add_argument("--ask", action="append", default=[], help="question asked after the stream (repeatable)")
    run.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap (default 64)")
    run.add_argument("--json", help="write the run report here")
    run.add_argument(
        "--coverage",
        action="store_true",
        help="also stream a full cache and report how well the kept tokens cover it (CoRDS Sec. 4.6)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    bench = commands.add_parser("bench", help="benchmark a bounded policy against the full cache")
    bench.add_argument("--policy", default="sliding-window", help="the bounded policy (default sliding-window)")
    bench.add_argument("--param", action="append", default=[], help="policy parameter key=value (repeatable)")
    bench.add_argument("--frames", type=int, default=400, help="synthetic frames to stream (default 400)")
    bench.add_argument("--budget", "-M", type=int, default=1536, help="M for the streaming run (default 1536)")
    bench.add_argument("--keep", "-C", type=int, default=1152, help="C for the streaming run (default 1152)")
    bench.add_argument("--pass-repeats", type=int, default=3, help="repeats of the 7B-shape pass timing (default 3)")
    bench.add_argument("--skip-pass", action="store_true", help="skip the 7B-shape compression pass timing")
    bench.add_argument("--every", type=int, default=1, help="print every Nth chunk of the table (default: all)")
    bench.add_argument("--json", help="write the benchmark results here")

    evaluate = commands.add_parser("eval", help="accuracy vs query delay on held-out generated streams (ProtoKV's protocol)")
    evaluate.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated policy names")
    evaluate.add_argument("--delays", default=",".join(str(d) for d in DEFAULT_DELAYS), help="query delays in seconds (comma-separated)")
    evaluate.add_argument("--episodes", type=int, default=200, help="held-out streams (default 200)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the held-out streams (default 0)")
    evaluate.add_argument("--budget", "-M", type=int, help="M for the bounded policies (visual tokens)")
    evaluate.add_argument("--keep", "-C", type=int, help="C for the policies that take one (visual tokens)")
    evaluate.add_argument("--model", default="tiny", help="the model (default: the trained tiny model)")
    evaluate.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the tiny model's matrices are "
                          "small, and on a busy machine more threads stall each other)")
    evaluate.add_argument("--json", help="write the results here")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bar")

    train = commands.add_parser("train-tiny", help="train the offline tiny model from scratch (writes assets/tiny)")
    train.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    train.add_argument("--threads", type=int, default=1, help="torch threads (default 1; fixed for reproducibility; "
                       "streams are generated on a second thread meanwhile)")
    train.add_argument("--out", default=str(TRAINED_DIR), help="output folder (default assets/tiny)")
    train.add_argument("--check-episodes", type=int, default=100, help="held-out streams for the final full-cache check")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return run_command(args)
        if args.command == "eval":
            from .evaluation import eval_command

            return eval_command(args)
        if args.command == "train-tiny":
            return train_command(args)
        from .bench import bench_command

        return bench_command(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run_command(args: argparse.Namespace) -> int:
    policy = make_policy(args.policy, **dict(parse_param(p) for p in args.param))
    if args.keep is not None and args.budget is None and policy.bounded:
        raise BudgetError("--keep needs --budget")
    if args.frames_per_chunk <= 0:
        raise BudgetError(f"--frames-per-chunk must be positive, got {args.frames_per_chunk}")
    if args.video:
        open_video(args.video, fps=args.fps, max_frames=args.max_frames)  # a bad file fails before a model loads
    model = load_model(args.model)
    min_pixels, max_pixels = args.min_pixels or model.min_pixels, args.max_pixels or model.max_pixels
    episode = None if args.video else sample_episode()
    if episode is None:
        video = open_video(args.video, fps=args.fps, max_frames=args.max_frames, min_pixels=min_pixels, max_pixels=max_pixels)
    else:
        video = episode.video.head(args.max_frames).resized(min(min_pixels, max_pixels), max_pixels)
    per_grid = tokens_per_grid(video.size)
    grids_per_chunk = -(-args.frames_per_chunk // model.temporal_patch_size)
    budget, keep = args.budget, args.keep
    note = ""
    if policy.bounded and budget is None:
        total = -(-video.num_frames // model.temporal_patch_size) * per_grid
        budget, keep = auto_budget(per_grid * grids_per_chunk, total)
        note = " (auto: about a third of this stream's visual tokens)"
    elif policy.bounded and keep is None:
        keep = int(budget * 0.75)
    engine = StreamEngine(model, policy, budget=budget, keep=keep, fps=video.fps, max_new_tokens=args.max_new_tokens)

    print(video.describe(), file=sys.stderr)
    print(f"model {model.name}; policy {policy.name}" + (f", M={budget}, C={keep}{note}" if policy.bounded else ""), file=sys.stderr)
    if model.notice:
        elsewhere = " Its answers about this video mean little." if episode is None and not model.random_weights else ""
        print(f"note: {model.notice}{elsewhere}", file=sys.stderr)
    engines = {"policy": engine}
    if args.coverage and policy.bounded:
        engines["full"] = StreamEngine(model, "full", fps=video.fps)
    progress = _progress(video.num_frames, args.quiet)
    for step in stream_video(model, video, engines, args.frames_per_chunk):
        if progress is not None:
            progress.update(step.chunk.frames)
            progress.set_postfix(tokens=engine.memory.visual_tokens, MB=f"{engine.memory.nbytes / 2**20:.1f}")
    if progress is not None:
        progress.close()
    if video.lost_frames:
        print(f"warning: {video.describe()}", file=sys.stderr)

    for question in args.ask:
        print(f"\nQ: {question}\nA: ", end="", flush=True)
        for piece in engine.ask(question):
            print(piece, end="", flush=True)
        print(f"   ({grade(episode, question, engine.answers[-1].answer, engine.last_time_s).note})" if episode else "")
    report = engine.report()
    report["video"] = video.describe()
    report["lost_frames"] = video.lost_frames
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


def _progress(total: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="frame", desc="streaming", file=sys.stderr, dynamic_ncols=True)


def summary_table(report: dict[str, Any], engine: StreamEngine) -> str:
    stats = engine.stats
    rows = [
        ("policy", report["policy"]),
        ("budget M / keep C", f"{report['budget']} / {report['keep']}" if report["keep"] else "unbounded"),
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
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def train_command(args: argparse.Namespace) -> int:
    """Train the tiny model, check it on held-out streams (full cache, every default delay), save it."""
    import os

    from .evaluation import evaluate
    from .training import TrainConfig, train_tiny

    if args.threads <= 0 or args.check_episodes < 0:
        raise BudgetError("--threads must be positive and --check-episodes non-negative")
    load_before = os.getloadavg()
    trainer, record = train_tiny(TrainConfig(seed=args.seed, threads=args.threads), out=None, progress=not args.quiet)
    record["load_average_before"], record["load_average_after"] = list(load_before), list(os.getloadavg())
    minutes = record["train_seconds"] / 60
    print(f"trained in {minutes:.1f} min, {record['train_cpu_seconds'] / 60:.1f} CPU-min ({args.threads} threads; "
          f"1-min load average {load_before[0]:.2f} before, {record['load_average_after'][0]:.2f} after)", file=sys.stderr)
    if args.check_episodes:
        import torch

        torch.set_num_threads(args.threads)
        # Seed + 1: other held-out streams than the benchmark's default seed 0.
        check = evaluate(trainer.adapter, ["full"], episodes=args.check_episodes, seed=args.seed + 1, progress=not args.quiet)
        record["check"] = {key: check[key] for key in ("accuracy", "by_kind", "questions", "chance", "episodes")}
        row = check["accuracy"]["full"]
        print("held-out full-cache accuracy by delay: " + ", ".join(f"{d} s {a:.3f}" for d, a in row.items())
              + f" ({check['questions']['total']} questions, chance {check['chance']:.3f})")
    folder = trainer.save(Path(args.out), record)
    print(f"weights, config and tokenizer written to {folder}", file=sys.stderr)
    return 0
