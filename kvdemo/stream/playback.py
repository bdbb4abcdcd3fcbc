"""A video played into a live session at its own pace, as a camera would deliver it, with questions asked at stream
seconds (:func:`play`; ``python -m kvdemo run --realtime --ask-at``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .live import ChunkLag, LiveAnswer, LiveSession
from .streaming import StreamStep


@dataclass
class LiveEvent:
    """What :func:`play` did: ``"chunk"`` (``lag``: its record), ``"asked"`` or ``"answered"`` (``answer``)."""

    kind: str
    stream_s: float  # the stream time it happened at
    lag: ChunkLag | None = None
    answer: LiveAnswer | None = None
    steps: list[StreamStep] = field(default_factory=list)


def play(
    live: LiveSession,
    parts: Iterator[tuple[Any, np.ndarray, np.ndarray]],
    questions: Sequence[tuple[float, str]] = (),
    realtime: bool = True,
    sleep: Callable[[float], None] = time.sleep,
    max_new_tokens: int | None = None,
) -> Iterator[LiveEvent]:
    """Play a video's ``parts`` (``(index, frames, stream times)``, e.g. ``video.chunks()``) into ``live``: with
    ``realtime`` at its own pace, each frame captured at its stream time after the start (``live.clock``;
    ``sleep`` waits), else as fast as the device takes them; each of ``questions`` (``(stream second, text)``) asked
    once the stream reaches its second, without pausing the stream (one at a time: a question whose second comes
    while an answer decodes is asked when it ends; ``LiveAnswer.stream_s`` says when). Yields what happened, then
    finishes."""
    pending = sorted(questions, key=lambda q: q[0])
    start = live.clock()
    frames = ((f, float(t)) for _, batch, times in parts for f, t in zip(batch, times))
    upcoming = next(frames, None)
    asked: list[LiveAnswer] = []
    fed_to = 0.0  # stream time of the newest frame put
    while upcoming is not None or pending or live.waiting or live.in_flight:
        now = live.clock() - start if realtime else math.inf
        while upcoming is not None and upcoming[1] <= now:
            live.put(upcoming[0], [upcoming[1]], start + upcoming[1] if realtime else None)
            fed_to, upcoming = upcoming[1], next(frames, None)
            if (pending and pending[0][0] <= fed_to) or (not realtime and live.frames_waiting >= live.frames_per_chunk):
                break  # a question is due (the stream reached its second), or the device has a chunk to take
        stream_s = min(now, fed_to) if realtime else fed_to
        # One question at a time: one whose second comes while an answer decodes waits for it, the stream going on.
        if pending and not live.in_flight and (pending[0][0] <= stream_s or (upcoming is None and not live.waiting)):
            answer = live.ask(pending.pop(0)[1], max_new_tokens)
            answer.stream_s = stream_s
            asked.append(answer)
            yield LiveEvent("asked", stream_s, answer=answer)
        if live.frames_waiting >= live.frames_per_chunk or live.in_flight or (upcoming is None and live.waiting):
            before = len(live.records)
            steps = live.step(flush=upcoming is None)
            for record in live.records[before:]:
                yield LiveEvent("chunk", record.time_s, lag=record, steps=steps)
            for answer in [a for a in asked if a.done]:
                asked.remove(answer)
                yield LiveEvent("answered", fed_to, answer=answer)
        elif upcoming is not None:
            sleep(max(0.0, start + upcoming[1] - live.clock()))
