"""What a page shows of a session, the part both pages share: :class:`PageUpdates` says what the one stream path
(:func:`kvdemo.app.handlers.run_stream`) and the one ask path (:func:`kvdemo.app.handlers.ask`) show at each step,
and each page fills it in (:class:`kvdemo.app.single_updates.SingleUpdates`, :class:`kvdemo.app.comparing.CompareUpdates`);
an answer as a chat pane shows it (:func:`answer_markdown`), what it is worth (:func:`answer_note`) and the report
file. Pure functions of a :class:`~kvdemo.app.sessions.Session`; no Gradio here."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from ..views import counted
from ..world.synthetic import grade
from .sessions import Session


@dataclass(frozen=True)
class PageUpdates(ABC):
    """What one page shows of a session as the stream and the questions go (update dicts keyed by view name, which
    the page maps to its components). Instances are small, frozen and picklable: a GPU call carries one."""

    #: How the page's messages name a stream ("run", "comparison").
    what: ClassVar[str] = "run"
    #: The answer to a question asked before any frame.
    no_video: ClassVar[str] = "no video yet: run a video first, then ask"
    #: The report file's name.
    report_name: ClassVar[str] = "kvdemo-report.json"
    #: Whether the line under an answer says its time to first token and the cache it came from
    #: (:func:`answer_markdown`).
    answer_details: ClassVar[bool] = True

    # --- the stream --------------------------------------------------------------------------------
    @abstractmethod
    def status(
        self, state: Session, done: int | None = None, total: int | None = None, error: str = "", stopped: bool = False
    ) -> str:
        raise NotImplementedError

    def starting(self, state: Session, source: str) -> dict[str, Any]:
        """The first update of a stream that has not fed its first chunk yet."""
        return {"session": state, "status": f"⏳ starting {source}"}

    def fresh(self, state: Session) -> dict[str, Any]:
        """What a stream clears or relabels once it has fed its first chunk (the previous stream's chats, answers
        and downloads)."""
        return {}

    @abstractmethod
    def live(
        self, state: Session, done: int | None = None, total: int | None = None, force: bool = False
    ) -> dict[str, Any]:
        """The update after a chunk (``force``: everything redrawn now)."""
        raise NotImplementedError

    def segment_update(self, state: Session, total: int | None, first: bool) -> dict[str, Any] | None:
        """A light update made inside a GPU call after each of its chunks (``state`` holds only the newest
        thumbnails there); None: the page shows nothing until the call returns."""
        return None

    def drawn(self, update: dict[str, Any], state: Session) -> dict[str, Any]:
        """A GPU call's :meth:`segment_update` finished where every thumbnail is."""
        return update

    @abstractmethod
    def finished(self, state: Session, done: int, total: int, stopped: bool) -> dict[str, Any]:
        """The last update of a stream that ran (``done`` of ``total`` frames; ``stopped`` by the user)."""
        raise NotImplementedError

    def kept_previous(self, previous: Session | None, error: str) -> dict[str, Any]:
        """A stream that failed before its first chunk: the previous session and its views stay as they were; the
        status says what failed and, if there is one, that the previous stream is what is shown (it looked current)."""
        update: dict[str, Any] = {"session": previous, "status": f"⚠️ **{error}**"}
        if previous is not None and previous.group is not None and previous.group.frames_seen:
            update["status"] += f"\n\n<small>Still showing the previous {self.what}: {previous.source}</small>"
            update.update(self.previous_views(previous))
        return update

    def previous_views(self, previous: Session) -> dict[str, Any]:
        """What else says that the views show the previous stream (:meth:`kept_previous`)."""
        return {}

    # --- questions ---------------------------------------------------------------------------------
    @abstractmethod
    def chats(self, state: Session | None) -> dict[str, Any]:
        """The chat panes (copies: Gradio keeps what it is given)."""
        raise NotImplementedError

    @abstractmethod
    def answered(self, state: Session, question: str, answers: dict[str, Any]) -> dict[str, Any]:
        """The last update of a question: its status (``ask_status``) and what the answers change on the page."""
        raise NotImplementedError

    # --- the report --------------------------------------------------------------------------------
    @abstractmethod
    def report(self, state: Session) -> dict[str, Any] | None:
        """The page's report of the session (None before there is one)."""
        raise NotImplementedError

    def write_report(self, state: Session) -> str | None:
        """:meth:`report` as a JSON file to download (in the session's folder)."""
        report = self.report(state) if state.group is not None else None
        if report is None:
            return None
        path = state.report_dir / self.report_name
        path.write_text(json.dumps(report, indent=1))
        return str(path)


def behind_live(state: Session) -> str:
    """For a live source, how far behind live the memory is, the frames waiting for the device and those dropped
    (kvdemo's rule: past the queue's bound the oldest waiting frames go, and are counted here); '' otherwise."""
    live = state.live
    if not state.live_source or live is None:
        return ""
    line = f"behind live **{live.lag():.1f} s** · {counted(live.frames_waiting, 'frame')} waiting"
    if live.dropped:
        line += (
            f" · ⚠️ **{counted(live.dropped, 'frame')} dropped**: more than {counted(live.max_waiting, 'frame')} "
            "waited for the model, the oldest went"
        )
    return line


def lag_series(state: Session) -> list[tuple[float, float]] | None:
    """(stream time, lag behind live) of each chunk of a live source, for the occupancy chart; None otherwise."""
    if not state.live_source or state.live is None:
        return None
    return [(record.time_s, record.lag_s) for record in state.live.records]


def answer_note(state: Session, answer) -> str:
    """What an answer is worth (either page): graded against the ground truth on a generated stream; on other inputs,
    a warning when the model is an offline tiny one (random, or trained only on generated streams)."""
    engine = next(iter(state.engines.values()), None)
    model = engine.model if engine is not None else None
    if model is not None and model.random_weights:
        return " · random weights"
    if state.episode is not None and engine is not None:
        return (
            " · "
            + grade(state.episode, answer.question, answer.answer, engine.last_time_s, earlier_questions(engine)).note
        )
    if model is not None and model.notice:
        return " · the tiny model knows only its generated streams: on this video its answers mean little"
    return ""


def earlier_questions(engine) -> list[str]:
    """The questions of ``engine``'s dialogue before its latest answer, oldest first (a follow-up is graded in them)."""
    return [question for question, _ in engine.history[:-1]]


def answer_markdown(state: Session, answer, details: bool = True) -> str:
    """An answer as its chat pane shows it (either page): the text, then (``details``) its time to first token, its
    tokens and time, (``details``) the cache it was answered from, the dialogue turns left out, what it is worth
    (:func:`answer_note`) and, when it was attributed, where its attention went."""
    timing = f"{counted(answer.tokens, 'token')} in {answer.ms:.0f} ms"
    if details:
        timing = (
            f"first token {answer.ttft_ms:.0f} ms · {timing} · cache {answer.cache_bytes / 2**20:.2f} MB, "
            f"{counted(answer.visual_tokens, 'visual token')}"
        )
    dropped = ""
    if answer.dropped_turns:
        oldest = "the oldest turn was" if answer.dropped_turns == 1 else f"the {answer.dropped_turns} oldest turns were"
        dropped = (
            f" · {oldest} left out of the replayed dialogue (it keeps at most "
            f"{counted(state.group.stream.model.max_dialogue_tokens, 'token')})"
        )
    share = ""
    if answer.attribution is not None:
        parts = answer.attribution.share()
        share = " · attention: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in parts.items() if v >= 0.005)
    return f"{answer.answer or '(empty answer)'}\n\n<small>{timing}{dropped}{answer_note(state, answer)}{share}</small>"
