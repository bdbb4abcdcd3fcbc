"""What the comparison page shows (:class:`CompareUpdates`: up to four policies and the full cache on one stream,
through the same stream and ask paths as the single page, :mod:`kvdemo.app.handlers`) and what its own buttons do,
as plain functions (tested without a browser): measure what compression changed, redraw what each answer looked at,
and sweep the delay after the evidence left view. Each yields or returns update dicts keyed by view name
(:mod:`kvdemo.app.compare_page` maps them to components); errors a user can cause end in a message, never an
exception. No Gradio and no tensors here."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import viz
from ..analysis.explain import attribution_views, fidelity_views
from ..errors import BudgetError, StreamSettingError, UserError
from ..experiments.compare import FULL, MAX_POLICIES, comparison_report, model_seconds, question_record
from ..stream.engine import EngineError
from ..views import counted, tokens_held
from .gpu import measure_fidelity, sweep_delays
from .page_updates import PageUpdates, earlier_questions
from .sessions import CompareSettings, Session
from .settings import USER_ERRORS
from .single_updates import DisplayChoice

#: Newest frames in each engine's survivor strip; frames in the attribution heatmaps.
STRIP_FRAMES = 6
ATTRIBUTION_FRAMES = 6
#: Answer panes: the compared policies, then the full cache.
SLOTS = MAX_POLICIES + 1


@dataclass(frozen=True)
class CompareUpdates(PageUpdates):
    """What the comparison page shows: every engine's line in the status and the chart, aligned survivor strips, an
    answer pane per engine (with its title), what each answer looked at, and the report in the CLI's format."""

    what = "comparison"
    no_video = "no video yet: run a comparison first, then ask"
    report_name = "kvdemo-compare.json"
    answer_details = False  # narrow panes: the answer stays in view (the status says every engine's cache)

    def status(
        self, state: Session, done: int | None = None, total: int | None = None, error: str = "", stopped: bool = False
    ) -> str:
        return status(state, total, error)

    def starting(self, state: Session, source: str) -> dict[str, Any]:
        # The comparison clears the last question's panes and status as it starts (the single page: at its first chunk).
        return {"session": state, "status": f"⏳ starting {source}\n\n{state.bound['text']}", **self.fresh(state)}

    def fresh(self, state: Session) -> dict[str, Any]:
        return {
            **titles(state),
            **self.chats(state),
            "ask_status": "",
            "attribution": None,
            "attribution_text": "",
            "fidelity_plot": None,
            "report": None,
        }

    def live(
        self, state: Session, done: int | None = None, total: int | None = None, force: bool = False
    ) -> dict[str, Any]:
        return {
            "session": state,
            "status": status(state, total),
            "plot": occupancy(state),
            "strips": strips(state),
            "strips_legend": strips_legend(state),
            **titles(state),
        }

    def finished(self, state: Session, done: int, total: int, stopped: bool) -> dict[str, Any]:
        final = self.live(state, done, total)
        if state.lost_frames:
            were = "was" if state.lost_frames == 1 else "were"
            lost = counted(state.lost_frames, "damaged frame")
            final["status"] = f"⚠️ **{lost} could not be decoded and {were} skipped**\n\n" + final["status"]
        return {**final, "report": self.write_report(state)}

    def previous_views(self, previous: Session) -> dict[str, Any]:
        return {"plot": occupancy(previous, f"the previous comparison ({previous.source}): the new one did not start")}

    def chats(self, state: Session | None) -> dict[str, Any]:
        chat = state.chat if state is not None else {}
        return {f"chat:{slot}": list(chat.get(name, [])) for slot, name in enumerate(state.engines if state else [])}

    def answered(self, state: Session, question: str, answers: dict[str, Any]) -> dict[str, Any]:
        earlier = earlier_questions(state.engines[FULL])
        state.questions.append(
            question_record(question, answers, state.episode, state.engines[FULL].last_time_s, earlier)
        )
        state.attributions = {name: a.attribution for name, a in answers.items() if a.attribution is not None}
        return {
            "ask_status": f"✓ answered by {counted(len(answers), 'engine')}",
            **attribution_update(state, question),
            "report": self.write_report(state),
        }

    def report(self, state: Session) -> dict[str, Any] | None:
        """The comparison report (the CLI's ``compare --json`` format) with the fidelity measured."""
        report = comparison_report(
            state.engines, state.group, state.source, state.questions, state.bound, state.lost_frames
        )
        report["fidelity"] = state.fidelity
        return report


def strips_legend(state: Session) -> str:
    """What the survivor strips' colours mean, for the statuses the compared engines can show."""
    pruned = any(engine.pruning is not None for engine in state.engines.values())
    return (
        viz.status_legend(viz.possible_statuses(state.engines.values()))
        + (" &nbsp; " + viz.pruned_legend() if pruned else "")
        + " (tint = share of the (layer, KV head) copies in each state)"
    )


def status(state: Session, total: int | None = None, error: str = "") -> str:
    """Frames so far, each engine's visual tokens and MB, the model work per second of stream, the memory bound."""
    if state.group is None:
        return (
            f"⚠️ **{state.freed or error}**"
            if (state.freed or error)
            else "Ready: choose up to four policies, then Run."
        )
    seen = state.group.frames_seen
    lines = [f"⚠️ **{error}**"] if error else []
    lines.append(f"**{seen}/{counted(total, 'frame')}**" if total else f"**{counted(seen, 'frame')}**")
    for name, engine in state.engines.items():
        why = state.stopped.get(name)
        lines.append(
            f"{label(state, name)}: {tokens_held(engine.memory)}, "
            f"{engine.memory.nbytes / 2**20:.2f} MB, {counted(engine.stats.compressions, 'compression')}"
            + (f" — {why}" if why else "")
        )
    stream_s = seen / state.group.stream.fps
    if stream_s:
        work = model_seconds(state.engines)
        lines.append(
            f"model work {work:.2f} s for {stream_s:.0f} s of stream ({work / stream_s:.3f} s per stream second, "
            f"{'faster' if work < stream_s else 'slower'} than real time)"
        )
    lines.append(f"<small>{state.bound.get('text', '')} · {state.source}</small>")
    return "\n\n".join(lines)


def label(state: Session, name: str) -> str:
    engine = state.engines[name]
    return "**full cache**" if name == FULL else f"**{name}** ({engine.budget.describe()})"


def titles(state: Session) -> dict[str, Any]:
    """Each answer pane's title and whether it shows (``title:i``, ``visible:i``)."""
    names = list(state.engines)
    out = {}
    for slot in range(SLOTS):
        out[f"title:{slot}"] = label(state, names[slot]) if slot < len(names) else ""
        out[f"visible:{slot}"] = slot < len(names)
    return out


def occupancy(state: Session, title: str = ""):
    """Every engine's occupancy line in one chart (the shared ``M`` dashed), under ``title`` if one is given."""
    series = {(name if name != FULL else "full cache"): e.memory.timeline for name, e in state.engines.items()}
    budgets = [e.budget.M for e in state.engines.values() if e.budget.M is not None]
    pruning = {name: e.pruning.points for name, e in state.engines.items() if e.pruning is not None}
    return viz.occupancy_figure(series, max(budgets) if budgets else None, title, pruning=pruning)


def strips(state: Session) -> np.ndarray | None:
    """One survivor strip per engine over the same newest frames, stacked, so each column is one moment."""
    if state.group is None or state.group.frames_seen == 0:
        return None
    return viz.labelled_rows(
        [
            (label(state, name).replace("*", ""), viz.engine_strip(engine, state.thumbnails, last=STRIP_FRAMES))
            for name, engine in state.engines.items()
            if engine.memory.num_grids
        ]
    )


def attribution_update(state: Session, question: str, view: DisplayChoice = DisplayChoice()) -> dict[str, Any]:
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
    ratios = [
        f"{name} {entry['evidence_ratio']:.2f}"
        for name, entry in record.items()
        if entry.get("evidence_ratio") is not None
    ]
    where = (
        "every layer and KV head"
        if layer is None and head is None
        else f"layer {'all' if layer is None else layer}, KV head {'all' if head is None else head}"
    )
    text = (
        f"**What each answer looked at** — “{question}” ({where}): the {counted(len(grids), 'frame')} the answers attended most, each "
        "patch as bright, and its cyan outline as strong, as the share of the answer's attention (question and "
        "generated tokens) on the tokens of that patch the engine still held or brought back from host memory (one "
        "scale for every engine; the frames keep their own colours).\n\n"
        + "\n".join(f"- {v.title.split(':')[0]}: {v.caption.split(' (brightness')[0]}" for v in views)
    )
    if ratios:
        text += f"\n\nEvidence ratio (attention per frame showing the asked object ÷ per frame; 1 = no preference): {', '.join(ratios)}"
    return {"attribution": viz.labelled_rows(rows), "attribution_text": text}


def redraw_attribution(state: Session | None, layer: str, head: str) -> dict[str, Any]:
    """The last answer's attribution for another layer and KV head ("all" or a number)."""
    if state is None or not state.questions:
        return {"attribution_text": "*Ask a question with “what each answer looked at” ticked first.*"}
    return attribution_update(state, state.questions[-1]["question"], DisplayChoice(layer, head))


def compare_fidelity(state: Session | None, question: str) -> dict[str, Any]:
    """Per-layer attention-output error and first-token KL of every policy against the full cache for ``question``."""
    question = (question or "").strip()
    if state is None or state.group is None or state.group.frames_seen == 0:
        return {"fidelity_text": "⚠️ no video yet: run a comparison first"}
    if FULL in state.stopped:
        return {"fidelity_text": f"⚠️ the full cache stopped ({state.stopped[FULL]}): nothing to compare with"}
    with state.turns:
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
        rows = "\n".join(
            f"| {n} | {r['first_token_kl']:.4f} | {np.mean(r['layer_error']):.3f} | {max(r['layer_error']):.3f} |"
            for n, r in results.items()
        )
        text = (
            f"**Measured for {measured}** (the question alone, every engine's memory as it is now)\n\n"
            "| policy | first-token KL (nats) | mean layer error | worst layer |\n|---|---|---|---|\n" + rows
        )
        figure = viz.chart_figure(chart, f"What compression changed for {measured}")
        return {
            "session": state,
            "fidelity_plot": figure,
            "fidelity_text": text,
            "report": CompareUpdates().write_report(state),
        }


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
        contenders = settings.contenders(overrides=False)
        if settings.overrides.strip():
            raise BudgetError("the delay sweep runs every policy at the shared M and C (clear the per-policy lines)")
    except UserError as exc:
        yield {"sweep_text": f"⚠️ {exc}"}
        return
    names = [c.label for c in contenders] + [FULL]
    last = 0.0
    sweep = None
    try:
        for sweep in sweep_delays(
            settings.model,
            names,
            delays,
            int(settings.budget),
            int(settings.keep),
            settings.sample,
            int(more_streams or 0),
        ):
            if time.monotonic() - last > 0.5:
                last = time.monotonic()
                yield {"sweep_plot": viz.chart_figure(sweep.chart()), "sweep_text": f"⏳ {sweep.chart().caption}"}
    except (*USER_ERRORS, ValueError) as exc:
        yield {"sweep_text": f"⚠️ {exc}"}
        return
    if sweep is not None:
        table = "| policy | " + " | ".join(f"{d:g} s" for d in delays) + " |\n|---|" + "---|" * len(delays) + "\n"
        table += "\n".join(
            f"| {n} | " + " | ".join("–" if a is None else f"{a:.2f}" for a in row) + " |"
            for n, row in sweep.accuracy().items()
        )
        yield {"sweep_plot": viz.chart_figure(sweep.chart()), "sweep_text": f"✓ {sweep.chart().caption}\n\n{table}"}
