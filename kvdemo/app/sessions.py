"""Process-wide models and per-session state: each model loaded once (:class:`ModelHub`), what a user chose on
either page (:class:`RunSettings`, :class:`CompareSettings`: both name their contenders), at most so many sessions
holding engines (:class:`SessionPool`), one session's engines, thumbnails and dialogue (:class:`Session`, one type
for both pages: the single page is a comparison with one contender), the live scheduler that feeds them and answers
on them (:class:`~kvdemo.stream.live.LiveSession`, whose device turn is the session's), and the files served to
them, deleted after an hour (:class:`CacheSweeper`)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..devices.turn import DeviceTurn
from ..experiments.compare import parse_overrides
from ..models.catalog import OFFLINE_MODELS, REAL_MODELS, chosen_model_name
from ..models.loading import load_model
from ..stream.engine import StreamEngine
from ..stream.lineup import FULL, Contender
from ..stream.live import LiveSession
from ..stream.streaming import EngineGroup
from ..world.synthetic import Episode
from .slots import STREAM_SLOTS, StreamSlots

log = logging.getLogger("kvdemo")

#: Sessions whose engines are kept (``KVDEMO_MAX_SESSIONS``); starting one more frees the least recently used.
MAX_SESSIONS = int(os.environ.get("KVDEMO_MAX_SESSIONS", "8"))
#: A session's engines are freed this long after its browser tab goes away.
SESSION_TTL_S = 3600
#: Files the app served (uploads, heatmaps, reports, charts) are deleted this long after they were last written
#: (``KVDEMO_CACHE_TTL_S``).
CACHE_TTL_S = float(os.environ.get("KVDEMO_CACHE_TTL_S", "3600"))
#: Files the app writes once and serves to every session (plotly.js for the exported charts), outside Gradio's
#: cache folder so that the sweeper leaves them (``KVDEMO_STATIC_DIR``; the app adds it to Gradio's allowed paths).
STATIC_DIR = Path(os.environ.get("KVDEMO_STATIC_DIR") or Path(tempfile.gettempdir()) / "kvdemo-static")

_MODELS: dict[str, Any] = {}
_MODELS_LOCK = threading.Lock()


def model_by_name(name: str):
    """The model called ``name``, loaded once per process. A GPU call resolves its model here by name
    (a ZeroGPU worker is a fork of this process, so a model loaded at start-up is already there)."""
    name = chosen_model_name(name)
    with _MODELS_LOCK:
        if name not in _MODELS:
            _MODELS[name] = load_model(name)
        return _MODELS[name]


class ModelHub:
    """The process's models: each loaded once and shared by every session (engines never write to model
    weights); ``default`` is the model the app starts with."""

    def __init__(self, default: str | None = None) -> None:
        self.default = chosen_model_name(default)

    def get(self, name: str | None = None):
        return model_by_name(name or self.default)

    def choices(self) -> list[str]:
        return list(dict.fromkeys([self.default, *OFFLINE_MODELS, *REAL_MODELS]))


@dataclass
class RunSettings:
    """What the user chose on the single page: the model, the policy and its parameters, ``M``/``C`` as typed
    (resolved into a :class:`~kvdemo.cache.budget.Budget` when a run starts), sampling and the baseline."""

    model: str
    policy: str
    params: dict[str, Any]
    budget: Any
    keep: Any
    fps: float
    max_pixels: int
    baseline: bool
    cap_mb: float
    sample: str = "static"  # the bundled sample's stream kind (kvdemo.world.synthetic.STREAM_KINDS)
    prune: str = ""  # pruning before the LLM in front of the policy ("evs:0.75"; "" or "none": none)

    def contenders(self) -> list[Contender]:
        """The one policy under study (its parameters parsed from the form), behind its pruning."""
        return [Contender(self.policy, dict(self.params), prune=self.prune or None)]


@dataclass
class CompareSettings:
    """What the user chose on the comparison page: the model, up to four policies (with per-policy lines of their
    own ``M``/``C``/parameters), the shared ``M``/``C``, sampling, the full cache's cap and the sample's kind."""

    model: str
    policies: list[str]
    overrides: str
    budget: Any
    keep: Any
    fps: float
    max_pixels: int
    cap_mb: float
    sample: str = "static"
    baseline: bool = True  # the full cache is always compared
    #: Pruning before the LLM per column: in front of the first chosen policy, the second... ("" or "none": none).
    prunes: list[str] = field(default_factory=list)

    def contenders(self, overrides: bool = True) -> list[Contender]:
        """The compared policies with their own lines (:func:`kvdemo.experiments.compare.parse_overrides`; a line's
        ``prune=`` wins over its column's pruning)."""
        chosen = parse_overrides(self.policies, self.overrides if overrides else "")
        columns = [*self.prunes, *[None] * len(chosen)]
        return [
            Contender(c.name, c.params, c.budget, c.keep, prune=c.prune or columns[i] or None)
            for i, c in enumerate(chosen)
        ]


@dataclass(eq=False)  # sessions are compared by identity (the pool holds them in a list)
class Session:
    """One browser session's stream on either page: its engines (the contenders in order, then :data:`FULL` when
    the baseline runs) behind one :class:`~kvdemo.stream.streaming.EngineGroup`, thumbnails and a chat per engine (freed
    when the session ends, or earlier by the :class:`SessionPool`)."""

    settings: RunSettings | CompareSettings | None = None
    group: EngineGroup | None = None
    thumbnails: list[np.ndarray] = field(default_factory=list)
    #: Engine name -> its chat pane's messages.
    chat: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    source: str = ""
    #: The generated stream being played (its ground truth grades the answers); None for files and the webcam.
    episode: Episode | None = None
    lost_frames: int = 0
    frame_size: tuple[int, int] | None = None
    #: Wall time of each chunk fed so far (its encoding and every engine's prefill and compression), oldest first.
    chunk_ms: list[float] = field(default_factory=list)
    coverage: dict[str, Any] | None = None
    #: What the engines may hold (:func:`kvdemo.experiments.compare.memory_bound`; the comparison's status says it).
    bound: dict[str, Any] = field(default_factory=dict)
    #: The last answers' attributions, the questions asked (with their grades) and the fidelity measured.
    attributions: dict[str, Any] = field(default_factory=dict)
    questions: list[dict[str, Any]] = field(default_factory=list)
    fidelity: dict[str, Any] = field(default_factory=dict)
    #: The live scheduler over the group: frames wait in its queue (bounded; the oldest dropped and counted), and
    #: chunks keep entering between an answer's tokens (:mod:`kvdemo.stream.live`).
    live: LiveSession | None = None
    #: The stream is live (the webcam): its lag behind live and dropped frames are shown and reported.
    live_source: bool = False
    #: A file run is streaming; ``stop_requested`` ends it after the current chunk.
    running: bool = False
    stop_requested: bool = False
    #: Why the engines were freed early ("" while they are held).
    freed: str = ""
    last_used: float = field(default_factory=time.monotonic)
    #: Whose turn it is to use the engines: one chunk or a few answer tokens at a time (:class:`DeviceTurn`).
    turns: DeviceTurn = field(default_factory=DeviceTurn)
    last_plot: float = 0.0
    last_heatmap: float = 0.0
    last_gallery: float = 0.0
    _report_dir: str | None = None

    @property
    def engines(self) -> dict[str, StreamEngine]:
        return self.group.engines if self.group is not None else {}

    @property
    def stopped(self) -> dict[str, str]:
        """Engine name (or "run") -> why it stopped."""
        return self.group.stopped if self.group is not None else {}

    @property
    def contenders(self) -> dict[str, StreamEngine]:
        """The engines under study (every one but the full-cache baseline), in order."""
        return {name: engine for name, engine in self.engines.items() if name != FULL}

    @property
    def engine(self) -> StreamEngine | None:
        """The first contender's engine (the single page's only one)."""
        return next(iter(self.contenders.values()), None)

    @property
    def full(self) -> StreamEngine | None:
        """The full-cache baseline's engine (None when it does not run)."""
        return self.engines.get(FULL)

    @property
    def model(self):
        engine = self.engine
        return engine.model if engine else None

    @property
    def report_dir(self) -> Path:
        """The folder for this session's downloads, created on first use (most sessions never need one)."""
        if self._report_dir is None:
            self._report_dir = tempfile.mkdtemp(prefix="kvdemo-")
        return Path(self._report_dir)

    def free(self, reason: str = "") -> None:
        """Let the engines go (an answer still decoding stops, its forks with it). The caller holds the turn."""
        if self.live is not None:
            self.live.close(held=True)
        self.group, self.live = None, None
        self.thumbnails.clear()
        self.freed = reason or "this session's engines were freed; run the video again"
        if self._report_dir is not None:
            shutil.rmtree(self._report_dir, ignore_errors=True)
            self._report_dir = None


class SessionPool:
    """The sessions holding engines in this process, at most ``limit``: admitting one more frees the
    engines of the least recently used other session (its next question or run says why)."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
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
            with victim.turns:
                victim.free(
                    f"this session's engines were freed to make room: the app keeps at most {self.limit} "
                    "sessions and this one was the least recently used; run the video again"
                )
            log.info("freed the least recently used session (%d sessions at most)", self.limit)

    def release(self, session: Session) -> None:
        with self._lock:
            self._sessions = [s for s in self._sessions if s is not session]

    def replace(self, previous: Session | None, new: Session) -> None:
        """``new`` replaces ``previous`` as a browser session's stream: the previous engines are freed and the
        new ones count against the limit."""
        if previous is not None and previous is not new:
            self.free(previous)
        self.admit(new)

    def free(self, session: Session | None) -> None:
        """Free a session's engines (between two of its turns: an answer still decoding stops there)."""
        if session is not None:
            self.release(session)
            with session.turns:
                session.free()


class CacheSweeper:
    """Deletes the files in Gradio's cache folder (uploads and every image, report and chart served) that were
    last written more than ``max_age_s`` ago, every ``max_age_s / 6`` seconds (at most 10 minutes), on a daemon
    thread. Gradio's own ``delete_cache`` misses most of them: a component updated with ``gr.update`` serves
    its files from a per-session copy of itself that Gradio never registers for deletion. ``clock`` (seconds,
    comparable with file times) and ``sleep`` are injected so that tests age files without waiting."""

    def __init__(
        self,
        folder: str | Path,
        max_age_s: float = CACHE_TTL_S,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.folder, self.max_age_s = Path(folder), float(max_age_s)
        self.every_s = min(600.0, self.max_age_s / 6)
        self.clock, self.sleep = clock, sleep
        self._thread: threading.Thread | None = None

    def sweep(self) -> int:
        """Delete what is too old now (and the folders that leaves empty); returns the files deleted."""
        deleted, oldest = 0, self.clock() - self.max_age_s
        for path in sorted(self.folder.rglob("*"), key=lambda p: -len(p.parts)):  # files before their folders
            try:
                if path.is_file() and path.stat().st_mtime < oldest:
                    path.unlink()
                    deleted += 1
                elif path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
            except OSError:  # written or removed meanwhile
                continue
        return deleted

    def run(self, rounds: int | None = None) -> None:
        """Sweep every :attr:`every_s` (``rounds`` times; None: for ever), logging what each sweep deleted."""
        done = 0
        while rounds is None or done < rounds:
            self.sleep(self.every_s)
            if self.folder.exists() and (count := self.sweep()):
                log.info("deleted %d served file(s) older than %g s from %s", count, self.max_age_s, self.folder)
            done += 1

    def start(self) -> "CacheSweeper":
        self._thread = threading.Thread(target=self.run, name="kvdemo-cache-sweeper", daemon=True)
        self._thread.start()
        return self


@dataclass
class AppServices:
    """What every handler shares: the models and the session pool."""

    models: ModelHub
    sessions: SessionPool
    #: The stream slots every run waits in line for (:mod:`kvdemo.app.slots`).
    streams: StreamSlots = field(default_factory=lambda: StreamSlots(STREAM_SLOTS))

    @classmethod
    def create(cls, model: str | None = None, max_sessions: int = MAX_SESSIONS) -> "AppServices":
        return cls(ModelHub(model), SessionPool(max_sessions))
