"""The app's model work as calls that take and return a session's state explicitly, so that each can run
wherever the model is: a stream segment (:func:`stream_segment`, fed by :func:`feed_segment`, the one feed path of
both pages) and a question (:func:`answer_question`, asked by :func:`answer_into`, the one ask path).
On a ZeroGPU Space (or its emulation, :mod:`kvdemo.devices.zerogpu`) each runs in a forked worker with pickled
arguments and results; elsewhere the session's live scheduler (:class:`~kvdemo.stream.live.LiveSession`) does the
work in place, in turns: a chunk, then a few tokens of the answer in flight, so a question never pauses the stream.

On ZeroGPU the engines live in the main process between calls and a call holds them whole, so the interleaving is
inside one call: a question's call also feeds the frames waiting when it starts, between its tokens
(:func:`answer_pieces`); frames that arrive during a call wait in the session's queue (bounded: past it the oldest
are dropped and counted) for the next call, and the lag behind live says how long they waited."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import viz
from ..analysis.explain import fidelity
from ..devices import zerogpu
from ..experiments.sweep import Sweep, delay_sweep
from ..stream.engine import StreamEngine
from ..stream.live import MAX_WAITING_S, ChunkLag, LiveSession
from ..stream.streaming import EngineGroup, StreamStep
from .page_updates import PageUpdates
from .sessions import Session, model_by_name
from .settings import FRAMES_PER_CHUNK

#: Frames per GPU call when calls cross a process boundary (a ZeroGPU Space, or its emulation): every call
#: pickles the session's engines in and out and waits for a GPU, so one call streams a segment of frames
#: (a question waits for at most one segment). Elsewhere a turn is one chunk (a question waits at most one).
ZEROGPU_SEGMENT_FRAMES = 16
#: Thumbnails a stream segment sends along: what the live heatmap shows.
SEGMENT_THUMBNAILS = 4


def segment_frames() -> int:
    return ZEROGPU_SEGMENT_FRAMES if zerogpu.active() else FRAMES_PER_CHUNK


def chunk_hook(session: Session) -> Callable[[StreamStep, np.ndarray], None]:
    """What the session keeps of each chunk fed (a live session's ``on_chunk``): one thumbnail per temporal grid (its
    first frame among those pushed; a webcam grid pairs the previous frame with this one, its thumbnail is this one)
    and the chunk's time (encoding, then every engine's prefill and compression)."""

    def kept(step: StreamStep, frames: np.ndarray) -> None:
        for g in range(step.chunk.num_grids):
            session.thumbnails.append(viz.thumbnail(frames[min(2 * g, len(frames) - 1)]))
        model_ms = sum(event.ms for events in step.events.values() for event in events)
        session.chunk_ms.append(step.chunk.encode_ms + model_ms)
        session.last_used = time.monotonic()

    return kept


def live_session(session: Session) -> LiveSession:
    """The live scheduler over a session's group, sharing the session's turn, keeping its thumbnails. At least one
    call's frames may wait (:func:`segment_frames`), whatever the sampling rate: a live source is fed once a segment
    waits, and a bound below it (10 s at under 1.6 fps on ZeroGPU) would drop every frame before any is fed."""
    waiting_s = max(MAX_WAITING_S, segment_frames() / session.group.stream.fps)
    return LiveSession.around(
        session.group,
        frames_per_chunk=FRAMES_PER_CHUNK,
        max_waiting_s=waiting_s,
        turn=session.turns,
        on_chunk=chunk_hook(session),
    )


@dataclass
class Segment:
    """Everything one stream-segment call needs, and what it changes (see :func:`stream_segment`).

    ``thumbnails`` holds the newest :data:`SEGMENT_THUMBNAILS` thumbnails at their grid index (older ones
    are None); the call appends the new grids' thumbnails. ``captured``: when each frame was captured (the session's
    clock). With a ``question`` the call also answers it (on the engines ``asked``), between its chunks.
    """

    model: str
    group: EngineGroup
    frames: np.ndarray
    times: np.ndarray | None
    flush: bool
    thumbnails: list[np.ndarray | None]
    updates: PageUpdates | None
    total: int | None
    source: str
    captured: np.ndarray | None = None
    question: str | None = None
    asked: list[str] = field(default_factory=list)
    max_new_tokens: int | None = None
    attribute: bool = False
    chunk_ms: list[float] = field(default_factory=list)  # the time of each chunk this call fed
    fed: int = 0
    records: list[ChunkLag] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        state: Session,
        frames: np.ndarray,
        times: np.ndarray | None,
        flush: bool,
        updates: PageUpdates | None,
        total: int | None,
        **more: Any,
    ) -> "Segment":
        old = len(state.thumbnails)
        recent = [None] * max(0, old - SEGMENT_THUMBNAILS) + state.thumbnails[-SEGMENT_THUMBNAILS:]
        return cls(
            state.settings.model, state.group, frames, times, flush, recent, updates, total, state.source, **more
        )

    def apply_to(self, state: Session, old_thumbnails: int) -> int:
        """Adopt what the call changed (the same objects when it ran in place, new ones from a worker, which
        come back without their model: it is attached again here, the memory stays on the CPU): the engines, the
        thumbnails, the chunks' lag records; returns the chunks the call fed."""
        state.group = self.group.attach(model_by_name(self.model))
        state.live.adopt(state.group, self.records)
        state.thumbnails[old_thumbnails:] = self.thumbnails[old_thumbnails:]  # some may have come with live updates
        state.chunk_ms.extend(self.chunk_ms)
        state.last_used = time.monotonic()
        return self.fed


def segment_duration(segment: Segment) -> int:
    """Seconds a ZeroGPU call may hold the GPU for ``segment``: a start-up allowance plus ~1 s per frame
    (vision encoding, prefill and compression of a Qwen2.5-VL at video resolution take well under that on
    ZeroGPU's hardware) and, with a question, ~0.1 s per token per engine, within ZeroGPU's per-request cap."""
    tokens = (segment.max_new_tokens or 64) * len(segment.asked) if segment.question else 0
    return int(min(120, 20 + len(segment.frames) + 0.1 * tokens))


@zerogpu.gpu(duration=segment_duration)
def stream_segment(segment: Segment) -> Iterator[dict[str, Any]]:
    """Stream the segment's frames into its engines chunk by chunk (and answer its question between them: a live
    session inside the call); yield ``{"piece": (engine, text)}`` as the answer comes, the page's light live update
    after each chunk (:meth:`PageUpdates.segment_update`, if it has one) with the thumbnails of the grids fed since
    the last one under ``"thumbnails"`` (so the caller can draw the views of the newest grids), and finally
    ``{"segment": segment}``.

    On ZeroGPU (or its emulation) this runs in a forked worker: the engines arrive pickled without their
    model, the model is resolved here by name, and the engines go back on the CPU.
    """
    model = model_by_name(segment.model)
    segment.group.attach(model)
    for engine in segment.group.engines.values():
        engine.bind(model)
    state = Session(group=segment.group, thumbnails=segment.thumbnails, source=segment.source)
    live = LiveSession.around(
        segment.group, frames_per_chunk=FRAMES_PER_CHUNK, max_waiting_s=math.inf, on_chunk=chunk_hook(state)
    )
    if len(segment.frames):
        live.put(segment.frames, segment.times, segment.captured)
    sent = len(segment.thumbnails)
    answer = None
    if segment.question is not None:
        answer = live.ask(segment.question, segment.max_new_tokens, segment.attribute, engines=segment.asked)
    while live.frames_waiting >= live.frames_per_chunk or (segment.flush and live.waiting) or live.in_flight:
        steps = live.step(flush=segment.flush)
        for piece in answer.drain() if answer is not None else ():
            yield {"piece": piece}
        for _ in steps:
            segment.fed += 1
            update = (
                segment.updates.segment_update(state, segment.total, first=segment.fed == 1)
                if segment.updates
                else None
            )
            if update:
                yield {**update, "thumbnails": segment.thumbnails[sent:]}
                sent = len(segment.thumbnails)
    segment.chunk_ms, segment.records = state.chunk_ms, live.records  # the new grids' thumbnails: segment.thumbnails
    if zerogpu.active():
        for engine in segment.group.engines.values():
            engine.to("cpu")
    yield {"segment": segment}


def whole_chunks(live: LiveSession, flush: bool = False) -> int:
    """Frames of the waiting ones that make whole chunks (all of them with ``flush``: a last odd frame pairs itself)."""
    waiting = live.frames_waiting
    return waiting if flush else waiting - waiting % live.frames_per_chunk


def feed_waiting(
    state: Session, updates: PageUpdates, total: int | None, flush: bool = False, live_updates: bool = False
) -> Generator[dict[str, Any], None, None]:
    """Feed the session's whole chunks waiting (the caller holds the turn): in place, turn by turn (each turn also
    decodes a few tokens of an answer in flight); on ZeroGPU, as one call with those frames (``live_updates``: its
    light updates yielded as they come, drawn here where every thumbnail is, :meth:`PageUpdates.drawn`; the new
    grids' thumbnails are kept as they come, and dropped again if the call fails, since its engines never return)."""
    if not zerogpu.active():
        while not state.freed and whole_chunks(state.live, flush):
            state.live.step(flush=flush, held=True)
        return
    taken = state.live.take_waiting(whole_chunks(state.live, flush))
    if taken is None:
        return
    frames, times, captured = taken
    segment = Segment.of(state, frames, times, flush, updates, total, captured=captured)
    old = len(segment.thumbnails)
    try:
        for update in stream_segment(segment):
            if "segment" in update:
                update["segment"].apply_to(state, old)
                continue
            state.thumbnails.extend(update.pop("thumbnails", ()))
            if live_updates:
                yield {"session": state, **updates.drawn(update, state)}
    except BaseException:
        del state.thumbnails[old:]
        raise


def feed_now(state: Session, updates: PageUpdates) -> None:
    """Feed the session's whole chunks waiting: in place after the turn in progress (a chunk, a few answer tokens or
    a redraw: never a whole answer); on ZeroGPU only if the engines are free now, since a question's call holds them
    until its answer ends (the frames then wait for the next call). A live source never waits for an answer."""
    if not state.turns.take(blocking=not zerogpu.active()):
        return
    try:
        if not state.freed:
            to_the_end(feed_waiting(state, updates, None))
    finally:
        state.turns.give_back()


def feed_segment(
    state: Session,
    frames: np.ndarray,
    times: np.ndarray | None,
    flush: bool,
    updates: PageUpdates,
    total: int | None,
    live: bool = False,
) -> Generator[dict[str, Any], None, int]:
    """The feed path of a file (or the bundled sample): ``frames`` queued in the session's live scheduler (none dropped), then fed in
    its turn (:func:`feed_waiting`; an answer's turns may have fed them first); returns the chunks that entered since
    they were queued (0 if the session was freed meanwhile). With ``live``, when one call streams many chunks
    (ZeroGPU), its live updates are yielded as they come."""
    if state.freed:
        return 0
    before = len(state.live.records)
    state.live.put(frames, times, bounded=False)
    with state.turns:
        if state.freed:  # freed while it waited for the turn
            return 0
        yield from feed_waiting(state, updates, total, flush, live_updates=live and zerogpu.active())
    return len(state.live.records) - before if not state.freed else 0


def to_the_end(steps: Generator[Any, None, Any]) -> Any:
    """Run ``steps`` to its end, dropping what it yields; what it returns (e.g. :func:`feed_segment`'s chunks fed)."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def answer_duration(
    model: str, engines: dict[str, StreamEngine], question: str, max_new_tokens: int, attribute: bool = False
) -> int:
    """Seconds a ZeroGPU call may hold the GPU for one question to every engine (~0.1 s per token each)."""
    return int(min(120, 15 + 0.1 * max_new_tokens * len(engines)))


@zerogpu.gpu(duration=answer_duration)
def answer_question(
    model: str, engines: dict[str, StreamEngine], question: str, max_new_tokens: int, attribute: bool = False
) -> Iterator[dict[str, Any]]:
    """Ask every engine (``attribute``: each answer records what it looked at, :mod:`kvdemo.analysis.explain`); yields
    ``{"piece": (engine name, text)}`` as tokens come, interleaved, and finally
    ``{"answered": {name: answer state}, "engines": {name: engine}}``: what answering changed (answering
    never changes the memory), which is all a ZeroGPU worker sends back for most engines, and the whole
    engine of a policy whose question ran a compression pass first (a probed policy that compresses on
    questions)."""
    resolved = model_by_name(model)
    passes = {}
    for name, engine in engines.items():
        engine.bind(resolved)
        passes[name] = engine.stats.compressions
    generators = {name: engine.ask(question, max_new_tokens, attribute) for name, engine in engines.items()}
    while generators:
        for name in list(generators):
            try:
                yield {"piece": (name, next(generators[name]))}
            except StopIteration:
                del generators[name]
    changed = {name: engine for name, engine in engines.items() if engine.stats.compressions != passes[name]}
    if zerogpu.active():
        for engine in changed.values():
            engine.to("cpu")
    yield {"answered": {name: engine.answer_state() for name, engine in engines.items()}, "engines": changed}


def answer_pieces(
    state: Session, asked: list[str], question: str, max_new_tokens: int, attribute: bool = False
) -> Iterator[tuple[str, str]]:
    """``(engine name, text piece)`` of each asked engine's answer as they come. In place: on the session's live
    scheduler, each answer on a fork of its engine's memory, the stream's chunks entering between its tokens; the
    answer stops (its forks let go) if this is closed before it is done. On ZeroGPU: one call, holding the engines,
    that also feeds the frames waiting when it starts (:func:`stream_segment`), or only answers when none wait
    (:func:`answer_question`: only what answering changes comes back)."""
    if not zerogpu.active():
        live = state.live
        if live is None:  # freed since the question was checked
            return
        answer = live.ask(question, max_new_tokens, attribute, engines=asked)
        try:
            yield from answer
        finally:
            if not answer.done:
                answer.close()
        return
    with state.turns:
        taken = state.live.take_waiting(whole_chunks(state.live))
        if taken is None:
            engines = {name: state.engines[name] for name in asked}
            for item in answer_question(state.settings.model, engines, question, max_new_tokens, attribute):
                if "piece" in item:
                    yield item["piece"]
                    continue
                for name, engine in item["engines"].items():  # its question ran a pass: the memory changed
                    state.engines[name] = engine.attach(state.engines[name].model)
                for name, answered in item["answered"].items():
                    state.engines[name].load_answer_state(answered)
            return
        frames, times, captured = taken
        more = dict(captured=captured, question=question, asked=asked, max_new_tokens=max_new_tokens)
        segment = Segment.of(state, frames, times, False, None, None, attribute=attribute, **more)
        old = len(segment.thumbnails)
        for update in stream_segment(segment):
            if "piece" in update:
                yield update["piece"]
            elif "segment" in update:
                update["segment"].apply_to(state, old)


def answer_into(
    state: Session,
    asked: dict[str, StreamEngine],
    question: str,
    max_new_tokens: int,
    attribute: bool = False,
    every_s: float = 0.1,
) -> Iterator[None]:
    """Ask the engines ``asked`` of a session (:func:`answer_pieces`), streaming each answer into the last message of
    its chat (``state.chat[name]``) and yielding at most every ``every_s`` seconds for a live update."""
    last = 0.0
    for name, piece in answer_pieces(state, list(asked), question, max_new_tokens, attribute):
        state.chat[name][-1]["content"] += piece
        if time.monotonic() - last > every_s:
            last = time.monotonic()
            yield


@zerogpu.gpu(duration=lambda model, full, engines, question: int(min(120, 15 + 2 * len(engines))))
def measure_fidelity(model: str, full: StreamEngine, engines: dict[str, StreamEngine], question: str) -> dict[str, Any]:
    """:func:`kvdemo.analysis.explain.fidelity` of ``engines`` against the full cache's engine ``full`` (memories unchanged)."""
    resolved = model_by_name(model)
    for engine in [full, *engines.values()]:
        engine.bind(resolved)
    return fidelity(full, engines, question)


@zerogpu.gpu(
    duration=lambda model, policies, delays, budget, keep, kind, more_streams: int(min(120, 30 + 15 * more_streams))
)
def sweep_delays(
    model: str,
    policies: list[str],
    delays: tuple[float, ...],
    budget: int | None,
    keep: int | None,
    kind: str,
    more_streams: int,
) -> Iterator[Sweep]:
    """:func:`kvdemo.experiments.sweep.delay_sweep` on the bundled sample (and ``more_streams`` held-out streams) as it goes."""
    yield from delay_sweep(model_by_name(model), policies, delays, budget, keep, kind, more_streams)
