"""The app's Blocks and its single page (:class:`Demo`, a :class:`~kvdemo.app.page.Page`): components built by named
builders (inputs, settings, what to watch, the chat), and the wiring of their events to the handlers
(:mod:`kvdemo.app.handlers`). The only module here that imports Gradio."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ..cache.budget import Budget
from ..models.catalog import default_budget, geometry_for
from ..policies import CARDS, DEFAULT_POLICY, REGISTRY, policy_class, policy_params
from ..world.synthetic import sample_episode, sample_manifest
from .compare_page import ComparePage
from .handlers import redraw, request_stop, webcam_frame
from .inputs import guard_inputs
from .page import Page, guard
from .sessions import SESSION_TTL_S, STATIC_DIR, AppServices, CacheSweeper, RunSettings, Session
from .settings import (
    SAMPLE_KIND_HELP,
    USER_ERRORS,
    baseline_cap_default,
    parse_params,
    policy_label,
    takes_keep,
    validate_settings,
)
from .single_updates import (
    DisplayChoice,
    SingleUpdates,
    banner_html,
    chat_title,
    empty_occupancy_plot,
    how_to_read,
    legend,
    status_text,
    write_chart,
)
from .slots import STREAM_SLOTS, WAITING_ROOM

log = logging.getLogger("kvdemo")

#: Questions served at once, in their own slots: a question never waits for other sessions' streams,
#: and its own session's stream pauses between chunks while it is answered.
QUESTION_SLOTS = 2
#: Gradio starts stream events up to the slots and a waiting room; those without a slot wait in line in the app,
#: where their status says their place (:mod:`kvdemo.app.slots`).
STREAMS = dict(concurrency_id="stream", concurrency_limit=STREAM_SLOTS + WAITING_ROOM)
QUESTIONS = dict(concurrency_id="question", concurrency_limit=QUESTION_SLOTS)
#: Gradio's own cleanup of its cache (every 10 minutes, files older than an hour); it misses the files of
#: components updated with gr.update, which :class:`~kvdemo.app.sessions.CacheSweeper` deletes.
CACHE_CLEANUP = (600, 3600)
#: The chat panes' own "Clear" button would clear the view but not the engines' dialogue (and it sits on
#: the first question's bubble): "New conversation" does both.
CSS = (
    "#policy-chat button[aria-label='Clear'], #full-chat button[aria-label='Clear'] { display: none; }"
    # Gradio cuts a thumbnail's caption to one line ("t=12.0s · 45% exact · 3…"): wrap it, whole, over the frame.
    " #gallery .caption-label { white-space: normal; max-width: 100%; opacity: 0.9; text-overflow: clip;"
    " font-size: 11px; line-height: 1.25; }"
)
#: The policies offered in the app (every bounded one; the full cache is the baseline beside it).
UI_POLICIES = [name for name, cls in REGISTRY.items() if cls.bounded]
#: Panel slots for the views a policy declares (its card's ``view_titles``): as many as any policy has.
MAX_PANELS = max(len(card.view_titles) for card in CARDS.values())


class Demo(Page):
    """The Blocks app for ``services`` (:meth:`build`) and its single page (one policy against the full cache);
    builders add components, :meth:`wire` connects them."""

    updates = SingleUpdates()
    no_upload = "upload a video first (or click Run the bundled sample)"
    hidden_when_empty = frozenset({"coverage"})

    def __init__(self, services: AppServices) -> None:
        super().__init__(None, services)
        self.budget0, self.keep0, self.pixels0 = default_budget(services.models.default)
        self.sample = sample_episode()

    # --- builders -------------------------------------------------------------------------
    def build(self):
        import gradio as gr  # deferred on purpose: the CLI and the library never need Gradio

        self.gr = gr
        with gr.Blocks(title="kvdemo: KV-cache compression for streaming video", delete_cache=CACHE_CLEANUP) as demo:
            self.session = gr.State(value=None, time_to_live=SESSION_TTL_S, delete_callback=self.services.sessions.free)
            gr.Markdown(
                "# kvdemo — what survives in the KV cache\n"
                "Stream a video into a vision-language model under a hard KV-cache budget, watch the cache, "
                "see which patches survive, and ask questions of the compressed memory and of a full-cache baseline."
            )
            banner = banner_html(self.services.models.default)
            self.banner = gr.Markdown(banner, visible=bool(banner), elem_id="banner")
            with gr.Tab("One policy against the full cache", elem_id="single-tab"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=320):
                        self.build_inputs()
                        self.build_settings()
                    with gr.Column(scale=2):
                        self.build_watch()
                        self.build_chat()
                self.wire()
            with gr.Tab("Compare policies", elem_id="compare-tab"):
                self.compare = ComparePage(
                    gr, self.services, UI_POLICIES, (self.budget0, self.keep0, self.pixels0), STREAMS, QUESTIONS
                )
                self.compare.build()
        guard_inputs(gr, demo)  # values sent through the API that no component takes: one line, no traceback
        return demo

    def build_inputs(self) -> None:
        gr = self.gr
        with gr.Tab("Video"):
            self.video = gr.Video(label="Upload a video (mp4, mkv, mov, webm, avi)", sources=["upload"], height=220)
            with gr.Row():
                self.run_button = gr.Button("Run", variant="primary", elem_id="run-button")
                self.sample_button = gr.Button("Run the bundled sample", elem_id="sample-button")
                self.stop_button = gr.Button("Stop", variant="stop", elem_id="stop-button")
            self.sample_kind = gr.Radio(
                [("still camera", "static"), ("moving camera", "moving")],
                value="static",
                label="Bundled sample",
                elem_id="sample-kind",
                info=SAMPLE_KIND_HELP["static"],
            )
            with gr.Accordion("What the bundled sample shows", open=False):
                self.manifest = gr.Markdown(
                    sample_manifest(self.sample), label="Sample manifest", elem_id="sample-manifest"
                )
        with gr.Tab("Webcam"):
            self.webcam = gr.Image(
                label="Webcam (frames are buffered into chunks)",
                sources=["webcam"],
                streaming=True,
                type="numpy",
                height=220,
                elem_id="webcam",
            )

    def build_settings(self) -> None:
        gr = self.gr
        with gr.Accordion("Settings", open=True):
            self.model = gr.Dropdown(
                self.services.models.choices(),
                value=self.services.models.default,
                label="Model",
                allow_custom_value=True,
                elem_id="model",
                info="tiny runs offline on the CPU (trained on generated streams; tiny-random*: "
                "random weights of each family); Hub ids need a GPU and the Hub",
            )
            self.policy = gr.Dropdown(UI_POLICIES, value=DEFAULT_POLICY, label="Policy", elem_id="policy")
            with gr.Row():
                self.budget = gr.Number(self.budget0, label="M (max visual tokens)", precision=0, elem_id="budget")
                self.keep = gr.Number(self.keep0, label="C (kept by a compression)", precision=0, elem_id="keep")
            self.budget_check = gr.Markdown(
                validate_settings(
                    DEFAULT_POLICY, self.budget0, self.keep0, 2.0, self.pixels0, None, self.services.models.default
                ),
                label="Settings check",
                elem_id="budget-check",
            )
            with gr.Row():
                self.fps = gr.Slider(0.5, 8, value=2, step=0.5, label="Sampling fps")
                self.max_pixels = gr.Number(
                    self.pixels0,
                    label="Max pixels per frame",
                    precision=0,
                    info=geometry_for(self.services.models.default).describe(),
                )
            self.param_inputs, self.param_groups = {}, {}
            with gr.Accordion("Policy parameters (the papers' defaults)", open=False, elem_id="policy-params"):
                for name in UI_POLICIES:
                    with gr.Group(visible=name == DEFAULT_POLICY) as group:
                        for spec in policy_params(name):
                            key = f"{name}_{spec.name}".replace("-", "_")
                            self.param_inputs[key] = (name, spec.name, param_component(gr, spec, name))
                    self.param_groups[name] = group
            with gr.Row():
                self.baseline = gr.Checkbox(True, label="Full-cache baseline")
                self.cap_mb = gr.Number(
                    baseline_cap_default(), label="Baseline memory cap (MB)", precision=0, info="0 = no cap"
                )

    def build_watch(self) -> None:
        gr = self.gr
        self.status = gr.Markdown(status_text(Session()), label="Status", elem_id="status")
        self.plot = gr.Plot(
            empty_occupancy_plot(DEFAULT_POLICY, self.budget0),
            label="Cache occupancy",
            show_label=False,
            elem_id="occupancy",
        )
        self.log_scale = gr.Checkbox(
            False,
            label="Logarithmic axes (keeps a policy's sawtooth visible once the full cache has grown)",
            elem_id="log-scale",
        )
        with gr.Row():
            self.view_layer = gr.Dropdown(["all"], value="all", label="Layer", scale=1)
            self.view_head = gr.Dropdown(["all"], value="all", label="KV head", scale=1)
            self.by_reason = gr.Checkbox(False, label="Colour by reason (one layer and head)", scale=2)
        gr.Markdown("**Newest frames: what survives**")
        # No toolbar on drawn strips: Gradio's covered the last frame's caption (right-click saves the image).
        self.heatmap = gr.Image(
            label="Newest frames: what survives",
            show_label=False,
            format="jpeg",
            type="numpy",
            interactive=False,
            buttons=[],
            elem_id="heatmap",
        )
        self.legend = gr.Markdown(legend(Session()), label="Legend")
        # The views the chosen policy declares (Policy.views), drawn by viz: slots filled in order.
        self.panel_slots = []
        for index in range(MAX_PANELS):
            with gr.Column(visible=False, elem_id=f"panel-{index}") as box:
                text = gr.Markdown(label=f"Policy view {index + 1}")
                image = gr.Image(
                    label=f"Policy view {index + 1} (image)",
                    show_label=False,
                    format="jpeg",
                    type="numpy",
                    interactive=False,
                    visible=False,
                    buttons=[],
                    elem_id=f"panel-{index}-image",
                )
                plot = gr.Plot(
                    label=f"Policy view {index + 1} (chart)",
                    show_label=False,
                    visible=False,
                    elem_id=f"panel-{index}-plot",
                )
            self.panel_slots.append((box, text, image, plot))
        with gr.Accordion("Every frame so far", open=False):
            # No label over the thumbnails (the accordion names it); captions wrap (see CSS) instead of being cut.
            self.gallery = gr.Gallery(
                label="What survives of each frame",
                show_label=False,
                columns=4,
                height=360,
                format="jpeg",
                elem_id="gallery",
            )
        self.coverage_plot = gr.Plot(label="Coverage of the full cache (CDF)", visible=False)

    def build_chat(self) -> None:
        gr = self.gr
        with gr.Row():
            self.question = gr.Textbox(
                label="Ask both engines", placeholder="What happens in the video?", scale=4, elem_id="question"
            )
            self.ask_button = gr.Button("Ask", variant="primary", scale=1, elem_id="ask-button")
            self.clear_button = gr.Button("New conversation", scale=1)
        # What became of the last question (why it was not asked, or that it was), beside the box, not off-screen.
        self.ask_status = gr.Markdown("", label="Question status", elem_id="ask-status")
        self.examples = gr.Dataset(
            components=[self.question],
            samples=[[q.text] for q in self.sample.questions],
            label="Questions about the bundled sample (click to ask both engines)",
            elem_id="examples",
        )
        with gr.Row():
            with gr.Column():
                budget = Budget.resolve(policy_class(DEFAULT_POLICY), self.budget0, self.keep0)
                self.policy_title = gr.Markdown(
                    policy_label(DEFAULT_POLICY, budget), label="Policy chat title", elem_id="policy-chat-title"
                )
                self.policy_chat = gr.Chatbot(
                    label="Policy engine chat", show_label=False, height=300, buttons=["copy"], elem_id="policy-chat"
                )
            with gr.Column():
                self.full_title = gr.Markdown(
                    chat_title(Session(), "full"), label="Full cache chat title", elem_id="full-chat-title"
                )
                self.full_chat = gr.Chatbot(
                    label="Full cache chat", show_label=False, height=300, buttons=["copy"], elem_id="full-chat"
                )
        with gr.Row():
            self.report_file = gr.File(label="Run report (JSON)", interactive=False)
            with gr.Column():
                self.chart_file = gr.File(label="Occupancy chart (HTML)", interactive=False, elem_id="chart-file")
                self.chart_button = gr.Button(
                    "Export the chart as HTML (opens while the app runs)", size="sm", elem_id="chart-button"
                )
        with gr.Accordion("How to read this", open=False):
            gr.Markdown(how_to_read(self.services.sessions.limit))

    # --- from handler updates to components ------------------------------------------------------
    def named(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "status": self.status,
            "plot": self.plot,
            "heatmap": self.heatmap,
            "gallery": self.gallery,
            "report": self.report_file,
            "chart": self.chart_file,
            "coverage": self.coverage_plot,
            "legend": self.legend,
            "policy_title": self.policy_title,
            "full_title": self.full_title,
            "policy_chat": self.policy_chat,
            "full_chat": self.full_chat,
            "ask_status": self.ask_status,
            "question": self.question,
        }

    def panel_components(self) -> list[Any]:
        return [component for slot in self.panel_slots for component in slot]

    def slot_components(self, update: dict[str, Any]) -> dict[Any, Any]:
        """The policy's drawn views into the panel slots, in order (the slots left over hidden)."""
        if "panels" not in update:
            return {}
        gr, out, panels = self.gr, {}, update["panels"]
        for index, (box, text, image, plot) in enumerate(self.panel_slots):
            panel = panels[index] if index < len(panels) else None
            out[box] = gr.update(visible=panel is not None)
            if panel is not None:
                out[text] = f"**{panel.title}** — {panel.caption}"
                out[image] = gr.update(
                    value=panel.value if panel.kind == "image" else None, visible=panel.kind == "image"
                )
                out[plot] = gr.update(value=panel.value if panel.kind == "plot" else None, visible=panel.kind == "plot")
        return out

    def run_settings(self, values: dict[str, Any]) -> tuple[RunSettings, SingleUpdates]:
        chosen = values["policy"]
        form = {field_name: values[key] for key, (owner, field_name, _) in self.param_inputs.items() if owner == chosen}
        settings = RunSettings(
            model=values["model"] or self.services.models.default,
            policy=chosen,
            params=parse_params(chosen, form),
            budget=values["budget"],
            keep=values["keep"],
            fps=float(values["fps"] or 0),
            max_pixels=int(values["max_pixels"] or 0),
            baseline=bool(values["baseline"]),
            cap_mb=float(values["baseline_cap_mb"] or 0),
            sample=values.get("sample_kind") or "static",
        )
        view = DisplayChoice(
            values["view_layer"], values["view_head"], bool(values["colour_by_reason"]), bool(values["log_scale"])
        )
        return settings, SingleUpdates(view)

    # --- the single page's own handlers (bound to components in wire; the shared ones are Page's) ---------------
    @guard("status")
    def on_webcam(self, session, frame, **settings):
        run_settings, updates = self.run_settings(settings)
        with self.services.streams.hold():
            return webcam_frame(self.services, session, frame, run_settings, updates)

    @guard("legend")
    def on_redraw(self, session, layer, head, by_reason, log_scale):
        return redraw(session, DisplayChoice(layer, head, bool(by_reason), bool(log_scale)))

    def on_policy(self, name: str):
        gr = self.gr
        keep = (
            gr.update(interactive=True, label="C (kept by a compression)")
            if takes_keep(name)
            else gr.update(interactive=False, label=f"C (not used: {name} splits M itself)")
        )
        return [keep, *(gr.update(visible=name == n) for n in self.param_groups)]

    def on_model(self, name: str):
        """A model chosen: its banner, and its family's budget and pixel range (unchanged if its config cannot be
        read; running it then says why)."""
        gr = self.gr
        banner = banner_html(name)
        try:
            budget, keep, pixels = default_budget(name)
        except USER_ERRORS:
            return gr.update(value=banner, visible=bool(banner)), gr.update(), gr.update(), gr.update()
        pixels_field = gr.update(value=pixels, info=geometry_for(name).describe())
        return (
            gr.update(value=banner, visible=bool(banner)),
            gr.update(value=budget),
            gr.update(value=keep),
            pixels_field,
        )

    # --- wiring ---------------------------------------------------------------------------
    def wire(self) -> None:
        gr = self.gr
        run_outputs = [*(c for key, c in self.named().items() if key != "question"), *self.panel_components()]
        ask_outputs = [self.session, self.ask_status, self.policy_chat, self.full_chat, self.report_file]
        settings_inputs = {
            "model": self.model,
            "policy": self.policy,
            "budget": self.budget,
            "keep": self.keep,
            "fps": self.fps,
            "max_pixels": self.max_pixels,
            "baseline": self.baseline,
            "baseline_cap_mb": self.cap_mb,
            **{key: component for key, (_, _, component) in self.param_inputs.items()},
            "view_layer": self.view_layer,
            "view_head": self.view_head,
            "colour_by_reason": self.by_reason,
            "log_scale": self.log_scale,
            "sample_kind": self.sample_kind,
        }
        # Streams and questions have separate slots: a question is served within one chunk's time whatever
        # other sessions stream (its own session's stream pauses between chunks while it is answered).
        streams, questions = STREAMS, QUESTIONS
        run_event = self.run_button.click(
            self.on_run,
            [self.session, self.video],
            run_outputs,
            inputs_kwargs=settings_inputs,
            api_name="run",
            show_progress_on=[self.status],
            **streams,
        )
        sample_event = self.sample_button.click(
            self.on_run_sample,
            [self.session],
            run_outputs,
            inputs_kwargs=settings_inputs,
            api_name="run_sample",
            show_progress_on=[self.status],
            **streams,
        )
        for event in (run_event, sample_event):
            event.then(
                self.on_view_choices, [self.session], [self.view_layer, self.view_head], api_visibility="private"
            )
        self.stop_button.click(
            request_stop, [self.session], None, api_name="stop", concurrency_limit=None, show_progress="hidden"
        )
        self.webcam.stream(
            self.on_webcam,
            [self.session, self.webcam],
            run_outputs,
            inputs_kwargs=settings_inputs,
            stream_every=0.5,
            time_limit=600,
            show_progress="hidden",
            api_visibility="private",
            **streams,
        )
        view_inputs = [self.view_layer, self.view_head, self.by_reason, self.log_scale]
        view_outputs = [self.plot, self.heatmap, self.legend, *self.panel_components()]
        asked = [
            self.ask_button.click(
                self.on_ask,
                [self.session, self.question],
                ask_outputs,
                api_name="ask",
                show_progress_on=[self.status],
                **questions,
            ),
            self.question.submit(
                self.on_ask,
                [self.session, self.question],
                ask_outputs,
                api_visibility="private",
                show_progress_on=[self.status],
                **questions,
            ),
            self.examples.click(
                self.on_example,
                [self.session, self.examples],
                [*ask_outputs, self.question],
                api_visibility="private",
                show_progress_on=[self.status],
                **questions,
            ),
        ]
        for event in asked:  # answering changes what some heads hold (retrieval): redraw the views
            event.then(
                self.on_redraw,
                [self.session, *view_inputs],
                view_outputs,
                api_visibility="private",
                show_progress="hidden",
            )
        self.clear_button.click(
            self.on_new_conversation,
            [self.session],
            [self.session, self.policy_chat, self.full_chat, self.ask_status],
            api_name="new_conversation",
            concurrency_limit=None,
        )

        def export_chart(session, request):  # the request: the address plotly.js is loaded from
            return write_chart(session, request)

        export_chart.__annotations__ = {"request": gr.Request}  # how Gradio knows to pass it (resolved, not a string)
        self.chart_button.click(
            export_chart, [self.session], self.chart_file, api_name="export_chart", concurrency_limit=None
        )
        for control in view_inputs:
            control.change(
                self.on_redraw,
                [self.session, *view_inputs],
                view_outputs,
                show_progress="hidden",
                api_visibility="private",
            )
        check_inputs = [self.policy, self.budget, self.keep, self.fps, self.max_pixels, self.video, self.model]
        gr.on(
            [control.change for control in check_inputs],
            validate_settings,
            check_inputs,
            self.budget_check,
            api_name="check_settings",
            show_progress="hidden",
            concurrency_limit=None,
        )
        self.sample_kind.change(
            self.on_sample_kind,
            [self.sample_kind],
            [self.manifest, self.examples, self.sample_kind],
            api_name="sample_kind",
            show_progress="hidden",
            concurrency_limit=None,
        )
        self.policy.change(
            self.on_policy,
            [self.policy],
            [self.keep, *self.param_groups.values()],
            api_visibility="private",
            show_progress="hidden",
        )
        self.model.change(
            self.on_model,
            [self.model],
            [self.banner, self.budget, self.keep, self.max_pixels],
            api_visibility="private",
        )


def param_component(gr, spec, policy: str):
    """The form field of one policy parameter (its kind decides the component)."""
    label = f"{policy}: {spec.name}"
    if spec.kind == "bool":
        return gr.Checkbox(spec.default, label=label, info=spec.help)
    if spec.kind == "choice":
        return gr.Dropdown(list(spec.choices), value=spec.default, label=label, info=spec.help)
    if spec.kind in ("int", "float"):
        return gr.Number(spec.default, label=label, info=spec.help, precision=0 if spec.kind == "int" else None)
    return gr.Textbox(
        "" if spec.default is None else ", ".join(str(x) for x in spec.default), label=label, info=spec.help
    )


def build_demo(services: AppServices | None = None):
    """The Blocks app (launch it with :func:`launch`)."""
    return Demo(services or AppServices.create()).build()


def launch(host: str | None = None, port: int | None = None, model: str | None = None, share: bool = False, **kwargs):
    """Build and launch the app (model loaded before the first request)."""
    import gradio as gr  # deferred on purpose, as in Demo.build

    # A cache folder of the app's own (unless one is set), so that sweeping it touches no other app's files.
    os.environ.setdefault("GRADIO_TEMP_DIR", str(Path(tempfile.gettempdir()) / "kvdemo-gradio"))
    CacheSweeper(os.environ["GRADIO_TEMP_DIR"]).start()
    services = AppServices.create(model)
    services.models.get()
    log.info(
        "building the app (%d stream and %d question slots; engines of at most %d sessions kept)",
        STREAM_SLOTS,
        QUESTION_SLOTS,
        services.sessions.limit,
    )
    demo = build_demo(services)
    demo.queue(default_concurrency_limit=STREAM_SLOTS)
    host = host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    port = port or int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
    log.info("starting the web server on http://%s:%d", host, port)
    allowed = [*kwargs.pop("allowed_paths", []), str(STATIC_DIR)]  # plotly.js for the exported charts
    return demo.launch(
        server_name=host,
        server_port=port,
        share=share,
        theme=gr.themes.Soft(),
        css=CSS,
        allowed_paths=allowed,
        **kwargs,
    )
