"""What the app shows of a session: the status line, the occupancy chart, the newest frames and gallery, the
views the policy declares (drawn by :mod:`kvdemo.viz`), the legend, chat titles, the run report and the chart
file. Pure functions of a :class:`~kvdemo.app.sessions.Session`; no Gradio here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import viz
from ..coverage import coverage
from ..models.catalog import TRAINED_NOTICE, caveat_for, family_of, family_spec, offline_model
from ..policies import CARDS, policy_card
from ..synthetic import grade
from ..views import View, counted
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
            f"**{progress}** · {engine.policy.name}: {counted(engine.memory.visual_tokens, 'visual token')} "
            f"({engine.budget.describe()}{summary_note(engine.memory)}), {engine.memory.nbytes / 2**20:.2f} MB"
            + (f" + {offloaded / 2**20:.2f} MB offloaded" if offloaded else "")
            + f" · {session.chunk_ms:.0f} ms/chunk · {compression_time(stats)}"
        )
        full = session.engines.get("full")
        if full is not None:
            state = session.stopped.get("full")
            lines.append(
                f"full cache: {counted(full.memory.visual_tokens, 'visual token')}, {full.memory.nbytes / 2**20:.2f} MB"
                + (f" — {state}" if state else "")
            )
        if session.source:
            lines.append(f"<small>{session.source}</small>")
    return "\n\n".join(lines) if lines else READY


#: The status before any run: a sample kind is always chosen, so the sample is one click away.
READY = ("Ready: **Run the bundled sample** plays the kind chosen under the buttons; or upload a video, then click "
         "**Run**.")


def compression_time(stats) -> str:
    """How many compressions ran and what they cost, in words: the time spent compressing as a share of the time spent
    prefilling the chunks (the work a stream costs without compression), e.g. "3 compressions, taking 12% as long as
    prefilling the chunks"."""
    done = counted(stats.compressions, "compression")
    if not stats.compressions or not stats.prefill_ms:
        return done
    share = 100 * stats.compress_ms / stats.prefill_ms
    return f"{done}, taking {share:.0f}% as long as prefilling the chunks"


def summary_note(memory) -> str:
    """How the visual tokens of a memory with a summary region split: its summary slots count from the first
    chunk, in use or not (so early in a stream such a policy holds more than the full cache)."""
    if not memory.summary_slots:
        return ""
    exact = memory.visual_tokens - memory.summary_slots
    return (f": {exact} exact + {counted(memory.summary_slots, 'summary slot')}, counted from the first chunk, "
            f"{memory.summary_active} in use")


def kept_previous(previous: Session | None, error: str) -> dict[str, Any]:
    """A run that failed before its first chunk: the previous session and its views stay as they were;
    the status says what failed (and, if there is one, that the previous run is what is shown)."""
    status = f"⚠️ **{error}**"
    if previous is not None and previous.engine is not None:
        status += f"\n\n<small>Still showing the previous run: {previous.source}</small>"
    return {"session": previous or Session(), "status": status}


def answer_note(state: Session, answer) -> str:
    """What an answer is worth (either tab): graded against the ground truth on a generated stream; on other inputs,
    a warning when the model is an offline tiny one (random, or trained only on generated streams)."""
    engine = next(iter(state.engines.values()), None)
    model = engine.model if engine is not None else None
    if model is not None and model.random_weights:
        return " · random weights"
    if state.episode is not None and engine is not None:
        return " · " + grade(state.episode, answer.question, answer.answer, engine.last_time_s).note
    if model is not None and model.notice:
        return " · the tiny model knows only its generated streams: on this video its answers mean little"
    return ""


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
    cap = f", stops at {settings.cap_mb:g} MB" if settings is not None and settings.cap_mb and settings.cap_mb > 0 else ""
    return f"**full cache**{cap}"


def fresh_views(state: Session) -> dict[str, Any]:
    """What a newly started stream clears or relabels: chat panes and their titles, the question status, the previous
    run's coverage and downloads."""
    return {"policy_title": chat_title(state, "policy"), "full_title": chat_title(state, "full"),
            "policy_chat": [], "full_chat": [], "ask_status": "", "coverage": None, "report": None, "chart": None}


@dataclass(frozen=True)
class ViewChoice:
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
    series = {_series_label(engine.policy.name, engine.budget.M): engine.memory.timeline}
    if "full" in session.engines:
        series["full cache"] = session.engines["full"].memory.timeline
    return viz.occupancy_figure(series, engine.budget.M, log_scale=log_scale)


def empty_occupancy_plot(policy: str, budget: int):
    """The chart before any run (drawn at page load, so the browser has plotly.js ready for the first run)."""
    return viz.occupancy_figure({_series_label(policy, budget): [], "full cache": []}, budget)


def _series_label(policy: str, budget: int | None) -> str:
    return f"{policy} at M={budget}"


def layer_head(layer: str | None, head: str | None) -> tuple[int | None, int | None]:
    """The view's layer and KV head choices ("all" or a number) as indices (None = all)."""
    return (None if layer in (None, "all") else int(layer)), (None if head in (None, "all") else int(head))


def heatmap_image(session: Session, view: ViewChoice = ViewChoice()) -> np.ndarray | None:
    engine = session.engine
    if engine is None or engine.memory.num_grids == 0:
        return None
    return viz.engine_strip(engine, session.thumbnails, *view.indices, by_reason=view.by_reason)


def declared_views(session: Session, view: ViewChoice = ViewChoice()) -> list[View]:
    """The views the session's policy declares for the chosen layer and KV head (0 and 0 when the view is
    aggregated over all), as plain data."""
    engine = session.engine
    if engine is None or engine.memory.num_grids == 0:
        return []
    layer, head = view.indices
    return engine.policy_views(layer or 0, head or 0)


def policy_panels(session: Session, view: ViewChoice = ViewChoice()) -> list[viz.Panel]:
    """:func:`declared_views`, drawn."""
    return viz.draw_views(declared_views(session, view), session.thumbnails)


def gallery_items(session: Session) -> list[tuple[np.ndarray, str]]:
    engine = session.engine
    if engine is None:
        return []
    return viz.engine_gallery(engine, session.thumbnails)


def legend(state: Session, view: ViewChoice = ViewChoice()) -> str:
    """What the newest-frames view's colours mean for this policy and view."""
    engine = state.engine
    layer, head = view.indices
    if engine is not None and not (view.by_reason and layer is not None and head is not None) and engine.memory.num_grids:
        fractions = viz.status_fractions(engine, layer, head)
        if fractions is not None:
            present = np.array([code for code, share in zip(viz.STATUS_COLOURS, fractions) if share.any()])
            return viz.status_legend(present) + " (tint = share of the (layer, KV head) copies in each state)"
    names = policy_card(engine.policy.name).reasons if engine else {}
    if names and view.by_reason:
        return viz.legend_text(names)
    note = " Pick a layer and a KV head to see what one head holds" + (", and colour by reason." if names else ".")
    return "Tint = share of (layer, KV head) copies held; dark = evicted." + (note if engine is not None else "")


def live_update(state: Session, view: ViewChoice, done: int | None = None, total: int | None = None,
                force: bool = False, gallery: bool = True, draw_views: bool = True) -> dict[str, Any]:
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


def write_report(session: Session) -> str | None:
    """The run report (the CLI's JSON format, plus the baseline's report) as a file to download."""
    engine = session.engine
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


def write_chart(session: Session | None, request: Any = None) -> str | None:
    """The occupancy chart as an HTML file, made only when asked for; it loads plotly.js from the app's one copy
    (:data:`~kvdemo.app.sessions.STATIC_DIR`), at the address the browser reached the app by (``request``, a
    ``gr.Request``; none: a path on the same host), so each export is ~10 KB rather than 4.8 MB."""
    if session is None or session.engine is None:
        return None
    script = viz.plotly_js_file(STATIC_DIR)
    chart_path = session.report_dir / "kvdemo-occupancy.html"
    chart_path.write_text(viz.figure_html(occupancy_plot(session), f"{app_origin(request)}/gradio_api/file={script}"),
                          encoding="utf-8")
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


def finish(state: Session, view: ViewChoice) -> dict[str, Any]:
    """Final update of a run: everything redrawn, the coverage CDF (with a baseline), the report."""
    update = live_update(state, view, force=True)
    full = state.engines.get("full")
    if full is not None and "full" not in state.stopped and state.engine is not None and state.engine.memory.num_grids:
        state.coverage = {state.engine.policy.name: coverage(full.memory, state.engine.memory)}
        update["coverage"] = viz.coverage_figure(state.coverage)
    update["report"] = write_report(state)
    return update


def banner_html(model_name: str | None) -> str:
    """What the page says over the settings about model ``name``: for an offline tiny model what its answers are
    worth, and for a family whose spec has a caveat about a streaming memory that caveat ('' if neither)."""
    offline = offline_model(model_name)
    caveat = caveat_for(family_of(model_name))
    lines = []
    if offline is not None:
        advice = ("Run the bundled sample and ask about it; on other videos its answers mean little."
                  if offline.notice == TRAINED_NOTICE
                  else f"Its family ({family_spec(offline.family).name}) is verified here on {family_spec(offline.family).verified}.")
        lines.append(f"⚠️ {offline.notice} {advice} Choose a real checkpoint on a GPU machine for meaningful answers "
                     "about real videos.")
    if caveat:
        lines.append(f"ℹ️ {caveat}")
    if not lines:
        return ""
    return ("<div style='padding:8px;border-radius:6px;background:#fff3cd;color:#664d03'>"
            + "<br>".join(lines) + "</div>")
