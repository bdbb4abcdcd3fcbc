"""The single page (:class:`SinglePage`, a :class:`~kvdemo.app.page.Page`): one policy against the full cache. Its
components are built by named builders (inputs, settings, what to watch, the chat) with the Gradio module the app
hands over (:mod:`kvdemo.app.layout` imports it); its events are wired in :mod:`kvdemo.app.single_events`."""

from __future__ import annotations

from typing import Any

from ..cache.budget import Budget
from ..models.catalog import default_budget, geometry_for
from ..policies import CARDS, DEFAULT_POLICY, REGISTRY, policy_class, policy_params
from ..world.synthetic import sample_episode, sample_manifest
from .page import Page
from .sessions import AppServices, RunSettings, Session
from .settings import (
    PRUNE_CHOICES,
    PRUNE_HELP,
    SAMPLE_KIND_HELP,
    baseline_cap_default,
    parse_params,
    policy_label,
    validate_settings,
)
from .single_updates import (
    DisplayChoice,
    SingleUpdates,
    chat_title,
    empty_occupancy_plot,
    how_to_read,
    legend,
    status_text,
)
from .slots import STREAM_SLOTS, WAITING_ROOM

#: Questions served at once, in their own slots: a question never waits for other sessions' streams,
#: and its own session's stream goes on between its tokens (kvdemo.stream.live).
QUESTION_SLOTS = 2
#: Gradio starts stream events up to the slots and a waiting room; those without a slot wait in line in the app,
#: where their status says their place (:mod:`kvdemo.app.slots`).
STREAMS = dict(concurrency_id="stream", concurrency_limit=STREAM_SLOTS + WAITING_ROOM)
QUESTIONS = dict(concurrency_id="question", concurrency_limit=QUESTION_SLOTS)
#: The policies offered in the app (every bounded one; the full cache is the baseline beside it).
UI_POLICIES = [name for name, cls in REGISTRY.items() if cls.bounded]
#: Panel slots for the views a policy declares (its card's ``view_titles``): as many as any policy has.
MAX_PANELS = max(len(card.view_titles) for card in CARDS.values())


class SinglePage(Page):
    """The single page for ``services`` (one policy against the full cache): builders add components, :meth:`wire`
    connects them (the app builds it inside its Blocks: :class:`kvdemo.app.layout.Demo`)."""

    updates = SingleUpdates()
    no_upload = "upload a video first (or click Run the bundled sample)"
    hidden_when_empty = frozenset({"coverage"})

    def __init__(self, services: AppServices) -> None:
        super().__init__(None, services)
        self.budget0, self.keep0, self.pixels0 = default_budget(services.models.default)
        self.sample = sample_episode()

    # --- builders -------------------------------------------------------------------------
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
            self.prune = gr.Dropdown(
                PRUNE_CHOICES,
                value=PRUNE_CHOICES[0],
                label="Pruning before the LLM",
                allow_custom_value=True,
                info=PRUNE_HELP,
                elem_id="prune",
            )
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
            prune=values.get("prune") or "",
        )
        view = DisplayChoice(
            values["view_layer"], values["view_head"], bool(values["colour_by_reason"]), bool(values["log_scale"])
        )
        return settings, SingleUpdates(view)


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
