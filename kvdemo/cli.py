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
from .models.qwen_vl import ModelError, load_model
from .models.tiny import RANDOM_WEIGHTS_NOTICE
from .policies import BudgetError, make_policy, policy_names
from .video import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, VideoError, open_video, sample_video_path, tokens_per_grid

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
    run.add_argument("--video", help="video file (mp4, mkv, mov, webm, avi); default: the bundled sample")
    run.add_argument("--policy", default="uniform", help=f"one of: {', '.join(policy_names())} (default uniform)")
    run.add_argument("--budget", "-M", type=int, help="M: max visual tokens held (default: auto for this video)")
    run.add_argument("--keep", "-C", type=int, help="C: visual tokens kept by a compression (default 0.75 M)")
    run.add_argument("--param", action="append", default=[], help="policy parameter key=value (repeatable)")
    run.add_argument("--model", help="tiny, auto, or a Hugging Face id / local path (default: $KVDEMO_MODEL or auto)")
    run.add_argument("--fps", type=float, default=2.0, help="sampling fps (default 2)")
    run.add_argument("--max-frames", type=int, help="stop after this many sampled frames")
    run.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="max pixels per frame after resize")
    run.add_argument("--min-pixels", type=int, default=DEFAULT_MIN_PIXELS, help="min pixels per frame after resize")
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
    bench.add_argument("--stream-factor", type=int, default=20,
                       help="protokv: also time the update on a stream this many times longer (default 20)")
    bench.add_argument("--every", type=int, default=1, help="print every Nth chunk of the table (default: all)")
    bench.add_argument("--json", help="write the benchmark results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return run_command(args)
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
    path = Path(args.video) if args.video else sample_video_path()
    video = open_video(path, fps=args.fps, max_frames=args.max_frames, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    model = load_model(args.model)
    per_grid = tokens_per_grid(video.size)
    grids_per_chunk = -(-args.frames_per_chunk // model.temporal_patch_size)
    budget, keep = args.budget, args.keep
    note = ""
    if policy.bounded and budget is None:
        total = -(-video.num_frames // model.temporal_patch_size) * per_grid
        budget, keep = auto_budget(per_grid * grids_per_chunk, total)
        keep = keep if policy.uses_keep else None
        note = " (auto: about a third of this stream's visual tokens)"
    elif policy.bounded and policy.uses_keep and keep is None:
        keep = int(budget * 0.75)
    engine = StreamEngine(model, policy, budget=budget, keep=keep, fps=video.fps, max_new_tokens=args.max_new_tokens)

    print(video.describe(), file=sys.stderr)
    sizes = f", M={budget}" + (f", C={keep}" if keep is not None else "") + note
    print(f"model {model.name}; policy {policy.name}" + (sizes if policy.bounded else ""), file=sys.stderr)
    if model.random_weights:
        print(f"note: {RANDOM_WEIGHTS_NOTICE}", file=sys.stderr)
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
        print()
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
