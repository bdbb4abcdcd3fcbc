"""The comparison page: up to four policies and the full cache on one stream (aligned survivor strips, occupancy
lines in one chart, one answer pane per engine, what each answer looked at, what compression changed, and a delay
sweep), its components and their wiring to :mod:`kvdemo.app.comparing`. Built inside the app's Blocks by
:class:`kvdemo.app.layout.Demo` (which imports Gradio and hands it over)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..compare import MAX_POLICIES, compare_budget
from ..policies import COMPARE_POLICIES
from ..synthetic import sample_episode
from .comparing import (
    SLOTS,
    CompareSettings,
    ask_comparison,
    compare_fidelity,
    kept_previous,
    new_conversation,
    redraw_attribution,
    run_comparison,
    run_sweep,
)
from .sessions import SESSION_TTL_S, AppServices
from .settings import SAMPLE_KIND_HELP, USER_ERRORS, baseline_cap_default

log = logging.getLogger("kvdemo")
#: Outputs shown only once they have something to show.
HIDDEN_WHEN_EMPTY = {"attribution", "fidelity_plot", "sweep_plot"}


class ComparePage:
    """The comparison tab's components (:meth:`build`) and events (:meth:`wire`); ``gr`` is the Gradio module."""

    def __init__(self, gr, services: AppServices, policies: list[str], defaults: tuple[int, int, int], streams: dict,
                 question_slots: dict) -> None:
        self.gr, self.services, self.policies = gr, services, policies
        (self.budget0, self.keep0), self.pixels0 = compare_budget(*defaults[:2]), defaults[2]
        self.streams, self.questions_slots = streams, question_slots  # concurrency of streams and of questions
        self.questions = sample_questions()

    def build(self) -> None:
        gr = self.gr
        self.state = gr.State(value=None, time_to_live=SESSION_TTL_S, delete_callback=self.services.sessions.free)
        gr.Markdown("Up to four policies and the full cache watch **one** stream (one vision encoding feeds them all): "
                    "their occupancy in one chart, what each kept of the same moments, their answers side by side, what "
                    "each answer looked at, and how far each policy's attention drifts from the full cache's.")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                self.video = gr.Video(label="Upload a video", sources=["upload"], height=180)
                with gr.Row():
                    self.run_button = gr.Button("Compare on the upload", elem_id="compare-run")
                    self.sample_button = gr.Button("Compare on the bundled sample", variant="primary", elem_id="compare-sample")
                    self.stop_button = gr.Button("Stop", variant="stop", elem_id="compare-stop")
                self.sample_kind = gr.Radio([("still camera", "static"), ("moving camera", "moving")], value="static",
                                            label="Bundled sample", elem_id="compare-sample-kind",
                                            info=SAMPLE_KIND_HELP["static"])
                self.model = gr.Dropdown(self.services.models.choices(), value=self.services.models.default, label="Model",
                                         allow_custom_value=True, elem_id="compare-model")
                self.chosen = gr.CheckboxGroup(self.policies, value=[p for p in COMPARE_POLICIES if p in self.policies],
                                               label=f"Policies (at most {MAX_POLICIES})", elem_id="compare-policies")
                with gr.Row():
                    self.budget = gr.Number(self.budget0, label="M (shared)", precision=0, elem_id="compare-budget")
                    self.keep = gr.Number(self.keep0, label="C (shared)", precision=0, elem_id="compare-keep")
                self.overrides = gr.Textbox("", label="A policy's own budget and parameters (one line each)", lines=2,
                                            placeholder="policy: M=96 C=72 parameter=value …", elem_id="compare-overrides")
                with gr.Row():
                    self.fps = gr.Slider(0.5, 8, value=2, step=0.5, label="Sampling fps")
                    self.max_pixels = gr.Number(self.pixels0, label="Max pixels per frame", precision=0)
                self.cap_mb = gr.Number(baseline_cap_default(), label="Full cache stops at (MB)", precision=0, info="0 = no cap")
            with gr.Column(scale=2):
                self.status = gr.Markdown("Ready: choose up to four policies, then compare.", label="Comparison status", elem_id="compare-status")
                self.plot = gr.Plot(label="Occupancy of every engine", show_label=False, elem_id="compare-occupancy")
                gr.Markdown("**What each engine holds of the newest frames** (same frames in the same columns)")
                self.strips = gr.Image(label="Survivor strips", show_label=False, format="jpeg", type="numpy",
                                       interactive=False, buttons=[], elem_id="compare-strips")
                self.strips_legend = gr.Markdown("", label="Survivor strips legend", elem_id="compare-strips-legend")
        with gr.Row():
            self.question = gr.Textbox(label="Ask every engine", scale=4, elem_id="compare-question",
                                       placeholder="What colour was the circle?")
            self.attribute = gr.Checkbox(True, label="what each answer looked at", scale=1, elem_id="compare-attribute")
            self.ask_button = gr.Button("Ask", variant="primary", scale=1, elem_id="compare-ask")
            self.clear_button = gr.Button("New conversation", scale=1)
        self.ask_status = gr.Markdown("", label="Question status", elem_id="compare-ask-status")
        self.examples = gr.Dataset(components=[self.question], samples=self.questions["static"],
                                   label="Questions about the bundled sample (click to ask every engine)",
                                   elem_id="compare-examples")
        self.columns, self.titles, self.chats = [], [], []
        with gr.Row(equal_height=True):
            for slot in range(SLOTS):
                with gr.Column(visible=slot < MAX_POLICIES + 1, min_width=180) as column:
                    first = [*(p for p in COMPARE_POLICIES if p in self.policies), "full cache"]
                    self.titles.append(gr.Markdown(f"**{first[slot]}**" if slot < len(first) else "", label=f"Engine {slot + 1} title",
                                                   elem_id=f"compare-title-{slot}"))
                    self.chats.append(gr.Chatbot(label=f"Engine {slot + 1} chat", show_label=False, height=260, buttons=["copy"],
                                                 elem_id=f"compare-chat-{slot}"))
                self.columns.append(column)
        with gr.Row():
            self.layer = gr.Dropdown(["all"], value="all", label="Attribution: layer", elem_id="compare-layer")
            self.head = gr.Dropdown(["all"], value="all", label="Attribution: KV head", elem_id="compare-head")
        self.attribution_text = gr.Markdown("", label="Attribution caption", elem_id="compare-attribution-text")
        self.attribution = gr.Image(label="What each answer looked at", show_label=False, format="jpeg", type="numpy",
                                    interactive=False, buttons=[], visible=False, elem_id="compare-attribution")
        with gr.Accordion("What compression changed (per layer, against the full cache)", open=True):
            self.fidelity_button = gr.Button("Measure for the question above", size="sm", elem_id="compare-fidelity")
            self.fidelity_plot = gr.Plot(label="Fidelity chart", show_label=False, visible=False, elem_id="compare-fidelity-plot")
            self.fidelity_text = gr.Markdown("", label="Fidelity table", elem_id="compare-fidelity-text")
        with gr.Accordion("Delay sweep on the bundled sample (accuracy against delay, the eval protocol)", open=True):
            with gr.Row():
                self.delays = gr.Textbox("0, 4, 8, 16", label="Delays after the evidence left view (s)", elem_id="compare-delays")
                self.more = gr.Number(3, label="More held-out streams of the sample's kind", precision=0, elem_id="compare-more")
                self.sweep_button = gr.Button("Sweep", elem_id="compare-sweep")
            self.sweep_plot = gr.Plot(label="Accuracy against delay", show_label=False, visible=False, elem_id="compare-sweep-plot")
            self.sweep_text = gr.Markdown("", label="Delay sweep table", elem_id="compare-sweep-text")
        self.report = gr.File(label="Comparison report (JSON)", interactive=False, elem_id="compare-report")
        self.wire()

    # --- from handler updates to components --------------------------------------------------------
    def to_components(self, update: dict[str, Any]) -> dict[Any, Any]:
        gr = self.gr
        named = {"session": self.state, "status": self.status, "plot": self.plot, "strips": self.strips,
                 "ask_status": self.ask_status, "attribution": self.attribution, "attribution_text": self.attribution_text,
                 "fidelity_plot": self.fidelity_plot, "fidelity_text": self.fidelity_text, "sweep_plot": self.sweep_plot,
                 "sweep_text": self.sweep_text, "report": self.report, "question": self.question,
                 "strips_legend": self.strips_legend}
        out = {named[key]: value for key, value in update.items() if key in named}
        for key in HIDDEN_WHEN_EMPTY.intersection(update):  # no empty placeholder box before there is something to show
            out[named[key]] = gr.update(value=update[key], visible=update[key] is not None)
        for key, value in update.items():
            kind, _, slot = key.partition(":")
            if kind == "chat":
                out[self.chats[int(slot)]] = value
            elif kind == "title":
                out[self.titles[int(slot)]] = value
            elif kind == "visible":
                out[self.columns[int(slot)]] = gr.update(visible=value)
        return out

    def outputs(self) -> list[Any]:
        return [self.state, self.status, self.plot, self.strips, self.ask_status, self.attribution, self.attribution_text,
                self.fidelity_plot, self.report, *self.titles, *self.chats, *self.columns, self.strips_legend]

    def settings(self, values: dict[str, Any]) -> CompareSettings:
        return CompareSettings(values["model"] or self.services.models.default, list(values["policies"] or []),
                               values["overrides"] or "", values["budget"], values["keep"], float(values["fps"] or 0),
                               int(values["max_pixels"] or 0), float(values["cap_mb"] or 0), values["sample_kind"] or "static")

    def guarded(self, fn, key: str):
        """``fn``'s updates as components; an unexpected error is logged and said in one line (the app keeps serving)."""
        @functools.wraps(fn)  # Gradio reads fn's signature: the API's parameter names
        def run(*args, **kwargs):
            try:
                result = fn(*args, **kwargs)
                for update in ([result] if isinstance(result, dict) else result):
                    yield self.to_components(update)
            except USER_ERRORS as exc:
                yield self.to_components({key: f"⚠️ {exc}"})
            except Exception as exc:
                log.exception("unexpected error in a comparison handler")
                yield self.to_components({key: f"⚠️ **internal error** ({type(exc).__name__}: {str(exc)[:200]}); it is "
                                               "logged, and the app keeps serving"})
        return run

    # --- handlers ------------------------------------------------------------------------------------
    def on_run(self, state, video, **values):
        if not video:
            return kept_previous(state, "upload a video first (or compare on the bundled sample)")
        return self.in_line(lambda: run_comparison(self.services, state, video, self.settings(values)))

    def on_sample(self, state, **values):
        return self.in_line(lambda: run_comparison(self.services, state, None, self.settings(values)))

    def in_line(self, run, key: str = "status"):
        """``run()``'s updates once it holds one of the app's stream slots; while it waits, where it stands."""
        return self.services.streams.held(run, key)

    def on_stop(self, state):
        if state is not None and state.running:
            state.stop_requested = True

    def on_example(self, state, example, attribute):
        """A sample question clicked: it goes in the box and to every engine at once (one event, no race with Ask)."""
        for update in ask_comparison(state, example[0], attribute):
            yield {**update, "question": example[0]}

    def on_sweep(self, delays, more, **values):
        return self.in_line(lambda: run_sweep(self.settings(values), delays, more), "sweep_text")

    def on_view_choices(self, state):
        """The layers and KV heads of the comparison's model, for the attribution's selectors."""
        engine = next(iter(state.engines.values()), None) if state is not None else None
        if engine is None:
            return self.gr.update(), self.gr.update()
        return (self.gr.update(choices=["all"] + [str(i) for i in range(engine.model.num_layers)], value="all"),
                self.gr.update(choices=["all"] + [str(i) for i in range(engine.model.num_kv_heads)], value="all"))

    def on_sample_kind(self, kind):
        return (self.gr.Dataset(samples=self.questions[kind or "static"]),
                self.gr.update(info=SAMPLE_KIND_HELP.get(kind or "static", "")))

    def wire(self) -> None:
        settings = {"model": self.model, "policies": self.chosen, "overrides": self.overrides, "budget": self.budget,
                    "keep": self.keep, "fps": self.fps, "max_pixels": self.max_pixels, "cap_mb": self.cap_mb,
                    "sample_kind": self.sample_kind}
        runs = self.outputs()
        started = [
            self.run_button.click(self.guarded(self.on_run, "status"), [self.state, self.video], runs, inputs_kwargs=settings,
                                  api_name="compare_run", show_progress_on=[self.status], **self.streams),
            self.sample_button.click(self.guarded(self.on_sample, "status"), [self.state], runs, inputs_kwargs=settings,
                                     api_name="compare_sample", show_progress_on=[self.status], **self.streams),
        ]
        for event in started:
            event.then(self.on_view_choices, [self.state], [self.layer, self.head], api_visibility="private")
        attribution = self.guarded(redraw_attribution, "attribution_text")
        for control in (self.layer, self.head):
            control.change(attribution, [self.state, self.layer, self.head], [self.attribution, self.attribution_text],
                           api_visibility="private", show_progress="hidden")
        self.stop_button.click(self.on_stop, [self.state], None, api_name="compare_stop", concurrency_limit=None,
                               show_progress="hidden")
        asked = [self.state, self.ask_status, self.attribution, self.attribution_text, self.report, *self.chats]
        ask = self.guarded(ask_comparison, "ask_status")
        self.ask_button.click(ask, [self.state, self.question, self.attribute], asked, api_name="compare_ask",
                              show_progress_on=[self.ask_status], **self.questions_slots)
        self.question.submit(ask, [self.state, self.question, self.attribute], asked, api_visibility="private",
                             show_progress_on=[self.ask_status], **self.questions_slots)
        self.examples.click(self.guarded(self.on_example, "ask_status"), [self.state, self.examples, self.attribute],
                            [*asked, self.question], api_visibility="private", show_progress_on=[self.ask_status],
                            **self.questions_slots)
        self.clear_button.click(self.guarded(new_conversation, "ask_status"), [self.state], [self.state, self.ask_status, *self.chats],
                                api_name="compare_new_conversation", concurrency_limit=None)
        self.fidelity_button.click(self.guarded(compare_fidelity, "fidelity_text"), [self.state, self.question],
                                   [self.state, self.fidelity_plot, self.fidelity_text, self.report], api_name="compare_fidelity",
                                   show_progress_on=[self.fidelity_text], **self.questions_slots)
        self.sweep_button.click(self.guarded(self.on_sweep, "sweep_text"), [self.delays, self.more],
                                [self.sweep_plot, self.sweep_text], inputs_kwargs=settings, api_name="compare_sweep",
                                show_progress_on=[self.sweep_text], **self.streams)
        self.sample_kind.change(self.on_sample_kind, [self.sample_kind], [self.examples, self.sample_kind], api_visibility="private",
                                show_progress="hidden")


def sample_questions() -> dict[str, list[list[str]]]:
    """The bundled samples' questions, per kind, as the examples list takes them."""
    return {kind: [[q.text] for q in sample_episode(kind).questions] for kind in ("static", "moving")}
