"""The app's handlers as plain functions (no browser): runs, errors, webcam buffering, chat, views."""

import json

import numpy as np
import pytest
import torch

from kvdemo import viz
from kvdemo.app import handlers
from kvdemo.app.handlers import run_stream, webcam_frame
from kvdemo.app.layout import CACHE_CLEANUP, build_demo
from kvdemo.app.sessions import AppServices, RunSettings, Session
from kvdemo.app.settings import parse_params, validate_settings
from kvdemo.app.single_updates import SingleUpdates, occupancy_plot, status_text, write_chart
from kvdemo.cache.memory import REASON_NEW
from kvdemo.policies import policy_card


@pytest.fixture(scope="module")
def hub():
    return AppServices.create("tiny")


def settings(**overrides):
    base = dict(
        model="tiny",
        policy="infinipot-v",
        params={},
        budget=540,
        keep=405,
        fps=2.0,
        max_pixels=256 * 28 * 28,
        baseline=True,
        cap_mb=2048,
    )
    base.update(overrides)
    return RunSettings(**base)


def run_video(hub, session, path, run_settings):
    """A run of the single page (the one stream path with the single page's views)."""
    return run_stream(hub, session, path, run_settings, SingleUpdates())


def ask(session, question):
    """A question on the single page (the one ask path with the single page's views)."""
    return handlers.ask(session, question, SingleUpdates())


def run(hub, session, path, **overrides):
    updates = list(run_video(hub, session, str(path) if path else None, settings(**overrides)))
    return updates, updates[-1]["session"]


def test_a_run_streams_live_updates_and_ends_with_everything(hub, media):
    updates, session = run(hub, None, media / "flipping_a_pancake.mkv")
    assert len(updates) >= 10  # one per chunk at least
    final = updates[-1]
    assert "20/20 frames" in final["status"]
    assert final["plot"] is not None and len(final["plot"].data) >= 3  # policy, compressions, full
    assert final["heatmap"].ndim == 3 and final["heatmap"].dtype == np.uint8
    assert len(final["gallery"]) == 10
    assert final["coverage"] is not None
    report = json.loads(open(final["report"]).read())
    assert report["policy"] == "infinipot-v" and report["frames"] == 20
    assert report["peak_visual_tokens"] <= 540
    assert report["baseline"]["peak_visual_tokens"] == 1350
    assert "infinipot-v" in report["coverage"]
    assert "chart" not in final, "the chart HTML is made on demand"
    chart = open(write_chart(session)).read()
    assert "<html>" in chart and "plotly" in chart and "visual tokens" in chart
    assert session.engine.memory.visual_tokens <= 540


def test_errors_are_messages_and_keep_the_previous_stream(hub, media, tmp_path):
    _, session = run(hub, None, media / "flipping_a_pancake.mkv")
    junk = tmp_path / "junk.mp4"
    junk.write_text("not a video")
    updates, after = run(hub, session, junk)
    assert "not a readable video" in updates[-1]["status"]
    assert after is session and session.engine.frames_fed == 20
    updates, after = run(hub, session, media / "flipping_a_pancake.mkv", budget=300, keep=200)
    assert "leaves no room for one chunk" in updates[-1]["status"]
    assert after.engine.frames_fed == 20
    updates, after = run(hub, session, media / "flipping_a_pancake.mkv", budget=100, keep=200)
    assert "C must be smaller than M" in updates[-1]["status"]
    updates, after = run(hub, session, media / "corrupted.mp4", budget=1024, keep=768)
    assert (
        "1 damaged frame could not be decoded and was skipped" in updates[-1]["status"]
    )  # decoded what it could, said what was lost
    assert after.engine.frames_fed > 0


@pytest.mark.slow
def test_the_bundled_sample_runs_without_a_file(hub):
    updates, session = run(hub, None, None, budget=1024, keep=768)
    assert "80/80 frames" in updates[-1]["status"] and "generated(seed=7)" in updates[-1]["status"]
    assert session.engine.memory.grid_shape == (4, 4), "the trained tiny model gets its 112 x 112 frames"


@pytest.mark.slow
def test_answers_on_the_sample_are_graded_against_the_ground_truth(hub):
    from kvdemo.world.synthetic import sample_episode

    _, session = run(hub, None, None, budget=128, keep=96)
    question = next(q for q in sample_episode().questions if q.kind == "colour")
    final = list(ask(session, question.text))[-1]
    for chat in (final["policy_chat"], final["full_chat"]):
        note = chat[1]["content"]
        assert "✓ matches the ground truth" in note or f"✗ the ground truth is {question.answer}" in note
    assert "✓ matches the ground truth" in final["full_chat"][1]["content"], "the full cache answers the sample right"
    unknown = list(ask(session, "What is cooking?"))[-1]
    assert "no ground truth" in unknown["full_chat"][-1]["content"]


def test_asking_before_any_frame_is_a_message(hub):
    update = list(ask(None, "hello?"))[-1]
    assert "no video yet" in update["ask_status"]


def test_ask_streams_both_answers_and_keeps_memory(hub, media):
    _, session = run(hub, None, media / "flipping_a_pancake.mkv")
    before = session.engine.memory.nbytes
    updates = list(ask(session, "What is cooking?"))
    final = updates[-1]
    for chat in (final["policy_chat"], final["full_chat"]):
        assert chat[0] == {"role": "user", "content": "What is cooking?"}
        assert "first token" in chat[1]["content"] and "its answers mean little" in chat[1]["content"]
    assert session.engine.memory.nbytes == before
    list(ask(session, "And then?"))
    assert len(session.chat["infinipot-v"]) == 4 and len(session.engine.history) == 2


def test_baseline_over_its_memory_cap_stops_with_a_message(hub, media):
    updates, session = run(hub, None, media / "flipping_a_pancake.mkv", cap_mb=1)
    assert "MB cap" in updates[-1]["status"]
    assert session.engine.frames_fed == 20
    final = list(ask(session, "What?"))[-1]
    assert "no answer" in final["full_chat"][-1]["content"]
    assert "first token" in final["policy_chat"][-1]["content"]


def test_webcam_frames_are_buffered_into_chunks(hub):
    rng = np.random.default_rng(0)
    session = None
    fed = []
    for _ in range(6):
        frame = rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)
        update = webcam_frame(hub, session, frame, settings(budget=1024, keep=768))
        session = update["session"]
        fed.append(session.engine.frames_fed)
    assert fed == [0, 2, 2, 4, 4, 6]  # one model call per pair of frames, never per frame
    assert "status" in update and len(session.thumbnails) == 3
    bad = webcam_frame(hub, session, frame, settings(budget=90, keep=50))  # a grid of 252 x 308 px is 99 tokens
    assert "smaller than one chunk" in bad["status"] and bad["session"] is session


def test_single_layer_head_view_colours_by_reason(hub, media):
    _, session = run(hub, None, media / "flipping_a_pancake.mkv")
    memory = session.engine.memory
    codes = viz.reason_map(memory, layer=1, head=0)
    assert codes.shape == (10, 9, 15)
    held = (codes != viz.EVICTED).sum()
    assert held == memory.frame[1].shape[1]
    assert set(np.unique(codes)) <= {viz.EVICTED, REASON_NEW, 0, 1, 2}
    image = viz.survivor_strip(memory, session.thumbnails, layer=1, head=0, by_reason=True)
    assert image.ndim == 3 and image.shape[0] > 100


@pytest.mark.parametrize("policy, names", [("uniform", {0, 1}), ("sliding-window", {0})])
def test_baselines_colour_by_their_own_reasons(tiny_random, pancake, policy, names):
    """Uniform and sliding-window say why they kept a token; tokens appended since the last pass are 'new'."""
    from kvdemo.stream.engine import StreamEngine
    from kvdemo.stream.streaming import stream_video

    engine = StreamEngine(tiny_random, policy, budget=540, keep=405, fps=pancake.fps)
    list(stream_video(tiny_random, pancake, {"p": engine}))
    codes = viz.reason_map(engine.memory, layer=0, head=1)
    held = codes[codes != viz.EVICTED]
    assert set(np.unique(held)) <= names | {REASON_NEW}
    assert (held == REASON_NEW).sum() == 135  # the last grid arrived after the last compression
    assert 0 in held
    reasons = policy_card(engine.policy.name).reasons
    legend = viz.legend_text(reasons)
    assert all(name in legend for name in reasons.values()) and "new since" in legend


def test_budget_validation_as_you_type():
    assert validate_settings("infinipot-v", 1024, 768).startswith("✓")
    assert "C must be smaller than M" in validate_settings("infinipot-v", 100, 200)
    assert "positive" in validate_settings("cords", 0, -1)
    assert "positive" in validate_settings("infinipot-v", -5, 50)


@pytest.mark.slow
def test_as_you_type_check_is_runs_rule_against_one_chunk(hub, media):
    # No video yet: a chunk of the bundled sample (what runs without an upload), resized into the model's range:
    # 112 x 112 stays (16 tokens) for the tiny model; Qwen's minimum (tiny-random's) takes it to 336 x 336 (144 tokens).
    qwen = "tiny-random"
    assert "M=100 is smaller than one chunk (144 visual tokens" in validate_settings(
        "infinipot-v", 100, 50, 2.0, 200704, None, qwen
    )
    assert "M - C = 24 leaves no room for one chunk (144" in validate_settings(
        "infinipot-v", 1024, 1000, 2.0, 200704, None, qwen
    )
    ok = validate_settings("infinipot-v", 96, 72, 2.0, 15680, None, "tiny")
    assert ok.startswith("✓") and "one chunk of the bundled sample is 16 visual tokens" in ok and "up to 20" in ok
    sample = list(run_video(hub, None, None, settings(budget=96, keep=80, max_pixels=15680)))[-1]["status"]
    assert (
        validate_settings("infinipot-v", 96, 80, 2.0, 15680, None, "tiny").startswith("✓") and "80/80 frames" in sample
    )
    # With the uploaded video: 426x240 resized within 200704 pixels -> 252x420 = 9x15 = 135 tokens.
    pancake = str(media / "flipping_a_pancake.mkv")
    for keep in (889, 890):
        verdict = validate_settings("infinipot-v", 1024, keep, 2.0, 200704, pancake)
        updates = list(run_video(hub, None, pancake, settings(budget=1024, keep=keep, max_pixels=200704)))
        ran = "20/20 frames" in updates[-1]["status"]
        assert verdict.startswith("✓") == ran == (1024 - keep >= 135), (keep, verdict, updates[-1]["status"])
    assert "135 visual tokens" in validate_settings("infinipot-v", 1024, 889, 2.0, 200704, pancake)
    assert "not a readable video" in validate_settings("infinipot-v", 1024, 768, 2.0, 200704, __file__)


def test_throwaway_sessions_make_no_temp_folders(hub, media, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    Session().free()
    list(ask(None, "hello?"))
    assert not list(tmp_path.glob("kvdemo-*")), "no folder until a report is written"
    _, session = run(hub, None, media / "flipping_a_pancake.mkv")
    assert len(list(tmp_path.glob("kvdemo-*"))) == 1
    session.free()
    assert not list(tmp_path.glob("kvdemo-*")), "closing a session removes its folder"


@pytest.mark.slow
def test_the_session_pool_frees_the_least_recently_used_session(media):
    small = AppServices.create("tiny", max_sessions=2)
    sessions = [run(small, None, None, fps=0.5, budget=1024, keep=768)[1] for _ in range(2)]
    assert len(small.sessions) == 2 and all(s.engine is not None for s in sessions)
    list(ask(sessions[0], "keep me"))  # the first session is now the more recently used one
    third = run(small, None, None, fps=0.5, budget=1024, keep=768)[1]
    assert len(small.sessions) == 2
    assert sessions[0].engine is not None and third.engine is not None
    assert sessions[1].engine is None and not sessions[1].thumbnails
    final = list(ask(sessions[1], "still there?"))[-1]
    assert "freed to make room: the app keeps at most 2 sessions" in final["ask_status"]
    updates, again = run(small, sessions[1], None, fps=0.5, budget=1024, keep=768)
    assert "20/20 frames" in updates[-1]["status"] and again.engine is not None  # the 40 s sample at 0.5 fps


@pytest.mark.slow
def test_a_new_run_replaces_the_previous_session_only_once_it_streams(hub, media, tmp_path):
    _, first = run(hub, None, media / "flipping_a_pancake.mkv")
    header_only = tmp_path / "header_only.mkv"  # opens, but no frame decodes
    header_only.write_bytes((media / "flipping_a_pancake.mkv").read_bytes()[:2000])
    updates, after = run(hub, first, header_only)
    assert after is first and first.engine.frames_fed == 20 and first.engine.memory.num_grids == 10
    assert "none of the sampled frames could be decoded" in updates[-1]["status"]
    assert "Still showing the previous run: flipping_a_pancake.mkv" in updates[-1]["status"]
    assert set(updates[-1]) == {"session", "status"}, "no view changes"
    updates, second = run(hub, first, None, budget=1024, keep=768)
    assert second is not first and first.engine is None, "the previous engines are freed once the new run streams"
    started = next(u for u in updates if "legend" in u)
    assert started["policy_chat"] == [] and started["report"] is None and started["coverage"] is None
    assert "**infinipot-v**, M=1024 C=768" == started["policy_title"]


def webcam(hub, frames, session=None, **overrides):
    for frame in frames:
        session = webcam_frame(hub, session, frame, settings(**overrides))["session"]
    return session


@pytest.mark.slow
def test_the_webcam_keeps_streaming_while_a_question_is_answered(hub):
    """The answer's handler and the webcam's take turns on the engines: frames given while the answer streams enter
    the memory at once (a chunk between its tokens), the answer comes from the memory as it was when it was asked,
    and the memory ends as a webcam session with no question ends. The random model answers all 24 tokens, 4 a turn."""
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(8)]
    options = dict(model="tiny-random", budget=1024, keep=768)
    session, quiet = webcam(hub, frames[:4], **options), webcam(hub, frames, **options)
    held = session.engine.memory.visual_tokens
    answering = handlers.ask(session, "What is in view?", SingleUpdates(), max_new_tokens=24)
    assert next(answering)["ask_status"] == "⏳ answering…"  # one turn ran: 4 tokens of each answer
    webcam(hub, frames[4:], session, **options)
    assert session.engine.frames_fed == 8 and session.live.in_flight, "two chunks entered while it answered"
    final = list(answering)[-1]
    assert "✓ answered" in final["ask_status"] and session.engine.answers[-1].visual_tokens == held
    assert session.engine.answers[-1].tokens == 24
    for name, engine in session.engines.items():
        mine, theirs = engine.memory, quiet.engines[name].memory
        assert all(torch.equal(a, b) for a, b in zip(mine.keys + mine.values, theirs.keys + theirs.values))


@pytest.mark.slow
def test_the_webcam_shows_and_reports_how_far_behind_live_it_is(hub):
    """The status line gives the lag behind live and the frames waiting, the occupancy chart draws each chunk's lag on
    an axis of its own, the report has the live section; frames dropped past the queue's bound (10 s at 2 fps: 20
    frames) are said on screen and counted in the report. A file is not a live source: none of it."""
    rng = np.random.default_rng(2)
    frames = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(4)]
    session = webcam(hub, frames, model="tiny-random", budget=1024, keep=768)
    records = session.live.records
    assert [r.frames for r in records] == [2, 4] and all(r.lag_s >= 0 for r in records)
    status = status_text(session)
    assert f"behind live **{records[-1].lag_s:.1f} s** · 0 frames waiting" in status and "dropped" not in status
    lag = next(trace for trace in occupancy_plot(session).data if trace.name == "behind live (s)")
    assert list(lag.x) == [r.time_s for r in records] and list(lag.y) == [r.lag_s for r in records]
    assert lag.yaxis == "y3"
    with session.turns:  # the engines are busy (an answer's turn): frames only queue, the oldest past the bound go
        session.live.put(np.zeros((23, *session.frame_size, 3), dtype=np.uint8))
    assert "⚠️ **3 frames dropped**: more than 20 frames waited" in status_text(session)
    live = SingleUpdates().report(session)["live"]
    assert [c["frames"] for c in live["chunks"]] == [2, 4] and live["dropped_frames"] == 3
    assert live["frames_waiting"] == 20 and live["frames_received"] == 27
    session.live_source = False
    assert "behind live" not in status_text(session) and occupancy_plot(session).data[-1].name != "behind live (s)"
    assert "live" not in SingleUpdates().report(session)


@pytest.mark.slow
def test_a_session_freed_while_it_answers_lets_the_answer_go_and_says_why(hub):
    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(4)]
    session = webcam(hub, frames, model="tiny-random", budget=1024, keep=768)
    answering = handlers.ask(session, "What is in view?", SingleUpdates(), max_new_tokens=24)
    next(answering)
    live = session.live
    hub.sessions.free(session)
    final = list(answering)[-1]
    assert live.in_flight == [] and "freed" in final["ask_status"]


@pytest.mark.slow
def test_the_app_bounds_gradios_cache_and_names_its_limits(hub):
    demo = build_demo(hub)
    assert demo.delete_cache == CACHE_CLEANUP and CACHE_CLEANUP[1] <= 3600
    assert f"at most {hub.sessions.limit} sessions" in json.dumps(demo.config, default=str)


def test_policy_form_values_are_parsed():
    assert parse_params("infinipot-v", {"alpha": "0.3", "cv_thresholds": "0.1, 0.2, 0.3"}) == {
        "alpha": 0.3,
        "cv_thresholds": [0.1, 0.2, 0.3],
    }
    assert parse_params("infinipot-v", {"cv_thresholds": ""}) == {"cv_thresholds": None}
    assert parse_params("cords", {"followers": False, "layers": "all"}) == {"followers": False, "layers": "all"}


@pytest.mark.slow
def test_sessions_are_independent(hub, media):
    _, first = run(hub, None, media / "flipping_a_pancake.mkv")
    _, second = run(hub, None, None, budget=1024, keep=768)
    assert first.engine is not second.engine
    assert first.engine.memory.num_grids == 10 and second.engine.memory.num_grids == 40
    assert first.engine.model is second.engine.model  # one model per process


def test_small_frames_get_enlarged_thumbnails_with_crisp_patches():
    frame = np.arange(112 * 112 * 3, dtype=np.uint32).reshape(112, 112, 3).astype(np.uint8)
    thumb = viz.thumbnail(frame)
    assert thumb.shape == (224, 224, 3)
    np.testing.assert_array_equal(thumb[::2, ::2], frame)
    np.testing.assert_array_equal(thumb[1::2, 1::2], frame)
    assert viz.thumbnail(np.zeros((240, 426, 3), np.uint8)).shape == (180, 320, 3)  # large frames still shrink


def test_policies_declare_their_views_and_viz_draws_them(tiny_random, pancake):
    """ProtoKV's assignment map and bank, HybridKV's head map: declared by the policy, drawn by viz; per-head
    views show summarised (ProtoKV) and offloaded / retrieved (HybridKV) patches."""
    from kvdemo.stream.engine import StreamEngine
    from kvdemo.stream.streaming import stream_video

    proto = StreamEngine(tiny_random, "protokv", budget=560, fps=pancake.fps, policy_params={"warmup": 64})
    hybrid = StreamEngine(tiny_random, "hybridkv", budget=540, keep=405, fps=pancake.fps, max_new_tokens=4)
    list(stream_video(tiny_random, pancake, {"p": proto, "h": hybrid}))
    hybrid.answer("What is it?")
    thumbs = [viz.thumbnail(frame) for frame in pancake.frames[::2]]
    panels = {engine.policy.name: viz.draw_views(engine.policy_views(1, 0), thumbs) for engine in (proto, hybrid)}
    titles = {name: [p.title for p in drawn] for name, drawn in panels.items()}
    assert titles == {"protokv": ["Prototype assignments", "Prototype bank"], "hybridkv": ["Head types"]}
    assignment = panels["protokv"][0]
    assert assignment.kind == "image" and assignment.value.shape[0] > 100 and "mass" in assignment.caption
    status = viz.patch_status(proto, 1, 0)
    assert set(np.unique(status)) <= {viz.HELD, viz.SUMMARISED, viz.EVICTED} and (status == viz.SUMMARISED).any()
    # the near window holds the newest tokens exactly; every older patch is represented in the bank
    assert (status[-1] == viz.HELD).sum() > 0 and (status[0] != viz.HELD).all()
    dynamic = [
        (l, h)
        for l in range(tiny_random.num_layers)
        for h in range(tiny_random.num_kv_heads)
        if not hybrid.policy.report()["head_class"][l][h] == "static"
    ]
    layer, head = dynamic[0]
    status = viz.patch_status(hybrid, layer, head)
    assert (status == viz.RETRIEVED).any() and (status == viz.HELD).any()
    assert viz.patch_status(StreamEngine(tiny_random, "uniform", budget=540, keep=405), 0, 0) is None


def test_a_caption_wider_than_its_tile_wraps_instead_of_running_into_the_next():
    from PIL import Image, ImageDraw, ImageFont

    measure = lambda text: 10 * len(text)  # noqa: E731 (10 px per character)
    assert viz.wrap_caption("t=36.0s 0% exact · 100% summarised", 120, measure) == [
        "t=36.0s 0%",
        "exact · 100%",
        "summarised",
    ]
    assert viz.wrap_caption("short", 120, measure) == ["short"]
    assert viz.wrap_caption("unbreakablewordthatislong", 50, measure) == ["unbreakablewordthatislong"]
    tiles = [np.zeros((40, 120, 3), dtype=np.uint8)] * 2
    font = ImageFont.load_default(size=16)
    textlength = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength
    long_caption = "t=36.0s  0% exact · 100% summarised"
    assert textlength(long_caption, font=font) > 120  # would overflow one line
    one_line, wrapped = viz.frame_strip(tiles, ["a", "b"]), viz.frame_strip(tiles, [long_caption, "b"])
    assert wrapped.shape[0] > one_line.shape[0] and wrapped.shape[1] == one_line.shape[1]
    # Nothing is drawn in the 6-px gap between the tiles: the caption stayed over its own tile.
    gap = wrapped[:, 120:126]
    assert (gap == 250).all()


def test_a_redraw_while_a_webcam_chunk_is_fed_waits_for_it(hub, monkeypatch):
    """Asking while the webcam streams redraws the views afterwards; the redraw ran while a chunk was half-fed
    (the memory had the new grid, the session not yet its thumbnail) and failed with an IndexError in
    viz.survivor_strip. A redraw takes the session's turn like a question, so it sees a whole chunk."""
    import threading

    from kvdemo.app import single_updates
    from kvdemo.app.layout import Demo

    demo = Demo(hub)
    demo.build()
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(4)]
    session = None
    for frame in frames[:2]:
        session = webcam_frame(hub, session, frame, settings(budget=1024, keep=768))["session"]
    half_fed, go = threading.Event(), threading.Event()
    real = single_updates.live_update

    def paused(*args, **kwargs):  # inside the segment: the memory holds the new grid, the session not its thumbnail
        half_fed.set()
        go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(single_updates, "live_update", paused)
    feeder = threading.Thread(
        target=lambda: [webcam_frame(hub, session, f, settings(budget=1024, keep=768)) for f in frames[2:]]
    )
    feeder.start()
    assert half_fed.wait(30)
    outcome = {}

    def redraw():
        try:
            outcome["views"] = demo.on_redraw(session, "all", "all", False, False)
        except Exception as exc:  # the failure being tested for
            outcome["error"] = exc

    redrawing = threading.Thread(target=redraw)
    redrawing.start()
    redrawing.join(1.0)
    go.set()
    feeder.join(30)
    redrawing.join(30)
    assert "error" not in outcome, repr(outcome.get("error"))
    image = outcome["views"][demo.heatmap]
    assert image.ndim == 3 and len(session.thumbnails) == session.engine.memory.num_grids == 2


def test_live_updates_of_gpu_calls_draw_the_policys_views_over_every_thumbnail(hub, monkeypatch):
    """On ZeroGPU (emulated: each segment of 16 frames in a forked child) the live updates while a segment runs
    draw the policy's views where every thumbnail is: ProtoKV's assignment map shows absorbed grids older than
    the four newest thumbnails a segment carries, so at M=512 it must show while the run goes on, not only once it
    ends. Once it shows, it stays."""
    monkeypatch.setenv("KVDEMO_ZEROGPU_EMULATE", "1")
    updates = run_video(hub, None, None, settings(policy="protokv", budget=512, keep=None, fps=1.0, baseline=False))
    shown = [[panel.title for panel in update["panels"]] for update in updates if "panels" in update]
    first = next((i for i, titles in enumerate(shown) if "Prototype assignments" in titles), len(shown))
    assert len(shown) - first >= 3, shown
    assert all("Prototype assignments" in titles for titles in shown[first:]), shown


def test_a_bug_in_a_handler_is_a_logged_one_line_message_not_a_bare_error_badge(hub, monkeypatch, caplog):
    from kvdemo.app import layout, page

    demo = layout.Demo(hub)
    demo.build()

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'shape'\nsecond line")

    monkeypatch.setattr(page, "run_stream", broken)
    monkeypatch.setattr(page, "ask", broken)
    values = dict(
        model="tiny",
        policy="infinipot-v",
        budget=96,
        keep=72,
        fps=2,
        max_pixels=12544,
        baseline=False,
        baseline_cap_mb=0,
        view_layer="all",
        view_head="all",
        colour_by_reason=False,
        log_scale=False,
        **{key: component.value for key, (_, _, component) in demo.param_inputs.items()},
    )
    with caplog.at_level("ERROR", logger="kvdemo"):
        status = list(demo.on_run_sample(None, **values))[-1][demo.status]
        asked = list(demo.on_ask(None, "hi"))[-1][demo.ask_status]
    for message in (status, asked):
        assert message.startswith("⚠️ **internal error** (AttributeError: 'NoneType' object has no attribute 'shape')")
        assert "\n" not in message and "keeps serving" in message
    assert "Traceback" in caplog.text
    nothing = list(demo.on_run(None, None, **values))[-1][demo.status]
    assert "upload a video first (or click Run the bundled sample)" in nothing, "Run with no upload runs nothing"


def test_small_things_a_new_user_saw_are_right():
    """In the drawing: "1 token" (not "1 tokens"); the empty chart starts at 0 s; a patch still exact in ProtoKV's
    prototype map is drawn as it is (dimmed, it would read as evicted next to the survivor strip)."""
    from kvdemo.app.page_updates import answer_markdown
    from kvdemo.stream.engine import Answer
    from kvdemo.views import UNLABELLED
    from kvdemo.viz.views import _label_tile

    one = Answer("q", "a", ms=5.0, ttft_ms=1.0, tokens=1, cache_bytes=2**20, visual_tokens=16)
    assert "1 token in 5 ms" in answer_markdown(Session(), one)
    empty = viz.occupancy_figure({"policy": [], "full cache": []}, 96)
    assert list(empty.layout.xaxis.range) == [0, 10]
    frame = np.random.default_rng(0).integers(0, 255, (112, 112, 3), dtype=np.uint8)
    labels = np.full((4, 4), UNLABELLED)
    labels[0, 0] = 3
    tile = _label_tile(frame, labels).astype(int)
    np.testing.assert_allclose(tile[60:80, 60:80].mean(), frame[60:80, 60:80].mean(), atol=2)  # untinted, not dimmed
    assert np.abs(tile[5:20, 5:20] - frame[5:20, 5:20]).mean() > 20  # the labelled patch is tinted


def test_counts_agree_and_the_compression_time_is_said_in_words(hub):
    """Every count in the status, the answers and the messages agrees with its noun ("1 token",
    "1 compression"); the compression time is a share of the prefill time, said in words; the Ready text names the
    sample's button (a sample kind is always chosen)."""

    from kvdemo.app.page_updates import answer_markdown
    from kvdemo.app.single_updates import READY, compression_time, status_text
    from kvdemo.stream.engine import Answer, EngineStats
    from kvdemo.views import counted

    assert [counted(n, "token") for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]
    assert counted(1, "patch", "patches") == "1 patch" and counted(3, "patch", "patches") == "3 patches"
    chunks = [{"prefill_ms": ms} for ms in (400.0, 100.0, 140.0)]  # the first pays for the warm-up: left out
    stats = EngineStats(chunks=3, compress_ms=30.0, compressions=1, prefill_ms=640.0, per_chunk=chunks)
    assert compression_time(stats) == (
        "1 compression, each 30 ms = 25% of a chunk's prefill (120 ms, the first chunk's warm-up left out)"
    )
    stats = EngineStats(chunks=1, compress_ms=408.0, compressions=3, prefill_ms=120.0, per_chunk=chunks[1:2])
    assert compression_time(stats) == "3 compressions, each 136 ms = 136% of a chunk's prefill (100 ms)"
    assert compression_time(EngineStats(chunks=2, per_chunk=chunks[:2])) == "0 compressions"
    assert status_text(Session()) == READY and "Run the bundled sample" in READY and "pick the sample" not in READY
    one = Answer("q", "a", ms=5.0, ttft_ms=1.0, tokens=1, cache_bytes=2**20, visual_tokens=1)
    assert "1 token in 5 ms" in answer_markdown(Session(), one)
    updates, session = run(hub, None, None, budget=96, keep=72, fps=0.5)
    status = updates[-1]["status"]
    assert "compressions, each" in status and "% of a chunk's prefill" in status and "overhead" not in status


def test_the_time_per_chunk_is_the_runs_median_with_the_warm_up_chunk_apart(hub):
    """Three runs of one sample showed 428, 45 and 49 ms per chunk: the last chunk's time, the first run's with the
    process's warm-up. The status gives the median of the chunks after the first, and the first chunk apart."""
    from kvdemo.app.single_updates import chunk_time, status_text

    assert chunk_time([428.0, 45.0, 60.0, 49.0]) == "49 ms/chunk (median; the first, with warm-up, 428 ms)"
    assert chunk_time([428.0]) == "first chunk 428 ms (with warm-up)" and chunk_time([]) == "no chunk yet"
    _, session = run(hub, None, None, budget=96, keep=72, fps=0.5)
    assert len(session.chunk_ms) == 10  # 40 s at 0.5 fps: 20 frames, 10 chunks
    assert chunk_time(session.chunk_ms) in status_text(session)


def test_a_question_about_a_shape_never_shown_and_a_follow_up_are_graded_in_the_chat(hub):
    """docs/app.md: a question about an object the sample did not show says so; "And the diamond?" after a colour
    question is graded as the diamond's colour question (the static sample has no square; its diamond is purple)."""
    _, session = run(hub, None, None, budget=96, keep=72, fps=0.5)
    list(ask(session, "What colour was the square?"))
    list(ask(session, "And the diamond?"))
    for name in ("infinipot-v", "full"):
        chat = session.chat[name]
        assert "no square was shown in this stream" in chat[1]["content"]
        assert "(purple) (read as “What colour was the diamond?”)" in chat[3]["content"] or (
            "the ground truth is purple (read as “What colour was the diamond?”)" in chat[3]["content"]
        )


def test_charts_read_as_the_newcomer_expected():
    """Log axes get a few spaced ticks (plotly's own labels every digit, which run together) and the
    M label sits at the line's right end, off the tick labels; integer axes (counts, layers) have whole ticks; lines
    of equal values stay apart by dash and marker; a cell grid has a legend of its classes; a title when asked."""
    from kvdemo.cache.memory import OccupancyEvent
    from kvdemo.views import CellGrid, Chart, Histogram, Series
    from kvdemo.viz.charts import log_ticks

    assert log_ticks([64, 96, 640])["tickvals"] == [100, 200, 500]  # 1-2-5 within the range
    assert log_ticks([16, 96])["tickvals"] == [20, 30, 50, 70]  # under a decade: 1-2-3-5-7
    assert log_ticks([10, 5e6])["tickvals"] == [10, 100, 1000, 10_000, 100_000, 1_000_000]  # many decades: powers
    assert log_ticks([0.26, 0.28]) == {} and log_ticks([0.25, 0.35]) == {} and log_ticks([]) == {}  # plotly's own
    events = [
        OccupancyEvent(
            event="append",
            frame=2 * i,
            time_s=float(i),
            visual_tokens=16 * (i + 1),
            cache_bytes=2**16 * (i + 1),
            ms=1.0,
        )
        for i in range(20)
    ]
    log = viz.occupancy_figure({"policy": events}, 96, log_scale=True)
    assert list(log.layout.yaxis.tickvals) == [20, 50, 100, 200]  # 16..320 tokens (and M = 96): 1-2-5
    label = next(a for a in log.layout.annotations if a.text == "M = 96")
    assert (label.x, label.xanchor) == (1, "right")
    counts = viz.chart_figure(Chart("bank", "", [Histogram(np.array([1, 1, 2, 3]), "mass", "prototypes")]))
    assert counts.layout.yaxis.dtick == 1 and counts.layout.yaxis.tickformat == "d"
    sweep = viz.chart_figure(
        Chart(
            "sweep",
            "",
            [Series([0, 4, 8], {"a": [1, 1, 0.5], "full": [1, 1, 0.5]}, "delay (s)", "accuracy", markers=True)],
        ),
        "What colour was the star?",
    )
    first, second = sweep.data
    assert first.line.dash != second.line.dash and first.marker.symbol != second.marker.symbol
    assert first.marker.size > second.marker.size, "the line drawn first shows as a ring around the one on top"
    assert sweep.layout.xaxis.dtick == 1 and sweep.layout.title.text == "What colour was the star?"
    grid = CellGrid(
        np.array([[1, 0]]), {1: "static", 0: "dynamic"}, np.array([[3, 4]]), [["", ""]], ["L0"], ["h0", "h1"]
    )
    heads = viz.chart_figure(Chart("Head types", "", [grid]))
    assert heads.layout.showlegend and {t.name for t in heads.data if t.type == "scatter"} == {"static", "dynamic"}


def test_lines_with_the_same_values_say_so_and_both_show():
    """Equal lines hid each other: the full cache under InfiniPot-V in the delay sweep and in `kvdemo results`' PNG,
    four policies on one occupancy line at M = 64. A repeated line is dashed, its legend names the line it repeats,
    and in the PNG the line drawn first still shows."""
    from kvdemo.cache.memory import OccupancyEvent
    from kvdemo.views import Chart, Series
    from kvdemo.viz.charts import CHART_COLOURS, same_values
    from kvdemo.viz.png import RIGHT, WIDTH, chart_png

    lines = {"infinipot-v": [1.0, 1.0, 0.5], "sliding-window": [1.0, 0.2, 0.1], "full": [1.0, 1.0, 0.5]}
    assert same_values(lines) == {"full": "infinipot-v"}
    figure = viz.chart_figure(Chart("sweep", "", [Series([0, 4, 8], lines, "delay (s)", "accuracy", markers=True)]))
    assert [trace.name for trace in figure.data] == [
        "infinipot-v",
        "sliding-window",
        "full (same values as infinipot-v)",
    ]
    events = {
        name: [
            OccupancyEvent(frame=2 * i, time_s=float(i), event="append", visual_tokens=t, cache_bytes=t, ms=1.0)
            for i, t in enumerate(tokens)
        ]
        for name, tokens in {"infinipot-v": [16, 32, 48], "cords": [16, 32, 48], "full cache": [16, 32, 64]}.items()
    }
    occupancy = viz.occupancy_figure(events, 64)
    tokens = [trace for trace in occupancy.data if trace.yaxis == "y" and trace.mode == "lines"]
    assert [trace.name for trace in tokens] == ["infinipot-v", "cords (same tokens as infinipot-v)", "full cache"]
    assert tokens[0].line.dash is None and tokens[1].line.dash not in (None, "solid") and tokens[2].line.dash is None
    image = np.asarray(chart_png(Chart("sweep", "", [Series([0, 4, 8], lines, "delay (s)", "accuracy", markers=True)])))
    first = tuple(int(CHART_COLOURS[1][i : i + 2], 16) for i in (1, 3, 5))  # the first line's colour
    plot = image[:, : WIDTH - RIGHT]  # left of the legend
    assert (plot == first).all(axis=-1).sum() > 50, "the line drawn first shows around and between the repeated one"


def test_runs_beyond_the_stream_slots_wait_in_line_and_say_where():
    """A run that finds every stream slot taken says in its status that it is queued and where, as its place
    changes, and starts once a slot is free; a run that leaves (ends, or is closed while it waits) frees its
    slot or its place. Driven step by step in one thread: no sleeps."""
    from kvdemo.app.slots import StreamSlots, queued_text

    slots = StreamSlots(1)

    def run(name):
        return slots.held(lambda: iter([{"status": f"{name} streams"}, {"status": f"{name} ends"}]))

    first, second, third = run("first"), run("second"), run("third")
    assert next(first) == {"status": "first streams"} and slots.running == 1
    assert next(second) == {"status": queued_text(1, 1)} and "queued: next in line" in queued_text(1, 1)
    assert next(third) == {"status": queued_text(2, 1)} and "queued: 2nd in line" in queued_text(2, 1)
    assert [next(first), next(first, None)] == [{"status": "first ends"}, None]  # it ended: its slot is free
    assert slots.running == 0
    assert next(second) == {"status": "second streams"} and slots.running == 1
    assert next(third) == {"status": queued_text(1, 1)}, "the third moved up"
    third.close()  # its client went away while it waited
    assert slots.waiting == 0
    fourth = run("fourth")
    assert next(fourth) == {"status": queued_text(1, 1)}
    second.close()  # stopped mid-run: the slot is freed
    assert next(fourth) == {"status": "fourth streams"} and slots.running == 1
    assert [queued_text(n, 2).split("**")[1] for n in (3, 11, 22)] == [
        "queued: 3rd in line",
        "queued: 11th in line",
        "queued: 22nd in line",
    ]
