"""Live streaming: chunks keep entering the memory while a question is answered, and kvdemo says how far behind live
the memory is (:class:`LiveSession`; :func:`kvdemo.stream.playback.play` plays a file at its own pace into one).

**Scheduling.** One device serves the stream and the answers, one model call at a time, in turns
(:meth:`LiveSession.step`): a turn feeds the oldest whole chunk waiting (vision encoding, then every engine's prefill,
compressing first when due), then decodes up to ``tokens_per_turn`` tokens of every answer in flight. The chunk goes
first, so a chunk that arrives waits at most one turn (a chunk and a few tokens) however long an answer runs; when no
chunk waits, turns only decode, so an answer goes at full speed between chunks; a device slower than the stream has a
chunk in every turn, and an answer then advances ``tokens_per_turn`` tokens a chunk. Whoever holds the device's turn runs
the next turn: the caller that feeds frames (:meth:`LiveSession.feed` runs turns only when the device is free, so it
never waits for an answer), the one that reads an answer (iterating a :class:`LiveAnswer` runs turns until its next
piece arrives) or a player (:func:`~kvdemo.stream.playback.play`). Turns go to waiting callers in the order they asked
(:class:`~kvdemo.devices.turn.DeviceTurn`).
What a turn does depends only on what waits when it starts, so the same calls in the same order do the same work
(the tests run them on the CPU and the emulated device).

**Answers on a fork.** A question forks every asked engine's memory when it is asked (:meth:`KVMemory.fork`: one copy
of the live slots) and answers on the fork: its question and answer tokens go into the fork's slack, so the chunks
that enter the memory meanwhile (into the memory's own slack) and the compressions that move its slots never meet
them, and the answer sees the memory as it was when the question was asked. The memory is never written by an
answer, so after a stream it is bit-identical to the same stream with no questions; the one thing an answer leaves on
it is the record of which offloaded chunks it retrieved (HybridKV), per answer, for the views. The fork is let go
when its answer ends or is stopped (:meth:`LiveAnswer.close`).

**Behind live.** Each frame is stamped when it was captured (the session's clock when :meth:`LiveSession.put` got it,
or the time a player scheduled it), each chunk records when its newest frame was captured and when it had entered
every engine's memory (:class:`ChunkLag`: its lag behind live). kvdemo's rule for frames that wait for the device:
at most ``max_waiting_s`` seconds of frames wait; past that the oldest waiting frames are dropped and counted
(:attr:`LiveSession.dropped`, :attr:`LiveSession.drops`, the report), never silently. A dropped frame leaves a gap in
stream time (its times are kept) but none in positions: the model sees the frames that entered as one stream, as it
would a cut in a video.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..devices.turn import DeviceTurn
from ..models.base import VideoLM
from .engine import Answer, EngineError, StreamEngine
from .streaming import EngineGroup, StreamStep

#: Seconds of stream that may wait for the device before the oldest waiting frames are dropped (kvdemo's choice: a
#: question's answer on a slow device takes seconds, and a live memory that falls further behind than this is worth
#: less than one that skips ahead).
MAX_WAITING_S = 10.0
#: Tokens each answer in flight decodes per turn (kvdemo's choice): a chunk that arrives waits for at most this many
#: decode steps of each answer.
TOKENS_PER_TURN = 4


@dataclass
class ChunkLag:
    """When one chunk's frames were captured and when they had entered every engine's memory (session clock)."""

    grid: int  # its first temporal grid
    frames: int  # frames fed so far, its own included
    time_s: float  # stream time of its newest frame
    captured_s: float  # when its newest frame was captured
    entered_s: float  # when it had entered every engine's memory
    waiting: int  # frames left waiting for the device when it entered
    dropped: int  # frames dropped so far

    @property
    def lag_s(self) -> float:
        """How far behind live the memory was when this chunk entered: entered - captured."""
        return self.entered_s - self.captured_s


@dataclass
class Drop:
    """Frames dropped at once because too many waited (the oldest waiting ones)."""

    at_s: float  # when (session clock)
    frames: int
    first_time_s: float  # stream times of the first and last frame dropped
    last_time_s: float


class LiveAnswer:
    """One question's answers streaming while the stream goes on (:meth:`LiveSession.ask`). Iterate it for
    ``(engine name, text piece)`` as tokens come, each engine's in turn; iterating runs the session's turns, so the
    chunks waiting enter between the tokens. :attr:`answers` holds each engine's :class:`Answer` once it is done;
    :meth:`close` stops it (the forks are let go)."""

    def __init__(self, session: "LiveSession", question: str, engines: dict[str, StreamEngine], generators) -> None:
        self.session, self.question = session, question
        self.asked_s = session.clock()
        self.answered_s: float | None = None
        self.stream_s: float | None = None  # the stream second it was asked at, when a player asked it
        self.texts = {name: "" for name in engines}
        self.answers: dict[str, Answer] = {}
        self._engines, self._generators = engines, dict(generators)
        self._started: set[str] = set()  # a generator never started has no answer and no dialogue turn to record
        self._pieces: deque[tuple[str, str]] = deque()

    @property
    def done(self) -> bool:
        return not self._generators

    def advance(self, tokens: int | None) -> None:
        """Decode up to ``tokens`` tokens of each engine's answer (None: to the end). The caller holds the turn."""
        for name, generator in list(self._generators.items()):
            for _ in range(tokens) if tokens is not None else iter(int, 1):
                self._started.add(name)
                try:
                    piece = next(generator)
                except StopIteration:
                    self._finished(name)
                    break
                self.texts[name] += piece
                self._pieces.append((name, piece))

    def _finished(self, name: str) -> None:
        del self._generators[name]
        if name in self._started:
            self.answers[name] = self._engines[name].answers[-1]
        if self.done:
            self.answered_s = self.session.clock()

    def drain(self) -> list[tuple[str, str]]:
        """The pieces decoded since they were last taken, without running a turn (for a caller that runs the turns)."""
        return [self._pieces.popleft() for _ in range(len(self._pieces))]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        while True:
            if self._pieces:
                yield self._pieces.popleft()
            elif self.done:
                return
            else:
                self.session.step()

    def close(self, held: bool = False) -> None:
        """Stop the answers still decoding (each keeps what it said so far, as a dialogue turn); the forks are let
        go. ``held``: the caller holds the device's turn (else this waits for it)."""
        with contextlib.nullcontext() if held else self.session.turn:
            for name in list(self._generators):
                self._generators[name].close()
                self._finished(name)
            self.session._retire(self)


class LiveSession:
    """Engines watching a live stream (one vision encoding per chunk feeds them all, :class:`EngineGroup`) that go
    on taking chunks while questions are answered, and record how far behind live they are. Scheduling, forks, the
    lag and the drop rule: the module docstring.

    ``engines``: one engine or several by name; ``fps``: the stream's sampling rate (default: the first engine's);
    ``frames_per_chunk``: frames a turn feeds (whole temporal grids); ``tokens_per_turn``: tokens each answer decodes
    per turn (None: an answer is decoded whole in one turn, the stream pausing meanwhile, as before live scheduling:
    for comparison); ``clock``: seconds (injected in tests); ``turn``: the device's turn to share with other users of
    the engines (a :class:`DeviceTurn`); ``on_chunk(step, frames)``: called in the turn that fed a chunk."""

    def __init__(
        self,
        model: VideoLM,
        engines: StreamEngine | dict[str, StreamEngine],
        fps: float | None = None,
        *,
        frames_per_chunk: int = 2,
        tokens_per_turn: int | None = TOKENS_PER_TURN,
        max_waiting_s: float = MAX_WAITING_S,
        clock: Callable[[], float] = time.monotonic,
        turn: DeviceTurn | None = None,
        on_chunk: Callable[[StreamStep, np.ndarray], None] | None = None,
    ) -> None:
        engines = {engines.policy.name: engines} if isinstance(engines, StreamEngine) else dict(engines)
        fps = fps if fps is not None else next(iter(engines.values())).fps
        group = EngineGroup(model, engines, fps)
        self._setup(group, frames_per_chunk, tokens_per_turn, max_waiting_s, clock, turn, on_chunk)

    @classmethod
    def around(cls, group: EngineGroup, **options: Any) -> "LiveSession":
        """A live session over an existing group of engines (the app's); ``options`` as for the constructor."""
        live = cls.__new__(cls)
        live._setup(group, **options)
        return live

    def _setup(
        self,
        group: EngineGroup,
        frames_per_chunk: int = 2,
        tokens_per_turn: int | None = TOKENS_PER_TURN,
        max_waiting_s: float = MAX_WAITING_S,
        clock: Callable[[], float] = time.monotonic,
        turn: DeviceTurn | None = None,
        on_chunk: Callable[[StreamStep, np.ndarray], None] | None = None,
    ) -> None:
        grid = group.stream.model.geometry.frames_per_grid
        if frames_per_chunk < 1 or frames_per_chunk % grid:
            raise EngineError(f"a live chunk is whole temporal grids of {grid} frames, got {frames_per_chunk} frames")
        if tokens_per_turn is not None and tokens_per_turn < 1:
            raise EngineError(f"an answer decodes at least one token per turn, got {tokens_per_turn}")
        self.group, self.fps = group, group.stream.fps
        self.frames_per_chunk, self.tokens_per_turn = frames_per_chunk, tokens_per_turn
        if not max_waiting_s > 0:
            raise EngineError(f"frames may wait a positive number of seconds, got {max_waiting_s}")
        bound = math.ceil(max_waiting_s * self.fps) if math.isfinite(max_waiting_s) else math.inf
        self.max_waiting = max(frames_per_chunk, bound)  # frames; inf: none is ever dropped
        self.clock, self.turn, self.on_chunk = clock, turn or DeviceTurn(), on_chunk
        self.waiting: deque[tuple[np.ndarray, float, float]] = deque()  # (frame, stream time, captured)
        self.received = 0  # frames put, dropped ones included (they keep their stream time)
        self.dropped = 0
        self.drops: list[Drop] = []
        self.records: list[ChunkLag] = []
        self.in_flight: list[LiveAnswer] = []
        self.start: float | None = None
        self._queue = threading.Lock()  # the waiting frames' own lock: putting never waits for the device

    @property
    def engines(self) -> dict[str, StreamEngine]:
        return self.group.engines

    @property
    def frames_waiting(self) -> int:
        return len(self.waiting)

    # --- frames in ------------------------------------------------------------------------------------
    def put(
        self,
        frames: np.ndarray,
        times_s: Sequence[float] | None = None,
        captured_s: Any = None,
        bounded: bool = True,
    ) -> int:
        """Queue frames ``[T, H, W, 3]`` (or one ``[H, W, 3]``) for the device, with no model work; returns the frames
        this dropped (the oldest waiting, past the bound). ``times_s``: their stream times (default: their index
        among the frames received, over ``fps``); ``captured_s``: when they were captured, one time or one each
        (default: now). ``bounded=False``: none is dropped (a file's frames: its reader waits instead of losing them,
        and may queue more than the bound at once, as a ZeroGPU call's segment does)."""
        frames = np.asarray(frames)
        frames = frames[None] if frames.ndim == 3 else frames
        self.group.stream.check(frames)
        count, now = len(frames), self.clock()
        captured = np.broadcast_to(np.asarray(now if captured_s is None else captured_s, dtype=float), (count,))
        with self._queue:
            times = (self.received + np.arange(count)) / self.fps if times_s is None else np.asarray(times_s, float)
            self.start = min(self.start if self.start is not None else now, float(captured.min()) if count else now)
            self.waiting.extend(zip(frames, times.tolist(), captured.tolist()))
            self.received += count
            over = len(self.waiting) - self.max_waiting
            if over <= 0 or not bounded:
                return 0
            gone = [self.waiting.popleft() for _ in range(over)]
            self.dropped += over
            self.drops.append(Drop(now, over, gone[0][1], gone[-1][1]))
            return over

    def take_waiting(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Remove the oldest waiting frames (at most ``limit``) for a caller that feeds them elsewhere (a ZeroGPU
        call): ``(frames, stream times, captured)``, or None if none wait."""
        with self._queue:
            count = len(self.waiting) if limit is None else min(limit, len(self.waiting))
            if not count:
                return None
            taken = [self.waiting.popleft() for _ in range(count)]
        return np.stack([f for f, _, _ in taken]), np.array([t for _, t, _ in taken]), np.array([c for *_, c in taken])

    def feed(
        self, frames: np.ndarray, times_s: Sequence[float] | None = None, captured_s: Any = None
    ) -> list[StreamStep]:
        """:meth:`put`, then feed the whole chunks waiting if the device is free (else the turns of whoever holds it
        feed them): never waits for an answer. Returns the chunks fed here."""
        self.put(frames, times_s, captured_s)
        return self.pump()

    def pump(self) -> list[StreamStep]:
        """Turns while a whole chunk waits, if the device is free now (nothing when it is not)."""
        if not self.turn.take(blocking=False):
            return []
        try:
            steps = []
            while self.frames_waiting >= self.frames_per_chunk:
                steps.extend(self.step(held=True))
            return steps
        finally:
            self.turn.give_back()

    # --- turns -----------------------------------------------------------------------------------------
    def step(self, flush: bool = False, held: bool = False) -> list[StreamStep]:
        """One turn: the oldest whole chunk waiting (with ``flush``, also fewer frames: a last odd frame is paired with
        a copy of itself), then ``tokens_per_turn`` tokens of every answer in flight. Waits for the device's turn
        unless the caller holds it (``held``). Returns the chunks fed (none when no whole chunk waited)."""
        with contextlib.nullcontext() if held else self.turn:
            steps = self._feed_one(flush)
            for answer in list(self.in_flight):
                answer.advance(self.tokens_per_turn)
                if answer.done:
                    self._retire(answer)
            return steps

    def _feed_one(self, flush: bool) -> list[StreamStep]:
        with self._queue:
            count = min(len(self.waiting), self.frames_per_chunk)
            if count < self.frames_per_chunk and not (flush and count):
                return []
            taken = [self.waiting.popleft() for _ in range(count)]
            left = len(self.waiting)
        frames = np.stack([f for f, _, _ in taken])
        times = np.array([t for _, t, _ in taken])
        steps = self.group.push(frames, times, flush=count < self.frames_per_chunk)
        entered = self.clock()
        for step in steps:
            self.records.append(
                ChunkLag(
                    step.chunk.first_grid,
                    step.frames_done,
                    float(times[-1]),
                    float(taken[-1][2]),
                    entered,
                    left,
                    self.dropped,
                )
            )
            if self.on_chunk is not None:
                self.on_chunk(step, frames)
        return steps

    def finish(self) -> list[StreamStep]:
        """Feed every frame waiting (a last odd one paired with a copy of itself) and finish the answers in flight."""
        steps: list[StreamStep] = []
        with self.turn:
            while self.waiting or self.in_flight:
                steps.extend(self.step(flush=True, held=True))
        return steps

    # --- questions ----------------------------------------------------------------------------------------
    def ask(
        self,
        question: str,
        max_new_tokens: int | None = None,
        attribute: bool = False,
        engines: Sequence[str] | None = None,
    ) -> LiveAnswer:
        """Ask every running engine (or those named) on forks of their memories as they are now; returns the answers'
        stream while the stream goes on. One question at a time: an earlier answer still decoding is finished first
        (chunks keep entering between its tokens). :class:`EngineError` for a question that cannot be asked."""
        with self.turn:
            while self.in_flight:
                self.step(held=True)
            names = list(engines) if engines is not None else [n for n in self.engines if n not in self.group.stopped]
            asked = {name: self.engines[name] for name in names}
            if not asked:
                raise EngineError("no engine to ask: every engine has stopped")
            question = next(iter(asked.values())).check_question(question)
            generators = {n: e.ask(question, max_new_tokens, attribute, fork=True) for n, e in asked.items()}
            answer = LiveAnswer(self, question, asked, generators)
            self.in_flight.append(answer)
            return answer

    def _retire(self, answer: LiveAnswer) -> None:
        if answer in self.in_flight:
            self.in_flight.remove(answer)

    def close(self, held: bool = False) -> None:
        """Stop every answer in flight (their forks are let go); the frames waiting stay. ``held``: the caller holds
        the device's turn (else this waits for it)."""
        with contextlib.nullcontext() if held else self.turn:
            for answer in list(self.in_flight):
                answer.close(held=True)

    # --- behind live ------------------------------------------------------------------------------------
    def lag(self, now: float | None = None) -> float:
        """Seconds the memory is behind live: while a whole chunk waits, how long its newest frame has waited so far
        (the lag it will have at least); otherwise the last chunk's lag (0 before any)."""
        with self._queue:
            if len(self.waiting) >= self.frames_per_chunk:
                newest = self.waiting[self.frames_per_chunk - 1][2]
                return max(0.0, (self.clock() if now is None else now) - newest)
        return self.records[-1].lag_s if self.records else 0.0

    def adopt(self, group: EngineGroup, records: list[ChunkLag]) -> None:
        """Take what a call elsewhere (a ZeroGPU worker) changed: its engines and the chunks it fed."""
        self.group = group
        self.records.extend(records)

    def report(self) -> dict[str, Any]:
        """Per chunk, when its frames were captured and entered the memory (seconds from the stream's first capture)
        and its lag; the frames dropped and when; the lag's mean and largest."""
        zero = self.start or 0.0
        lags = [r.lag_s for r in self.records]

        def relative(entry: dict[str, Any]) -> dict[str, Any]:
            return {k: (round(v - zero, 4) if k.endswith("ed_s") or k == "at_s" else v) for k, v in entry.items()}

        return {
            "frames_received": self.received,
            "frames_fed": self.group.frames_seen,
            "frames_waiting": self.frames_waiting,
            "dropped_frames": self.dropped,
            "max_waiting_frames": self.max_waiting if math.isfinite(self.max_waiting) else None,
            "tokens_per_turn": self.tokens_per_turn,
            "lag_s": {
                "mean": float(np.mean(lags)) if lags else 0.0,
                "max": max(lags, default=0.0),
                "last": lags[-1] if lags else 0.0,
            },
            "chunks": [relative({**asdict(r), "lag_s": r.lag_s}) for r in self.records],
            "drops": [relative(asdict(d)) for d in self.drops],
        }
