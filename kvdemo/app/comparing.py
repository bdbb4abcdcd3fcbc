"""What the comparison page's buttons do, as plain functions (tested without a browser): stream a file or the
bundled sample into up to four policies and the full cache (:mod:`kvdemo.compare`), ask them all with answer
attribution, measure what compression changed, and sweep the delay after the evidence left view. Each yields
or returns update dicts keyed by view name (:mod:`kvdemo.app.compare_page` maps them to components); errors a
user can cause end in a message, never an exception. No Gradio and no tensors here."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import viz
from ..compare import (
    FULL,
    MAX_POLICIES,
    check_chunks,
    compare_engines,
    comparison_report,
    memory_bound,
    model_seconds,
    parse_overrides,
    question_record,
)
from ..engine import EngineError
from ..errors import BudgetError, StreamSettingError, UserError
from ..explain import attribution_views, fidelity_views
from ..streaming import EngineGroup
from ..views import counted
from .gpu import Segment, answer_into, measure_fidelity, segment_frames, stream_segment, sweep_delays
from .sessions import AppServices, Session
from .settings import FRAMES_PER_CHUNK, USER_ERRORS, open_stream, within_max_pixels
from .views import ViewChoice, answer_note

#: Newest frames in each engine's survivor strip; frames in the attribution heatmaps.
STRIP_FRAMES = 6
ATTRIBUTION_FRAMES = 6
#: Answer panes: the compared policies, then the full cache.
SLOTS = MAX_POLICIES + 1


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


@dataclass(eq=False)
class Comparison(Session):
    """One browser session's comparison: its engines (policies, then ``full``) behind one group, thumbnails, a chat
    per engine, the last answer's attributions and the report's questions."""

    bound: dict[str, Any] = field(default_factory=dict)
    attributions: dict[str, Any] = field(default_factory=dict)
    questions: list[dict[str, Any]] = field(default_factory=list)
    fidelity: dict[str, Any] = field(default_factory=dict)


def start_comparison(services: AppServices, settings: CompareSettings, source: str, frame_size: tuple[int, int],
                     fps: float) -> Comparison:
    """A fresh comparison for ``settings`` on frames of ``frame_size``: the choices and every engine's budget checked
    against one chunk of such frames (a one-line :class:`~kvdemo.errors.UserError` otherwise)."""
    model = services.models.get(settings.model)
    contenders = parse_overrides(settings.policies, settings.overrides)
    cap = int(settings.cap_mb * 2**20) if settings.cap_mb and settings.cap_mb > 0 else None
    engines = compare_engines(model, contenders, settings.budget, settings.keep, fps, cap)
    tokens, shape = model.geometry.chunk_tokens(frame_size, FRAMES_PER_CHUNK)
    check_chunks(engines, tokens, shape)
    state = Comparison(settings=settings, group=EngineGroup(model, engines, fps), source=source, frame_size=tuple(frame_size))
    state.chat = {name: [] for name in engines}
    state.bound = memory_bound(model, engines, tokens * fps / FRAMES_PER_CHUNK, cap)
    return state


def run_comparison(services: AppServices, previous: Comparison | None, video_path: str | None,
                   settings: CompareSettings) -> Iterator[dict[str, Any]]:
    """Stream a file (the bundled sample of ``settings.sample`` when ``video_path`` is None) into a fresh comparison;
    yields updates (session, status, plot, strips, titles, chats, report) after every chunk. A run that fails before
    its first chunk leaves the previous comparison as it was."""
    try:
        geometry = within_max_pixels(services.models.get(settings.model).geometry, settings.max_pixels)
        if settings.fps is None or float(settings.fps) <= 0:
            raise StreamSettingError(f"sampling fps must be positive, got {settings.fps}")
        video, episode = open_stream(geometry, video_path, settings.fps, settings.sample)
        state = start_comparison(services, settings, video.describe(), video.size, video.fps)
        state.episode = episode
    except USER_ERRORS as exc:
        yield kept_previous(previous, str(exc))
        return
    services.sessions.replace(previous, state)
    state.running = True
    yield {"session": state, "status": f"⏳ starting {video.describe()}\n\n{state.bound['text']}", **titles(state),
           **chats(state), "ask_status": "", "attribution": None, "attribution_text": "", "fidelity_plot": None,
           "report": None}
    try:
        parts = video.chunks(segment_frames())
        current = next(parts, None)
        while current is not None and not state.stop_requested and not state.freed:
            following = next(parts, None)
            _, frames, times = current
            with state.turns.chunk():
                segment = Segment.of(state, frames, times, following is None, ViewChoice(), video.num_frames)
                old = len(segment.thumbnails)
                for update in stream_segment(segment):
                    if "segment" in update:
                        update["segment"].apply_to(state, old)
            current = following
            yield live(state, video.num_frames)
    except USER_ERRORS as exc:
        yield {"session": state, "status": status(state, error=str(exc))}
        return
    finally:
        state.running = False
    if state.stop_requested:
        state.stopped["run"] = f"stopped by the user at {state.group.frames_seen} of {counted(video.num_frames, 'frame')}"
        state.stop_requested = False
    state.source, state.lost_frames = video.describe(), video.lost_frames  # now knows the damaged frames
    final = live(state, video.num_frames - video.lost_frames)
    if video.lost_frames:
        were = "was" if video.lost_frames == 1 else "were"
        final["status"] = (f"⚠️ **{counted(video.lost_frames, 'damaged frame')} could not be decoded and {were} "
                           f"skipped**\n\n" + final["status"])
    yield {**final, "report": write_report(state)}


def kept_previous(previous: Comparison | None, error: str) -> dict[str, Any]:
    """A comparison that failed before it started: the previous one stays, and both the status and the chart's title
    say that what is shown is the previous comparison (it looked current)."""
    update: dict[str, Any] = {"session": previous, "status": f"⚠️ **{error}**"}
    if previous is not None and previous.group is not None and previous.group.frames_seen:
        update["status"] += f"\n\n<small>Still showing the previous comparison: {previous.source}</small>"
        update["plot"] = occupancy(previous, f"the previous comparison ({previous.source}): the new one did not start")
    return update


def live(state: Comparison, total: int | None = None) -> dict[str, Any]:
    return {"session": state, "status": status(state, total), "plot": occupancy(state), "strips": strips(state),
            "strips_legend": strips_legend(state), **titles(state)}


def strips_legend(state: Comparison) -> str:
    """What the survivor strips' colours mean, for the statuses the compared engines can show."""
    return (viz.status_legend(viz.possible_statuses(state.engines.values()))
            + " (tint = share of the (layer, KV head) copies in each state)")


def status(state: Comparison, total: int | None = None, error: str = "") -> str:
    """Frames so far, each engine's visual tokens and MB, the model work per second of stream, the memory bound."""
    if state.group is None:
        return f"⚠️ **{state.freed or error}**" if (state.freed or error) else "Ready: choose up to four policies, then Run."
    seen = state.group.frames_seen
    lines = [f"⚠️ **{error}**"] if error else []
    lines.append(f"**{seen}/{counted(total, 'frame')}**" if total else f"**{counted(seen, 'frame')}**")
    for name, engine in state.engines.items():
        why = state.stopped.get(name)
        lines.append(f"{label(state, name)}: {counted(engine.memory.visual_tokens, 'visual token')}, "
                     f"{engine.memory.nbytes / 2**20:.2f} MB, {counted(engine.stats.compressions, 'compression')}"
                     + (f" — {why}" if why else ""))
    stream_s = seen / state.group.stream.fps
    if stream_s:
        work = model_seconds(state.engines)
        lines.append(f"model work {work:.2f} s for {stream_s:.0f} s of stream ({work / stream_s:.3f} s per stream second, "
                     f"{'faster' if work < stream_s else 'slower'} than real time)")
    lines.append(f"<small>{state.bound.get('text', '')} · {state.source}</small>")
    return "\n\n".join(lines)


def label(state: Comparison, name: str) -> str:
    engine = state.engines[name]
    return "**full cache**" if name == FULL else f"**{name}** ({engine.budget.describe()})"


def titles(state: Comparison) -> dict[str, Any]:
    """Each answer pane's title and whether it shows (``title:i``, ``visible:i``)."""
    names = list(state.engines)
    out = {}
    for slot in range(SLOTS):
        out[f"title:{slot}"] = label(state, names[slot]) if slot < len(names) else ""
        out[f"visible:{slot}"] = slot < len(names)
    return out


def chats(state: Comparison) -> dict[str, Any]:
    return {f"chat:{slot}": list(state.chat.get(name, [])) for slot, name in enumerate(state.engines)}


def occupancy(state: Comparison, title: str = ""):
    """Every engine's occupancy line in one chart (the shared ``M`` dashed), under ``title`` if one is given."""
    series = {(name if name != FULL else "full cache"): e.memory.timeline for name, e in state.engines.items()}
    budgets = [e.budget.M for e in state.engines.values() if e.budget.M is not None]
    return viz.occupancy_figure(series, max(budgets) if budgets else None, title)


def strips(state: Comparison) -> np.ndarray | None:
    """One survivor strip per engine over the same newest frames, stacked, so each column is one moment."""
    if state.group is None or state.group.frames_seen == 0:
        return None
    return viz.labelled_rows([(label(state, name).replace("*", ""), viz.engine_strip(engine, state.thumbnails, last=STRIP_FRAMES))
                              for name, engine in state.engines.items() if engine.memory.num_grids])


def ask_comparison(state: Comparison | None, question: str, attribute: bool = True,
                   max_new_tokens: int = 64) -> Iterator[dict[str, Any]]:
    """Ask every engine (each in its own dialogue), answers streaming into their panes, graded on a generated
    stream; with ``attribute`` the heatmaps of what each answer looked at, policy beside the full cache."""
    question = (question or "").strip()
    if state is None or state.group is None or state.group.frames_seen == 0:
        yield {"ask_status": f"⚠️ {state.freed if state is not None and state.freed else 'no video yet: run a comparison first, then ask'}"}
        return
    with state.turns.question():
        try:
            if not question:
                raise EngineError("type a question first")
            next(iter(state.engines.values())).check_question(question)
        except EngineError as exc:
            yield {"session": state, "ask_status": f"⚠️ {exc}"}
            return
        asked = {name: e for name, e in state.engines.items() if name not in state.stopped}
        for name in state.engines:
            state.chat[name] += [{"role": "user", "content": question},
                                 {"role": "assistant", "content": "" if name in asked else f"*{state.stopped[name]}; no answer.*"}]
        for _ in answer_into(state, asked, question, max_new_tokens, attribute):
            yield {"session": state, "ask_status": "⏳ answering…", **chats(state)}
        answers = {name: state.engines[name].answers[-1] for name in asked}
        for name, answer in answers.items():
            state.chat[name][-1]["content"] = answer_markdown(state, answer)
        state.questions.append(question_record(question, answers, state.episode, state.engines[FULL].last_time_s))
        state.attributions = {name: a.attribution for name, a in answers.items() if a.attribution is not None}
        update = {"session": state, "ask_status": f"✓ answered by {counted(len(asked), 'engine')}", **chats(state),
                  **attribution_update(state, question), "report": write_report(state)}
    yield update


def answer_markdown(state: Comparison, answer) -> str:
    """An answer, its tokens and time, what it is worth (graded on a generated stream, or the offline model's warning
    on a real video: :func:`~kvdemo.app.views.answer_note`) and where its attention went."""
    note = answer_note(state, answer)
    share = ""
    if answer.attribution is not None:
        parts = answer.attribution.share()
        share = " · attention: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in parts.items() if v >= 0.005)
    return f"{answer.answer or '(empty answer)'}\n\n<small>{counted(answer.tokens, 'token')} in {answer.ms:.0f} ms{note}{share}</small>"


def attribution_update(state: Comparison, question: str, view: ViewChoice = ViewChoice()) -> dict[str, Any]:
    """The attribution heatmaps (one row per engine, over the frames the answers looked at most) for the chosen layer
    and KV head (all of them by default) and a caption."""
    if not state.attributions:
        return {"attribution": None, "attribution_text": "*Tick “what each answer looked at” to see attribution.*"}
    layer, head = view.indices
    mass = np.max([a.frame_mass(layer, head) for a in state.attributions.values()], axis=0)
    grids = sorted(np.argsort(-mass, kind="stable")[:ATTRIBUTION_FRAMES].tolist())
    grids = viz.drawable(grids, state.thumbnails)
    views = attribution_views(state.attributions, state.group.engines[FULL].memory.grid_times_s, grids, layer, head)
    rows = [(view.title, panel.value) for view, panel in zip(views, viz.draw_views(views, state.thumbnails))]
    record = state.questions[-1]["answers"] if state.questions else {}
    ratios = [f"{name} {entry['evidence_ratio']:.2f}" for name, entry in record.items() if entry.get("evidence_ratio") is not None]
    where = "every layer and KV head" if layer is None and head is None else \
        f"layer {'all' if layer is None else layer}, KV head {'all' if head is None else head}"
    text = (f"**What each answer looked at** — “{question}” ({where}): the {counted(len(grids), 'frame')} the answers attended most, each "
            "patch tinted by the share of the answer's attention (question and generated tokens) "
            "on the tokens of that patch the engine still held or brought back from host memory (one scale for every "
            "engine).\n\n"
            + "\n".join(f"- {v.title.split(':')[0]}: {v.caption.split(' (tint')[0]}" for v in views))
    if ratios:
        text += f"\n\nEvidence ratio (attention per frame showing the asked object ÷ per frame; 1 = no preference): {', '.join(ratios)}"
    return {"attribution": viz.labelled_rows(rows), "attribution_text": text}


def redraw_attribution(state: Comparison | None, layer: str, head: str) -> dict[str, Any]:
    """The last answer's attribution for another layer and KV head ("all" or a number)."""
    if state is None or not state.questions:
        return {"attribution_text": "*Ask a question with “what each answer looked at” ticked first.*"}
    return attribution_update(state, state.questions[-1]["question"], ViewChoice(layer, head))


def compare_fidelity(state: Comparison | None, question: str) -> dict[str, Any]:
    """Per-layer attention-output error and first-token KL of every policy against the full cache for ``question``."""
    question = (question or "").strip()
    if state is None or state.group is None or state.group.frames_seen == 0:
        return {"fidelity_text": "⚠️ no video yet: run a comparison first"}
    if FULL in state.stopped:
        return {"fidelity_text": f"⚠️ the full cache stopped ({state.stopped[FULL]}): nothing to compare with"}
    with state.turns.question():
        try:
            full = state.engines[FULL]
            full.check_question(question)
            others = {n: e for n, e in state.engines.items() if n != FULL and n not in state.stopped}
            results = measure_fidelity(state.settings.model, full, others, question)
        except EngineError as exc:
            return {"fidelity_text": f"⚠️ {exc}"}
        state.fidelity[question] = results
        chart = fidelity_views(question, results)[0]
        measured = f"“{question if len(question) <= 80 else question[:79] + '…'}”"
        rows = "\n".join(f"| {n} | {r['first_token_kl']:.4f} | {np.mean(r['layer_error']):.3f} | {max(r['layer_error']):.3f} |"
                         for n, r in results.items())
        text = (f"**Measured for {measured}** (the question alone, every engine's memory as it is now)\n\n"
                "| policy | first-token KL (nats) | mean layer error | worst layer |\n|---|---|---|---|\n" + rows)
        figure = viz.chart_figure(chart, f"What compression changed for {measured}")
        return {"session": state, "fidelity_plot": figure, "fidelity_text": text, "report": write_report(state)}


def parse_delays(text: str) -> tuple[float, ...]:
    try:
        delays = tuple(float(d) for d in (text or "").replace(" ", "").split(",") if d)
    except ValueError:
        raise StreamSettingError(f"delays are seconds separated by commas, got {text!r}") from None
    if not delays or min(delays) < 0:
        raise StreamSettingError(f"delays must be non-negative seconds, got {text!r}")
    return delays


def run_sweep(settings: CompareSettings, delays_text: str, more_streams: int) -> Iterator[dict[str, Any]]:
    """The eval protocol on the bundled sample (and ``more_streams`` held-out streams of its kind) for the chosen
    policies and the full cache: accuracy against delay, redrawn after every answer round."""
    try:
        delays = parse_delays(delays_text)
        if not 0 <= int(more_streams or 0) <= 20:
            raise StreamSettingError(f"more streams: 0 to 20, got {more_streams}")
        contenders = parse_overrides(settings.policies, "")
        if settings.overrides.strip():
            raise BudgetError("the delay sweep runs every policy at the shared M and C (clear the per-policy lines)")
    except UserError as exc:
        yield {"sweep_text": f"⚠️ {exc}"}
        return
    names = [c.name for c in contenders] + [FULL]
    last = 0.0
    sweep = None
    try:
        for sweep in sweep_delays(settings.model, names, delays, int(settings.budget), int(settings.keep), settings.sample,
                                  int(more_streams or 0)):
            if time.monotonic() - last > 0.5:
                last = time.monotonic()
                yield {"sweep_plot": viz.chart_figure(sweep.chart()), "sweep_text": f"⏳ {sweep.chart().caption}"}
    except (*USER_ERRORS, ValueError) as exc:
        yield {"sweep_text": f"⚠️ {exc}"}
        return
    if sweep is not None:
        table = "| policy | " + " | ".join(f"{d:g} s" for d in delays) + " |\n|---|" + "---|" * len(delays) + "\n"
        table += "\n".join(f"| {n} | " + " | ".join("–" if a is None else f"{a:.2f}" for a in row) + " |"
                           for n, row in sweep.accuracy().items())
        yield {"sweep_plot": viz.chart_figure(sweep.chart()), "sweep_text": f"✓ {sweep.chart().caption}\n\n{table}"}


def write_report(state: Comparison) -> str | None:
    """The comparison report (the CLI's ``compare --json`` format) as a file to download."""
    if state.group is None:
        return None
    report = comparison_report(state.engines, state.group, state.source, state.questions, state.bound, state.lost_frames)
    report["fidelity"] = state.fidelity
    path = state.report_dir / "kvdemo-compare.json"
    path.write_text(json.dumps(report, indent=1))
    return str(path)


def new_conversation(state: Comparison | None) -> dict[str, Any]:
    if state is not None:
        for engine in state.engines.values():
            engine.reset_dialogue()
        state.chat = {name: [] for name in state.engines}
    return {"session": state, **(chats(state) if state else {}), "ask_status": ""}
