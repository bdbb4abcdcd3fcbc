"""The two pages through their shared parts: one session type, one stream path, one ask path, one stop, one new
conversation and one error guard (kvdemo.app.handlers, kvdemo.app.page). The single page is a comparison with one
contender: both pages' sessions of the same policy hold what the library's engines hold, and answer what they answer."""

import json

import pytest

from kvdemo.app import compare_page, page
from kvdemo.app.comparing import CompareUpdates
from kvdemo.app.handlers import ask, new_conversation, request_stop, run_stream
from kvdemo.app.layout import Demo
from kvdemo.app.sessions import AppServices, CompareSettings, RunSettings
from kvdemo.app.single_updates import SingleUpdates
from kvdemo.policies import BudgetError
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import stream_video
from kvdemo.world.synthetic import sample_episode

QUESTION = "What colour was the circle?"
#: The bundled sample at 0.5 fps: 20 frames, 10 chunks of the tiny model's 112 x 112 frames.
FPS, PIXELS = 0.5, 15680


@pytest.fixture(scope="module")
def services():
    return AppServices.create("tiny")


def single_settings(**overrides) -> RunSettings:
    base = dict(
        model="tiny",
        policy="infinipot-v",
        params={},
        budget=64,
        keep=48,
        fps=FPS,
        max_pixels=PIXELS,
        baseline=True,
        cap_mb=2048,
    )
    return RunSettings(**{**base, **overrides})


def compare_settings(**overrides) -> CompareSettings:
    base = dict(
        model="tiny",
        policies=["infinipot-v"],
        overrides="",
        budget=64,
        keep=48,
        fps=FPS,
        max_pixels=PIXELS,
        cap_mb=2048,
    )
    return CompareSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def both(services):
    """The same policy streamed through the one stream path by each page: the single page's and the comparison's
    final updates."""
    single = list(run_stream(services, None, None, single_settings(), SingleUpdates()))[-1]
    compared = list(run_stream(services, None, None, compare_settings(), CompareUpdates()))[-1]
    return single, compared


@pytest.fixture(scope="module")
def library(services):
    """The library's own path: an engine of the policy and a full cache streamed by stream_video."""
    model = services.models.get("tiny")
    video = sample_episode("static").video.sampled(FPS).resized(model.geometry)
    engines = {
        "infinipot-v": StreamEngine(model, "infinipot-v", budget=64, keep=48, fps=video.fps),
        "full": StreamEngine(model, "full", fps=video.fps, max_cache_bytes=2048 * 2**20),
    }
    list(stream_video(model, video, engines))
    return engines


@pytest.mark.slow
def test_both_pages_hold_what_the_library_holds(both, library):
    single, compared = both[0]["session"], both[1]["session"]
    assert "20/20 frames" in both[0]["status"] and "**20/20 frames**" in both[1]["status"]
    for state in (single, compared):
        assert list(state.engines) == ["infinipot-v", "full"]
        assert state.engine is state.engines["infinipot-v"] and state.full is state.engines["full"]
        for name, engine in library.items():
            mine = state.engines[name]
            assert mine.frames_fed == engine.frames_fed == 20
            assert mine.memory.visual_tokens == engine.memory.visual_tokens
            assert [e.visual_tokens for e in mine.memory.timeline] == [e.visual_tokens for e in engine.memory.timeline]
            assert mine.stats.compressions == engine.stats.compressions
    single_report = json.loads(open(both[0]["report"]).read())  # each page keeps its own report format
    compared_report = json.loads(open(both[1]["report"]).read())
    assert single_report["policy"] == "infinipot-v" and single_report["baseline"]["frames"] == 20
    assert set(compared_report["policies"]) == {"infinipot-v"} and compared_report["full"]["frames"] == 20


def test_one_question_gets_the_library_answers_on_both_pages(both, library):
    expected = {}
    for name, engine in library.items():
        expected[name] = engine.answer(QUESTION).answer
        engine.reset_dialogue()
    single = list(ask(both[0]["session"], QUESTION, SingleUpdates()))[-1]
    compared = list(ask(both[1]["session"], QUESTION, CompareUpdates()))[-1]
    assert single["ask_status"] == "✓ answered by infinipot-v and the full cache"
    assert compared["ask_status"] == "✓ answered by 2 engines"
    panes = {
        "infinipot-v": (single["policy_chat"], compared["chat:0"]),
        "full": (single["full_chat"], compared["chat:1"]),
    }
    for name, (single_chat, compared_chat) in panes.items():
        for chat in (single_chat, compared_chat):
            assert chat[0] == {"role": "user", "content": QUESTION}
            assert "ground truth" in chat[1]["content"], "answers on the sample are graded on both pages"
        # One answer line; the comparison's narrow panes leave out the time to first token and the cache.
        assert single_chat[1]["content"].startswith(expected[name] + "\n\n<small>first token ")
        assert compared_chat[1]["content"].startswith(expected[name] + "\n\n<small>")
        assert "first token" not in compared_chat[1]["content"] and " tokens in " in compared_chat[1]["content"]


def test_a_new_conversation_clears_the_dialogue_and_keeps_the_memory_on_both_pages(services):
    for settings, views in ((single_settings(baseline=False), SingleUpdates()), (compare_settings(), CompareUpdates())):
        state = list(run_stream(services, None, None, settings, views))[-1]["session"]
        held = {name: engine.memory.nbytes for name, engine in state.engines.items()}
        list(ask(state, QUESTION, views))
        assert all(len(chat) == 2 for chat in state.chat.values())
        update = new_conversation(state, views)
        assert update["ask_status"] == "" and update["session"] is state
        assert all(chat == [] for key, chat in update.items() if "chat" in key)
        assert all(engine.history == [] for engine in state.engines.values())
        assert {name: engine.memory.nbytes for name, engine in state.engines.items()} == held
    assert list(state.engines) == ["infinipot-v", "full"]
    assert new_conversation(None, views) == {"session": None, "ask_status": ""}


@pytest.mark.parametrize("views", [SingleUpdates(), CompareUpdates()], ids=["single", "compare"])
def test_stop_ends_either_pages_run_after_the_current_chunk(services, views):
    """Driven step by step in one thread (no sleeps): Stop after the first chunk is fed; the run ends after the next
    chunk it is feeding, and its report says what ran."""
    settings = single_settings() if isinstance(views, SingleUpdates) else compare_settings()
    run = run_stream(services, None, None, settings, views)
    update = next(run)
    # The comparison clears the last question's panes as it starts; the single page once its first chunk is fed.
    assert ("ask_status" in update) == isinstance(views, CompareUpdates)
    while "plot" not in update:  # the first chunk has been fed
        update = next(run)
    state = update["session"]
    request_stop(state)
    final = list(run)[-1]
    done = state.group.frames_seen
    assert 2 <= done < 20 and not state.running and not state.stop_requested
    assert state.stopped["run"] == f"stopped by the user at {done} of 20 frames"
    assert json.loads(open(final["report"]).read())["stopped"]["run"] == state.stopped["run"]
    request_stop(state)  # after the run: nothing to stop
    assert not state.stop_requested


def test_several_contenders_name_the_one_a_message_is_about_and_one_does_not(services):
    one = list(run_stream(services, None, None, single_settings(budget=10, keep=5), SingleUpdates()))
    assert one[-1]["status"].startswith("⚠️ **M=10 is smaller than one chunk")
    settings = compare_settings(policies=["sliding-window", "infinipot-v"], overrides="infinipot-v: M=10 C=5")
    several = list(run_stream(services, None, None, settings, CompareUpdates()))
    assert several[-1]["status"].startswith("⚠️ **infinipot-v: M=10 is smaller than one chunk")


def test_the_one_guard_says_a_users_mistake_and_a_bug_in_one_line_on_both_pages(services, monkeypatch, caplog):
    demo = Demo(services)
    demo.build()
    compare = demo.compare

    def refused(*args, **kwargs):
        raise BudgetError("delays must be non-negative seconds, got '-1'")

    def broken(*args, **kwargs):
        raise AttributeError("first line\nsecond line")

    monkeypatch.setattr(compare_page, "compare_fidelity", refused)
    refusal = "⚠️ delays must be non-negative seconds, got '-1'"
    assert compare.on_fidelity(None, "What?") == {compare.fidelity_text: refusal}
    monkeypatch.setattr(compare_page, "compare_fidelity", broken)
    monkeypatch.setattr(page, "ask", broken)
    with caplog.at_level("ERROR", logger="kvdemo"):
        said = compare.on_fidelity(None, "What?")[compare.fidelity_text]
        asked = list(demo.on_ask(None, "hi"))[-1][demo.ask_status]
    for message in (said, asked):
        assert message == ("⚠️ **internal error** (AttributeError: first line); it is logged, and the app keeps serving")
    assert caplog.text.count("Traceback") == 2
    values = dict(
        model="tiny",
        policy="infinipot-v",
        budget=64,
        keep=48,
        fps=FPS,
        max_pixels=PIXELS,
        baseline=False,
        baseline_cap_mb=0,
        view_layer="all",
        view_head="all",
        colour_by_reason=False,
        log_scale=False,
        **{key: component.value for key, (_, _, component) in demo.param_inputs.items()},
    )
    values["infinipot_v_alpha"] = "abc"  # the form's text for a number: a user's mistake, said as the run's status
    status = list(demo.on_run_sample(None, **values))[-1][demo.status]
    assert status.startswith("⚠️ **") and "alpha" in status and "internal error" not in status
