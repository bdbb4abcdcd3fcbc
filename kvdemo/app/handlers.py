"""What the app's buttons do, as plain functions (tested without a browser): start a session, stream a file
or the bundled sample, stream the webcam, ask both engines, start a new conversation. Each yields or returns
update dicts keyed by view name (:mod:`kvdemo.app.layout` maps them to components); errors a user can cause
end in a message, never an exception."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import viz, zerogpu
from ..engine import EngineError, StreamEngine
from ..streaming import EngineGroup
from ..video import resize_frames
from ..views import counted
from .gpu import Segment, answer_into, segment_frames, stream_segment
from .sessions import AppServices, RunSettings, Session
from .settings import FRAMES_PER_CHUNK, USER_ERRORS, open_stream, resolve_settings, within_max_pixels
from .views import (
    ViewChoice,
    answer_note,
    finish,
    fresh_views,
    heatmap_image,
    kept_previous,
    legend,
    live_update,
    occupancy_plot,
    policy_panels,
    status_text,
    write_report,
)


def start_session(
    services: AppServices,
    settings: RunSettings,
    source: str,
    frame_size: tuple[int, int],
    fps: float | None = None,
) -> Session:
    """A fresh session (engines behind one group) for ``settings`` and frames of ``frame_size`` (resized).

    The settings are resolved once (policy and :class:`~kvdemo.budget.Budget`) and the budget checked against
    one chunk of such frames. The caller's previous session is left alone: the pool replaces it once the new
    stream is under way. ``fps`` is the stream's real sampling rate when it differs from the setting (a file
    sampled faster than it was recorded streams at its own rate).
    """
    fps = fps or settings.fps
    model = services.models.get(settings.model)
    policy, budget = resolve_settings(settings)
    budget.check_chunk(*model.geometry.chunk_tokens(frame_size, FRAMES_PER_CHUNK))
    engines = {"policy": StreamEngine(model, policy, budget=budget, fps=fps)}
    if settings.baseline:
        cap = int(settings.cap_mb * 2**20) if settings.cap_mb and settings.cap_mb > 0 else None
        engines["full"] = StreamEngine(model, "full", fps=fps, max_cache_bytes=cap)
    return Session(settings=settings, group=EngineGroup(model, engines, fps), source=source, frame_size=tuple(frame_size))


def run_video(
    services: AppServices,
    session: Session | None,
    video_path: str | None,
    settings: RunSettings,
    view: ViewChoice = ViewChoice(),
) -> Iterator[dict[str, Any]]:
    """Stream a file (the bundled sample when ``video_path`` is None) into a fresh session; yields update dicts
    (keys: session, status, plot, heatmap, gallery, report, chart, coverage, legend, panels, chat panes and
    their titles). Errors end the run with a message, never an exception.

    The previous session and its views stay until the first chunk of the new stream has been fed; a run
    that fails before that leaves them as they were. ``request_stop`` ends the run after the current
    chunk with the report of what ran.
    """
    previous = session
    try:
        resolve_settings(settings)  # the settings' own errors first, before a file is opened
        geometry = within_max_pixels(services.models.get(settings.model).geometry, settings.max_pixels)
        video, episode = open_stream(geometry, video_path, settings.fps, settings.sample)
        state = start_session(services, settings, video.describe(), video.size, video.fps)
        state.episode = episode
    except USER_ERRORS as exc:
        yield kept_previous(previous, str(exc))
        return
    state.running = True
    total = video.num_frames
    committed = False
    try:
        yield {"session": state, "status": f"⏳ starting {video.describe()}"}
        chunks = video.chunks(segment_frames())  # decoded lazily, batch by batch, outside the session's turn
        current = next(chunks, None)
        while current is not None and not state.stop_requested:
            following = next(chunks, None)
            _, frames, times = current
            fed = False
            with state.turns.chunk():
                if state.freed:
                    break
                segment = Segment.of(state, frames, times, following is None, view, total)
                old = len(segment.thumbnails)
                for update in stream_segment(segment):
                    if "segment" in update:
                        fed = update["segment"].apply_to(state, old) > 0
                    elif committed and zerogpu.active():  # a segment of many chunks: show each as it comes
                        yield {"session": state, **drawn(update, state)}
            current = following
            if fed and not committed:
                services.sessions.replace(previous, state)
                committed = True
                yield {**live_update(state, view, state.group.frames_seen, total, force=True), **fresh_views(state)}
            elif fed:
                yield live_update(state, view, done=state.group.frames_seen, total=total)
    except USER_ERRORS as exc:
        if not committed:
            state.free()
            yield kept_previous(previous, str(exc))
            return
        yield {"session": state, "status": status_text(state, error=str(exc))}
        return
    finally:
        state.running = False
        if not committed:
            state.free()  # ended before its first chunk (an error, Stop, or the client went away)
    if not committed:
        yield kept_previous(previous, "stopped before the first chunk")
        return
    if state.freed:
        yield {"session": state, "status": status_text(state)}
        return
    stopped = state.stop_requested
    state.stop_requested = False
    done = state.group.frames_seen
    if stopped:
        state.stopped["run"] = f"stopped by the user at {done} of {counted(total, 'frame')}"
    else:
        state.source, state.lost_frames = video.describe(), video.lost_frames  # now knows the damaged frames
    final = finish(state, view)
    final["status"] = status_text(state, done, total if stopped else total - video.lost_frames, stopped=stopped)
    yield final


def drawn(update: dict[str, Any], state: Session) -> dict[str, Any]:
    """A GPU call's live update with the policy's declared views drawn here, where every thumbnail is."""
    if "views" in update:
        update = {**update, "panels": viz.draw_views(update["views"], state.thumbnails)}
        del update["views"]
    return update


def request_stop(session: Session | None) -> None:
    """Ask the session's running file stream to end after its current chunk (it then writes its report)."""
    if session is not None and session.running:
        session.stop_requested = True


def webcam_frame(
    services: AppServices,
    session: Session | None,
    frame: np.ndarray | None,
    settings: RunSettings,
    view: ViewChoice = ViewChoice(),
) -> dict[str, Any]:
    """One webcam frame: buffered into segments for the engines (never one model call per frame). Starts a
    fresh session on the first frame or when the settings changed."""
    state = session or Session()
    if frame is None:
        return {"session": state}
    started = False
    try:
        geometry = within_max_pixels(services.models.get(settings.model).geometry, settings.max_pixels)
        resized = resize_frames(np.asarray(frame, dtype=np.uint8)[None, ..., :3], geometry)
        size = tuple(resized.shape[1:3])
        if state.settings != settings or state.group is None or not state.source.startswith("webcam") or state.frame_size != size:
            state = start_session(services, settings, "webcam (live)", size)
            services.sessions.replace(session, state)
            started = True
        state.webcam_frames.append(resized[0])
        fed = False
        if len(state.webcam_frames) >= segment_frames():
            frames, state.webcam_frames = np.stack(state.webcam_frames), []
            with state.turns.chunk():
                if not state.freed:
                    segment = Segment.of(state, frames, None, False, view, None)
                    old = len(segment.thumbnails)
                    for item in stream_segment(segment):
                        if "segment" in item:
                            fed = item["segment"].apply_to(state, old) > 0
    except USER_ERRORS as exc:
        return {"session": state, "status": status_text(state, error=str(exc))}
    update = live_update(state, view) if fed else {"session": state}
    if started:
        update.update(fresh_views(state))
    return update


def ask(session: Session | None, question: str, max_new_tokens: int = 64) -> Iterator[dict[str, Any]]:
    """Ask both engines; yields {ask_status, policy_chat, full_chat} (the chats always as lists of messages, the
    status a line beside the question box: why it was not asked, or that it was). Answers stream interleaved.

    The question takes the session's turn before the stream's next chunk (the stream pauses meanwhile,
    and nothing frees the engines until the answer is done).
    """
    state = session or Session()
    question = (question or "").strip()
    with state.turns.question():
        try:
            if state.freed and state.engine is None:
                raise EngineError(state.freed)
            if state.engine is None or state.engine.memory.num_grids == 0:
                raise EngineError("no video yet: run a video or the webcam first, then ask")
            if not question:
                raise EngineError("type a question first")
            state.engine.check_question(question)
        except EngineError as exc:
            yield {"session": state, "ask_status": f"⚠️ {exc}", **chats(state)}
            return
        state.last_used = time.monotonic()
        asked = {}
        for name, engine in state.engines.items():
            state.chat[name].append({"role": "user", "content": question})
            if name in state.stopped:
                state.chat[name].append({"role": "assistant", "content": f"*{state.stopped[name]}; no answer.*"})
                continue
            state.chat[name].append({"role": "assistant", "content": ""})
            asked[name] = engine
        for _ in answer_into(state, asked, question, max_new_tokens):
            yield {"session": state, "ask_status": "⏳ answering…", **chats(state)}
        for name in asked:
            state.chat[name][-1]["content"] = _answer_markdown(state, name, state.engines[name].answers[-1])
        report = write_report(state)
    answered = " and ".join("the full cache" if name == "full" else engine.policy.name for name, engine in asked.items())
    status = f"✓ answered by {answered}" if asked else "⚠️ no engine answered: every engine has stopped"
    yield {"session": state, "ask_status": status, **chats(state), "report": report}


def chats(state: Session) -> dict[str, list[dict[str, str]]]:
    """Both chat panes as lists of messages (copies: Gradio keeps what it is given)."""
    return {"policy_chat": list(state.chat["policy"]), "full_chat": list(state.chat["full"])}


def _answer_markdown(state: Session, name: str, answer) -> str:
    text = answer.answer or "(empty answer)"
    tokens = counted(answer.tokens, "token")
    oldest = "the oldest turn was" if answer.dropped_turns == 1 else f"the {answer.dropped_turns} oldest turns were"
    dropped = (f" · {oldest} left out of the replayed dialogue (it keeps at most "
               f"{counted(state.group.stream.model.max_dialogue_tokens, 'token')})") if answer.dropped_turns else ""
    return (
        f"{text}\n\n<small>first token {answer.ttft_ms:.0f} ms · {tokens} in {answer.ms:.0f} ms · "
        f"cache {answer.cache_bytes / 2**20:.2f} MB, {counted(answer.visual_tokens, 'visual token')}{dropped}"
        f"{answer_note(state, answer)}</small>"
    )


def redraw(session: Session | None, view: ViewChoice) -> dict[str, Any]:
    """The chart, the newest-frames view, its legend and the policy's views as ``view`` chooses, drawn in the
    session's turn: between two chunks, never while one is half-fed (its grid in the memory, its thumbnail not
    yet in the session)."""
    if session is None:
        return {"heatmap": None}
    with session.turns.question():
        return {"plot": occupancy_plot(session, view.log_scale), "heatmap": heatmap_image(session, view),
                "legend": legend(session, view), "panels": policy_panels(session, view)}


def reset_chat(session: Session | None) -> dict[str, Any]:
    state = session or Session()
    for engine in state.engines.values():
        engine.reset_dialogue()
    state.chat = {"policy": [], "full": []}
    return {"session": state, "policy_chat": [], "full_chat": [], "ask_status": ""}
