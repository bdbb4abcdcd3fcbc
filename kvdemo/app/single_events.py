"""The single page's events (:class:`SinglePageEvents`): its own handlers (the webcam, the display choices, a
policy or a model picked) and :meth:`SinglePageEvents.wire`, which binds every component of
:class:`~kvdemo.app.single_page.SinglePage` to its handler (the shared ones are :class:`~kvdemo.app.page.Page`'s)
with the app's stream and question slots."""

from __future__ import annotations

from ..models.catalog import default_budget, geometry_for
from .handlers import redraw, request_stop, webcam_frame
from .page import guard
from .settings import (
    USER_ERRORS,
    takes_keep,
    validate_settings,
)
from .single_page import QUESTIONS, STREAMS, SinglePage
from .single_updates import (
    DisplayChoice,
    banner_html,
    write_chart,
)


class SinglePageEvents(SinglePage):
    """:class:`SinglePage` with its events wired (:meth:`wire`)."""

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
            "prune": self.prune,
        }
        # Streams and questions have separate slots: a question is served within one chunk's time whatever
        # other sessions stream (its own session's stream goes on between its tokens).
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
        self.show_newest_turn(asked)
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
