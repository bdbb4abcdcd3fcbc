"""The app's handlers as plain functions (no browser): runs, errors, webcam buffering, chat, views."""

import json

import numpy as np
import pytest

from kvdemo import viz
from kvdemo.ui import ModelHub, RunSettings, ask, parse_params, run_video, validate_settings, webcam_frame


@pytest.fixture(scope="module")
def hub():
    return ModelHub("tiny")


def settings(**overrides):
    base = dict(model="tiny", policy="infinipot-v", params={}, budget=540, keep=405, fps=2.0,
                max_pixels=256 * 28 * 28, baseline=True, cap_mb=2048)
    base.update(overrides)
    return RunSettings(**base)


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
    chart = open(final["chart"]).read()
    assert "<html>" in chart and "plotly" in chart and "visual tokens" in chart
    assert session.policy.memory.visual_tokens <= 540


def test_errors_are_messages_and_keep_the_previous_stream(hub, media, tmp_path):
    _, session = run(hub, None, media / "flipping_a_pancake.mkv")
    junk = tmp_path / "junk.mp4"
    junk.write_text("not a video")
    updates, after = run(hub, session, junk)
    assert "not a readable video" in updates[-1]["status"]
    assert after is session and session.policy.frames_fed == 20
    updates, after = run(hub, session, media / "flipping_a_pancake.mkv", budget=300, keep=200)
    assert "leaves no room for one chunk" in updates[-1]["status"]
    assert after.policy.frames_fed == 20
    updates, after = run(hub, session, media / "flipping_a_pancake.mkv", budget=100, keep=200)
    assert "C must be smaller than M" in updates[-1]["status"]
    updates, after = run(hub, session, media / "corrupted.mp4", budget=1024, keep=768)
    assert "damaged frame(s)" in updates[-1]["status"]  # decoded what it could, said what was lost
    assert after.policy.frames_fed > 0


def test_the_bundled_sample_runs_without_a_file(hub):
    updates, session = run(hub, None, None, budget=1024, keep=768)
    assert "80/80 frames" in updates[-1]["status"] and "generated(seed=7)" in updates[-1]["status"]
    assert session.policy.memory.grid_shape == (4, 4), "the trained tiny model gets its 112 x 112 frames"


def test_answers_on_the_sample_are_graded_against_the_ground_truth(hub):
    from kvdemo.synthetic import sample_episode

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
    assert "no video yet" in update["status"]


def test_ask_streams_both_answers_and_keeps_memory(hub, media):
    _, session = run(hub, None, media / "flipping_a_pancake.mkv")
    before = session.policy.memory.nbytes
    updates = list(ask(session, "What is cooking?"))
    final = updates[-1]
    for chat in (final["policy_chat"], final["full_chat"]):
        assert chat[0] == {"role": "user", "content": "What is cooking?"}
        assert "first token" in chat[1]["content"] and "its answers mean little" in chat[1]["content"]
    assert session.policy.memory.nbytes == before
    list(ask(session, "And then?"))
    assert len(session.chat["policy"]) == 4 and len(session.policy.history) == 2


def test_baseline_over_its_memory_cap_stops_with_a_message(hub, media):
    updates, session = run(hub, None, media / "flipping_a_pancake.mkv", cap_mb=1)
    assert "MB cap" in updates[-1]["status"]
    assert session.policy.frames_fed == 20
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
        fed.append(session.policy.frames_fed)
    assert fed == [0, 2, 2, 4, 4, 6]  # one model call per pair of frames, never per frame
    assert "status" in update and len(session.thumbnails) == 3
    bad = webcam_frame(hub, session, frame, settings(budget=90, keep=50))  # a grid of 252 x 308 px is 99 tokens
    assert "smaller than one chunk" in bad["status"] and bad["session"] is session


def test_single_layer_head_view_colours_by_reason(hub, media):
    _, session = run(hub, None, media / "flipping_a_pancake.mkv")
    memory, info = session.policy.memory, session.policy.last_selection_info
    codes = viz.reason_map(memory, info, layer=1, head=0)
    assert codes.shape == (10, 9, 15)
    held = (codes != viz.EVICTED).sum()
    assert held == memory.frame[1].shape[1]
    assert set(np.unique(codes)) <= {viz.EVICTED, viz.REASON_NEW, 0, 1, 2}
    image = viz.survivor_strip(memory, session.thumbnails, info, layer=1, head=0, by_reason=True)
    assert image.ndim == 3 and image.shape[0] > 100


def test_budget_validation_as_you_type():
    assert validate_settings("infinipot-v", 1024, 768).startswith("✓")
    assert "C must be smaller than M" in validate_settings("infinipot-v", 100, 200)
    assert "positive" in validate_settings("cords", 0, -1)


def test_policy_form_values_are_parsed():
    assert parse_params("infinipot-v", {"alpha": "0.3", "cv_thresholds": "0.1, 0.2, 0.3"}) == {
        "alpha": 0.3, "cv_thresholds": [0.1, 0.2, 0.3]}
    assert parse_params("infinipot-v", {"cv_thresholds": ""}) == {"cv_thresholds": None}
    assert parse_params("cords", {"followers": False, "layers": "all"}) == {"followers": False, "layers": "all"}


def test_sessions_are_independent(hub, media):
    _, first = run(hub, None, media / "flipping_a_pancake.mkv")
    _, second = run(hub, None, None, budget=1024, keep=768)
    assert first.policy is not second.policy
    assert first.policy.memory.num_grids == 10 and second.policy.memory.num_grids == 40
    assert first.policy.model is second.policy.model  # one model per process


def test_small_frames_get_enlarged_thumbnails_with_crisp_patches():
    frame = np.arange(112 * 112 * 3, dtype=np.uint32).reshape(112, 112, 3).astype(np.uint8)
    thumb = viz.thumbnail(frame)
    assert thumb.shape == (224, 224, 3)
    np.testing.assert_array_equal(thumb[::2, ::2], frame)
    np.testing.assert_array_equal(thumb[1::2, 1::2], frame)
    assert viz.thumbnail(np.zeros((240, 426, 3), np.uint8)).shape == (180, 320, 3)  # large frames still shrink

