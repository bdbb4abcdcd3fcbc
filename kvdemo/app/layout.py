"""The app's Blocks (:class:`Demo`: the single page and the comparison page as two tabs), building it
(:func:`build_demo`) and serving it (:func:`launch`). The only module here that imports Gradio; the pages get it
from here (:mod:`kvdemo.app.single_page`, :mod:`kvdemo.app.compare_page`)."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from .compare_page import ComparePage
from .inputs import guard_inputs
from .sessions import SESSION_TTL_S, STATIC_DIR, AppServices, CacheSweeper
from .single_events import SinglePageEvents
from .single_page import QUESTION_SLOTS, QUESTIONS, STREAMS, UI_POLICIES
from .single_updates import (
    banner_html,
)
from .slots import STREAM_SLOTS

log = logging.getLogger("kvdemo")

#: Gradio's own cleanup of its cache (every 10 minutes, files older than an hour); it misses the files of
#: components updated with gr.update, which :class:`~kvdemo.app.sessions.CacheSweeper` deletes.
CACHE_CLEANUP = (600, 3600)
#: The chat panes' own "Clear" button (both pages) would clear the view but not the engines' dialogue (and it sits on
#: the first question's bubble, in the comparison's narrow panes over its text): "New conversation" does both.
CSS = (
    "#policy-chat button[aria-label='Clear'], #full-chat button[aria-label='Clear'],"
    " [id^='compare-chat-'] button[aria-label='Clear'] { display: none; }"
    # Gradio cuts a thumbnail's caption to one line ("t=12.0s · 45% exact · 3…"): wrap it, whole, over the frame.
    " #gallery .caption-label { white-space: normal; max-width: 100%; opacity: 0.9; text-overflow: clip;"
    " font-size: 11px; line-height: 1.25; }"
)


class Demo(SinglePageEvents):
    """The Blocks app for ``services`` (:meth:`build`): the single page (:class:`~kvdemo.app.single_events.SinglePageEvents`) in the first tab, the
    comparison page (:class:`~kvdemo.app.compare_page.ComparePage`) in the second."""

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
