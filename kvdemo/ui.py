"""The Gradio app: stream a video or the webcam into a policy engine and a full-cache baseline, watch
the cache live, see what survives, and chat with both side by side.

No model logic here: handlers drive :mod:`kvdemo.engine` and draw with :mod:`kvdemo.viz`. The handlers
are plain functions (tested without a browser); :func:`build_demo` wires them to components.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .coverage import coverage
from .engine import EngineError, FrameStream, MemoryCapError, StreamEngine, validate_budget
from .models.qwen_vl import DEFAULT_REAL_MODEL, ModelError, load_model, resolve_model_name
from .models.tiny import OFFLINE_NOTICES, TINY_NAME, TINY_RANDOM_NAME, TRAINED_MAX_PIXELS
from .policies import BudgetError, make_policy, policy_params
from .synthetic import Episode, grade, sample_episode, sample_manifest
from .video import (
    RESIZE_FACTOR,
    VideoError,
    open_video,
    resize_frames,
    tokens_per_grid,
)
from . import viz

FRAMES_PER_CHUNK = 2
MODEL_CONCURRENCY = 2
PLOT_EVERY_S = 0.5
HEATMAP_EVERY_S = 0.35
GALLERY_EVERY_S = 3.0
UI_POLICIES = ["infinipot-v", "cords", "uniform", "sliding-window"]
USER_ERRORS = (VideoError, BudgetError, EngineError, ModelError)

HOW_TO_READ = """
**Occupancy** (top chart): visual tokens and real KV-cache megabytes over stream time. The policy engine
grows to its budget `M`, compresses to `C` (▼ marks), and grows again: a sawtooth under the dashed line.
The full-cache baseline grows without bound.

**What survives**: the newest frames with the patches the cache still holds; dark patches were evicted.
*Aggregate* tints each patch by the share of (layer, KV head) copies still held. Pick one layer and
head and *colour by reason* to see why the policy kept each patch (InfiniPot-V: recent window, TaR,
VaN; CoRDS: recent tail, coreset frame, partial frame). Grey patches arrived after the last compression.
Every heatmap is drawn from the provenance the engine gathers with the same indices as the keys and
values, so it shows exactly what the cache holds.

**Chat**: one question goes to both engines; the dialogue is replayed as text after the video memory,
and the memory is unchanged by answering. Under each answer: time to first token and the cache size.
"""


# --- process-wide models -----------------------------------------------------------------------------


class ModelHub:
    """Loads each model once per process; sessions share them (engines never write to model weights)."""

    def __init__(self, default: str | None = None) -> None:
        self.default = resolve_model_name(default)
        self._models: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str | None = None):
        name = resolve_model_name(name or self.default)
        with self._lock:
            if name not in self._models:
                self._models[name] = load_model(name)
            return self._models[name]

    def choices(self) -> list[str]:
        names = [self.default, TINY_NAME, TINY_RANDOM_NAME, DEFAULT_REAL_MODEL, "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct"]
        return list(dict.fromkeys(names))


# --- per-session state ---------------------------------------------------------------------------------


@dataclass
class RunSettings:
    model: str
    policy: str
    params: dict[str, Any]
    budget: int
    keep: int
    fps: float
    max_pixels: int
    baseline: bool
    cap_mb: float


@dataclass
class Session:
    """One browser session's stream: its engines, thumbnails and dialogue (freed when the session ends)."""

    settings: RunSettings | None = None
    engines: dict[str, StreamEngine] = field(default_factory=dict)
    stream: FrameStream | None = None
    thumbnails: list[np.ndarray] = field(default_factory=list)
    stopped: dict[str, str] = field(default_factory=dict)
    chat: dict[str, list[dict[str, str]]] = field(default_factory=lambda: {"policy": [], "full": []})
    source: str = ""
    #: The generated stream being played (its ground truth grades the answers); None for files and the webcam.
    episode: Episode | None = None
    frame_size: tuple[int, int] | None = None
    chunk_ms: float = 0.0
    coverage: dict[str, Any] | None = None
    report_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="kvdemo-"))
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_plot: float = 0.0
    last_heatmap: float = 0.0
    last_gallery: float = 0.0

    def close(self) -> None:
        self.engines.clear()
        self.thumbnails.clear()
        shutil.rmtree(self.report_dir, ignore_errors=True)

    @property
    def policy(self) -> StreamEngine | None:
        return self.engines.get("policy")

    @property
    def model(self):
        engine = self.policy
        return engine.model if engine else None


def free_session(session: Session | None) -> None:
    if session is not None:
        session.close()


# --- settings -------------------------------------------------------------------------------------------


def parse_params(policy: str, values: dict[str, Any]) -> dict[str, Any]:
    """Form values of ``policy``'s parameters -> keyword arguments (blank number lists mean "none")."""
    params = {}
    for spec in policy_params(policy):
        if spec.name not in values:
            continue
        value = values[spec.name]
        if spec.kind == "numbers":
            text = str(value or "").strip().strip("[]()")
            if not text:
                value = None
            else:
                try:
                    value = [float(x) for x in text.replace(";", ",").split(",") if x.strip()]
                except ValueError:
                    raise BudgetError(f"{spec.name} takes numbers separated by commas, got {text!r}") from None
        elif spec.kind == "int":
            value = int(value)
        elif spec.kind == "float":
            value = float(value)
        elif spec.kind == "bool":
            value = bool(value)
        params[spec.name] = value
    return params


def validate_settings(policy: str, budget: Any, keep: Any, fps: Any = 2.0, max_pixels: Any = 200704) -> str:
    """A one-line verdict on the settings, shown as the user types ('' when fine)."""
    try:
        check_settings(policy, budget, keep, fps, max_pixels)
    except USER_ERRORS as exc:
        return f"⚠️ {exc}"
    tokens = int(max_pixels) // RESIZE_FACTOR**2
    return f"✓ M={int(budget)}, C={int(keep)}; a chunk at max pixels holds up to ~{tokens} visual tokens"


def check_settings(policy: str, budget: Any, keep: Any, fps: Any, max_pixels: Any) -> tuple[int, int]:
    if budget is None or keep is None:
        raise BudgetError("set both M and C")
    if fps is None or float(fps) <= 0:
        raise BudgetError(f"sampling fps must be positive, got {fps}")
    if max_pixels is None or int(max_pixels) < RESIZE_FACTOR**2:
        raise BudgetError(f"max pixels must be at least {RESIZE_FACTOR**2} (one 28x28 patch), got {max_pixels}")
    budget_, keep_ = validate_budget(make_policy(policy), budget, keep)
    return budget_, keep_


# --- run ------------------------------------------------------------------------------------------------


def start_session(
    hub: ModelHub,
    session: Session | None,
    settings: RunSettings,
    source: str,
    frame_size: tuple[int, int],
    fps: float | None = None,
) -> Session:
    """A fresh session state (engines, stream) for ``settings`` and frames of ``frame_size`` (resized).

    The budget is checked against one chunk of such frames before anything changes; then the old
    session is freed. ``fps`` is the stream's real sampling rate when it differs from the setting
    (a file sampled faster than it was recorded streams at its own rate).
    """
    fps = fps or settings.fps
    model = hub.get(settings.model)
    rows, cols = frame_size[0] // RESIZE_FACTOR, frame_size[1] // RESIZE_FACTOR
    grids = -(-FRAMES_PER_CHUNK // model.temporal_patch_size)
    probe = StreamEngine(model, make_policy(settings.policy, **settings.params), budget=settings.budget, keep=settings.keep)
    probe.check_fits(grids * tokens_per_grid(frame_size), f"{grids} temporal grid(s) of {rows}x{cols} tokens")
    free_session(session)
    new = Session(settings=settings, source=source, frame_size=tuple(frame_size))
    policy = make_policy(settings.policy, **settings.params)
    new.engines["policy"] = StreamEngine(model, policy, budget=settings.budget, keep=settings.keep, fps=fps)
    if settings.baseline:
        cap = int(settings.cap_mb * 2**20) if settings.cap_mb and settings.cap_mb > 0 else None
        new.engines["full"] = StreamEngine(model, "full", fps=fps, max_cache_bytes=cap)
    new.stream = FrameStream(model, fps)
    return new


def feed_frames(session: Session, frames: np.ndarray, times_s: np.ndarray | None, flush: bool = False) -> bool:
    """Push frames through the session's stream into every running engine; True if a chunk was fed."""
    chunk = session.stream.push(frames, times_s) if len(frames) else None
    if chunk is None and flush:
        chunk = session.stream.flush()
    if chunk is None:
        return False
    start = time.perf_counter()
    for name, engine in session.engines.items():
        if name in session.stopped:
            continue
        try:
            engine.feed_chunk(chunk)
        except MemoryCapError as exc:
            session.stopped[name] = str(exc)
        except RuntimeError as exc:
            if "out of memory" not in str(exc).lower():
                raise
            session.stopped[name] = f"stopped: out of memory at {engine.frames_fed} frames"
    # One thumbnail per temporal grid: its first frame among those pushed now (a webcam grid pairs the
    # previous frame with this one; its thumbnail is this one).
    for g in range(chunk.num_grids):
        session.thumbnails.append(viz.thumbnail(frames[min(2 * g, len(frames) - 1)]))
    session.chunk_ms = chunk.encode_ms + (time.perf_counter() - start) * 1000
    return True


def status_text(session: Session, done: int | None = None, total: int | None = None, error: str = "") -> str:
    """The status line: frames, tokens, MB, ms per chunk, compression overhead."""
    lines = []
    if error:
        lines.append(f"⚠️ **{error}**")
    engine = session.policy
    if engine is not None:
        stats = engine.stats
        overhead = f"{100 * stats.compress_ms / stats.prefill_ms:.1f}%" if stats.prefill_ms else "n/a"
        progress = f"{done}/{total} frames" if total else f"{engine.frames_fed} frames"
        lines.append(
            f"**{progress}** · {engine.policy.name}: {engine.memory.visual_tokens} visual tokens "
            f"(M={engine.budget}, C={engine.keep}), {engine.memory.nbytes / 2**20:.2f} MB · "
            f"{session.chunk_ms:.0f} ms/chunk · {stats.compressions} compressions, overhead {overhead} of prefill"
        )
        full = session.engines.get("full")
        if full is not None:
            state = session.stopped.get("full")
            lines.append(
                f"full cache: {full.memory.visual_tokens} visual tokens, {full.memory.nbytes / 2**20:.2f} MB"
                + (f" — {state}" if state else "")
            )
        if session.source:
            lines.append(f"<small>{session.source}</small>")
    return "\n\n".join(lines) if lines else "Ready: upload a video or pick the sample, then Run."


def occupancy_plot(session: Session):
    series = {}
    engine = session.policy
    if engine is None:
        return None
    series[f"{engine.policy.name} at M={engine.budget}"] = engine.memory.timeline
    if "full" in session.engines:
        series["full cache"] = session.engines["full"].memory.timeline
    return viz.occupancy_figure(series, engine.budget)


def heatmap_image(session: Session, layer: str = "all", head: str = "all", by_reason: bool = False) -> np.ndarray | None:
    engine = session.policy
    if engine is None or engine.memory.num_grids == 0:
        return None
    layer_index = None if layer in (None, "all") else int(layer)
    head_index = None if head in (None, "all") else int(head)
    return viz.survivor_strip(
        engine.memory, session.thumbnails, engine.last_selection_info, layer_index, head_index, by_reason=by_reason
    )


def gallery_items(session: Session) -> list[tuple[np.ndarray, str]]:
    engine = session.policy
    if engine is None:
        return []
    return viz.survivor_gallery(engine.memory, session.thumbnails)


def write_report(session: Session, chart: bool = True) -> tuple[str | None, str | None]:
    """The run report (CLI JSON format) and the occupancy chart (self-contained HTML) as files to download."""
    engine = session.policy
    if engine is None:
        return None, None
    report = engine.report()
    report["video"] = session.source
    if "full" in session.engines:
        report["baseline"] = session.engines["full"].report()
    if session.stopped:
        report["stopped"] = dict(session.stopped)
    if session.coverage:
        report["coverage"] = session.coverage
    report_path = Path(session.report_dir) / "kvdemo-report.json"
    report_path.write_text(json.dumps(report, indent=1))
    if not chart:
        return str(report_path), None
    chart_path = Path(session.report_dir) / "kvdemo-occupancy.html"
    figure = occupancy_plot(session)
    figure.write_html(str(chart_path), include_plotlyjs=True)  # opens offline
    return str(report_path), str(chart_path)


def run_video(
    hub: ModelHub,
    session: Session | None,
    video_path: str | None,
    settings: RunSettings,
    view: tuple[str, str, bool] = ("all", "all", False),
) -> Iterator[dict[str, Any]]:
    """Stream a file into a fresh session; yields update dicts (keys: session, status, plot, heatmap,
    gallery, report, chart, coverage, legend). Errors end the run with a message, never an exception."""
    state = session or Session()
    try:
        check_settings(settings.policy, settings.budget, settings.keep, settings.fps, settings.max_pixels)
        min_pixels = min(settings.max_pixels, hub.get(settings.model).min_pixels)
        episode = None if video_path else sample_episode()
        if episode is None:
            video = open_video(Path(video_path), fps=settings.fps, max_pixels=settings.max_pixels, min_pixels=min_pixels)
        else:
            video = episode.video.resized(min_pixels, settings.max_pixels)
        state = start_session(hub, session, settings, video.describe(), video.size, video.fps)
        state.episode = episode
    except USER_ERRORS as exc:
        yield {"session": state, "status": status_text(state, error=str(exc))}
        return
    yield {"session": state, "status": status_text(state, 0, video.num_frames), "legend": legend(state)}
    try:
        chunks = video.chunks(FRAMES_PER_CHUNK)  # decoded lazily, batch by batch
        current = next(chunks, None)
        while current is not None:
            following = next(chunks, None)
            _, frames, times = current
            with state.lock:
                fed = feed_frames(state, frames, times, flush=following is None)
            current = following
            if fed:
                yield live_update(state, view, done=state.stream.frames_seen, total=video.num_frames)
    except USER_ERRORS as exc:
        yield {"session": state, "status": status_text(state, error=str(exc))}
        return
    state.source = video.describe()  # now knows how many damaged frames were skipped
    final = finish(state, view)
    final["status"] = status_text(state, state.stream.frames_seen, video.num_frames - video.lost_frames)
    yield final


def live_update(state: Session, view: tuple[str, str, bool], done: int | None = None, total: int | None = None, force: bool = False) -> dict[str, Any]:
    """Status every chunk; plot, heatmap and gallery at most a few times per second."""
    now = time.monotonic()
    update: dict[str, Any] = {"session": state, "status": status_text(state, done, total)}
    if force or now - state.last_plot >= PLOT_EVERY_S:
        update["plot"] = occupancy_plot(state)
        state.last_plot = now
    if force or now - state.last_heatmap >= HEATMAP_EVERY_S:
        update["heatmap"] = heatmap_image(state, *view)
        state.last_heatmap = now
    if force or now - state.last_gallery >= GALLERY_EVERY_S:
        update["gallery"] = gallery_items(state)
        state.last_gallery = now
    return update


def finish(state: Session, view: tuple[str, str, bool]) -> dict[str, Any]:
    """Final update of a run: everything redrawn, the coverage CDF (with a baseline), the downloads."""
    update = live_update(state, view, force=True)
    full = state.engines.get("full")
    if full is not None and "full" not in state.stopped and state.policy is not None and state.policy.memory.num_grids:
        state.coverage = {state.policy.policy.name: coverage(full.memory, state.policy.memory)}
        update["coverage"] = viz.coverage_figure(state.coverage)
    update["report"], update["chart"] = write_report(state)
    return update


def legend(state: Session) -> str:
    engine = state.policy
    names = engine.policy.reason_names if engine else {}
    return viz.legend_text(names) if names else "Tint = share of (layer, KV head) copies held; dark = evicted."


# --- webcam ---------------------------------------------------------------------------------------------


def webcam_frame(
    hub: ModelHub,
    session: Session | None,
    frame: np.ndarray | None,
    settings: RunSettings,
    view: tuple[str, str, bool] = ("all", "all", False),
) -> dict[str, Any]:
    """One webcam frame: buffered into temporal-grid chunks for the engines (never one model call per
    frame). Starts a fresh session on the first frame or when the settings changed."""
    state = session or Session()
    if frame is None:
        return {"session": state}
    started = False
    try:
        min_pixels = min(settings.max_pixels, hub.get(settings.model).min_pixels)
        resized = resize_frames(np.asarray(frame, dtype=np.uint8)[None, ..., :3], min_pixels, settings.max_pixels)
        size = tuple(resized.shape[1:3])
        if state.settings != settings or state.stream is None or not state.source.startswith("webcam") or state.frame_size != size:
            check_settings(settings.policy, settings.budget, settings.keep, settings.fps, settings.max_pixels)
            state = start_session(hub, session, settings, "webcam (live)", size)
            started = True
        with state.lock:
            fed = feed_frames(state, resized, None)
    except USER_ERRORS as exc:
        return {"session": state, "status": status_text(state, error=str(exc))}
    update = live_update(state, view) if fed else {"session": state}
    if started:
        update["legend"] = legend(state)
    return update


# --- chat -----------------------------------------------------------------------------------------------


def ask(session: Session | None, question: str, max_new_tokens: int = 64) -> Iterator[dict[str, Any]]:
    """Ask both engines; yields {policy_chat, full_chat, status}. Answers stream interleaved."""
    state = session or Session()
    question = (question or "").strip()
    if state.policy is None or state.policy.memory.num_grids == 0:
        yield {"session": state, "status": status_text(state, error="no video yet: run a video or the webcam first, then ask")}
        return
    if not question:
        yield {"session": state, "status": status_text(state, error="type a question first")}
        return
    generators = {}
    for name, engine in state.engines.items():
        state.chat[name].append({"role": "user", "content": question})
        if name in state.stopped:
            state.chat[name].append({"role": "assistant", "content": f"*{state.stopped[name]}; no answer.*"})
            continue
        state.chat[name].append({"role": "assistant", "content": ""})
        generators[name] = engine.ask(question, max_new_tokens)
    texts = {name: "" for name in generators}
    last_yield = 0.0
    with state.lock:
        while generators:
            for name in list(generators):
                try:
                    texts[name] += next(generators[name])
                except StopIteration:
                    del generators[name]
                    answer = state.engines[name].answers[-1]
                    state.chat[name][-1]["content"] = _answer_markdown(state, name, answer)
                    continue
                state.chat[name][-1]["content"] = texts[name]
            if time.monotonic() - last_yield > 0.1 or not generators:
                last_yield = time.monotonic()
                yield {"session": state, "policy_chat": list(state.chat["policy"]), "full_chat": list(state.chat["full"])}
    yield {"session": state, "policy_chat": list(state.chat["policy"]), "full_chat": list(state.chat["full"]),
           "report": write_report(state, chart=False)[0]}


def _answer_markdown(state: Session, name: str, answer) -> str:
    text = answer.answer or "(empty answer)"
    return (
        f"{text}\n\n<small>first token {answer.ttft_ms:.0f} ms · {answer.tokens} tokens in {answer.ms:.0f} ms · "
        f"cache {answer.cache_bytes / 2**20:.2f} MB, {answer.visual_tokens} visual tokens{answer_note(state, answer)}</small>"
    )


def answer_note(state: Session, answer) -> str:
    """What an answer is worth: graded against the ground truth on a generated stream; on other inputs,
    a warning when the model is an offline tiny one (random, or trained only on generated streams)."""
    model = state.model
    if model is not None and model.random_weights:
        return " · random weights"
    if state.episode is not None:
        return " · " + grade(state.episode, answer.question, answer.answer, state.policy.last_time_s).note
    if model is not None and model.notice:
        return " · the tiny model knows only its generated streams: on this video its answers mean little"
    return ""


def reset_chat(session: Session | None) -> dict[str, Any]:
    state = session or Session()
    for engine in state.engines.values():
        engine.reset_dialogue()
    state.chat = {"policy": [], "full": []}
    return {"session": state, "policy_chat": [], "full_chat": []}


# --- layout ---------------------------------------------------------------------------------------------


def default_budget(model_name: str) -> tuple[int, int, int]:
    """(M, C, max pixels) defaults: the paper's 6144/4608 at Qwen's video resolution on a real model;
    budgets that compress visibly within a short clip on the tiny models (the trained one at the 112 x 112
    frames it was trained on, 16 tokens per frame pair)."""
    name = resolve_model_name(model_name)
    if name == TINY_NAME:
        return 64, 48, TRAINED_MAX_PIXELS
    if name == TINY_RANDOM_NAME:
        return 1024, 768, 256 * 28 * 28
    return 6144, 4608, 768 * 28 * 28


def build_demo(hub: ModelHub | None = None):
    """The Blocks app (launch it with :func:`launch`)."""
    import gradio as gr

    hub = hub or ModelHub()
    budget0, keep0, pixels0 = default_budget(hub.default)
    sample = sample_episode()

    with gr.Blocks(title="kvdemo: KV-cache compression for streaming video") as demo:
        session = gr.State(value=None, time_to_live=3600, delete_callback=free_session)
        gr.Markdown(
            "# kvdemo — what survives in the KV cache\n"
            "Stream a video into a vision-language model under a hard KV-cache budget, watch the cache, "
            "see which patches survive, and ask questions of the compressed memory and of a full-cache baseline."
        )
        banner = gr.Markdown(banner_html(hub.default), visible=bool(banner_html(hub.default)), elem_id="banner")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                with gr.Tab("Video"):
                    video = gr.Video(label="Upload a video (mp4, mkv, mov, webm, avi)", sources=["upload"], height=220)
                    with gr.Row():
                        run_button = gr.Button("Run", variant="primary", elem_id="run-button")
                        sample_button = gr.Button("Run the bundled sample", elem_id="sample-button")
                        stop_button = gr.Button("Stop", variant="stop")
                    with gr.Accordion("What the bundled sample shows", open=False):
                        gr.Markdown(sample_manifest(sample), elem_id="sample-manifest")
                with gr.Tab("Webcam"):
                    webcam = gr.Image(label="Webcam (frames are buffered into chunks)", sources=["webcam"],
                                      streaming=True, type="numpy", height=220, elem_id="webcam")
                with gr.Accordion("Settings", open=True):
                    model = gr.Dropdown(hub.choices(), value=hub.default, label="Model", allow_custom_value=True,
                                        info="tiny runs offline on the CPU (trained on generated streams; tiny-random: "
                                             "random weights); Qwen ids need a GPU and the Hub")
                    policy = gr.Dropdown(UI_POLICIES, value="infinipot-v", label="Policy")
                    with gr.Row():
                        budget = gr.Number(budget0, label="M (max visual tokens)", precision=0, minimum=1)
                        keep = gr.Number(keep0, label="C (kept by a compression)", precision=0, minimum=1)
                    budget_check = gr.Markdown(validate_settings("infinipot-v", budget0, keep0, 2.0, pixels0))
                    with gr.Row():
                        fps = gr.Slider(0.5, 8, value=2, step=0.5, label="Sampling fps")
                        max_pixels = gr.Number(pixels0, label="Max pixels per frame", precision=0,
                                               info="frames are resized like Qwen: sides multiples of 28")
                    param_inputs, param_keys, groups = [], [], {}
                    for name in UI_POLICIES:
                        specs = policy_params(name)
                        with gr.Group(visible=name == "infinipot-v") as group:
                            for spec in specs:
                                param_inputs.append(_param_component(gr, spec, name))
                                param_keys.append((name, spec.name))
                        groups[name] = group
                    with gr.Row():
                        baseline = gr.Checkbox(True, label="Full-cache baseline")
                        cap_mb = gr.Number(2048, label="Baseline memory cap (MB)", precision=0, minimum=0)
            with gr.Column(scale=2):
                status = gr.Markdown(status_text(Session()), elem_id="status")
                plot = gr.Plot(label="Cache occupancy", show_label=False, elem_id="occupancy")
                with gr.Row():
                    view_layer = gr.Dropdown(["all"], value="all", label="Layer", scale=1)
                    view_head = gr.Dropdown(["all"], value="all", label="KV head", scale=1)
                    by_reason = gr.Checkbox(False, label="Colour by reason (one layer and head)", scale=2)
                gr.Markdown("**Newest frames: what survives**")
                heatmap = gr.Image(label="Newest frames: what survives", show_label=False, format="jpeg", type="numpy",
                                   interactive=False, elem_id="heatmap")
                legend_box = gr.Markdown(legend(Session()))
                with gr.Accordion("Every frame so far", open=False):
                    gallery = gr.Gallery(label="What survives of each frame", columns=6, height=300, format="jpeg")
                coverage_plot = gr.Plot(label="Coverage of the full cache (CDF, after a run with the baseline)", visible=False)
                with gr.Row():
                    question = gr.Textbox(label="Ask both engines", placeholder="What happens in the video?",
                                          scale=4, elem_id="question")
                    ask_button = gr.Button("Ask", variant="primary", scale=1, elem_id="ask-button")
                    clear_button = gr.Button("New conversation", scale=1)
                examples = gr.Dataset(components=[question], samples=[[q.text] for q in sample.questions],
                                      label="Questions about the bundled sample (click to ask both engines)",
                                      elem_id="examples")
                with gr.Row():
                    policy_chat = gr.Chatbot(label="policy at M tokens", height=300, elem_id="policy-chat")
                    full_chat = gr.Chatbot(label="full cache", height=300, elem_id="full-chat")
                with gr.Row():
                    report_file = gr.File(label="Run report (JSON)", interactive=False)
                    chart_file = gr.File(label="Occupancy chart (HTML)", interactive=False)
                with gr.Accordion("How to read this", open=False):
                    gr.Markdown(HOW_TO_READ)

        names = {"session": session, "status": status, "plot": plot, "heatmap": heatmap, "gallery": gallery,
                 "report": report_file, "chart": chart_file, "coverage": coverage_plot, "legend": legend_box,
                 "policy_chat": policy_chat, "full_chat": full_chat}
        outputs = list(names.values())
        settings_inputs = [model, policy, budget, keep, fps, max_pixels, baseline, cap_mb, *param_inputs]
        view_inputs = [view_layer, view_head, by_reason]

        def to_components(update: dict[str, Any]) -> dict[Any, Any]:
            out = {names[key]: value for key, value in update.items() if key in names}
            if update.get("coverage") is not None:
                out[coverage_plot] = gr.update(value=update["coverage"], visible=True)
            return out

        def settings_from(values: list[Any]) -> RunSettings:
            model_v, policy_v, budget_v, keep_v, fps_v, pixels_v, baseline_v, cap_v, *params_v = values
            form = {field_name: value for (owner, field_name), value in zip(param_keys, params_v) if owner == policy_v}
            return RunSettings(
                model=model_v or hub.default, policy=policy_v, params=parse_params(policy_v, form),
                budget=budget_v, keep=keep_v, fps=float(fps_v or 0), max_pixels=int(pixels_v or 0),
                baseline=bool(baseline_v), cap_mb=float(cap_v or 0),
            )

        def run_handler(state, video_path, *values):
            *setting_values, layer_v, head_v, reason_v = values
            try:
                settings = settings_from(setting_values)
            except USER_ERRORS as exc:
                yield to_components({"session": state, "status": status_text(state or Session(), error=str(exc))})
                return
            for update in run_video(hub, state, video_path, settings, (layer_v, head_v, reason_v)):
                yield to_components(update)

        def sample_handler(state, *values):
            yield from run_handler(state, None, *values)

        def webcam_handler(state, frame, *values):
            *setting_values, layer_v, head_v, reason_v = values
            try:
                settings = settings_from(setting_values)
            except USER_ERRORS as exc:
                return to_components({"session": state, "status": status_text(state or Session(), error=str(exc))})
            return to_components(webcam_frame(hub, state, frame, settings, (layer_v, head_v, reason_v)))

        def ask_handler(state, text):
            for update in ask(state, text):
                yield to_components(update)

        def example_handler(state, example):
            for update in ask(state, example[0]):
                yield {**to_components(update), question: example[0]}

        def view_handler(state, layer_v, head_v, reason_v):
            if state is None:
                return None
            return heatmap_image(state, layer_v, head_v, reason_v)

        def view_choices(state):
            engine = state.policy if state else None
            if engine is None:
                return gr.update(), gr.update()
            layers = ["all"] + [str(i) for i in range(engine.model.num_layers)]
            heads = ["all"] + [str(i) for i in range(engine.model.num_kv_heads)]
            return gr.update(choices=layers), gr.update(choices=heads)

        # All model work shares one concurrency group. Two events at a time, so that a question can be
        # answered while a stream runs: the session lock pauses the stream between chunks meanwhile.
        common = dict(outputs=outputs, show_progress_on=[status], concurrency_id="model", concurrency_limit=MODEL_CONCURRENCY)
        run_event = run_button.click(run_handler, [session, video, *settings_inputs, *view_inputs], api_name="run", **common)
        sample_event = sample_button.click(sample_handler, [session, *settings_inputs, *view_inputs], api_name="run_sample", **common)
        for event in (run_event, sample_event):
            event.then(view_choices, [session], [view_layer, view_head], api_visibility="private")
        stop_button.click(None, cancels=[run_event, sample_event])
        webcam.stream(webcam_handler, [session, webcam, *settings_inputs, *view_inputs], outputs,
                      stream_every=0.5, time_limit=600, concurrency_id="model", concurrency_limit=MODEL_CONCURRENCY,
                      show_progress="hidden",
                      api_visibility="private")
        ask_event = dict(outputs=outputs, show_progress_on=[status], concurrency_id="model", concurrency_limit=MODEL_CONCURRENCY)
        ask_button.click(ask_handler, [session, question], api_name="ask", **ask_event)
        question.submit(ask_handler, [session, question], api_visibility="private", **ask_event)
        examples.click(example_handler, [session, examples], api_visibility="private",
                       **{**ask_event, "outputs": [*outputs, question]})
        clear_button.click(lambda s: to_components(reset_chat(s)), [session], outputs, api_name="new_conversation")
        for control in view_inputs:
            control.change(view_handler, [session, *view_inputs], heatmap, show_progress="hidden", api_visibility="private")
        for control in (policy, budget, keep, fps, max_pixels):
            control.change(validate_settings, [policy, budget, keep, fps, max_pixels], budget_check,
                           show_progress="hidden", api_visibility="private")
        policy.change(lambda name: [gr.update(visible=name == n) for n in groups], [policy], list(groups.values()),
                      api_visibility="private")
        model.change(lambda name: gr.update(value=banner_html(name), visible=bool(banner_html(name))), [model], banner,
                     api_visibility="private")
    return demo


def banner_html(model_name: str | None) -> str:
    """The warning shown over the app for an offline tiny model ('' for real models)."""
    try:
        notice = OFFLINE_NOTICES.get(resolve_model_name(model_name))
    except Exception:
        notice = None
    if not notice:
        return ""
    advice = ("Run the bundled sample and ask about it; on other videos its answers mean little."
              if resolve_model_name(model_name) == TINY_NAME else "")
    return (f"<div style='padding:8px;border-radius:6px;background:#fff3cd;color:#664d03'>⚠️ {notice} {advice} "
            "Choose a real Qwen2.5-VL model on a GPU machine for meaningful answers about real videos.</div>")


def _param_component(gr, spec, policy: str):
    label = f"{policy}: {spec.name}"
    if spec.kind == "bool":
        return gr.Checkbox(spec.default, label=label, info=spec.help)
    if spec.kind == "choice":
        return gr.Dropdown(list(spec.choices), value=spec.default, label=label, info=spec.help)
    if spec.kind in ("int", "float"):
        return gr.Number(spec.default, label=label, info=spec.help, precision=0 if spec.kind == "int" else None)
    return gr.Textbox("" if spec.default is None else ", ".join(str(x) for x in spec.default), label=label, info=spec.help)


def launch(host: str | None = None, port: int | None = None, model: str | None = None, share: bool = False, **kwargs):
    """Build and launch the app (model loaded before the first request)."""
    import gradio as gr

    hub = ModelHub(model)
    hub.get()
    demo = build_demo(hub)
    demo.queue(default_concurrency_limit=MODEL_CONCURRENCY)
    return demo.launch(
        server_name=host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=port or int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        share=share,
        theme=gr.themes.Soft(),
        **kwargs,
    )
