"""The ZeroGPU boundary, emulated: every call in a forked child with pickled arguments and results."""

import pickle

import numpy as np
import pytest
import torch

from kvdemo.devices import zerogpu


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(zerogpu.EMULATE_ENV, "1")
    zerogpu.TRANSFERS.clear()


def test_off_spaces_and_without_emulation_a_call_runs_in_place(monkeypatch):
    monkeypatch.delenv(zerogpu.EMULATE_ENV, raising=False)
    zerogpu.TRANSFERS.clear()
    state = {"frames": [1]}

    @zerogpu.gpu(duration=10)
    def work(state):
        state["frames"].append(2)
        return state

    assert work(state) is state and state == {"frames": [1, 2]} and not zerogpu.TRANSFERS
    assert not zerogpu.active()


def test_a_call_runs_elsewhere_so_what_it_changes_does_not_persist(emulate):
    state = {"frames": [1, 2]}

    @zerogpu.gpu(duration=10)
    def work(state, pid):
        import os

        state["frames"].append(3)
        return state, os.getpid() != pid

    import os

    result, elsewhere = work(state, os.getpid())
    assert elsewhere and result == {"frames": [1, 2, 3]}
    assert state == {"frames": [1, 2]}  # the caller's copy is untouched: state must come back explicitly
    transfer = zerogpu.TRANSFERS[-1]
    assert transfer.args_bytes == len(pickle.dumps(((state, os.getpid()), {})))
    assert transfer.items == 1 and transfer.result_bytes > 0


def test_generators_stream_pickled_items_and_errors_come_back(emulate):
    @zerogpu.gpu(duration=10)
    def segment(n):
        for i in range(n):
            yield {"chunk": i, "frame": np.full((2, 2), i, dtype=np.uint8)}
        raise ValueError("bad frame at the end")

    items = []
    with pytest.raises(ValueError, match="bad frame"):
        for item in segment(3):
            items.append(item)
    assert [i["chunk"] for i in items] == [0, 1, 2] and items[2]["frame"].sum() == 8
    assert zerogpu.TRANSFERS[-1].items == 3


def test_unpicklable_arguments_fail_in_the_caller_as_on_zerogpu(emulate):
    @zerogpu.gpu(duration=10)
    def work(lock):
        return 1

    import threading

    with pytest.raises(TypeError):
        work(threading.Lock())


@pytest.mark.slow
def test_an_engine_continues_a_stream_in_the_worker_exactly(emulate, tiny_random, pancake):
    """Half the clip in the main process, the rest in an emulated GPU call that gets the engine pickled
    (no model) and returns it: the memory equals an engine that never left, and torch runs in the fork."""
    from kvdemo.models.qwen2_vl import build_tiny_model
    from kvdemo.stream.engine import FrameStream, StreamEngine

    stream = FrameStream(tiny_random, 2.0)
    chunks = [stream.push(pancake.frames[i : i + 2]) for i in range(0, 20, 2)]
    here = StreamEngine(tiny_random, "infinipot-v", budget=540, keep=405, fps=2.0, max_new_tokens=4)
    travelled = StreamEngine(tiny_random, "infinipot-v", budget=540, keep=405, fps=2.0, max_new_tokens=4)
    for chunk in chunks[:5]:
        here.feed_chunk(chunk)
        travelled.feed_chunk(chunk)

    @zerogpu.gpu(duration=30)
    def rest(engine, chunks):
        engine.bind(build_tiny_model())  # the worker resolves the model itself (same seed, same weights)
        for chunk in chunks:
            engine.feed_chunk(chunk)
        answer = engine.answer("What is it?")
        return engine.to("cpu"), answer.answer

    travelled, answer = rest(travelled, chunks[5:])
    travelled.bind(tiny_random)
    for chunk in chunks[5:]:
        here.feed_chunk(chunk)
    assert answer == here.answer("What is it?").answer
    for a, b in zip(here.memory.keys + here.memory.values, travelled.memory.keys + travelled.memory.values):
        assert torch.equal(a, b)
    assert len(travelled.memory.timeline) == len(here.memory.timeline)


@pytest.mark.slow
def test_a_question_that_runs_a_pass_sends_its_engine_back(emulate, pancake):
    """HybridKV with ``classify_with=question`` compresses when asked: answered in an emulated GPU call, the
    engine comes back and equals one that answered in this process (memory, timeline, classes)."""
    from kvdemo.app.gpu import answer_question
    from kvdemo.app.sessions import model_by_name
    from kvdemo.policies import make_policy
    from kvdemo.stream.engine import StreamEngine
    from kvdemo.stream.streaming import stream_video

    model = model_by_name("tiny-random")
    engines = {
        name: StreamEngine(
            model,
            make_policy("hybridkv", classify_with="question"),
            budget=540,
            keep=405,
            fps=pancake.fps,
            max_new_tokens=3,
        )
        for name in ("here", "travelled")
    }
    list(stream_video(model, pancake, engines))
    here, travelled = engines["here"], engines["travelled"]
    answer = here.answer("What is in the pan?")
    *pieces, last = answer_question("tiny-random", {"policy": travelled}, "What is in the pan?", 3)
    returned = last["engines"]["policy"].attach(model)
    assert returned is not travelled  # it crossed the process boundary and came back
    returned.load_answer_state(last["answered"]["policy"])
    assert returned.answers[-1].answer == answer.answer
    assert returned.stats.compressions == here.stats.compressions
    assert torch.equal(returned.last_selection_info["static"], here.last_selection_info["static"])
    for a, b in zip(here.memory.keys + here.memory.values, returned.memory.keys + returned.memory.values):
        assert torch.equal(a, b)
    assert [e.event for e in returned.memory.timeline] == [e.event for e in here.memory.timeline]


@pytest.mark.slow
def test_a_file_under_zerogpu_loses_no_frame_and_its_calls_draw_the_views_of_their_newest_grids(emulate, monkeypatch):
    """The sample at 1 fps (40 frames) in calls of 16 frames: every frame enters, although a call queues more than a
    live source may keep waiting (10 s of stream, 10 frames); and the calls' live updates, drawn here, show the same
    views as in place once a call has fed more grids than the worker's thumbnails held when it started (without the
    new grids' thumbnails ProtoKV's assignment map of the newest grids has no frame to draw)."""
    from kvdemo.app import single_updates
    from kvdemo.app.gpu import SEGMENT_THUMBNAILS, ZEROGPU_SEGMENT_FRAMES
    from kvdemo.app.handlers import run_stream
    from kvdemo.app.sessions import AppServices
    from kvdemo.app.single_updates import SingleUpdates
    from test_app import frames_done
    from test_app_pages import single_settings

    monkeypatch.setattr(single_updates, "HEATMAP_EVERY_S", 0.0)  # every update draws the views (the fork inherits it)
    services = AppServices.create("tiny")
    settings = single_settings(policy="protokv", keep=None, fps=1.0, baseline=False)

    def run() -> tuple[dict[int, list[str]], dict]:
        drawn = {}
        for update in run_stream(services, None, None, settings, SingleUpdates()):
            assert "thumbnails" not in update  # the worker's thumbnails are the session's, not the page's
            if "panels" in update:
                drawn[frames_done(update["status"])] = [panel.title for panel in update["panels"]]
        return drawn, update

    emulated, last = run()
    assert "40/40 frames" in last["status"] and last["session"].live.dropped == 0
    assert len(last["session"].thumbnails) == last["session"].engine.memory.num_grids == 20
    monkeypatch.delenv(zerogpu.EMULATE_ENV)
    in_place, _ = run()
    late = [n for n in emulated if n > ZEROGPU_SEGMENT_FRAMES and n % ZEROGPU_SEGMENT_FRAMES > 2 * SEGMENT_THUMBNAILS]
    assert late and all(emulated[n] == in_place[n] for n in emulated)
    assert all("Prototype assignments" in emulated[n] for n in late)


@pytest.mark.slow
@pytest.mark.parametrize("fps", [0.5, 2.0])
def test_the_webcam_under_zerogpu_is_fed_at_any_sampling_rate(emulate, fps):
    """A webcam is fed one call per 16 frames; at 0.5 fps 10 s of stream is 5 frames, and a queue bounded there would
    drop every frame before 16 wait, so none would be fed. At least one call's frames may wait."""
    from kvdemo.app.gpu import ZEROGPU_SEGMENT_FRAMES
    from kvdemo.app.handlers import webcam_frame
    from kvdemo.app.sessions import AppServices
    from test_app_pages import single_settings

    hub = AppServices.create("tiny")
    settings = single_settings(budget=1024, keep=768, fps=fps, max_pixels=200_704, baseline=False)
    rng = np.random.default_rng(0)
    session = None
    for _ in range(ZEROGPU_SEGMENT_FRAMES + 4):
        session = webcam_frame(hub, session, rng.integers(0, 255, (240, 320, 3), dtype=np.uint8), settings)["session"]
    assert session.engine.frames_fed == ZEROGPU_SEGMENT_FRAMES and session.live.dropped == 0
    assert session.live.frames_waiting == 4 and len(session.thumbnails) == ZEROGPU_SEGMENT_FRAMES // 2
