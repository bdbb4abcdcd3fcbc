"""What the single page shows of a session (:class:`SingleUpdates`): the status line, the occupancy chart, the newest
frames and gallery, the views the policy declares (drawn by :mod:`kvdemo.viz`), the legend, chat titles, the run
report and the chart file. Pure functions of a :class:`~kvdemo.app.sessions.Session`; no Gradio here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import viz
from ..analysis.coverage import coverage
from ..experiments.compare import FULL
from ..models.catalog import TRAINED_NOTICE, caveat_for, family_of, family_spec, offline_model
from ..policies import CARDS, policy_card
from ..views import View, counted, tokens_held
from .page_updates import PageUpdates, behind_live, lag_series
from .sessions import CACHE_TTL_S, STATIC_DIR, Session
from .settings import policy_label

PLOT_EVERY_S = 0.5
HEATMAP_EVERY_S = 0.35
GALLERY_EVERY_S = 3.0

HOW_TO_READ = """
**Occupancy** (top chart): visual tokens and real KV-cache megabytes over stream time. The policy engine
grows to its budget `M`, compresses to `C` (▼ marks), and grows again: a sawtooth under the dashed line.
The full-cache baseline grows without bound (tick *logarithmic axes* to keep the sawtooth readable beside it).
A policy sized by `M` alone with a summary region counts all its summary slots from the first chunk, in use or
not, so early in a stream its line starts above the full cache's (the status line says how many are in use).

**What survives**: the newest frames with the patches the cache still holds; dark patches were evicted.
*Aggregate* tints each patch by the share of (layer, KV head) copies still held. Pick one layer and
head and *colour by reason* to see why the policy kept each patch ({reasons}). Grey patches arrived after
the last compression.
Every heatmap is drawn from the provenance the engine gathers with the same indices as the keys and
values, so it shows exactly what the cache holds.

**Chat**: one question goes to both engines; the dialogue is replayed as text after the video memory,
and the memory is unchanged by answering. Under each answer: time to first token and the cache size.
The stream goes on while a question is answered: each answer reads a copy of the memory as it was when it was
asked, and the next chunks enter between its tokens. On the webcam the status says how far behind live the memory
is (the dotted line on the chart, per chunk); frames that wait more than 10 s for the model are dropped, oldest
first, and counted there.

**Limits**: this app keeps the engines of at most {max_sessions} sessions (starting another frees the least
recently used one) and frees a session's engines an hour after its tab closes; files it serves (uploads,
heatmaps, reports, charts) are deleted {cache_age} after they were written.
"""


def how_to_read(max_sessions: int) -> str:
    """The page's reading guide, with every registered policy's reasons for keeping a token."""
    reasons = "; ".join(f"{name}: {', '.join(card.reasons.values())}" for name, card in CARDS.items() if card.reasons)
    cache_age = "an hour" if CACHE_TTL_S == 3600 else f"{CACHE_TTL_S:g} s"
    return HOW_TO_READ.format(max_sessions=max_sessions, reasons=reasons, cache_age=cache_age)


def status_text(
    session: Session, done: int | None = None, total: int | None = None, error: str = "", stopped: bool = False
) -> str:
    """The status line: frames, tokens, MB, ms per chunk, and the time compression took beside the chunks' prefill."""
    lines = []
    if error:
        lines.append(f"⚠️ **{error}**")
    engine = session.engine
    if engine is None and session.freed and not error:
        lines.append(f"⚠️ **{session.freed}**")
    if engine is not None:
        stats = engine.stats
        progress = f"{done}/{counted(total, 'frame')}" if total else counted(engine.frames_fed, "frame")
        if stopped:
            progress = f"stopped at {progress}"
        offloaded = engine.memory.offloaded_bytes
        lines.append(
            f"**{progress}** · {engine.policy.name}: {tokens_held(engine.memory)} "
            f"({engine.budget.describe()}), {engine.memory.nbytes / 2**20:.2f} MB"
            + (f" + {offloaded / 2**20:.2f} MB offloaded" if offloaded else "")
            + f" · {chunk_time(session.chunk_ms)} · {compression_time(stats)}"
        )
        if live := behind_live(session):
            lines.append(live)
        full = session.full
        if full is not None:
            state = session.stopped.get(FULL)
            lines.append(
                f"full cache: {tokens_held(full.memory)}, {full.memory.nbytes / 2**20:.2f} MB"
                + (f" — {state}" if state else "")
            )
        if session.source:
            lines.append(f"<small>{session.source}</small>")
    return "\n\n".join(lines) if lines else READY


#: The status before any run: a sample kind is always chosen, so the sample is one click away.
READY = (
    "Ready: **Run the bundled sample** plays the kind chosen under the buttons; or upload a video, then click **Run**."
)


def chunk_time(chunk_ms: list[float]) -> str:
    """A run's time per chunk, in words: the median of its chunks after the first, and the first apart (it also
    prefills the prompt and lays out the memory, and the process's first chunk warms the model up), e.g.
    "47 ms/chunk (median; the first, with warm-up, 428 ms)"."""
    if not chunk_ms:
        return "no chunk yet"
    first = f"{chunk_ms[0]:.0f} ms"
    if len(chunk_ms) == 1:
        return f"first chunk {first} (with warm-up)"
    return f"{float(np.median(chunk_ms[1:])):.0f} ms/chunk (median; the first, with warm-up, {first})"


def compression_time(stats) -> str:
    """How many compressions ran and what one costs, in words: one pass as a share of one chunk's prefill (the work a
    chunk costs without compression; the first chunk's warm-up left out), e.g. "3 compressions, each 12 ms = 27% of
    a chunk's prefill (45 ms, the first chunk's warm-up left out)"."""
    done = counted(stats.compressions, "compression")
    share = stats.pass_share
    if share is None:
        return done
    warm = ", the first chunk's warm-up left out" if stats.chunks > 1 else ""
    return (
        f"{done}, each {stats.pass_ms:.0f} ms = {100 * share:.0f}% of a chunk's prefill "
        f"({stats.chunk_prefill_ms:.0f} ms{warm})"
    )


def chat_title(state: Session, name: str) -> str:
    """The label over a chat pane: the policy and its numbers, or the full cache (and whether it runs)."""
    settings = state.settings
    if name == "policy":
        engine = state.engine
        if engine is None:
            return "**policy engine**"
        return policy_label(engine.policy.name, engine.budget)
    if settings is not None and not settings.baseline:
        return "**full cache** (baseline off)"
    cap = (
        f", stops at {settings.cap_mb:g} MB" if settings is not None and settings.cap_mb and settings.cap_mb > 0 else ""
    )
    return f"**full cache**{cap}"


@dataclass(frozen=True)
class DisplayChoice:
    """What the user chose to look at: one layer and KV head or all of them ("all" or a number as text), each
    patch coloured by the policy's reason, and logarithmic chart axes (a policy's sawtooth stays visible next
    to a full cache that has grown)."""

    layer: str = "all"
    head: str = "all"
    by_reason: bool = False
    log_scale: bool = False

    @property
    def indices(self) -> tuple[int | None, int | None]:
        """The layer and KV head as indices (None = all)."""
        return layer_head(self.layer, self.head)


def occupancy_plot(session: Session, log_scale: bool = False):
    engine = session.engine
    if engine is None:
        return None
    name = _series_label(next(iter(session.contenders)), engine.budget.M)
    series = {name: engine.memory.timeline}
    if session.full is not None:
        series["full cache"] = session.full.memory.timeline
    pruning = {name: engine.pruning.points} if engine.pruning is not None else None
    return viz.occupancy_figure(series, engine.budget.M, log_scale=log_scale, pruning=pruning, lag=lag_series(session))


def empty_occupancy_plot(policy: str, budget: int):
    """The chart before any run (drawn at page load, so the browser has plotly.js ready for the first run)."""
    return viz.occupancy_figure({_series_label(policy, budget): [], "full cache": []}, budget)


def _series_label(policy: str, budget: int | None) -> str:
    return f"{policy} at M={budget}"


def layer_head(layer: str | None, head: str | None) -> tuple[int | None, int | None]:
    """The view's layer and KV head choices ("all" or a number) as indices (None = all)."""
    return (None if layer in (None, "all") else int(layer)), (None if head in (None, "all") else int(head))


def heatmap_image(session: Session, view: DisplayChoice = DisplayChoice()) -> np.ndarray | None:
    engine = session.engine
    if engine is None or engine.memory.num_grids == 0:
        return None
    return viz.engine_strip(engine, session.thumbnails, *view.indices, by_reason=view.by_reason)


def declared_views(session: Session, view: DisplayChoice = DisplayChoice()) -> list[View]:
    """The views the session's policy declares for the chosen layer and KV head (0 and 0 when the view is
    aggregated over all), as plain data."""
    engine = session.engine
    if engine is None or engine.memory.num_grids == 0:
        return []
    layer, head = view.indices
    return engine.policy_views(layer or 0, head or 0)


def policy_panels(session: Session, view: DisplayChoice = DisplayChoice()) -> list[viz.Panel]:
    """:func:`declared_views`, drawn."""
    return viz.draw_views(declared_views(session, view), session.thumbnails)


def gallery_items(session: Session) -> list[tuple[np.ndarray, str]]:
    engine = session.engine
    if engine is None:
        return []
    return viz.engine_gallery(engine, session.thumbnails)


def legend(state: Session, view: DisplayChoice = DisplayChoice()) -> str:
    """What the newest-frames view's colours mean for this policy and view."""
    engine = state.engine
    layer, head = view.indices
    if (
        engine is not None
        and not (view.by_reason and layer is not None and head is not None)
        and engine.memory.num_grids
    ):
        fractions = viz.status_fractions(engine, layer, head)
        if fractions is not None:
            present = np.array([code for code, share in zip(viz.STATUS_COLOURS, fractions) if share.any()])
            return (
                viz.status_legend(present)
                + (" &nbsp; " + viz.pruned_legend() if engine.pruning is not None else "")
                + " (tint = share of the (layer, KV head) copies in each state)"
            )
    names = policy_card(engine.policy.name).reasons if engine else {}
    pruned = engine is not None and engine.pruning is not None
    if names and view.by_reason:
        return viz.legend_text(names, pruned)
    note = " Pick a layer and a KV head to see what one head holds" + (", and colour by reason." if names else ".")
    return (
        "Tint = share of (layer, KV head) copies held; dark = evicted"
        + ("; " + viz.pruned_legend() + " (it never entered the cache)." if pruned else ".")
        + (note if engine is not None else "")
    )


def live_update(
    state: Session,
    view: DisplayChoice,
    done: int | None = None,
    total: int | None = None,
    force: bool = False,
    gallery: bool = True,
    draw_views: bool = True,
) -> dict[str, Any]:
    """Status every chunk; plot, heatmap and (``gallery``) the gallery at most a few times per second. Without
    ``draw_views`` the policy's views go out declared (``"views"``, plain data) for a caller that holds more
    thumbnails than this session (a GPU worker carries only the newest) to draw."""
    now = time.monotonic()
    update: dict[str, Any] = {"session": state, "status": status_text(state, done, total)}
    if force or now - state.last_plot >= PLOT_EVERY_S:
        update["plot"] = occupancy_plot(state, view.log_scale)
        state.last_plot = now
    if force or now - state.last_heatmap >= HEATMAP_EVERY_S:
        update["heatmap"] = heatmap_image(state, view)
        if draw_views:
            update["panels"] = policy_panels(state, view)
        else:
            update["views"] = declared_views(state, view)
        update["legend"] = legend(state, view)
        state.last_heatmap = now
    if gallery and (force or now - state.last_gallery >= GALLERY_EVERY_S):
        update["gallery"] = gallery_items(state)
        state.last_gallery = now
    return update


def write_chart(session: Session | None, request: Any = None) -> str | None:
    """The occupancy chart as an HTML file, made only when asked for; it loads plotly.js from the app's one copy
    (:data:`~kvdemo.app.sessions.STATIC_DIR`), at the address the browser reached the app by (``request``, a
    ``gr.Request``; none: a path on the same host), so each export is ~10 KB rather than 4.8 MB."""
    if session is None or session.engine is None:
        return None
    script = viz.plotly_js_file(STATIC_DIR)
    chart_path = session.report_dir / "kvdemo-occupancy.html"
    chart_path.write_text(
        viz.figure_html(occupancy_plot(session), f"{app_origin(request)}/gradio_api/file={script}"), encoding="utf-8"
    )
    return str(chart_path)


def app_origin(request: Any) -> str:
    """``scheme://host[:port]`` the browser reached the app by (a proxy's forwarded host and scheme first), or ""
    without a request."""
    headers = getattr(request, "headers", None) or {}
    host = headers.get("x-forwarded-host") or headers.get("host")
    if not host:
        return ""
    url = getattr(request, "url", None)
    scheme = headers.get("x-forwarded-proto") or getattr(url, "scheme", None) or "http"
    return f"{scheme.split(',')[0].strip()}://{host.split(',')[0].strip()}"


def banner_html(model_name: str | None) -> str:
    """What the page says over the settings about model ``name``: for an offline tiny model what its answers are
    worth, and for a family whose spec has a caveat about a streaming memory that caveat ('' if neither)."""
    offline = offline_model(model_name)
    caveat = caveat_for(family_of(model_name))
    lines = []
    if offline is not None:
        advice = (
            "Run the bundled sample and ask about it; on other videos its answers mean little."
            if offline.notice == TRAINED_NOTICE
            else f"Its family ({family_spec(offline.family).name}) is verified here on {family_spec(offline.family).verified}."
        )
        lines.append(
            f"⚠️ {offline.notice} {advice} Choose a real checkpoint on a GPU machine for meaningful answers "
            "about real videos."
        )
    if caveat:
        lines.append(f"ℹ️ {caveat}")
    if not lines:
        return ""
    return (
        "<div style='padding:8px;border-radius:6px;background:#fff3cd;color:#664d03'>" + "<br>".join(lines) + "</div>"
    )


@dataclass(frozen=True)
class SingleUpdates(PageUpdates):
    """What the single page shows (one policy against the full cache) as the user's ``view`` chooses."""

    view: DisplayChoice = DisplayChoice()
    no_video = "no video yet: run a video or the webcam first, then ask"

    def status(
        self, state: Session, done: int | None = None, total: int | None = None, error: str = "", stopped: bool = False
    ) -> str:
        return status_text(state, done, total, error, stopped)

    def fresh(self, state: Session) -> dict[str, Any]:
        return {
            "policy_title": chat_title(state, "policy"),
            "full_title": chat_title(state, "full"),
            "policy_chat": [],
            "full_chat": [],
            "ask_status": "",
            "coverage": None,
            "report": None,
            "chart": None,
        }

    def live(
        self, state: Session, done: int | None = None, total: int | None = None, force: bool = False
    ) -> dict[str, Any]:
        return live_update(state, self.view, done, total, force=force)

    def segment_update(self, state: Session, total: int | None, first: bool) -> dict[str, Any]:
        # The gallery and the policy's views are drawn by the caller, which holds every thumbnail.
        update = live_update(
            state, self.view, state.group.frames_seen, total, force=first, gallery=False, draw_views=False
        )
        update.pop("session", None)
        return update

    def drawn(self, update: dict[str, Any], state: Session) -> dict[str, Any]:
        if "views" in update:
            update = {**update, "panels": viz.draw_views(update["views"], state.thumbnails)}
            del update["views"]
        return update

    def finished(self, state: Session, done: int, total: int, stopped: bool) -> dict[str, Any]:
        """Everything redrawn, the coverage CDF (with a baseline that ran to the end) and the report."""
        update = live_update(state, self.view, force=True)
        full, engine = state.full, state.engine
        if full is not None and FULL not in state.stopped and engine is not None and engine.memory.num_grids:
            state.coverage = {engine.policy.name: coverage(full.memory, engine.memory)}
            update["coverage"] = viz.coverage_figure(state.coverage)
        update["report"] = self.write_report(state)
        update["status"] = status_text(state, done, total, stopped=stopped)
        return update

    def chats(self, state: Session | None) -> dict[str, Any]:
        chat = state.chat if state is not None else {}
        policy = next(iter(state.contenders), None) if state is not None else None
        return {"policy_chat": list(chat.get(policy, [])), "full_chat": list(chat.get(FULL, []))}

    def answered(self, state: Session, question: str, answers: dict[str, Any]) -> dict[str, Any]:
        names = " and ".join("the full cache" if name == FULL else state.engines[name].policy.name for name in answers)
        status = f"✓ answered by {names}" if answers else "⚠️ no engine answered: every engine has stopped"
        return {"ask_status": status, "report": self.write_report(state)}

    def report(self, state: Session) -> dict[str, Any] | None:
        """The run report (the CLI's JSON format, plus the baseline's report, why engines stopped, the coverage)."""
        engine = state.engine
        if engine is None:
            return None
        report = engine.report(video=state.source, lost_frames=state.lost_frames)
        if state.full is not None:
            report["baseline"] = state.full.report(video=state.source, lost_frames=state.lost_frames)
        if state.stopped:
            report["stopped"] = dict(state.stopped)
        if state.coverage:
            report["coverage"] = state.coverage
        if state.live_source and state.live is not None:
            report["live"] = state.live.report()
        return report

    def redraw(self, state: Session) -> dict[str, Any]:
        """The chart, the newest-frames view, its legend and the policy's views, drawn now."""
        return {
            "plot": occupancy_plot(state, self.view.log_scale),
            "heatmap": heatmap_image(state, self.view),
            "legend": legend(state, self.view),
            "panels": policy_panels(state, self.view),
        }
