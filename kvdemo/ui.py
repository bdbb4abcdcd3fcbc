"""The Gradio app: stream a video or the webcam into a policy engine and a full-cache baseline, watch
the cache live, see what survives, and chat with both side by side.

No model logic here: handlers drive :mod:`kvdemo.engine` and draw with :mod:`kvdemo.viz`. The handlers
are plain functions (tested without a browser); :func:`build_demo` wires them to components.

Per-session engine state lives in a :class:`Session` and the model work is done by functions that take
it explicitly (:func:`feed_frames` for a chunk, :func:`ask` for a question), so a stream segment or a
question can run as one call wherever the model is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .coverage import coverage
from .engine import EngineError, FrameStream, MemoryCapError, StreamEngine, check_chunk_fits, validate_budget
from .models.qwen_vl import DEFAULT_REAL_MODEL, ModelError, load_model, resolve_model_name
from .models.tiny import OFFLINE_NOTICES, TINY_NAME, TINY_RANDOM_NAME, TRAINED_MAX_PIXELS
from .policies import BudgetError, make_policy, policy_params
from .synthetic import Episode, grade, sample_episode, sample_manifest
from .video import (
    DEFAULT_MIN_PIXELS,
    RESIZE_FACTOR,
    TEMPORAL_PATCH_SIZE,
    VideoError,
    open_video,
    resize_frames,
    tokens_per_grid,
)
from . import viz, zerogpu

log = logging.getLogger("kvdemo")

FRAMES_PER_CHUNK = 2
#: File runs and webcam streams served at once; more wait in the queue.
STREAM_SLOTS = 2
#: Questions served at once, in their own slots: a question never waits for other sessions' streams,
#: and its own session's stream pauses between chunks while it is answered.
QUESTION_SLOTS = 2
#: Sessions whose engines are kept (``KVDEMO_MAX_SESSIONS``); starting one more frees the least recently used.
MAX_SESSIONS = int(os.environ.get("KVDEMO_MAX_SESSIONS", "8"))
#: A session's engines are freed this long after its browser tab goes away.
SESSION_TTL_S = 3600
#: Gradio's cache (uploads, reports, images sent to the browser): checked every 10 minutes, files
#: older than an hour deleted.
CACHE_CLEANUP = (600, 3600)
PLOT_EVERY_S = 0.5
#: The chat panes' own "Clear" button would clear the view but not the engines' dialogue (and it sits on
#: the first question's bubble): "New conversation" does both.
CSS = "#policy-chat button[aria-label='Clear'], #full-chat button[aria-label='Clear'] { display: none; }"
HEATMAP_EVERY_S = 0.35
GALLERY_EVERY_S = 3.0
UI_POLICIES = ["infinipot-v", "cords", "protokv", "hybridkv", "uniform", "sliding-window"]
#: Panel slots for the views a policy declares (``Policy.panels``, drawn by viz): as many as any policy has.
MAX_PANELS = 2
USER_ERRORS = (VideoError, BudgetError, EngineError, ModelError)

HOW_TO_READ = """
**Occupancy** (top chart): visual tokens and real KV-cache megabytes over stream time. The policy engine
grows to its budget `M`, compresses to `C` (▼ marks), and grows again: a sawtooth under the dashed line.
The full-cache baseline grows without bound.

**What survives**: the newest frames with the patches the cache still holds; dark patches were evicted.
*Aggregate* tints each patch by the share of (layer, KV head) copies still held. Pick one layer and
head and *colour by reason* to see why the policy kept each patch (InfiniPot-V: recent window, TaR,
VaN; CoRDS: recent tail, coreset frame, partial frame). Grey patches arrived after the last compression.
Every heatmap is drawn from the provenance the engine gathers with the same indices as the keys and
values, so it shows exactly what the cache holds.

**Chat**: one question goes to both engines; the dialogue is replayed as text after the video memory,
and the memory is unchanged by answering. Under each answer: time to first token and the cache size.

**Limits**: this app keeps the engines of at most {max_sessions} sessions (starting another frees the least
recently used one) and frees a session's engines an hour after its tab closes; files it serves (uploads,
reports, charts) are deleted after an hour.
"""


# --- process-wide models and sessions ------------------------------------------------------------------


_MODELS: dict[str, Any] = {}
_MODELS_LOCK = threading.Lock()


def model_by_name(name: str):
    """The model called ``name``, loaded once per process. A GPU call resolves its model here by name
    (a ZeroGPU worker is a fork of this process, so a model loaded at start-up is already there)."""
    name = resolve_model_name(name)
    with _MODELS_LOCK:
        if name not in _MODELS:
            _MODELS[name] = load_model(name)
        return _MODELS[name]


class ModelHub:
    """Process-wide resources: each model loaded once (sessions share it; engines never write to model
    weights), and the :class:`SessionPool` that bounds how many sessions keep engines."""

    def __init__(self, default: str | None = None, max_sessions: int = MAX_SESSIONS) -> None:
        self.default = resolve_model_name(default)
        self.sessions = SessionPool(max_sessions)

    def get(self, name: str | None = None):
        return model_by_name(name or self.default)

    def choices(self) -> list[str]:
        names = [self.default, TINY_NAME, TINY_RANDOM_NAME, DEFAULT_REAL_MODEL, "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct"]
        return list(dict.fromkeys(names))


class SessionPool:
    """The sessions holding engines in this process, at most ``limit``: admitting one more frees the
    engines of the least recently used other session (its next question or run says why)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the session limit must be at least 1, got {limit}")
        self.limit = limit
        self._sessions: list[Session] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def admit(self, session: Session) -> None:
        with self._lock:
            if session not in self._sessions:
                self._sessions.append(session)
            others = sorted((s for s in self._sessions if s is not session), key=lambda s: s.last_used)
            victims = others[: max(0, len(self._sessions) - self.limit)]
            self._sessions = [s for s in self._sessions if s not in victims]
        for victim in victims:  # outside the pool's lock: a victim may be mid-chunk or mid-answer
            with victim.turns.question():
                victim.free(f"this session's engines were freed to make room: the app keeps at most {self.limit} "
                            "sessions and this one was the least recently used; run the video again")
            log.info("freed the least recently used session (%d sessions at most)", self.limit)

    def release(self, session: Session) -> None:
        with self._lock:
            self._sessions = [s for s in self._sessions if s is not session]


# --- per-session state ---------------------------------------------------------------------------------


@dataclass
class RunSettings:
    model: str
    policy: str
    params: dict[str, Any]
    budget: int
    keep: int
    fps: float
    max_pixels: int
    baseline: bool
    cap_mb: float


class Turns:
    """Who uses one session's engines now: one stream chunk or one question at a time. A waiting
    question goes before the stream's next chunk, so it waits at most one chunk."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._busy = False
        self._questions_waiting = 0

    @contextmanager
    def chunk(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._busy and not self._questions_waiting)
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def question(self) -> Iterator[None]:
        with self._condition:
            self._questions_waiting += 1
            try:
                self._condition.wait_for(lambda: not self._busy)
            finally:
                self._questions_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._condition:
            self._busy = False
            self._condition.notify_all()


@dataclass(eq=False)  # sessions are compared by identity (the pool holds them in a list)
class Session:
    """One browser session's stream: its engines, thumbnails and dialogue (freed when the session ends,
    or earlier by the :class:`SessionPool`)."""

    settings: RunSettings | None = None
    engines: dict[str, StreamEngine] = field(default_factory=dict)
    stream: FrameStream | None = None
    thumbnails: list[np.ndarray] = field(default_factory=list)
    stopped: dict[str, str] = field(default_factory=dict)
    chat: dict[str, list[dict[str, str]]] = field(default_factory=lambda: {"policy": [], "full": []})
    source: str = ""
    #: The generated stream being played (its ground truth grades the answers); None for files and the webcam.
    episode: Episode | None = None
    lost_frames: int = 0
    frame_size: tuple[int, int] | None = None
    chunk_ms: float = 0.0
    coverage: dict[str, Any] | None = None
    #: Webcam frames (resized) waiting to make a segment (one GPU call per segment, never per frame).
    webcam_frames: list[np.ndarray] = field(default_factory=list)
    #: A file run is streaming; ``stop_requested`` ends it after the current chunk.
    running: bool = False
    stop_requested: bool = False
    #: Why the engines were freed early ("" while they are held).
    freed: str = ""
    last_used: float = field(default_factory=time.monotonic)
    turns: Turns = field(default_factory=Turns)
    last_plot: float = 0.0
    last_heatmap: float = 0.0
    last_gallery: float = 0.0
    _report_dir: str | None = None

    @property
    def report_dir(self) -> Path:
        """The folder for this session's downloads, created on first use (most sessions never need one)."""
        if self._report_dir is None:
            self._report_dir = tempfile.mkdtemp(prefix="kvdemo-")
        return Path(self._report_dir)

    def free(self, reason: str = "") -> None:
        self.engines.clear()
        self.thumbnails.clear()
        self.stream = None
        self.freed = reason
        if self._report_dir is not None:
            shutil.rmtree(self._report_dir, ignore_errors=True)
            self._report_dir = None

    def close(self) -> None:
        self.free()

    @property
    def policy(self) -> StreamEngine | None:
        return self.engines.get("policy")

    @property
    def model(self):
        engine = self.policy
        return engine.model if engine else None


def free_session(session: Session | None, hub: ModelHub | None = None) -> None:
    """Free a session's engines (between its chunks and after its answer, if one is running)."""
    if session is not None:
        if hub is not None:
            hub.sessions.release(session)
        with session.turns.question():
            session.close()


# --- settings -------------------------------------------------------------------------------------------


def parse_params(policy: str, values: dict[str, Any]) -> dict[str, Any]:
    """Form values of ``policy``'s parameters -> keyword arguments (blank number lists mean "none")."""
    params = {}
    for spec in policy_params(policy):
        if spec.name not in values:
            continue
        value = values[spec.name]
        try:
            if spec.kind == "numbers":
                text = str(value or "").strip().strip("[]()")
                value = [float(x) for x in text.replace(";", ",").split(",") if x.strip()] if text else None
            elif spec.kind == "int":
                value = int(value)
            elif spec.kind == "float":
                value = float(value)
            elif spec.kind == "bool":
                value = bool(value)
        except (TypeError, ValueError):
            kind = "numbers separated by commas" if spec.kind == "numbers" else f"a number ({spec.kind})"
            raise BudgetError(f"{policy}'s {spec.name} takes {kind}, got {value!r}") from None
        params[spec.name] = value
    return params


def chunk_tokens(size: tuple[int, int] | None, max_pixels: int, temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> tuple[int, str]:
    """Visual tokens of one chunk (``FRAMES_PER_CHUNK`` frames) and its shape in words, for frames resized
    to ``size`` (height, width) or, when the size is not known yet, the most ``max_pixels`` allows."""
    grids = -(-FRAMES_PER_CHUNK // temporal_patch_size)
    if size is not None:
        rows, cols = size[0] // RESIZE_FACTOR, size[1] // RESIZE_FACTOR
        return grids * tokens_per_grid(size), f"{grids} temporal grid(s) of {rows}x{cols} tokens"
    return grids * (int(max_pixels) // RESIZE_FACTOR**2), f"{FRAMES_PER_CHUNK} frames at max pixels"


def check_settings(policy: str, budget: Any, keep: Any, fps: Any, max_pixels: Any) -> tuple[int, int | None]:
    """The settings' numbers as the engine will see them; :class:`BudgetError` with a one-line reason if not.
    A policy sized by ``M`` alone (ProtoKV) ignores ``C``."""
    uses_keep = make_policy(policy).uses_keep
    keep = keep if uses_keep else None
    if budget is None or (uses_keep and keep is None):
        raise BudgetError("set both M and C" if uses_keep else "set M")
    if fps is None or float(fps) <= 0:
        raise BudgetError(f"sampling fps must be positive, got {fps}")
    if max_pixels is None or int(max_pixels) < RESIZE_FACTOR**2:
        raise BudgetError(f"max pixels must be at least {RESIZE_FACTOR**2} (one 28x28 patch), got {max_pixels}")
    budget_, keep_ = validate_budget(make_policy(policy), budget, keep)
    return budget_, keep_


def validate_settings(
    policy: str, budget: Any, keep: Any, fps: Any = 2.0, max_pixels: Any = 200704, video: str | None = None
) -> str:
    """A one-line verdict on the settings, shown as the user types: the same checks as Run, with one chunk
    of the uploaded ``video`` (resized) when there is one, else a chunk at ``max_pixels``."""
    try:
        budget_, keep_ = check_settings(policy, budget, keep, fps, max_pixels)
        size, name = None, ""
        if video:
            opened = open_video(video, fps=float(fps), max_pixels=int(max_pixels),
                                min_pixels=min(int(max_pixels), DEFAULT_MIN_PIXELS))
            size, name = opened.size, f" of {Path(video).name} ({opened.size[1]}x{opened.size[0]})"
        tokens, shape = chunk_tokens(size, max_pixels)
        check_chunk_fits(make_policy(policy), budget_, keep_, tokens, shape)
    except USER_ERRORS as exc:
        return f"⚠️ {exc}"
    except (TypeError, ValueError) as exc:
        return f"⚠️ not a number: {exc}"
    up_to = "" if size else "up to "
    chosen = make_policy(policy)
    if not chosen.uses_keep and hasattr(chosen, "split"):
        near, prototypes = chosen.split(budget_)
        return (f"✓ M={budget_} = a near window of {near} exact tokens + {prototypes} prototypes × "
                f"{chosen.pseudo_tokens} pseudo-tokens (C does not apply); one chunk{name} is {up_to}{tokens} "
                f"visual tokens and must fit the near window")
    return (f"✓ M={budget_}, C={keep_}: one chunk{name} is {up_to}{tokens} visual tokens; "
            f"M and M − C must each hold one chunk (≥ {tokens})")


def check_run_settings(settings: RunSettings) -> None:
    check_settings(settings.policy, settings.budget, settings.keep, settings.fps, settings.max_pixels)
    if settings.cap_mb is not None and settings.cap_mb < 0:
        raise BudgetError(f"the baseline memory cap must be 0 (no cap) or more MB, got {settings.cap_mb:g}")


# --- run ------------------------------------------------------------------------------------------------


def start_session(
    hub: ModelHub,
    settings: RunSettings,
    source: str,
    frame_size: tuple[int, int],
    fps: float | None = None,
) -> Session:
    """A fresh session (engines, stream) for ``settings`` and frames of ``frame_size`` (resized).

    The budget is checked against one chunk of such frames first. The caller's previous session is
    left alone: :func:`commit` replaces it once the new stream is under way. ``fps`` is the stream's real
    sampling rate when it differs from the setting (a file sampled faster than it was recorded streams at
    its own rate).
    """
    fps = fps or settings.fps
    model = hub.get(settings.model)
    policy = make_policy(settings.policy, **settings.params)
    budget, keep = validate_budget(policy, settings.budget, settings.keep)
    check_chunk_fits(policy, budget, keep, *chunk_tokens(frame_size, settings.max_pixels, model.temporal_patch_size))
    new = Session(settings=settings, source=source, frame_size=tuple(frame_size))
    new.engines["policy"] = StreamEngine(model, policy, budget=budget, keep=keep, fps=fps)
    if settings.baseline:
        cap = int(settings.cap_mb * 2**20) if settings.cap_mb and settings.cap_mb > 0 else None
        new.engines["full"] = StreamEngine(model, "full", fps=fps, max_cache_bytes=cap)
    new.stream = FrameStream(model, fps)
    return new


def commit(hub: ModelHub, previous: Session | None, new: Session) -> None:
    """``new`` replaces ``previous`` as the session's stream: the previous engines are freed and the new
    ones count against the process's session limit."""
    if previous is not None and previous is not new:
        free_session(previous, hub)
    hub.sessions.admit(new)


def fresh_views(state: Session) -> dict[str, Any]:
    """What a newly started stream clears or relabels: chat panes and their titles, the previous run's
    coverage and downloads."""
    return {"policy_title": chat_title(state, "policy"), "full_title": chat_title(state, "full"),
            "policy_chat": [], "full_chat": [], "coverage": None, "report": None, "chart": None}


def feed_frames(session: Session, frames: np.ndarray, times_s: np.ndarray | None, flush: bool = False) -> bool:
    """Push frames through the session's stream into every running engine; True if a chunk was fed.
    The caller holds the session's turn (:meth:`Turns.chunk`)."""
    chunk = session.stream.push(frames, times_s) if len(frames) else None
    if chunk is None and flush:
        chunk = session.stream.flush()
    if chunk is None:
        return False
    start = time.perf_counter()
    for name, engine in session.engines.items():
        if name in session.stopped:
            continue
        try:
            engine.feed_chunk(chunk)
        except MemoryCapError as exc:
            session.stopped[name] = str(exc)
        except RuntimeError as exc:
            if "out of memory" not in str(exc).lower():
                raise
            session.stopped[name] = f"stopped: out of memory at {engine.frames_fed} frames"
    # One thumbnail per temporal grid: its first frame among those pushed now (a webcam grid pairs the
    # previous frame with this one; its thumbnail is this one).
    for g in range(chunk.num_grids):
        session.thumbnails.append(viz.thumbnail(frames[min(2 * g, len(frames) - 1)]))
    session.chunk_ms = chunk.encode_ms + (time.perf_counter() - start) * 1000
    session.last_used = time.monotonic()
    return True


# --- model work: GPU calls that take and return the session's state explicitly ---------------------------

#: Frames per GPU call when calls cross a process boundary (a ZeroGPU Space, or its emulation): every call
#: pickles the session's engines in and out and waits for a GPU, so one call streams a segment of frames
#: (a question waits for at most one segment). Elsewhere a call is one chunk (a question waits at most one).
ZEROGPU_SEGMENT_FRAMES = 16
#: Thumbnails a stream segment sends along: what the live heatmap shows.
SEGMENT_THUMBNAILS = 4


def segment_frames() -> int:
    return ZEROGPU_SEGMENT_FRAMES if zerogpu.active() else FRAMES_PER_CHUNK


@dataclass
class Segment:
    """Everything one stream-segment call needs, and what it changes (see :func:`stream_segment`).

    ``thumbnails`` holds the newest :data:`SEGMENT_THUMBNAILS` thumbnails at their grid index (older ones
    are None); the call appends the new grids' thumbnails.
    """

    model: str
    engines: dict[str, StreamEngine]
    stream: FrameStream
    stopped: dict[str, str]
    frames: np.ndarray
    times: np.ndarray | None
    flush: bool
    thumbnails: list[np.ndarray | None]
    view: tuple[str, str, bool]
    done: int
    total: int | None
    source: str
    chunk_ms: float = 0.0
    fed: int = 0

    @classmethod
    def of(cls, state: Session, frames: np.ndarray, times: np.ndarray | None, flush: bool,
           view: tuple[str, str, bool], total: int | None) -> "Segment":
        old = len(state.thumbnails)
        recent = [None] * max(0, old - SEGMENT_THUMBNAILS) + state.thumbnails[-SEGMENT_THUMBNAILS:]
        return cls(state.settings.model, state.engines, state.stream, state.stopped, frames, times, flush, recent, view,
                   state.stream.frames_seen, total, state.source)

    def apply_to(self, state: Session, old_thumbnails: int) -> int:
        """Adopt what the call changed (the same objects when it ran in place, new ones from a worker, which
        come back without their model: it is attached again here, the memory stays on the CPU); returns the
        chunks the call fed."""
        model = model_by_name(self.model)
        for engine in self.engines.values():
            engine.attach(model)
        self.stream.model = model
        state.engines, state.stream, state.stopped = self.engines, self.stream, self.stopped
        state.thumbnails.extend(self.thumbnails[old_thumbnails:])
        state.chunk_ms = self.chunk_ms or state.chunk_ms
        state.last_used = time.monotonic()
        return self.fed


def segment_duration(segment: Segment) -> int:
    """Seconds a ZeroGPU call may hold the GPU for ``segment``: a start-up allowance plus ~1 s per frame
    (vision encoding, prefill and compression of a Qwen2.5-VL at video resolution take well under that on
    ZeroGPU's hardware), within ZeroGPU's per-request cap."""
    return int(min(120, 20 + len(segment.frames)))


@zerogpu.gpu(duration=segment_duration)
def stream_segment(segment: Segment) -> Iterator[dict[str, Any]]:
    """Stream the segment's frames into its engines chunk by chunk; after each chunk yield a light live update
    (status, occupancy chart, newest-frames heatmap), and finally ``{"segment": segment}``.

    On ZeroGPU (or its emulation) this runs in a forked worker: the engines arrive pickled without their
    model, the model is resolved here by name, and the engines go back on the CPU.
    """
    model = model_by_name(segment.model)
    for engine in segment.engines.values():
        engine.bind(model)
    segment.stream.model = model
    state = Session(engines=segment.engines, stream=segment.stream, thumbnails=segment.thumbnails,
                    stopped=segment.stopped, source=segment.source)
    count = len(segment.frames)
    for start in range(0, max(count, 1), FRAMES_PER_CHUNK):
        last = start + FRAMES_PER_CHUNK >= count
        times = segment.times[start : start + FRAMES_PER_CHUNK] if segment.times is not None else None
        if feed_frames(state, segment.frames[start : start + FRAMES_PER_CHUNK], times, flush=last and segment.flush):
            segment.fed += 1
            # The gallery is drawn by the caller, which holds every thumbnail.
            update = live_update(state, segment.view, segment.stream.frames_seen, segment.total, force=segment.fed == 1,
                                 gallery=False)
            update.pop("session", None)
            yield update
    segment.chunk_ms = state.chunk_ms  # the thumbnails of the new grids were appended to segment.thumbnails
    if zerogpu.active():
        for engine in segment.engines.values():
            engine.to("cpu")
    yield {"segment": segment}


def answer_duration(model: str, engines: dict[str, StreamEngine], question: str, max_new_tokens: int) -> int:
    """Seconds a ZeroGPU call may hold the GPU for one question to every engine (~0.1 s per token each)."""
    return int(min(120, 15 + 0.1 * max_new_tokens * len(engines)))


@zerogpu.gpu(duration=answer_duration)
def answer_question(model: str, engines: dict[str, StreamEngine], question: str, max_new_tokens: int) -> Iterator[dict[str, Any]]:
    """Ask every engine; yields ``{"piece": (engine name, text)}`` as tokens come, interleaved, and finally
    ``{"answered": {name: answer state}, "engines": {name: engine}}``: what answering changed (answering
    never changes the memory), which is all a ZeroGPU worker sends back for most engines, and the whole
    engine of a policy whose question ran a compression pass first (HybridKV's ``classify_with=question``)."""
    resolved = model_by_name(model)
    passes = {}
    for name, engine in engines.items():
        engine.bind(resolved)
        passes[name] = engine.stats.compressions
    generators = {name: engine.ask(question, max_new_tokens) for name, engine in engines.items()}
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


def status_text(
    session: Session, done: int | None = None, total: int | None = None, error: str = "", stopped: bool = False
) -> str:
    """The status line: frames, tokens, MB, ms per chunk, compression overhead."""
    lines = []
    if error:
        lines.append(f"⚠️ **{error}**")
    engine = session.policy
    if engine is None and session.freed and not error:
        lines.append(f"⚠️ **{session.freed}**")
    if engine is not None:
        stats = engine.stats
        overhead = f"{100 * stats.compress_ms / stats.prefill_ms:.1f}%" if stats.prefill_ms else "n/a"
        progress = f"{done}/{total} frames" if total else f"{engine.frames_fed} frames"
        if stopped:
            progress = f"stopped at {progress}"
        sizes = f"M={engine.budget}" + (f", C={engine.keep}" if engine.keep is not None else "")
        offloaded = engine.memory.offloaded_bytes
        lines.append(
            f"**{progress}** · {engine.policy.name}: {engine.memory.visual_tokens} visual tokens "
            f"({sizes}), {engine.memory.nbytes / 2**20:.2f} MB"
            + (f" + {offloaded / 2**20:.2f} MB offloaded" if offloaded else "")
            + f" · {session.chunk_ms:.0f} ms/chunk · {stats.compressions} compressions, overhead {overhead} of prefill"
        )
        full = session.engines.get("full")
        if full is not None:
            state = session.stopped.get("full")
            lines.append(
                f"full cache: {full.memory.visual_tokens} visual tokens, {full.memory.nbytes / 2**20:.2f} MB"
                + (f" — {state}" if state else "")
            )
        if session.source:
            lines.append(f"<small>{session.source}</small>")
    return "\n\n".join(lines) if lines else "Ready: upload a video or pick the sample, then Run."


def kept_previous(previous: Session | None, error: str) -> dict[str, Any]:
    """A run that failed before its first chunk: the previous session and its views stay as they were;
    the status says what failed (and, if there is one, that the previous run is what is shown)."""
    status = f"⚠️ **{error}**"
    if previous is not None and previous.policy is not None:
        status += f"\n\n<small>Still showing the previous run: {previous.source}</small>"
    return {"session": previous or Session(), "status": status}


def policy_label(policy: str, budget: Any, keep: Any, bounded: bool = True) -> str:
    """"**infinipot-v**, M=1024 C=768" (Markdown; "**protokv**, M=1024" for a policy sized by M alone)."""
    if not bounded:
        return f"**{policy}**"
    return f"**{policy}**, M={budget}" + (f" C={keep}" if keep is not None and make_policy(policy).uses_keep else "")


def chat_title(state: Session, name: str) -> str:
    """The label over a chat pane: the policy and its numbers, or the full cache (and whether it runs)."""
    settings = state.settings
    if name == "policy":
        engine = state.policy
        if engine is None:
            return "**policy engine**"
        return policy_label(engine.policy.name, engine.budget, engine.keep, engine.policy.bounded)
    if settings is not None and not settings.baseline:
        return "**full cache** (baseline off)"
    cap = f", stops at {settings.cap_mb:g} MB" if settings is not None and settings.cap_mb and settings.cap_mb > 0 else ""
    return f"**full cache**{cap}"


def occupancy_plot(session: Session):
    engine = session.policy
    if engine is None:
        return None
    series = {_series_label(engine.policy.name, engine.budget): engine.memory.timeline}
    if "full" in session.engines:
        series["full cache"] = session.engines["full"].memory.timeline
    return viz.occupancy_figure(series, engine.budget)


def empty_occupancy_plot(policy: str, budget: int):
    """The chart before any run (drawn at page load, so the browser has plotly.js ready for the first run)."""
    return viz.occupancy_figure({_series_label(policy, budget): [], "full cache": []}, budget)


def _series_label(policy: str, budget: int | None) -> str:
    return f"{policy} at M={budget}"


def heatmap_image(session: Session, layer: str = "all", head: str = "all", by_reason: bool = False) -> np.ndarray | None:
    engine = session.policy
    if engine is None or engine.memory.num_grids == 0:
        return None
    return viz.engine_strip(engine, session.thumbnails, *_layer_head(layer, head), by_reason=by_reason)


def _layer_head(layer: str | None, head: str | None) -> tuple[int | None, int | None]:
    return (None if layer in (None, "all") else int(layer)), (None if head in (None, "all") else int(head))


def policy_panels(session: Session, layer: str = "all", head: str = "all") -> list[viz.Panel]:
    """The views the session's policy declares, drawn for the chosen layer and KV head."""
    engine = session.policy
    if engine is None or engine.memory.num_grids == 0:
        return []
    return viz.policy_panels(engine, session.thumbnails, *_layer_head(layer, head))


def gallery_items(session: Session) -> list[tuple[np.ndarray, str]]:
    engine = session.policy
    if engine is None:
        return []
    return viz.engine_gallery(engine, session.thumbnails)


def write_report(session: Session) -> str | None:
    """The run report (the CLI's JSON format, plus the baseline's report) as a file to download."""
    engine = session.policy
    if engine is None:
        return None
    report = engine.report(video=session.source, lost_frames=session.lost_frames)
    if "full" in session.engines:
        report["baseline"] = session.engines["full"].report(video=session.source, lost_frames=session.lost_frames)
    if session.stopped:
        report["stopped"] = dict(session.stopped)
    if session.coverage:
        report["coverage"] = session.coverage
    report_path = session.report_dir / "kvdemo-report.json"
    report_path.write_text(json.dumps(report, indent=1))
    return str(report_path)


def write_chart(session: Session | None) -> str | None:
    """The occupancy chart as a self-contained HTML file (plotly.js inside, ~5 MB: it opens offline), made
    only when asked for."""
    if session is None or session.policy is None:
        return None
    chart_path = session.report_dir / "kvdemo-occupancy.html"
    occupancy_plot(session).write_html(str(chart_path), include_plotlyjs=True)
    return str(chart_path)


def run_video(
    hub: ModelHub,
    session: Session | None,
    video_path: str | None,
    settings: RunSettings,
    view: tuple[str, str, bool] = ("all", "all", False),
) -> Iterator[dict[str, Any]]:
    """Stream a file into a fresh session; yields update dicts (keys: session, status, plot, heatmap,
    gallery, report, chart, coverage, legend, chat panes and their titles). Errors end the run with a
    message, never an exception.

    The previous session and its views stay until the first chunk of the new stream has been fed; a run
    that fails before that leaves them as they were. ``request_stop`` ends the run after the current
    chunk with the report of what ran.
    """
    previous = session
    try:
        check_run_settings(settings)
        min_pixels = min(settings.max_pixels, hub.get(settings.model).min_pixels)
        episode = None if video_path else sample_episode()
        if episode is None:
            video = open_video(Path(video_path), fps=settings.fps, max_pixels=settings.max_pixels, min_pixels=min_pixels)
        else:
            video = episode.video.sampled(settings.fps).resized(min_pixels, settings.max_pixels)
        state = start_session(hub, settings, video.describe(), video.size, video.fps)
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
                        yield {"session": state, **update}
            current = following
            if fed and not committed:
                commit(hub, previous, state)
                committed = True
                yield {**live_update(state, view, state.stream.frames_seen, total, force=True), **fresh_views(state)}
            elif fed:
                yield live_update(state, view, done=state.stream.frames_seen, total=total)
    except USER_ERRORS as exc:
        if not committed:
            state.close()
            yield kept_previous(previous, str(exc))
            return
        yield {"session": state, "status": status_text(state, error=str(exc))}
        return
    finally:
        state.running = False
        if not committed:
            state.close()  # ended before its first chunk (an error, Stop, or the client went away)
    if not committed:
        yield kept_previous(previous, "stopped before the first chunk")
        return
    if state.freed:
        yield {"session": state, "status": status_text(state)}
        return
    stopped = state.stop_requested
    state.stop_requested = False
    if stopped:
        state.stopped["run"] = f"stopped by the user at {state.stream.frames_seen} of {total} frames"
    else:
        state.source, state.lost_frames = video.describe(), video.lost_frames  # now knows the damaged frames
    final = finish(state, view)
    done = state.stream.frames_seen
    final["status"] = status_text(state, done, total if stopped else total - video.lost_frames, stopped=stopped)
    yield final


def request_stop(session: Session | None) -> None:
    """Ask the session's running file stream to end after its current chunk (it then writes its report)."""
    if session is not None and session.running:
        session.stop_requested = True


def live_update(state: Session, view: tuple[str, str, bool], done: int | None = None, total: int | None = None,
                force: bool = False, gallery: bool = True) -> dict[str, Any]:
    """Status every chunk; plot, heatmap and (``gallery``) the gallery at most a few times per second."""
    now = time.monotonic()
    update: dict[str, Any] = {"session": state, "status": status_text(state, done, total)}
    if force or now - state.last_plot >= PLOT_EVERY_S:
        update["plot"] = occupancy_plot(state)
        state.last_plot = now
    if force or now - state.last_heatmap >= HEATMAP_EVERY_S:
        update["heatmap"] = heatmap_image(state, *view)
        update["panels"] = policy_panels(state, *view[:2])
        update["legend"] = legend(state, view)
        state.last_heatmap = now
    if gallery and (force or now - state.last_gallery >= GALLERY_EVERY_S):
        update["gallery"] = gallery_items(state)
        state.last_gallery = now
    return update


def finish(state: Session, view: tuple[str, str, bool]) -> dict[str, Any]:
    """Final update of a run: everything redrawn, the coverage CDF (with a baseline), the report."""
    update = live_update(state, view, force=True)
    full = state.engines.get("full")
    if full is not None and "full" not in state.stopped and state.policy is not None and state.policy.memory.num_grids:
        state.coverage = {state.policy.policy.name: coverage(full.memory, state.policy.memory)}
        update["coverage"] = viz.coverage_figure(state.coverage)
    update["report"] = write_report(state)
    return update


def legend(state: Session, view: tuple[str, str, bool] = ("all", "all", False)) -> str:
    """What the newest-frames view's colours mean for this policy and view."""
    engine = state.policy
    layer, head = _layer_head(*view[:2])
    if engine is not None and not (view[2] and layer is not None and head is not None) and engine.memory.num_grids:
        fractions = viz.status_fractions(engine, layer, head)
        if fractions is not None:
            present = np.array([code for code, share in zip(viz.STATUS_COLOURS, fractions) if share.any()])
            return viz.status_legend(present) + " (tint = share of the (layer, KV head) copies in each state)"
    names = engine.policy.reason_names if engine else {}
    if names and view[2]:
        return viz.legend_text(names)
    note = " Pick a layer and a KV head to see what one head holds" + (", and colour by reason." if names else ".")
    return "Tint = share of (layer, KV head) copies held; dark = evicted." + (note if engine is not None else "")


# --- webcam ---------------------------------------------------------------------------------------------


def webcam_frame(
    hub: ModelHub,
    session: Session | None,
    frame: np.ndarray | None,
    settings: RunSettings,
    view: tuple[str, str, bool] = ("all", "all", False),
) -> dict[str, Any]:
    """One webcam frame: buffered into temporal-grid chunks for the engines (never one model call per
    frame). Starts a fresh session on the first frame or when the settings changed."""
    state = session or Session()
    if frame is None:
        return {"session": state}
    started = False
    try:
        min_pixels = min(settings.max_pixels, hub.get(settings.model).min_pixels)
        resized = resize_frames(np.asarray(frame, dtype=np.uint8)[None, ..., :3], min_pixels, settings.max_pixels)
        size = tuple(resized.shape[1:3])
        if state.settings != settings or state.stream is None or not state.source.startswith("webcam") or state.frame_size != size:
            check_run_settings(settings)
            state = start_session(hub, settings, "webcam (live)", size)
            commit(hub, session, state)
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


# --- chat -----------------------------------------------------------------------------------------------


def ask(session: Session | None, question: str, max_new_tokens: int = 64) -> Iterator[dict[str, Any]]:
    """Ask both engines; yields {policy_chat, full_chat, status}. Answers stream interleaved.

    The question takes the session's turn before the stream's next chunk (the stream pauses meanwhile,
    and nothing frees the engines until the answer is done).
    """
    state = session or Session()
    question = (question or "").strip()
    with state.turns.question():
        if state.freed and state.policy is None:
            yield {"session": state, "status": status_text(state, error=state.freed)}
            return
        if state.policy is None or state.policy.memory.num_grids == 0:
            yield {"session": state, "status": status_text(state, error="no video yet: run a video or the webcam first, then ask")}
            return
        if not question:
            yield {"session": state, "status": status_text(state, error="type a question first")}
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
        texts = {name: "" for name in asked}
        last_yield = 0.0
        for item in answer_question(state.settings.model, asked, question, max_new_tokens):
            if "answered" in item:
                for name, engine in item["engines"].items():  # its question ran a pass: the memory changed
                    state.engines[name] = engine.attach(state.engines[name].model)
                for name, answered in item["answered"].items():
                    state.engines[name].load_answer_state(answered)
                    state.chat[name][-1]["content"] = _answer_markdown(state, name, state.engines[name].answers[-1])
                break
            name, piece = item["piece"]
            texts[name] += piece
            state.chat[name][-1]["content"] = texts[name]
            if time.monotonic() - last_yield > 0.1:
                last_yield = time.monotonic()
                yield {"session": state, "policy_chat": list(state.chat["policy"]), "full_chat": list(state.chat["full"])}
        report = write_report(state)
    yield {"session": state, "policy_chat": list(state.chat["policy"]), "full_chat": list(state.chat["full"]), "report": report}


def _answer_markdown(state: Session, name: str, answer) -> str:
    text = answer.answer or "(empty answer)"
    return (
        f"{text}\n\n<small>first token {answer.ttft_ms:.0f} ms · {answer.tokens} tokens in {answer.ms:.0f} ms · "
        f"cache {answer.cache_bytes / 2**20:.2f} MB, {answer.visual_tokens} visual tokens{answer_note(state, answer)}</small>"
    )


def answer_note(state: Session, answer) -> str:
    """What an answer is worth: graded against the ground truth on a generated stream; on other inputs,
    a warning when the model is an offline tiny one (random, or trained only on generated streams)."""
    model = state.model
    if model is not None and model.random_weights:
        return " · random weights"
    if state.episode is not None:
        return " · " + grade(state.episode, answer.question, answer.answer, state.policy.last_time_s).note
    if model is not None and model.notice:
        return " · the tiny model knows only its generated streams: on this video its answers mean little"
    return ""


def reset_chat(session: Session | None) -> dict[str, Any]:
    state = session or Session()
    for engine in state.engines.values():
        engine.reset_dialogue()
    state.chat = {"policy": [], "full": []}
    return {"session": state, "policy_chat": [], "full_chat": []}


# --- layout ---------------------------------------------------------------------------------------------


def default_budget(model_name: str) -> tuple[int, int, int]:
    """(M, C, max pixels) defaults: the paper's 6144/4608 at Qwen's video resolution on a real model;
    budgets that compress visibly within a short clip on the tiny models (the trained one at the 112 x 112
    frames it was trained on, 16 tokens per frame pair: M = 96 holds 12 s of the 40 s sample, and M - C = 24,
    like ProtoKV's near window at M = 96, holds a chunk at its max pixels, 20 tokens)."""
    name = resolve_model_name(model_name)
    if name == TINY_NAME:
        return 96, 72, TRAINED_MAX_PIXELS
    if name == TINY_RANDOM_NAME:
        return 1024, 768, 256 * 28 * 28
    return 6144, 4608, 768 * 28 * 28


def build_demo(hub: ModelHub | None = None):
    """The Blocks app (launch it with :func:`launch`)."""
    import gradio as gr

    hub = hub or ModelHub()
    budget0, keep0, pixels0 = default_budget(hub.default)
    sample = sample_episode()

    with gr.Blocks(title="kvdemo: KV-cache compression for streaming video", delete_cache=CACHE_CLEANUP) as demo:
        session = gr.State(value=None, time_to_live=SESSION_TTL_S, delete_callback=lambda state: free_session(state, hub))
        gr.Markdown(
            "# kvdemo — what survives in the KV cache\n"
            "Stream a video into a vision-language model under a hard KV-cache budget, watch the cache, "
            "see which patches survive, and ask questions of the compressed memory and of a full-cache baseline."
        )
        banner = gr.Markdown(banner_html(hub.default), visible=bool(banner_html(hub.default)), elem_id="banner")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                with gr.Tab("Video"):
                    video = gr.Video(label="Upload a video (mp4, mkv, mov, webm, avi)", sources=["upload"], height=220)
                    with gr.Row():
                        run_button = gr.Button("Run", variant="primary", elem_id="run-button")
                        sample_button = gr.Button("Run the bundled sample", elem_id="sample-button")
                        stop_button = gr.Button("Stop", variant="stop", elem_id="stop-button")
                    with gr.Accordion("What the bundled sample shows", open=False):
                        gr.Markdown(sample_manifest(sample), elem_id="sample-manifest")
                with gr.Tab("Webcam"):
                    webcam = gr.Image(label="Webcam (frames are buffered into chunks)", sources=["webcam"],
                                      streaming=True, type="numpy", height=220, elem_id="webcam")
                with gr.Accordion("Settings", open=True):
                    model = gr.Dropdown(hub.choices(), value=hub.default, label="Model", allow_custom_value=True, elem_id="model",
                                        info="tiny runs offline on the CPU (trained on generated streams; tiny-random: "
                                             "random weights); Qwen ids need a GPU and the Hub")
                    policy = gr.Dropdown(UI_POLICIES, value="infinipot-v", label="Policy", elem_id="policy")
                    with gr.Row():
                        budget = gr.Number(budget0, label="M (max visual tokens)", precision=0, elem_id="budget")
                        keep = gr.Number(keep0, label="C (kept by a compression)", precision=0, elem_id="keep")
                    budget_check = gr.Markdown(validate_settings("infinipot-v", budget0, keep0, 2.0, pixels0),
                                               label="Settings check", elem_id="budget-check")
                    with gr.Row():
                        fps = gr.Slider(0.5, 8, value=2, step=0.5, label="Sampling fps")
                        max_pixels = gr.Number(pixels0, label="Max pixels per frame", precision=0,
                                               info="frames are resized like Qwen: sides multiples of 28")
                    param_inputs, groups = {}, {}
                    with gr.Accordion("Policy parameters (the papers' defaults)", open=False, elem_id="policy-params"):
                        for name in UI_POLICIES:
                            with gr.Group(visible=name == "infinipot-v") as group:
                                for spec in policy_params(name):
                                    key = f"{name}_{spec.name}".replace("-", "_")
                                    param_inputs[key] = (name, spec.name, _param_component(gr, spec, name))
                            groups[name] = group
                    with gr.Row():
                        baseline = gr.Checkbox(True, label="Full-cache baseline")
                        cap_mb = gr.Number(baseline_cap_default(), label="Baseline memory cap (MB)", precision=0,
                                           info="0 = no cap")
            with gr.Column(scale=2):
                status = gr.Markdown(status_text(Session()), label="Status", elem_id="status")
                plot = gr.Plot(empty_occupancy_plot("infinipot-v", budget0), label="Cache occupancy", show_label=False, elem_id="occupancy")
                with gr.Row():
                    view_layer = gr.Dropdown(["all"], value="all", label="Layer", scale=1)
                    view_head = gr.Dropdown(["all"], value="all", label="KV head", scale=1)
                    by_reason = gr.Checkbox(False, label="Colour by reason (one layer and head)", scale=2)
                gr.Markdown("**Newest frames: what survives**")
                heatmap = gr.Image(label="Newest frames: what survives", show_label=False, format="jpeg", type="numpy",
                                   interactive=False, elem_id="heatmap")
                legend_box = gr.Markdown(legend(Session()), label="Legend")
                # The views the chosen policy declares (Policy.panels), drawn by viz: slots filled in order.
                panel_slots = []
                for index in range(MAX_PANELS):
                    with gr.Column(visible=False, elem_id=f"panel-{index}") as panel_box:
                        panel_text = gr.Markdown(label=f"Policy view {index + 1}")
                        panel_image = gr.Image(label=f"Policy view {index + 1} (image)", show_label=False, format="jpeg",
                                               type="numpy", interactive=False, visible=False, elem_id=f"panel-{index}-image")
                        panel_plot = gr.Plot(label=f"Policy view {index + 1} (chart)", show_label=False, visible=False,
                                             elem_id=f"panel-{index}-plot")
                    panel_slots.append((panel_box, panel_text, panel_image, panel_plot))
                with gr.Accordion("Every frame so far", open=False):
                    gallery = gr.Gallery(label="What survives of each frame", columns=6, height=300, format="jpeg")
                coverage_plot = gr.Plot(label="Coverage of the full cache (CDF)", visible=False)
                with gr.Row():
                    question = gr.Textbox(label="Ask both engines", placeholder="What happens in the video?",
                                          scale=4, elem_id="question")
                    ask_button = gr.Button("Ask", variant="primary", scale=1, elem_id="ask-button")
                    clear_button = gr.Button("New conversation", scale=1)
                examples = gr.Dataset(components=[question], samples=[[q.text] for q in sample.questions],
                                      label="Questions about the bundled sample (click to ask both engines)",
                                      elem_id="examples")
                with gr.Row():
                    with gr.Column():
                        policy_title = gr.Markdown(policy_label("infinipot-v", budget0, keep0), label="Policy chat title",
                                                   elem_id="policy-chat-title")
                        policy_chat = gr.Chatbot(label="Policy engine chat", show_label=False, height=300,
                                                 buttons=["copy"], elem_id="policy-chat")
                    with gr.Column():
                        full_title = gr.Markdown(chat_title(Session(), "full"), label="Full cache chat title",
                                                 elem_id="full-chat-title")
                        full_chat = gr.Chatbot(label="Full cache chat", show_label=False, height=300,
                                               buttons=["copy"], elem_id="full-chat")
                with gr.Row():
                    report_file = gr.File(label="Run report (JSON)", interactive=False)
                    with gr.Column():
                        chart_file = gr.File(label="Occupancy chart (HTML)", interactive=False, elem_id="chart-file")
                        chart_button = gr.Button("Export the chart as HTML (~5 MB, opens offline)", size="sm",
                                                 elem_id="chart-button")
                with gr.Accordion("How to read this", open=False):
                    gr.Markdown(HOW_TO_READ.format(max_sessions=hub.sessions.limit))

        names = {"session": session, "status": status, "plot": plot, "heatmap": heatmap, "gallery": gallery,
                 "report": report_file, "chart": chart_file, "coverage": coverage_plot, "legend": legend_box,
                 "policy_title": policy_title, "full_title": full_title, "policy_chat": policy_chat, "full_chat": full_chat}
        run_outputs = list(names.values())
        ask_outputs = [session, status, policy_chat, full_chat, report_file]
        settings_inputs = {"model": model, "policy": policy, "budget": budget, "keep": keep, "fps": fps,
                           "max_pixels": max_pixels, "baseline": baseline, "baseline_cap_mb": cap_mb,
                           **{key: component for key, (_, _, component) in param_inputs.items()},
                           "view_layer": view_layer, "view_head": view_head, "colour_by_reason": by_reason}

        panel_components = [component for slot in panel_slots for component in slot]
        run_outputs += panel_components

        def panel_updates(panels: list[viz.Panel]) -> dict[Any, Any]:
            out = {}
            for index, (box, text, image, plot) in enumerate(panel_slots):
                panel = panels[index] if index < len(panels) else None
                out[box] = gr.update(visible=panel is not None)
                if panel is not None:
                    out[text] = f"**{panel.title}** — {panel.caption}"
                    out[image] = gr.update(value=panel.value if panel.kind == "image" else None, visible=panel.kind == "image")
                    out[plot] = gr.update(value=panel.value if panel.kind == "plot" else None, visible=panel.kind == "plot")
            return out

        def to_components(update: dict[str, Any]) -> dict[Any, Any]:
            out = {names[key]: value for key, value in update.items() if key in names}
            if "coverage" in update:
                out[coverage_plot] = gr.update(value=update["coverage"], visible=update["coverage"] is not None)
            if "panels" in update:
                out.update(panel_updates(update["panels"]))
            return out

        def settings_from(values: dict[str, Any]) -> tuple[RunSettings, tuple[str, str, bool]]:
            chosen = values["policy"]
            form = {field_name: values[key] for key, (owner, field_name, _) in param_inputs.items() if owner == chosen}
            settings = RunSettings(
                model=values["model"] or hub.default, policy=chosen, params=parse_params(chosen, form),
                budget=values["budget"], keep=values["keep"] if make_policy(chosen).uses_keep else None,
                fps=float(values["fps"] or 0),
                max_pixels=int(values["max_pixels"] or 0), baseline=bool(values["baseline"]),
                cap_mb=float(values["baseline_cap_mb"] or 0),
            )
            return settings, (values["view_layer"], values["view_head"], values["colour_by_reason"])

        def run(session, video, **settings):
            try:
                run_settings, view = settings_from(settings)
            except USER_ERRORS as exc:
                yield to_components(kept_previous(session, str(exc)))
                return
            for update in run_video(hub, session, video, run_settings, view):
                yield to_components(update)

        def run_sample(session, **settings):
            yield from run(session, None, **settings)

        def stop(session):
            request_stop(session)

        def webcam_stream(session, frame, **settings):
            try:
                run_settings, view = settings_from(settings)
            except USER_ERRORS as exc:
                return to_components({"session": session, "status": status_text(session or Session(), error=str(exc))})
            return to_components(webcam_frame(hub, session, frame, run_settings, view))

        def ask_both(session, question):
            for update in ask(session, question):
                yield to_components(update)

        def ask_example(session, example):
            for update in ask(session, example[0]):
                yield {**to_components(update), question: example[0]}

        def new_conversation(session):
            return to_components(reset_chat(session))

        def export_chart(session):
            return write_chart(session)

        def redraw_views(session, layer, head, by_reason):
            if session is None:
                return {heatmap: None}
            view = (layer, head, by_reason)
            return {heatmap: heatmap_image(session, *view), legend_box: legend(session, view),
                    **panel_updates(policy_panels(session, layer, head))}

        def view_choices(state):
            engine = state.policy if state else None
            if engine is None:
                return gr.update(), gr.update()
            layers = ["all"] + [str(i) for i in range(engine.model.num_layers)]
            heads = ["all"] + [str(i) for i in range(engine.model.num_kv_heads)]
            return gr.update(choices=layers), gr.update(choices=heads)

        # Streams and questions have separate slots: a question is served within one chunk's time whatever
        # other sessions stream (its own session's stream pauses between chunks while it is answered).
        streams = dict(concurrency_id="stream", concurrency_limit=STREAM_SLOTS)
        questions = dict(concurrency_id="question", concurrency_limit=QUESTION_SLOTS)
        run_event = run_button.click(run, [session, video], run_outputs, inputs_kwargs=settings_inputs, api_name="run",
                                     show_progress_on=[status], **streams)
        sample_event = sample_button.click(run_sample, [session], run_outputs, inputs_kwargs=settings_inputs,
                                           api_name="run_sample", show_progress_on=[status], **streams)
        for event in (run_event, sample_event):
            event.then(view_choices, [session], [view_layer, view_head], api_visibility="private")
        stop_button.click(stop, [session], None, api_name="stop", concurrency_limit=None, show_progress="hidden")
        webcam.stream(webcam_stream, [session, webcam], run_outputs, inputs_kwargs=settings_inputs, stream_every=0.5,
                      time_limit=600, show_progress="hidden", api_visibility="private", **streams)
        view_inputs = [view_layer, view_head, by_reason]
        view_outputs = [heatmap, legend_box, *panel_components]
        asked = [
            ask_button.click(ask_both, [session, question], ask_outputs, api_name="ask", show_progress_on=[status], **questions),
            question.submit(ask_both, [session, question], ask_outputs, api_visibility="private", show_progress_on=[status],
                            **questions),
            examples.click(ask_example, [session, examples], [*ask_outputs, question], api_visibility="private",
                           show_progress_on=[status], **questions),
        ]
        for event in asked:  # answering changes what some heads hold (HybridKV retrieves): redraw the views
            event.then(redraw_views, [session, *view_inputs], view_outputs, api_visibility="private", show_progress="hidden")
        clear_button.click(new_conversation, [session], [session, policy_chat, full_chat], api_name="new_conversation",
                           concurrency_limit=None)
        chart_button.click(export_chart, [session], chart_file, api_name="export_chart", concurrency_limit=None)
        for control in view_inputs:
            control.change(redraw_views, [session, *view_inputs], view_outputs, show_progress="hidden", api_visibility="private")
        check_inputs = [policy, budget, keep, fps, max_pixels, video]
        gr.on([control.change for control in check_inputs], validate_settings, check_inputs, budget_check,
              api_name="check_settings", show_progress="hidden", concurrency_limit=None)
        policy.change(lambda name: [gr.update(visible=name == n) for n in groups], [policy], list(groups.values()),
                      api_visibility="private")
        policy.change(keep_field, [policy], keep, api_visibility="private", show_progress="hidden")
        model.change(lambda name: gr.update(value=banner_html(name), visible=bool(banner_html(name))), [model], banner,
                     api_visibility="private")
    return demo


def baseline_cap_default() -> int:
    """The full-cache baseline's memory cap (MB): 2048, or 512 when every GPU call pickles the session's state
    in and out (ZeroGPU: the baseline's cache is most of what crosses, ~37 KB per visual token on
    Qwen2.5-VL-3B)."""
    return 512 if zerogpu.active() else 2048


def keep_field(policy: str):
    """The C field: a number for policies that keep C tokens, greyed out for one sized by M alone."""
    import gradio as gr

    if make_policy(policy).uses_keep:
        return gr.update(interactive=True, label="C (kept by a compression)")
    return gr.update(interactive=False, label=f"C (not used: {policy} splits M itself)")


def banner_html(model_name: str | None) -> str:
    """The warning shown over the app for an offline tiny model ('' for real models)."""
    try:
        notice = OFFLINE_NOTICES.get(resolve_model_name(model_name))
    except Exception:
        notice = None
    if not notice:
        return ""
    advice = ("Run the bundled sample and ask about it; on other videos its answers mean little."
              if resolve_model_name(model_name) == TINY_NAME else "")
    return (f"<div style='padding:8px;border-radius:6px;background:#fff3cd;color:#664d03'>⚠️ {notice} {advice} "
            "Choose a real Qwen2.5-VL model on a GPU machine for meaningful answers about real videos.</div>")


def _param_component(gr, spec, policy: str):
    label = f"{policy}: {spec.name}"
    if spec.kind == "bool":
        return gr.Checkbox(spec.default, label=label, info=spec.help)
    if spec.kind == "choice":
        return gr.Dropdown(list(spec.choices), value=spec.default, label=label, info=spec.help)
    if spec.kind in ("int", "float"):
        return gr.Number(spec.default, label=label, info=spec.help, precision=0 if spec.kind == "int" else None)
    return gr.Textbox("" if spec.default is None else ", ".join(str(x) for x in spec.default), label=label, info=spec.help)


def launch(host: str | None = None, port: int | None = None, model: str | None = None, share: bool = False, **kwargs):
    """Build and launch the app (model loaded before the first request)."""
    import gradio as gr

    hub = ModelHub(model)
    hub.get()
    log.info("building the app (%d stream and %d question slots; engines of at most %d sessions kept)",
             STREAM_SLOTS, QUESTION_SLOTS, hub.sessions.limit)
    demo = build_demo(hub)
    demo.queue(default_concurrency_limit=STREAM_SLOTS)
    host = host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    port = port or int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
    log.info("starting the web server on http://%s:%d", host, port)
    return demo.launch(server_name=host, server_port=port, share=share, theme=gr.themes.Soft(), css=CSS, **kwargs)
