"""The app's model work as calls that take and return a session's state explicitly, so that each can run
wherever the model is: a stream segment (:func:`stream_segment`, fed by :func:`feed_segment`, the one feed path of
both pages) and a question (:func:`answer_question`, asked by :func:`answer_into`, the one ask path).
On a ZeroGPU Space (or its emulation, :mod:`kvdemo.devices.zerogpu`) each runs in a forked worker with pickled
arguments and results; elsewhere in place."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import viz
from ..analysis.explain import fidelity
from ..devices import zerogpu
from ..experiments.sweep import Sweep, delay_sweep
from ..stream.engine import StreamEngine
from ..stream.streaming import EngineGroup
from .page_updates import PageUpdates
from .sessions import Session, model_by_name
from .settings import FRAMES_PER_CHUNK

#: Frames per GPU call when calls cross a process boundary (a ZeroGPU Space, or its emulation): every call
#: pickles the session's engines in and out and waits for a GPU, so one call streams a segment of frames
#: (a question waits for at most one segment). Elsewhere a call is one chunk (a question waits at most one).
ZEROGPU_SEGMENT_FRAMES = 16
#: Thumbnails a stream segment sends along: what the live heatmap shows.
SEGMENT_THUMBNAILS = 4


def segment_frames() -> int:
    return ZEROGPU_SEGMENT_FRAMES if zerogpu.active() else FRAMES_PER_CHUNK


def feed_frames(session: Session, frames: np.ndarray, times_s: np.ndarray | None, flush: bool = False) -> bool:
    """Push frames through the session's engine group (one vision encoding per chunk, every running engine
    fed); True if a chunk was fed. The caller holds the session's turn (``Turns.chunk``)."""
    start = time.perf_counter()
    steps = session.group.push(frames, times_s, flush=flush)
    if not steps:
        return False
    # One thumbnail per temporal grid: its first frame among those pushed now (a webcam grid pairs the
    # previous frame with this one; its thumbnail is this one).
    grids = sum(step.chunk.num_grids for step in steps)
    for g in range(grids):
        session.thumbnails.append(viz.thumbnail(frames[min(2 * g, len(frames) - 1)]))
    session.chunk_ms.append(sum(step.chunk.encode_ms for step in steps) + (time.perf_counter() - start) * 1000)
    session.last_used = time.monotonic()
    return True


@dataclass
class Segment:
    """Everything one stream-segment call needs, and what it changes (see :func:`stream_segment`).

    ``thumbnails`` holds the newest :data:`SEGMENT_THUMBNAILS` thumbnails at their grid index (older ones
    are None); the call appends the new grids' thumbnails.
    """

    model: str
    group: EngineGroup
    frames: np.ndarray
    times: np.ndarray | None
    flush: bool
    thumbnails: list[np.ndarray | None]
    updates: PageUpdates
    total: int | None
    source: str
    chunk_ms: list[float] = field(default_factory=list)  # the wall time of each chunk this call fed
    fed: int = 0

    @classmethod
    def of(
        cls,
        state: Session,
        frames: np.ndarray,
        times: np.ndarray | None,
        flush: bool,
        updates: PageUpdates,
        total: int | None,
    ) -> "Segment":
        old = len(state.thumbnails)
        recent = [None] * max(0, old - SEGMENT_THUMBNAILS) + state.thumbnails[-SEGMENT_THUMBNAILS:]
        return cls(state.settings.model, state.group, frames, times, flush, recent, updates, total, state.source)

    def apply_to(self, state: Session, old_thumbnails: int) -> int:
        """Adopt what the call changed (the same objects when it ran in place, new ones from a worker, which
        come back without their model: it is attached again here, the memory stays on the CPU); returns the
        chunks the call fed."""
        state.group = self.group.attach(model_by_name(self.model))
        state.thumbnails.extend(self.thumbnails[old_thumbnails:])
        state.chunk_ms.extend(self.chunk_ms)
        state.last_used = time.monotonic()
        return self.fed


def segment_duration(segment: Segment) -> int:
    """Seconds a ZeroGPU call may hold the GPU for ``segment``: a start-up allowance plus ~1 s per frame
    (vision encoding, prefill and compression of a Qwen2.5-VL at video resolution take well under that on
    ZeroGPU's hardware), within ZeroGPU's per-request cap."""
    return int(min(120, 20 + len(segment.frames)))


@zerogpu.gpu(duration=segment_duration)
def stream_segment(segment: Segment) -> Iterator[dict[str, Any]]:
    """Stream the segment's frames into its engines chunk by chunk; after each chunk yield the page's light live
    update (:meth:`PageUpdates.segment_update`, if it has one), and finally ``{"segment": segment}``.

    On ZeroGPU (or its emulation) this runs in a forked worker: the engines arrive pickled without their
    model, the model is resolved here by name, and the engines go back on the CPU.
    """
    model = model_by_name(segment.model)
    segment.group.attach(model)
    for engine in segment.group.engines.values():
        engine.bind(model)
    state = Session(group=segment.group, thumbnails=segment.thumbnails, source=segment.source)
    count = len(segment.frames)
    for start in range(0, max(count, 1), FRAMES_PER_CHUNK):
        last = start + FRAMES_PER_CHUNK >= count
        times = segment.times[start : start + FRAMES_PER_CHUNK] if segment.times is not None else None
        if feed_frames(state, segment.frames[start : start + FRAMES_PER_CHUNK], times, flush=last and segment.flush):
            segment.fed += 1
            update = segment.updates.segment_update(state, segment.total, first=segment.fed == 1)
            if update:
                yield update
    segment.chunk_ms = state.chunk_ms  # the thumbnails of the new grids were appended to segment.thumbnails
    if zerogpu.active():
        for engine in segment.group.engines.values():
            engine.to("cpu")
    yield {"segment": segment}


def feed_segment(
    state: Session,
    frames: np.ndarray,
    times: np.ndarray | None,
    flush: bool,
    updates: PageUpdates,
    total: int | None,
    live: bool = False,
) -> Generator[dict[str, Any], None, int]:
    """The one feed path of both pages (a file, the bundled sample, the webcam): ``frames`` streamed into the
    session's engines in its turn, as one GPU call (:func:`stream_segment`); returns the chunks fed (0 if the session
    was freed meanwhile). With ``live``, when one call streams many chunks (ZeroGPU), its live updates are yielded
    as they come, drawn here where every thumbnail is (:meth:`PageUpdates.drawn`)."""
    fed = 0
    with state.turns.chunk():
        if state.freed:
            return 0
        segment = Segment.of(state, frames, times, flush, updates, total)
        old = len(segment.thumbnails)
        for update in stream_segment(segment):
            if "segment" in update:
                fed = update["segment"].apply_to(state, old)
            elif live and zerogpu.active():
                yield {"session": state, **updates.drawn(update, state)}
    return fed


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


def answer_into(
    state: Session,
    asked: dict[str, StreamEngine],
    question: str,
    max_new_tokens: int,
    attribute: bool = False,
    every_s: float = 0.1,
) -> Iterator[None]:
    """Ask the engines ``asked`` of a session (:func:`answer_question`), streaming each answer into the last message
    of its chat (``state.chat[name]``) and yielding at most every ``every_s`` seconds for a live update; at the end
    what answering changed is applied to the session's engines (a ZeroGPU worker sends back only that)."""
    texts, last = {name: "" for name in asked}, 0.0
    for item in answer_question(state.settings.model, asked, question, max_new_tokens, attribute):
        if "answered" in item:
            for name, engine in item["engines"].items():  # its question ran a pass: the memory changed
                state.engines[name] = engine.attach(state.engines[name].model)
            for name, answered in item["answered"].items():
                state.engines[name].load_answer_state(answered)
            return
        name, piece = item["piece"]
        texts[name] += piece
        state.chat[name][-1]["content"] = texts[name]
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
