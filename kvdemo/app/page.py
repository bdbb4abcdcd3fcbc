"""What both pages are built from (:class:`Page`): the one error guard (:func:`guard`), handler updates mapped to
components (a picture an event has sent already not sent again: :func:`unsent`), and the events both pages have:
run a file or the bundled sample, stop, ask (a typed question or a clicked example), start a new conversation, the
layer and KV head choices after a run, and the sample's kind. Each page (:class:`kvdemo.app.single_page.SinglePage`,
:class:`kvdemo.app.compare_page.ComparePage`) builds its components and says what its settings and updates are;
``gr`` (the Gradio module) is handed in by :mod:`kvdemo.app.layout`, the only module that imports it."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from ..world.synthetic import sample_episode, sample_manifest
from .handlers import ask, new_conversation, run_stream
from .page_updates import PageUpdates
from .sessions import AppServices
from .settings import SAMPLE_KIND_HELP, USER_ERRORS

log = logging.getLogger("kvdemo")

#: Run in the browser when an answer is done: every chat pane shows its newest turn. Gradio's own autoscroll stops for
#: good once a pane was scrolled up (a mouse wheel that scrolls the page over a pane does it), and the newest answer
#: then stayed below the fold; asking a question is the moment to show it again.
SHOW_NEWEST_TURN = """() => {
  for (const pane of document.querySelectorAll("#policy-chat, #full-chat, [id^='compare-chat-']")) {
    for (const el of pane.querySelectorAll("*")) {
      if (el.scrollHeight > el.clientHeight + 1 && getComputedStyle(el).overflowY !== "visible") {
        el.scrollTop = el.scrollHeight;
      }
    }
  }
}"""


def internal_error(exc: Exception) -> str:
    """A bug said in one line (its traceback goes to the log)."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"⚠️ **internal error** ({type(exc).__name__}: {first}); it is logged, and the app keeps serving"


def guard(key: str) -> Callable:
    """The one error guard of both pages' handlers: a page method's updates (a dict, or a generator of them) mapped
    to components; a user's mistake that got this far said in one line under ``key`` (for the status: the previous
    stream stays, :meth:`PageUpdates.kept_previous`), anything else (a bug) logged with its traceback and said in one
    line: never Gradio's bare "Error" badge, and the app keeps serving."""

    def decorate(method: Callable) -> Callable:
        def failed(page: "Page", exc: Exception, args: tuple) -> dict[Any, Any]:
            if isinstance(exc, USER_ERRORS):
                if key == "status":
                    return page.to_components(page.updates.kept_previous(args[0] if args else None, str(exc)))
                return page.to_components({key: f"⚠️ {exc}"})
            log.exception("unexpected error in a handler")
            return page.to_components({key: internal_error(exc)})

        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)  # Gradio reads the method's signature: the API's parameter names
            def run(page: "Page", *args, **kwargs):
                shown: dict[str, Any] = {}  # the pictures this event has sent (see unsent)
                try:
                    for update in method(page, *args, **kwargs):
                        yield page.to_components(unsent(update, shown))
                except Exception as exc:
                    yield failed(page, exc, args)
        else:

            @functools.wraps(method)
            def run(page: "Page", *args, **kwargs):
                try:
                    return page.to_components(method(page, *args, **kwargs))
                except Exception as exc:
                    return failed(page, exc, args)

        return run

    return decorate


def holds_image(value: Any) -> bool:
    """Whether an update's value carries a picture Gradio serves as a file (an array, or a gallery's or the drawn
    panels' list with one inside)."""
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, (list, tuple)):
        return any(holds_image(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds_image(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def same_value(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same picture(s): equal arrays, and lists, tuples or dataclasses of equal parts with equal
    captions and titles. Anything else (a figure, a component update) never counts as the same."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(np.array_equal(a, b))
        )
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same_value(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (str, int, float, bool, type(None))):
        return type(a) is type(b) and a == b
    return False


def unsent(update: dict[str, Any], shown: dict[str, Any]) -> dict[str, Any]:
    """``update`` less the pictures the same event sent last under the same keys (``shown``, which it keeps up to date;
    :func:`same_value`). Gradio writes every picture it is sent to a cache file named by its content, rewriting the file
    in place when it exists: sent again while the browser still reads the first copy (a run's last chunk and its final
    update carry the same survivor strips), the file is truncated under the reader and the picture stays broken (seen
    in a test run, where the app logged h11's "Too much data for declared Content-Length"). Kept per event, so what
    another event drew meanwhile is never taken for shown; text, plots and component updates always go out."""
    out = {}
    for key, value in update.items():
        if holds_image(value):
            if key in shown and same_value(shown[key], value):
                continue
            shown[key] = value
        else:
            shown.pop(key, None)
        out[key] = value
    return out


class Page(ABC):
    """A page's shared parts. A page sets :attr:`updates`, :attr:`no_upload` and the components the shared events use
    (``examples``, ``sample_kind``, and ``manifest`` if it has one), and implements :meth:`named` and
    :meth:`run_settings`."""

    #: What the page shows (a run's updates may add the user's display choices: :meth:`run_settings`).
    updates: PageUpdates
    #: What Run says without an upload.
    no_upload = "upload a video first (or run the bundled sample)"
    #: Outputs shown only once they have something to show.
    hidden_when_empty: frozenset[str] = frozenset()
    #: After a run, the layer and KV head choices go back to "all" (else they keep what was chosen).
    view_choices_reset = False
    manifest = None

    def __init__(self, gr, services: AppServices) -> None:
        self.gr, self.services = gr, services

    # --- from handler updates to components --------------------------------------------------------
    @abstractmethod
    def named(self) -> dict[str, Any]:
        """The page's components by the update keys they show."""
        raise NotImplementedError

    def slot_components(self, update: dict[str, Any]) -> dict[Any, Any]:
        """Components of updates the page keys by more than a name (numbered panes, drawn panels)."""
        return {}

    def to_components(self, update: dict[str, Any]) -> dict[Any, Any]:
        named = self.named()
        out = {named[key]: value for key, value in update.items() if key in named}
        for key in self.hidden_when_empty.intersection(update):  # no empty placeholder box before there is something
            out[named[key]] = self.gr.update(value=update[key], visible=update[key] is not None)
        out.update(self.slot_components(update))
        return out

    # --- the events both pages have ------------------------------------------------------------------
    @abstractmethod
    def run_settings(self, values: dict[str, Any]) -> tuple[Any, PageUpdates]:
        """The settings form's values as the page's settings, and the updates the run shows."""
        raise NotImplementedError

    def show_newest_turn(self, events: list) -> None:
        """After each of the ``events`` (a question asked), scroll every chat pane to its newest turn (in the browser)."""
        for event in events:
            event.then(None, None, None, js=SHOW_NEWEST_TURN, api_visibility="private", show_progress="hidden")

    def in_line(self, run: Callable, key: str = "status"):
        """``run()``'s updates once it holds one of the app's stream slots; while it waits, where it stands."""
        return self.services.streams.held(run, key)

    @guard("status")
    def on_run(self, session, video, **settings):
        if not video:
            yield self.updates.kept_previous(session, self.no_upload)  # Run with no upload runs nothing
            return
        yield from self.stream(session, video, settings)

    @guard("status")
    def on_run_sample(self, session, **settings):
        yield from self.stream(session, None, settings)

    def stream(self, session, video: str | None, values: dict[str, Any]):
        """A file run (the bundled sample without ``video``), in line for a stream slot first: while it waits, the
        status says where it stands."""
        settings, updates = self.run_settings(values)
        yield from self.in_line(lambda: run_stream(self.services, session, video, settings, updates))

    @guard("ask_status")
    def on_ask(self, session, question, attribute=False):
        yield from ask(session, question, self.updates, bool(attribute))

    @guard("ask_status")
    def on_example(self, session, example, attribute=False):
        """A sample question clicked: it goes in the box and to every engine at once (one event, no race with Ask)."""
        for update in ask(session, example[0], self.updates, bool(attribute)):
            yield {**update, "question": example[0]}

    @guard("ask_status")
    def on_new_conversation(self, session):
        return new_conversation(session, self.updates)

    def on_view_choices(self, session):
        """The layers and KV heads of the session's model, for the view's selectors."""
        gr = self.gr
        engine = session.engine if session is not None else None
        if engine is None:
            return gr.update(), gr.update()
        reset = {"value": "all"} if self.view_choices_reset else {}
        return (
            gr.update(choices=["all"] + [str(i) for i in range(engine.model.num_layers)], **reset),
            gr.update(choices=["all"] + [str(i) for i in range(engine.model.num_kv_heads)], **reset),
        )

    def on_sample_kind(self, kind: str):
        """The bundled sample's kind chosen: its questions, what it is under the choice (and what it shows)."""
        episode = sample_episode(kind or "static")
        out = {
            self.examples: self.gr.Dataset(samples=[[q.text] for q in episode.questions]),
            self.sample_kind: self.gr.update(info=SAMPLE_KIND_HELP.get(kind or "static", "")),
        }
        if self.manifest is not None:
            out[self.manifest] = sample_manifest(episode)
        return out
