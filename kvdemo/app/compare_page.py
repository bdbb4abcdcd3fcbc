"""The comparison page: up to four policies and the full cache on one stream (aligned survivor strips, occupancy
lines in one chart, one answer pane per engine, what each answer looked at, what compression changed, and a delay
sweep), its components and their wiring to :mod:`kvdemo.app.comparing`. Built inside the app's Blocks by
:class:`kvdemo.app.layout.Demo` (which imports Gradio and hands it over)."""

from __future__ import annotations

from typing import Any

from ..experiments.compare import MAX_POLICIES, compare_budget
from ..policies import COMPARE_POLICIES
from ..world.synthetic import sample_episode
from .comparing import SLOTS, CompareUpdates, compare_fidelity, redraw_attribution, run_sweep
from .handlers import request_stop
from .page import Page, guard
from .sessions import SESSION_TTL_S, AppServices, CompareSettings
from .settings import PRUNE_CHOICES, PRUNE_HELP, SAMPLE_KIND_HELP, baseline_cap_default


class ComparePage(Page):
    """The comparison tab's components (:meth:`build`) and events (:meth:`wire`); ``gr`` is the Gradio module."""

    updates = CompareUpdates()
    no_upload = "upload a video first (or compare on the bundled sample)"
    hidden_when_empty = frozenset({"attribution", "fidelity_plot", "sweep_plot"})
    view_choices_reset = True  # a new comparison's attributions are drawn over every layer and head first

    def __init__(
        self,
        gr,
        services: AppServices,
        policies: list[str],
        defaults: tuple[int, int, int],
        streams: dict,
        question_slots: dict,
    ) -> None:
        super().__init__(gr, services)
        self.policies = policies
        (self.budget0, self.keep0), self.pixels0 = compare_budget(*defaults[:2]), defaults[2]
        self.streams, self.questions_slots = streams, question_slots  # concurrency of streams and of questions

    def build(self) -> None:
        gr = self.gr
        self.state = gr.State(value=None, time_to_live=SESSION_TTL_S, delete_callback=self.services.sessions.free)
        gr.Markdown(
            "Up to four policies and the full cache watch **one** stream (one vision encoding feeds them all): "
            "their occupancy in one chart, what each kept of the same moments, their answers side by side, what "
            "each answer looked at, and how far each policy's attention drifts from the full cache's."
        )
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                self.video = gr.Video(label="Upload a video", sources=["upload"], height=180)
                with gr.Row():
                    self.run_button = gr.Button("Compare on the upload", elem_id="compare-run")
                    self.sample_button = gr.Button(
                        "Compare on the bundled sample", variant="primary", elem_id="compare-sample"
                    )
                    self.stop_button = gr.Button("Stop", variant="stop", elem_id="compare-stop")
                self.sample_kind = gr.Radio(
                    [("still camera", "static"), ("moving camera", "moving")],
                    value="static",
                    label="Bundled sample",
                    elem_id="compare-sample-kind",
                    info=SAMPLE_KIND_HELP["static"],
                )
                self.model = gr.Dropdown(
                    self.services.models.choices(),
                    value=self.services.models.default,
                    label="Model",
                    allow_custom_value=True,
                    elem_id="compare-model",
                )
                self.chosen = gr.CheckboxGroup(
                    self.policies,
                    value=[p for p in COMPARE_POLICIES if p in self.policies],
                    label=f"Policies (at most {MAX_POLICIES})",
                    elem_id="compare-policies",
                )
                with gr.Accordion("Pruning before the LLM, per column", open=False, elem_id="compare-pruning"):
                    gr.Markdown(f"In front of the first, second... chosen policy: {PRUNE_HELP}.")
                    with gr.Row():
                        self.prunes = [
                            gr.Dropdown(
                                PRUNE_CHOICES,
                                value=PRUNE_CHOICES[0],
                                label=f"Column {slot + 1}",
                                allow_custom_value=True,
                                min_width=90,
                                elem_id=f"compare-prune-{slot}",
                            )
                            for slot in range(MAX_POLICIES)
                        ]
                with gr.Row():
                    self.budget = gr.Number(self.budget0, label="M (shared)", precision=0, elem_id="compare-budget")
                    self.keep = gr.Number(self.keep0, label="C (shared)", precision=0, elem_id="compare-keep")
                self.overrides = gr.Textbox(
                    "",
                    label="A policy's own budget and parameters (one line each)",
                    lines=2,
                    placeholder="policy: M=96 C=72 parameter=value …",
                    elem_id="compare-overrides",
                )
                with gr.Row():
                    self.fps = gr.Slider(0.5, 8, value=2, step=0.5, label="Sampling fps")
                    self.max_pixels = gr.Number(self.pixels0, label="Max pixels per frame", precision=0)
                self.cap_mb = gr.Number(
                    baseline_cap_default(), label="Full cache stops at (MB)", precision=0, info="0 = no cap"
                )
            with gr.Column(scale=2):
                self.status = gr.Markdown(
                    "Ready: choose up to four policies, then compare.",
                    label="Comparison status",
                    elem_id="compare-status",
                )
                self.plot = gr.Plot(label="Occupancy of every engine", show_label=False, elem_id="compare-occupancy")
                gr.Markdown("**What each engine holds of the newest frames** (same frames in the same columns)")
                self.strips = gr.Image(
                    label="Survivor strips",
                    show_label=False,
                    format="jpeg",
                    type="numpy",
                    interactive=False,
                    buttons=[],
                    elem_id="compare-strips",
                )
                self.strips_legend = gr.Markdown("", label="Survivor strips legend", elem_id="compare-strips-legend")
        with gr.Row():
            self.question = gr.Textbox(
                label="Ask every engine", scale=4, elem_id="compare-question", placeholder="What colour was the circle?"
            )
            self.attribute = gr.Checkbox(True, label="what each answer looked at", scale=1, elem_id="compare-attribute")
            self.ask_button = gr.Button("Ask", variant="primary", scale=1, elem_id="compare-ask")
            self.clear_button = gr.Button("New conversation", scale=1)
        self.ask_status = gr.Markdown("", label="Question status", elem_id="compare-ask-status")
        self.examples = gr.Dataset(
            components=[self.question],
            samples=[[q.text] for q in sample_episode().questions],
            label="Questions about the bundled sample (click to ask every engine)",
            elem_id="compare-examples",
        )
        self.columns, self.titles, self.chats = [], [], []
        with gr.Row(equal_height=True):
            for slot in range(SLOTS):
                with gr.Column(visible=slot < MAX_POLICIES + 1, min_width=180) as column:
                    first = [*(p for p in COMPARE_POLICIES if p in self.policies), "full cache"]
                    self.titles.append(
                        gr.Markdown(
                            f"**{first[slot]}**" if slot < len(first) else "",
                            label=f"Engine {slot + 1} title",
                            elem_id=f"compare-title-{slot}",
                        )
                    )
                    self.chats.append(
                        gr.Chatbot(
                            label=f"Engine {slot + 1} chat",
                            show_label=False,
                            height=260,
                            buttons=["copy"],
                            elem_id=f"compare-chat-{slot}",
                        )
                    )
                self.columns.append(column)
        with gr.Row():
            self.layer = gr.Dropdown(["all"], value="all", label="Attribution: layer", elem_id="compare-layer")
            self.head = gr.Dropdown(["all"], value="all", label="Attribution: KV head", elem_id="compare-head")
        self.attribution_text = gr.Markdown("", label="Attribution caption", elem_id="compare-attribution-text")
        self.attribution = gr.Image(
            label="What each answer looked at",
            show_label=False,
            format="jpeg",
            type="numpy",
            interactive=False,
            buttons=[],
            visible=False,
            elem_id="compare-attribution",
        )
        with gr.Accordion("What compression changed (per layer, against the full cache)", open=True):
            self.fidelity_button = gr.Button("Measure for the question above", size="sm", elem_id="compare-fidelity")
            self.fidelity_plot = gr.Plot(
                label="Fidelity chart", show_label=False, visible=False, elem_id="compare-fidelity-plot"
            )
            self.fidelity_text = gr.Markdown("", label="Fidelity table", elem_id="compare-fidelity-text")
        with gr.Accordion("Delay sweep on the bundled sample (accuracy against delay, the eval protocol)", open=True):
            with gr.Row():
                self.delays = gr.Textbox(
                    "0, 4, 8, 16", label="Delays after the evidence left view (s)", elem_id="compare-delays"
                )
                self.more = gr.Number(
                    3, label="More held-out streams of the sample's kind", precision=0, elem_id="compare-more"
                )
                self.sweep_button = gr.Button("Sweep", elem_id="compare-sweep")
            self.sweep_plot = gr.Plot(
                label="Accuracy against delay", show_label=False, visible=False, elem_id="compare-sweep-plot"
            )
            self.sweep_text = gr.Markdown("", label="Delay sweep table", elem_id="compare-sweep-text")
        self.report = gr.File(label="Comparison report (JSON)", interactive=False, elem_id="compare-report")
        self.wire()

    # --- from handler updates to components --------------------------------------------------------
    def named(self) -> dict[str, Any]:
        return {
            "session": self.state,
            "status": self.status,
            "plot": self.plot,
            "strips": self.strips,
            "ask_status": self.ask_status,
            "attribution": self.attribution,
            "attribution_text": self.attribution_text,
            "fidelity_plot": self.fidelity_plot,
            "fidelity_text": self.fidelity_text,
            "sweep_plot": self.sweep_plot,
            "sweep_text": self.sweep_text,
            "report": self.report,
            "question": self.question,
            "strips_legend": self.strips_legend,
        }

    def slot_components(self, update: dict[str, Any]) -> dict[Any, Any]:
        """Each engine's answer pane (``chat:i``), its title (``title:i``) and whether it shows (``visible:i``)."""
        out = {}
        for key, value in update.items():
            kind, _, slot = key.partition(":")
            if kind == "chat":
                out[self.chats[int(slot)]] = value
            elif kind == "title":
                out[self.titles[int(slot)]] = value
            elif kind == "visible":
                out[self.columns[int(slot)]] = self.gr.update(visible=value)
        return out

    def outputs(self) -> list[Any]:
        return [
            self.state,
            self.status,
            self.plot,
            self.strips,
            self.ask_status,
            self.attribution,
            self.attribution_text,
            self.fidelity_plot,
            self.report,
            *self.titles,
            *self.chats,
            *self.columns,
            self.strips_legend,
        ]

    def run_settings(self, values: dict[str, Any]) -> tuple[CompareSettings, CompareUpdates]:
        settings = CompareSettings(
            values["model"] or self.services.models.default,
            list(values["policies"] or []),
            values["overrides"] or "",
            values["budget"],
            values["keep"],
            float(values["fps"] or 0),
            int(values["max_pixels"] or 0),
            float(values["cap_mb"] or 0),
            values["sample_kind"] or "static",
            prunes=[values.get(f"prune_{slot}") or "" for slot in range(MAX_POLICIES)],
        )
        return settings, self.updates

    # --- the comparison's own handlers (the shared ones are Page's) ------------------------------------
    @guard("sweep_text")
    def on_sweep(self, delays, more, **values):
        settings, _ = self.run_settings(values)
        yield from self.in_line(lambda: run_sweep(settings, delays, more), "sweep_text")

    @guard("fidelity_text")
    def on_fidelity(self, state, question):
        return compare_fidelity(state, question)

    @guard("attribution_text")
    def on_attribution(self, state, layer, head):
        return redraw_attribution(state, layer, head)

    def wire(self) -> None:
        settings = {
            "model": self.model,
            "policies": self.chosen,
            "overrides": self.overrides,
            "budget": self.budget,
            "keep": self.keep,
            "fps": self.fps,
            "max_pixels": self.max_pixels,
            "cap_mb": self.cap_mb,
            "sample_kind": self.sample_kind,
            **{f"prune_{slot}": dropdown for slot, dropdown in enumerate(self.prunes)},
        }
        runs = self.outputs()
        started = [
            self.run_button.click(
                self.on_run,
                [self.state, self.video],
                runs,
                inputs_kwargs=settings,
                api_name="compare_run",
                show_progress_on=[self.status],
                **self.streams,
            ),
            self.sample_button.click(
                self.on_run_sample,
                [self.state],
                runs,
                inputs_kwargs=settings,
                api_name="compare_sample",
                show_progress_on=[self.status],
                **self.streams,
            ),
        ]
        for event in started:
            event.then(self.on_view_choices, [self.state], [self.layer, self.head], api_visibility="private")
        for control in (self.layer, self.head):
            control.change(
                self.on_attribution,
                [self.state, self.layer, self.head],
                [self.attribution, self.attribution_text],
                api_visibility="private",
                show_progress="hidden",
            )
        self.stop_button.click(
            request_stop, [self.state], None, api_name="compare_stop", concurrency_limit=None, show_progress="hidden"
        )
        asked = [self.state, self.ask_status, self.attribution, self.attribution_text, self.report, *self.chats]
        questions = [
            self.ask_button.click(
                self.on_ask,
                [self.state, self.question, self.attribute],
                asked,
                api_name="compare_ask",
                show_progress_on=[self.ask_status],
                **self.questions_slots,
            ),
            self.question.submit(
                self.on_ask,
                [self.state, self.question, self.attribute],
                asked,
                api_visibility="private",
                show_progress_on=[self.ask_status],
                **self.questions_slots,
            ),
            self.examples.click(
                self.on_example,
                [self.state, self.examples, self.attribute],
                [*asked, self.question],
                api_visibility="private",
                show_progress_on=[self.ask_status],
                **self.questions_slots,
            ),
        ]
        self.show_newest_turn(questions)
        self.clear_button.click(
            self.on_new_conversation,
            [self.state],
            [self.state, self.ask_status, *self.chats],
            api_name="compare_new_conversation",
            concurrency_limit=None,
        )
        self.fidelity_button.click(
            self.on_fidelity,
            [self.state, self.question],
            [self.state, self.fidelity_plot, self.fidelity_text, self.report],
            api_name="compare_fidelity",
            show_progress_on=[self.fidelity_text],
            **self.questions_slots,
        )
        self.sweep_button.click(
            self.on_sweep,
            [self.delays, self.more],
            [self.sweep_plot, self.sweep_text],
            inputs_kwargs=settings,
            api_name="compare_sweep",
            show_progress_on=[self.sweep_text],
            **self.streams,
        )
        self.sample_kind.change(
            self.on_sample_kind,
            [self.sample_kind],
            [self.examples, self.sample_kind],
            api_visibility="private",
            show_progress="hidden",
        )
