"""The comparison page's handlers (kvdemo.app.comparing) called as the app calls them, checked against the library
path (kvdemo.experiments.compare's engines streamed by kvdemo.stream.streaming, asked directly): the same answers, the same fidelity,
and one-line messages for what a user can get wrong."""

import json

import numpy as np
import pytest

from kvdemo.analysis.explain import fidelity
from kvdemo.app import handlers
from kvdemo.app.comparing import CompareUpdates, compare_fidelity, parse_delays, redraw_attribution
from kvdemo.app.page import same_value, unsent
from kvdemo.app.sessions import AppServices, CompareSettings
from kvdemo.errors import StreamSettingError
from kvdemo.experiments.compare import FULL, compare_engines, parse_overrides
from kvdemo.stream.streaming import stream_video
from kvdemo.world.synthetic import sample_episode

POLICIES = ["infinipot-v", "hybridkv"]


def settings(**overrides) -> CompareSettings:
    base = dict(
        model="tiny",
        policies=list(POLICIES),
        overrides="",
        budget=64,
        keep=48,
        fps=2.0,
        max_pixels=112 * 112,
        cap_mb=2048,
        sample="static",
    )
    base.update(overrides)
    return CompareSettings(**base)


def run_comparison(services, previous, path, compare_settings):
    """A run of the comparison page (the one stream path with the comparison's views)."""
    return handlers.run_stream(services, previous, path, compare_settings, CompareUpdates())


def ask_comparison(state, question, attribute=True, max_new_tokens=64):
    """A question on the comparison page (the one ask path with the comparison's views)."""
    return handlers.ask(state, question, CompareUpdates(), attribute, max_new_tokens)


@pytest.fixture(scope="module")
def services():
    return AppServices.create("tiny")


@pytest.fixture(scope="module")
def compared(services):
    """The bundled static sample compared through the handler: its updates and final state."""
    updates = list(run_comparison(services, None, None, settings()))
    return updates, updates[-1]["session"]


@pytest.fixture(scope="module")
def library(services):
    """The same comparison by the library path: engines from kvdemo.experiments.compare streamed by stream_video."""
    model = services.models.get("tiny")
    episode = sample_episode("static")
    video = episode.video.sampled(2.0).resized(model.geometry)
    engines = compare_engines(model, parse_overrides(POLICIES), 64, 48, video.fps, 2048 * 2**20)
    for _ in stream_video(model, video, engines):
        pass
    return engines, episode


@pytest.mark.slow
def test_a_comparison_streams_the_sample_into_every_engine_as_the_library_does(compared, library):
    updates, state = compared
    engines, _ = library
    assert list(state.engines) == [*POLICIES, FULL]
    assert "80/80 frames" in updates[-1]["status"]
    for name, engine in engines.items():
        mine = state.engines[name]
        assert mine.frames_fed == engine.frames_fed == 80
        assert mine.memory.visual_tokens == engine.memory.visual_tokens
        assert mine.stats.compressions == engine.stats.compressions
        if name != FULL:
            assert mine.memory.visual_tokens <= 64
    report = json.loads(open(updates[-1]["report"]).read())
    assert set(report["policies"]) == set(POLICIES) and report["full"]["frames"] == 80


def test_a_picture_the_run_sent_is_not_sent_again(compared):
    """The run's last chunk and its final update carry the same survivor strips: the pages send them once (Gradio
    rewrites an identical picture's cache file in place, under a browser still reading it), while every update still
    carries its status and a changed picture goes out."""
    updates, _ = compared
    assert same_value(updates[-2]["strips"], updates[-1]["strips"]), "this run would show nothing"
    shown: dict = {}
    sent = [unsent(update, shown) for update in updates]
    assert "strips" in sent[-2] and "strips" not in sent[-1]
    assert all("status" in update for update in sent) and sent[-1]["report"] == updates[-1]["report"]
    strips = [update["strips"] for update in sent if "strips" in update]
    assert len(strips) >= 2 and not any(same_value(a, b) for a, b in zip(strips, strips[1:]))


def test_what_counts_as_the_same_picture():
    """Equal arrays, galleries and drawn panels are the same; a changed pixel, caption or title is not; a figure
    (served as data, not a file) never is, and a cleared picture (None) forgets what was shown."""
    from kvdemo.viz.views import Panel

    image = np.zeros((4, 5, 3), dtype=np.uint8)
    other = image.copy()
    other[1, 2, 0] = 1
    assert same_value(image, image.copy()) and not same_value(image, other)
    assert not same_value(image, image.astype(np.int16)) and not same_value(image, image[:3])
    gallery = [(image, "t = 0.5 s"), (other, "t = 1.0 s")]
    assert same_value(gallery, [(image.copy(), "t = 0.5 s"), (other.copy(), "t = 1.0 s")])
    assert not same_value(gallery, [(image, "t = 0.5 s"), (other, "t = 1.5 s")]) and not same_value(
        gallery, gallery[:1]
    )
    panel = Panel("survivors", "image", image, "kept")
    assert same_value([panel], [Panel("survivors", "image", image.copy(), "kept")])
    assert not same_value([panel], [Panel("survivors, layer 2", "image", image, "kept")])
    assert not same_value(object(), object())
    shown: dict = {}
    assert unsent({"heatmap": image, "status": "a"}, shown) == {"heatmap": image, "status": "a"}
    assert unsent({"heatmap": image.copy(), "status": "a"}, shown) == {"status": "a"}
    assert unsent({"heatmap": None}, shown) == {"heatmap": None}
    assert "heatmap" in unsent({"heatmap": image}, shown), "after a clear the picture goes out again"


def test_questions_get_the_library_answers_graded_with_attribution(compared, library):
    _, state = compared
    engines, episode = library
    question = next(q for q in episode.questions if q.kind == "colour")
    updates = list(ask_comparison(state, question.text, attribute=True, max_new_tokens=12))
    final = updates[-1]
    assert final["ask_status"] == f"✓ answered by {len(engines)} engines"
    for slot, name in enumerate(state.engines):
        expected = engines[name].answer(question.text, 12).answer
        engines[name].reset_dialogue()
        assert state.engines[name].answers[-1].answer == expected
        assert final[f"chat:{slot}"][-2:][0] == {"role": "user", "content": question.text}
        assert final[f"chat:{slot}"][-1]["content"].startswith(expected)
    assert state.engines[FULL].answers[-1].answer.strip() == question.answer  # the full cache answers the sample right
    assert set(state.attributions) == set(engines)
    assert "What each answer looked at" in final["attribution_text"] and "Evidence ratio" in final["attribution_text"]
    record = json.loads(open(final["report"]).read())["questions"][-1]
    assert record["question"] == question.text and record["expected"] == question.answer
    assert record["answers"][FULL]["correct"] is True
    redrawn = redraw_attribution(state, "2", "0")
    assert "(layer 2, KV head 0)" in redrawn["attribution_text"]


def test_fidelity_through_the_handler_is_the_librarys(compared, library):
    _, state = compared
    engines, _ = library
    question = "What colour was the circle?"
    update = compare_fidelity(state, question)
    expected = fidelity(engines[FULL], {n: e for n, e in engines.items() if n != FULL}, question)
    got = state.fidelity[question]
    assert set(got) == set(POLICIES)
    for name in POLICIES:
        assert got[name]["first_token_kl"] == pytest.approx(expected[name]["first_token_kl"], abs=1e-6)
        np.testing.assert_allclose(got[name]["layer_error"], expected[name]["layer_error"], atol=1e-6)
        assert f"| {name} | {got[name]['first_token_kl']:.4f} |" in update["fidelity_text"]


@pytest.mark.slow
def test_a_new_conversation_clears_every_chat_and_dialogue(services):
    state = list(run_comparison(services, None, None, settings(policies=["sliding-window"])))[-1]["session"]
    list(ask_comparison(state, "Which shape appeared first?", attribute=False, max_new_tokens=4))
    assert all(len(chat) == 2 for chat in state.chat.values())
    update = handlers.new_conversation(state, CompareUpdates())
    assert update["chat:0"] == [] and update["chat:1"] == []
    assert all(engine.history == [] for engine in state.engines.values())


def test_the_status_says_the_full_cache_stopped_only_when_it_did(services, compared):
    """The bundled sample's full cache holds 80 frames x 16 tokens (a fraction of a MB on the tiny model): under the
    default 2048 MB cap it runs to the end, and the status names the cap as a limit; under a 0.05 MB cap it stops."""
    updates, state = compared
    status = updates[-1]["status"]
    assert FULL not in state.stopped and "stopped" not in status
    assert "it stops if it reaches its 2048 MB cap" in status
    small = list(run_comparison(services, None, None, settings(cap_mb=0.05)))[-1]
    full_line = [line for line in small["status"].split("\n\n") if line.startswith("**full cache**")]
    assert FULL in small["session"].stopped and full_line and "— stopped at" in full_line[0]


def test_user_mistakes_are_one_line_messages_and_keep_the_previous_comparison(services, compared):
    _, state = compared
    failed = list(run_comparison(services, state, None, settings(budget=10, keep=5)))
    assert len(failed) == 1 and failed[0]["session"] is state and failed[0]["status"].startswith("⚠️ **")
    message, _, note = failed[0]["status"].partition("\n")  # the message is one line; a note under it says what stays
    assert message.endswith("**") and "Still showing the previous comparison" in note
    failed = list(run_comparison(services, state, None, settings(fps=0)))
    assert failed[0]["status"].split("\n")[0] == "⚠️ **sampling fps must be positive, got 0**"
    assert list(ask_comparison(None, "What?"))[-1]["ask_status"] == "⚠️ no video yet: run a comparison first, then ask"
    assert list(ask_comparison(state, "   "))[-1]["ask_status"] == "⚠️ type a question first"
    assert compare_fidelity(None, "What?")["fidelity_text"] == "⚠️ no video yet: run a comparison first"
    assert redraw_attribution(None, "all", "all")["attribution_text"].startswith("*Ask a question")


def test_delays_are_parsed_or_refused_in_one_line():
    assert parse_delays("0, 4,8") == (0.0, 4.0, 8.0)
    for text, message in (
        ("a,b", "delays are seconds separated by commas, got 'a,b'"),
        ("-1", "delays must be non-negative seconds, got '-1'"),
        ("", "delays must be non-negative seconds, got ''"),
    ):
        with pytest.raises(StreamSettingError) as error:
            parse_delays(text)
        assert str(error.value) == message
