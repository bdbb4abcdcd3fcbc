"""What the buttons of both pages do, as plain functions (tested without a browser): start a session (the one place
the app builds engines), stream a file or the bundled sample (:func:`run_stream`) or the webcam, ask every engine
(:func:`ask`), start a new conversation, stop. The single page is a comparison with one contender: each handler
takes the page's :class:`~kvdemo.app.page_updates.PageUpdates`, which says what the page shows at each step. Each
yields or returns update dicts keyed by view name (the pages map them to components); errors a user can cause
end in a message, never an exception.

A question never pauses the stream: the session's live scheduler feeds the stream's chunks between the answer's
tokens (:mod:`kvdemo.stream.live`), so the stream's and the question's handlers use the engines in turns; whatever
reads the memory to draw it does so in the session's turn (:func:`drawn`), never while a chunk is half-fed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..cache.budget import Budget
from ..experiments.compare import memory_bound
from ..media.video import resize_frames
from ..policies import Policy
from ..stream.engine import EngineError
from ..stream.lineup import Contender, cap_bytes, make_engines, size_lineup
from ..stream.streaming import EngineGroup
from ..views import counted
from .gpu import answer_into, feed_now, feed_segment, live_session, segment_frames
from .page_updates import PageUpdates, answer_markdown
from .sessions import AppServices, CompareSettings, RunSettings, Session
from .settings import FRAMES_PER_CHUNK, USER_ERRORS, open_stream, settings_lineup, within_max_pixels
from .single_updates import DisplayChoice, SingleUpdates

Settings = RunSettings | CompareSettings


def start_session(
    services: AppServices,
    settings: Settings,
    lineup: dict[str, tuple[Policy, Budget]],
    source: str,
    frame_size: tuple[int, int],
    fps: float | None = None,
    live_source: bool = False,
) -> Session:
    """A fresh session for ``settings`` (either page's) on frames of ``frame_size`` (resized): one engine per
    contender of ``lineup`` (the settings resolved once, :func:`~kvdemo.app.settings.settings_lineup`), then the full
    cache (stopped at its cap) when the baseline runs (:func:`kvdemo.stream.lineup.make_engines`, the one engine
    factory), behind one group.

    Every budget is sized here for one chunk of such frames (:func:`kvdemo.stream.lineup.size_lineup`: with several
    contenders, a message names the one it is about). The caller's previous session is left alone: the pool replaces
    it once the new stream is under way. ``fps`` is the stream's real sampling rate when it differs from the setting
    (a file sampled faster than it was recorded streams at its own).
    ``live_source``: the stream is live (the webcam): its lag behind live is shown and reported.
    """
    fps = fps or settings.fps
    model = services.models.get(settings.model)
    tokens, shape = model.geometry.chunk_tokens(frame_size, FRAMES_PER_CHUNK)
    sized = size_lineup(lineup, tokens, shape, seconds=FRAMES_PER_CHUNK / fps)
    cap = cap_bytes(settings.cap_mb)
    contenders = [Contender(name, policy=policy, budget=budget) for name, (policy, budget) in sized.items()]
    engines = make_engines(model, contenders, fps=fps, baseline=settings.baseline, baseline_cap_bytes=cap)
    state = Session(
        settings=settings,
        group=EngineGroup(model, engines, fps),
        source=source,
        frame_size=tuple(frame_size),
        live_source=live_source,
    )
    state.live = live_session(state)
    state.chat = {name: [] for name in engines}
    state.bound = memory_bound(model, engines, tokens * fps / FRAMES_PER_CHUNK, cap)
    return state


def run_stream(
    services: AppServices, session: Session | None, video_path: str | None, settings: Settings, updates: PageUpdates
) -> Iterator[dict[str, Any]]:
    """Stream a file (the bundled sample of ``settings.sample`` when ``video_path`` is None) into a fresh session;
    yields the page's updates (``updates``) after every chunk. Errors end the run with a message, never an exception.

    The previous session and its views stay until the first chunk of the new stream has been fed; a run that fails
    before that leaves them as they were. :func:`request_stop` ends the run after the current chunk with the report
    of what ran.
    """
    previous = session
    try:
        lineup = settings_lineup(settings)  # the settings' own errors first, before a file is opened
        geometry = within_max_pixels(services.models.get(settings.model).geometry, settings.max_pixels)
        video, episode = open_stream(geometry, video_path, settings.fps, settings.sample)
        state = start_session(services, settings, lineup, video.describe(), video.size, video.fps)
        state.episode = episode
    except USER_ERRORS as exc:
        yield updates.kept_previous(previous, str(exc))
        return
    state.running = True
    total = video.num_frames
    committed = False
    try:
        yield updates.starting(state, video.describe())
        chunks = video.chunks(segment_frames())  # decoded lazily, batch by batch, outside the session's turn
        current = next(chunks, None)
        while current is not None and not state.stop_requested and not state.freed:
            following = next(chunks, None)
            _, frames, times = current
            fed = yield from feed_segment(state, frames, times, following is None, updates, total, live=committed)
            current = following
            if fed and not committed:
                services.sessions.replace(previous, state)
                committed = True
                yield drawn(
                    state, lambda: {**updates.live(state, seen(state), total, force=True), **updates.fresh(state)}
                )
            elif fed:
                yield drawn(state, lambda: updates.live(state, seen(state), total))
    except USER_ERRORS as exc:
        if not committed:
            with state.turns:
                state.free()
            yield updates.kept_previous(previous, str(exc))
            return
        message = str(exc)
        yield drawn(state, lambda: {"session": state, "status": updates.status(state, error=message)})
        return
    finally:
        state.running = False
        if not committed:
            with state.turns:
                state.free()  # ended before its first chunk (an error, Stop, or the client went away)
    if not committed:
        yield updates.kept_previous(previous, "stopped before the first chunk")
        return
    if state.freed:
        yield {"session": state, "status": updates.status(state)}
        return
    stopped = state.stop_requested
    state.stop_requested = False
    done = state.group.frames_seen
    if stopped:
        state.stopped["run"] = f"stopped by the user at {done} of {counted(total, 'frame')}"
    else:
        state.source, state.lost_frames = video.describe(), video.lost_frames  # now knows the damaged frames
    yield drawn(state, lambda: updates.finished(state, done, total if stopped else total - video.lost_frames, stopped))


def seen(state: Session) -> int | None:
    return state.group.frames_seen if state.group is not None else None


def drawn(state: Session, update: Callable[[], dict[str, Any]], key: str = "status") -> dict[str, Any]:
    """``update()`` made in the session's turn: what it reads of the memory is whole (a question's turns feed chunks
    from another thread), and the turn is given back before the update is yielded. A session freed meanwhile says
    why under ``key``."""
    with state.turns:
        if state.group is None and state.freed:
            return {"session": state, key: f"⚠️ **{state.freed}**"}
        return update()


def request_stop(session: Session | None) -> None:
    """Ask the session's running file stream to end after its current chunk (it then writes its report)."""
    if session is not None and session.running:
        session.stop_requested = True


def webcam_frame(
    services: AppServices,
    session: Session | None,
    frame: np.ndarray | None,
    settings: RunSettings,
    updates: SingleUpdates = SingleUpdates(),
) -> dict[str, Any]:
    """One webcam frame, queued in the session's live scheduler and fed with the frames waiting once they make a
    segment, if the engines are free now: never one model call per frame, and never a wait for an answer (its turns
    feed the frames meanwhile; on ZeroGPU the next call does). Starts a fresh session on the first frame or when the
    settings changed. The update shows how far behind live the memory is and any frames dropped."""
    state = session or Session()
    if frame is None:
        return {"session": state}
    started = False
    try:
        geometry = within_max_pixels(services.models.get(settings.model).geometry, settings.max_pixels)
        resized = resize_frames(np.asarray(frame, dtype=np.uint8)[None, ..., :3], geometry)
        size = tuple(resized.shape[1:3])
        if (
            state.settings != settings
            or state.group is None
            or not state.source.startswith("webcam")
            or state.frame_size != size
        ):
            state = start_session(
                services, settings, settings_lineup(settings), "webcam (live)", size, live_source=True
            )
            services.sessions.replace(session, state)
            started = True
        state.live.put(resized)
        if state.live.frames_waiting >= segment_frames():
            feed_now(state, updates)
    except USER_ERRORS as exc:
        message = str(exc)
        return drawn(state, lambda: {"session": state, "status": updates.status(state, error=message)})
    if not state.group or not state.group.frames_seen:
        return {"session": state, **(updates.fresh(state) if started else {})}
    return drawn(state, lambda: {**updates.live(state), **(updates.fresh(state) if started else {})})


def ask(
    session: Session | None, question: str, updates: PageUpdates, attribute: bool = False, max_new_tokens: int = 64
) -> Iterator[dict[str, Any]]:
    """Ask every engine that runs (each in its own dialogue; ``attribute``: each answer records what it looked at);
    yields the page's chats as the answers stream in, interleaved, and an ``ask_status`` line beside the question
    box: why it was not asked, or that it was; the last update adds what the answers change (``updates.answered``).

    The stream goes on while the answers decode (each on a fork of its engine's memory as it is now: its chunks enter
    between their tokens); a session freed meanwhile ends the answers with its reason.
    """
    state = session or Session()
    question = (question or "").strip()
    with state.turns:
        try:
            if state.freed and state.group is None:
                raise EngineError(state.freed)
            if not any(engine.memory.num_grids for engine in state.engines.values()):
                raise EngineError(updates.no_video)
            if not question:
                raise EngineError("type a question first")
            next(iter(state.engines.values())).check_question(question)
            refused = ""
        except EngineError as exc:
            refused = f"⚠️ {exc}"
        if not refused:
            state.last_used = time.monotonic()
            asked = {name: engine for name, engine in state.engines.items() if name not in state.stopped}
            for name in state.engines:
                reply = "" if name in asked else f"*{state.stopped[name]}; no answer.*"
                state.chat[name] += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    if refused:
        yield {"session": state, "ask_status": refused, **updates.chats(state)}
        return
    for _ in answer_into(state, asked, question, max_new_tokens, attribute):
        yield {"session": state, "ask_status": "⏳ answering…", **updates.chats(state)}
    yield drawn(state, lambda: answered(state, asked, question, updates), key="ask_status")


def answered(state: Session, asked: dict, question: str, updates: PageUpdates) -> dict[str, Any]:
    """The last update of a question (in the session's turn): each answer with its details in its chat pane."""
    answers = {name: state.engines[name].answers[-1] for name in asked}
    for name, answer in answers.items():
        state.chat[name][-1]["content"] = answer_markdown(state, answer, updates.answer_details)
    return {"session": state, **updates.chats(state), **updates.answered(state, question, answers)}


def new_conversation(session: Session | None, updates: PageUpdates) -> dict[str, Any]:
    """Every engine's dialogue and chat pane cleared (the memory stays)."""
    if session is not None:
        for engine in session.engines.values():
            engine.reset_dialogue()
        session.chat = {name: [] for name in session.engines}
    return {"session": session, **updates.chats(session), "ask_status": ""}


def redraw(session: Session | None, view: DisplayChoice) -> dict[str, Any]:
    """The single page's chart, newest-frames view, legend and policy views as ``view`` chooses, drawn in the
    session's turn: between two chunks, never while one is half-fed (its grid in the memory, its thumbnail not
    yet in the session)."""
    if session is None:
        return {"heatmap": None}
    with session.turns:
        return SingleUpdates(view).redraw(session)
