"""``python -m kvdemo run --realtime`` / ``--ask-at``: the video played into a live session (:mod:`kvdemo.stream.live`)
at its own pace (:mod:`kvdemo.stream.playback`), the questions asked at their stream seconds without pausing it, each
answer printed with the lag behind live. :mod:`kvdemo.cli` checks the arguments here before the model loads (:func:`ask_schedule`) and runs
:func:`run_live` in place of the plain stream; the summary, coverage and ``--json`` stay the run's own."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .dialogue import clipped
from .usage import UsageError
from .world.synthetic import Episode, grade

if TYPE_CHECKING:  # types only: these import torch, which the CLI loads after its checks
    from .media.video import Video, VideoFile
    from .models.base import VideoLM
    from .stream.engine import StreamEngine


def is_live(args: argparse.Namespace) -> bool:
    """Whether ``run`` plays its stream live (``--realtime`` or ``--ask-at``)."""
    return bool(args.realtime or args.ask_at is not None)


def ask_schedule(args: argparse.Namespace) -> list[tuple[float, str]]:
    """``(stream second, question)`` for each question of a live run (``--ask-at``; without it every question comes
    when the stream ends); raises :class:`UsageError` for seconds that do not pair with the questions."""
    at, bound = getattr(args, "ask_at", None), getattr(args, "max_waiting", 1.0)  # compare has neither
    if not bound > 0:  # not > 0: also nan
        raise UsageError(f"--max-waiting must be positive, got {args.max_waiting}")
    if at is None:
        return [(float("inf"), question) for question in args.ask]
    if not args.ask:
        raise UsageError("--ask-at needs a question: give --ask")
    if len(args.ask) != 1 and len(at) != len(args.ask):
        raise UsageError(
            f"--ask-at gives {len(at)} seconds for {len(args.ask)} questions: one second per question, or one question"
        )
    questions = args.ask * len(at) if len(args.ask) == 1 else args.ask
    return list(zip(at, questions))


def run_live(
    args: argparse.Namespace,
    model: VideoLM,
    video: Video | VideoFile,
    engines: dict[str, StreamEngine],
    engine: StreamEngine,
    episode: Episode | None,
    progress_bar: Callable[[int, bool], Any],
) -> dict[str, Any]:
    """Play ``video`` into a live session over ``engines``, asking each ``--ask`` question at its ``--ask-at`` second
    (``engine``'s answers printed, graded on the bundled sample, with the lag behind live under ``--realtime``;
    ``progress_bar(total, quiet)``: the CLI's bar, or None); returns the session's report (the run report's ``live`` section)."""
    from .stream.live import TOKENS_PER_TURN, LiveSession  # deferred on purpose: torch, with the model
    from .stream.playback import play  # deferred with it

    live = LiveSession(
        model,
        engines,
        video.fps,
        frames_per_chunk=args.frames_per_chunk,
        tokens_per_turn=None if args.pause_to_answer else TOKENS_PER_TURN,
        max_waiting_s=args.max_waiting,
    )
    name = next(name for name, candidate in engines.items() if candidate is engine)
    progress, earlier = progress_bar(video.num_frames, args.quiet), []  # earlier: what was asked ("And the diamond?")
    try:
        for event in play(live, video.chunks(args.frames_per_chunk), ask_schedule(args), args.realtime):
            if event.kind == "chunk" and progress is not None:
                progress.update(event.lag.frames - progress.n)
                progress.set_postfix(tokens=engine.memory.held_tokens, lag=f"{live.lag():.2f}s" * args.realtime)
            elif event.kind == "answered":
                answer, at = event.answer.answers[name], event.answer.stream_s
                seen = min(at, engine.last_time_s)
                note = grade(episode, answer.question, answer.answer, seen, earlier) if episode else None
                earlier.append(answer.question)
                lag = f", {live.lag():.2f} s behind live" if args.realtime else ""
                (progress.write if progress is not None else print)(
                    f"\nQ (at {at:g} s): {clipped(answer.question)}\n"
                    f"A: {answer.answer}{f'   ({note.note})' if note else ''}\n   ({answer.tokens} tokens in "
                    f"{answer.ms:.0f} ms{lag})"
                )
    finally:
        if progress is not None:
            progress.close()
    report = live.report()
    if args.realtime:
        lags = report["lag_s"]
        print(f"lag behind live: mean {lags['mean']:.2f} s, max {lags['max']:.2f} s over {len(live.records)} chunks")
    if live.dropped:
        print(
            f"warning: {live.dropped} frames dropped: more than {args.max_waiting:g} s of frames waited for the "
            "device (the oldest waiting went; the report lists when)",
            file=sys.stderr,
        )
    return report
