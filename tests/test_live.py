"""Live sessions (kvdemo.stream.live): chunks keep entering while questions are answered on forks, the memory ends
bit-identical to the same stream with no questions, an answer sees the memory as it was when it was asked, a stopped
answer lets its fork go, and frames that wait too long are dropped and counted."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import threading
import weakref
from dataclasses import fields, is_dataclass

import numpy as np
import pytest
import torch

from kvdemo.cache.memory import KVMemory
from kvdemo.cache.offload import OffloadStore
from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice, place_module
from kvdemo.devices.turn import DeviceTurn
from kvdemo.policies import REGISTRY
from kvdemo.stream.engine import EngineError, StreamEngine
from kvdemo.stream.live import LiveSession
from kvdemo.stream.playback import play
from kvdemo.world.synthetic import sample_episode

FRAMES = sample_episode().video.frames[:16]  # 112 x 112: 16 visual tokens a temporal grid for the tiny models
#: Budgets that compress several times over FRAMES (a chunk of two frames is one grid of 16 tokens).
BUDGETS = {"full": {}, "protokv": {"budget": 128}}
#: Bookkeeping that may differ between two runs of the same stream: measured times, and which offloaded chunks
#: the last answer retrieved (HybridKV; per answer, for the views).
PER_RUN = {"ms", "retrieved", "last_fetched"}


def state_of(value, path: str = "") -> list[tuple[str, object]]:
    """Every tensor and plain value reachable from ``value`` (objects, dataclasses, dicts, lists), by path, with the
    bookkeeping of :data:`PER_RUN` left out: what "bit-identical" compares."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, (str, int, float, bool, type(None))):
        return [(path, value)]
    if isinstance(value, dict):
        return [item for k, v in value.items() if str(k) not in PER_RUN for item in state_of(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in state_of(v, f"{path}[{i}]")]
    if isinstance(value, OffloadStore):  # the pools' chunks past ``used`` are allocated, never written nor read
        pools = {"keys", "values", "valid", "provenance"}
        used = {name: state_of(getattr(value, name), f"{path}.{name}") for name in pools}
        trimmed = [
            (p, t[: value.used] if isinstance(t, torch.Tensor) else t) for part in used.values() for p, t in part
        ]
        rest = [f for f in fields(value) if f.name not in pools | PER_RUN]
        return trimmed + [item for f in rest for item in state_of(getattr(value, f.name), f"{path}.{f.name}")]
    if is_dataclass(value):
        return [
            item
            for f in fields(value)
            if f.name not in PER_RUN
            for item in state_of(getattr(value, f.name), f"{path}.{f.name}")
        ]
    if hasattr(value, "__dict__"):
        return state_of(vars(value), path)
    return [(path, repr(value))]


def assert_bit_identical(a, b) -> None:
    left, right = state_of(a), state_of(b)
    assert [p for p, _ in left] == [p for p, _ in right]
    for (path, x), (_, y) in zip(left, right):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), path
        else:
            assert x == y, path


def live_slots(engine: StreamEngine) -> list[torch.Tensor]:
    """What the memory's attention reads and its provenance, cloned (the slack is not the memory's)."""
    memory = engine.memory
    return [t.clone() for t in (*memory.keys, *memory.values, *memory.frame, *memory.row, *memory.col)]


def engines(model, policy: str, max_new_tokens: int = 6) -> dict[str, StreamEngine]:
    """The policy and, unless it is the full cache itself, the full cache beside it (as the app runs them)."""
    out = {
        policy: StreamEngine(
            model, policy, max_new_tokens=max_new_tokens, **BUDGETS.get(policy, {"budget": 64, "keep": 32})
        )
    }
    if policy != "full":
        out["full"] = StreamEngine(model, "full", max_new_tokens=max_new_tokens)
    return out


def stream(model, policy: str, questions: dict[int, str]) -> tuple[LiveSession, list]:
    """FRAMES fed two at a time into a live session with one token decoded per turn (so every answer spans
    several chunks), each of ``questions`` asked before the chunk of that number; returns the session and the
    answers."""
    live = LiveSession(model, engines(model, policy), tokens_per_turn=1)
    answers = []
    for number, start in enumerate(range(0, len(FRAMES), 2)):
        if number in questions:
            answers.append(live.ask(questions[number]))
        live.feed(FRAMES[start : start + 2])
    live.finish()
    return live, answers


#: The day-to-day tier keeps the cheapest compressing policy on the CPU; every other case is in the slow tier.
MATRIX = [
    pytest.param(policy, device, marks=() if (policy, device) == ("sliding-window", "cpu") else pytest.mark.slow)
    for policy in sorted(REGISTRY)
    for device in ("cpu", "emulated")
]


@pytest.mark.parametrize("policy, device", MATRIX)
def test_questions_mid_stream_leave_the_memory_bit_identical(tiny_random, policy, device):
    """Every policy (HybridKV's offload store and ProtoKV's bank included), on the CPU and on the emulated device: the
    stream with two questions answered while it goes on ends with every engine's memory and policy state equal, bit
    for bit, to the same stream with no questions; chunks entered while the answers decoded."""
    model = copy.deepcopy(tiny_random)
    mode = EmulatedDevice() if device == "emulated" else None
    with mode or contextlib.nullcontext(), torch.inference_mode():
        if mode is not None:
            place_module(model.hf)
            model.device = DEVICE
        quiet, _ = stream(model, policy, {})
        asked, answers = stream(model, policy, {2: "What colour was the circle?", 5: "And the square?"})
    assert all(answer.done and set(answer.answers) == set(asked.engines) for answer in answers)
    for answer in answers:  # each answer spanned chunks: the stream went on while it decoded
        entered = [r for r in asked.records if answer.asked_s < r.entered_s < answer.answered_s]
        assert entered, "no chunk entered while the answer decoded"
    for name in quiet.engines:
        assert_bit_identical(quiet.engines[name].memory, asked.engines[name].memory)
        assert_bit_identical(quiet.engines[name].policy, asked.engines[name].policy)
        assert quiet.engines[name].stats.compressions == asked.engines[name].stats.compressions
    if policy not in ("full",):
        assert asked.engines[policy].stats.compressions >= 2
    if mode is not None:
        assert mode.ops > 1000


@pytest.mark.parametrize(
    "policy",
    [
        "infinipot-v",
        *(pytest.param(name, marks=pytest.mark.slow) for name in ("hybridkv", "protokv", "rekv", "streamingvlm")),
    ],
)
def test_an_answer_sees_the_memory_as_it_was_when_asked_even_with_a_compression_due(tiny_random, policy):
    """The question comes when the next chunk must compress first: that chunk enters (and the pass runs) while the
    answer decodes, and the answer equals the one an engine fed up to the question gives without a live session
    (StreamingVLM's pass also moves the stream's positions down: the answer keeps the fork's)."""
    live = LiveSession(tiny_random, engines(tiny_random, policy), tokens_per_turn=1)
    reference = engines(tiny_random, policy)
    target = live.engines[policy]
    start = 0
    while True:  # up to the chunk before a compression
        live.feed(FRAMES[start : start + 2])
        for engine in reference.values():
            engine.feed(FRAMES[start : start + 2])
        start += 2
        held, budget = target.memory.visual_tokens, target.budget
        if target.stats.compressions and held + 16 > budget.M:
            break
    before = target.stats.compressions
    answer = live.ask("What colour was the circle?")
    live.feed(FRAMES[start : start + 2])  # due to compress: the pass runs before the answer's second token
    assert target.stats.compressions == before + 1 and not answer.done
    text = "".join(piece for name, piece in answer if name == policy)
    expected = reference[policy].answer("What colour was the circle?")
    assert text == expected.answer and answer.answers[policy].visual_tokens == expected.visual_tokens
    assert answer.answers[policy].cache_bytes == expected.cache_bytes


def test_stopping_during_an_answer_lets_its_fork_go(tiny_random):
    live = LiveSession(tiny_random, engines(tiny_random, "infinipot-v", max_new_tokens=32), tokens_per_turn=1)
    for start in range(0, 8, 2):
        live.feed(FRAMES[start : start + 2])
    before = {name: live_slots(engine) for name, engine in live.engines.items()}
    existing = [o for o in gc.get_objects() if type(o) is KVMemory]  # held alive: theirs and other tests' memories
    answer = live.ask("What colour was the circle?")
    live.step()
    made = [o for o in gc.get_objects() if type(o) is KVMemory and not any(o is e for e in existing)]
    forks = [weakref.ref(o) for o in made]
    del made
    assert len(forks) == 2 and not answer.done, "one fork per engine while the answer runs"
    answer.close()
    gc.collect()
    assert [fork() for fork in forks] == [None, None], "the forks are freed"
    assert answer.done and live.in_flight == []
    for name, engine in live.engines.items():  # what it said so far is a dialogue turn; the memory is untouched
        assert engine.history[-1][0] == "What colour was the circle?"
        assert all(torch.equal(a, b) for a, b in zip(before[name], live_slots(engine)))
    live.feed(FRAMES[8:10])  # the stream goes on
    assert live.group.frames_seen == 10


def test_a_question_not_yet_begun_stops_without_a_dialogue_turn(tiny_random):
    live = LiveSession(tiny_random, engines(tiny_random, "full"))
    live.feed(FRAMES[:2])
    live.ask("What colour was the circle?").close()
    assert live.engines["full"].history == [] and live.engines["full"].answers == []


class FakeClock:
    """Seconds that pass only when told (a slow device, a sleep)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def expected_slow_stream(times: list[float], chunk_s: float, bound: int) -> tuple[list[tuple[float, ...]], int]:
    """The drop rule worked out by hand for a device that takes ``chunk_s`` per chunk of two frames: every frame is
    queued when its time comes, the oldest dropped past ``bound`` waiting; returns the chunks fed (their frames'
    times) and the frames dropped."""
    now, upcoming, waiting, fed, dropped = 0.0, list(times), [], [], 0
    while upcoming or waiting:
        while upcoming and upcoming[0] <= now:
            waiting.append(upcoming.pop(0))
            if len(waiting) > bound:
                waiting.pop(0)
                dropped += 1
        if len(waiting) >= 2 or (waiting and not upcoming):
            fed.append(tuple(waiting[:2]))
            waiting = waiting[2:]
            now += chunk_s
        else:
            now = upcoming[0]
    return fed, dropped


def test_an_unbounded_put_keeps_every_frame_and_a_bounded_one_drops_past_the_bound(tiny_random):
    """A file's frames (``bounded=False``) all wait however many come at once; a live source's put past the bound
    (4 frames: 2 s at 2 fps) drops the oldest waiting, the file's included, and counts them."""
    live = LiveSession(tiny_random, engines(tiny_random, "full"), max_waiting_s=2.0, clock=FakeClock())
    assert live.put(FRAMES[:10], bounded=False) == 0 and live.frames_waiting == 10 and live.dropped == 0
    assert live.put(FRAMES[10:11]) == 7 and live.frames_waiting == 4 and live.dropped == 7
    assert [t for _, t, _ in live.waiting] == [3.5, 4.0, 4.5, 5.0]


def test_a_slow_device_fills_the_queue_and_the_dropped_frames_are_counted(tiny_random, monkeypatch):
    """Each chunk takes 3 s of the fake clock (the vision encoding waits) while the stream brings one chunk a second:
    past 2 s of waiting frames (4 at 2 fps) the oldest are dropped. Exactly the frames the rule drops are dropped,
    the others entered, each counted once, and every chunk's lag is what the hand-worked schedule says."""
    clock = FakeClock()
    model = copy.copy(tiny_random)
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda *a, **k: (clock.advance(3.0), encode(*a, **k))[1])
    live = LiveSession(model, engines(model, "infinipot-v"), max_waiting_s=2.0, clock=clock)
    times = [i / 2 for i in range(len(FRAMES))]
    events = list(play(live, iter([(0, FRAMES, np.array(times))]), sleep=clock.advance))
    fed, dropped = expected_slow_stream(times, 3.0, 4)
    assert live.max_waiting == 4 and dropped > 0
    assert live.dropped == dropped == sum(d.frames for d in live.drops)
    assert live.group.frames_seen + live.dropped == live.received == len(FRAMES)
    assert [r.time_s for r in live.records] == [chunk[-1] for chunk in fed]
    assert [e.lag.time_s for e in events if e.kind == "chunk"] == [chunk[-1] for chunk in fed]
    report = live.report()
    assert report["dropped_frames"] == dropped and sum(d["frames"] for d in report["drops"]) == dropped
    assert min(r.lag_s for r in live.records) >= 3.0  # every chunk waited for at least its own encoding
    assert report["lag_s"]["max"] == max(r.lag_s for r in live.records) > 3.0


def test_a_question_at_a_stream_second_is_asked_there_and_the_stream_goes_on(tiny_random, monkeypatch):
    """Every model call takes 0.2 s of the fake clock, so the answer's 12 decode steps (6 tokens of two engines) take
    longer than the frames' half-second spacing: chunks enter between its tokens, and none is dropped."""
    clock = FakeClock()
    model = copy.copy(tiny_random)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: (clock.advance(0.2), forward(*a, **k))[1])
    live = LiveSession(model, engines(model, "infinipot-v"), clock=clock, tokens_per_turn=1)
    times = np.arange(len(FRAMES)) / 2
    events = list(play(live, iter([(0, FRAMES, times)]), [(3.0, "What colour was the circle?")], sleep=clock.advance))
    asked = next(e for e in events if e.kind == "asked")
    answered = next(i for i, e in enumerate(events) if e.kind == "answered")
    # Asked once the frame at 3.0 s came: the grids of 0-2.5 s are in memory, that frame waits for its pair.
    assert asked.stream_s == 3.0 and asked.answer.answers["full"].visual_tokens == 16 * 3
    chunks_while_answering = [e for e in events[events.index(asked) : answered] if e.kind == "chunk"]
    assert chunks_while_answering, "the stream went on while the answer decoded"
    assert live.dropped == 0 and live.group.frames_seen == len(FRAMES)


def test_a_question_due_while_an_answer_decodes_waits_for_it_and_the_stream_goes_on(tiny_random, monkeypatch):
    """Every model call takes 0.2 s of the fake clock, so the first answer (12 decode steps) still decodes when the
    second question's second comes: the player asks it once the first is done, and meanwhile every chunk enters
    within one turn of its capture (none waits behind the answers, none is dropped)."""
    clock = FakeClock()
    model = copy.copy(tiny_random)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: (clock.advance(0.2), forward(*a, **k))[1])
    live = LiveSession(model, engines(model, "infinipot-v"), clock=clock, tokens_per_turn=1)
    times = np.arange(len(FRAMES)) / 2
    questions = [(2.0, "What colour was the circle?"), (2.5, "And the square?")]
    events = list(play(live, iter([(0, FRAMES, times)]), questions, sleep=clock.advance))
    first, second = [e.answer for e in events if e.kind == "asked"]
    assert first.stream_s == 2.0 and second.stream_s > 2.5 and second.asked_s >= first.answered_s
    assert live.dropped == 0 and live.group.frames_seen == len(FRAMES)
    # A turn is at most one chunk (two engines' prefill and the encoding) and one token of each answer: 1.2 s here.
    assert max(r.lag_s for r in live.records) <= 1.2 + 1e-9


def test_put_never_waits_for_the_device(tiny_random):
    """Frames put while another thread holds the device's turn are queued at once (and counted if dropped); the
    holder's turns feed them."""
    clock = FakeClock()
    live = LiveSession(tiny_random, engines(tiny_random, "full"), clock=clock, max_waiting_s=2.0)
    held, release = threading.Event(), threading.Event()

    def hold():
        with live.turn:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    for start in range(0, 12, 2):
        assert live.feed(FRAMES[start : start + 2]) == []  # returns at once: the device is taken
    clock.advance(5.0)
    assert live.frames_waiting == 4 and live.dropped == 8
    assert live.lag() == pytest.approx(5.0)  # the oldest whole chunk waiting was captured 5 s ago
    release.set()
    holder.join(30)
    assert len(live.pump()) == 2 and live.frames_waiting == 0
    assert live.lag() == pytest.approx(5.0) and live.records[-1].dropped == 8


def test_the_device_turn_serves_waiters_in_order_and_try_take_never_waits():
    """Waiters are served in the order they came; a try never waits and fails while the turn is held, even on the
    thread that took it (the turn is not reentrant: its holder may be a generator resumed on another thread)."""
    turn, order = DeviceTurn(), []
    turn.take()
    waiters = []
    for name in ("first", "second"):
        thread = threading.Thread(target=lambda n=name: (turn.take(), order.append(n), turn.give_back()))
        thread.start()
        while len(turn._line) < len(waiters) + 1:  # this waiter is in line before the next one comes
            threading.Event().wait(0.001)
        waiters.append(thread)
    assert turn.take(blocking=False) is False, "held, and people wait"
    turn.give_back()
    for thread in waiters:
        thread.join(30)
    assert order == ["first", "second"]
    assert turn.take(blocking=False) is True and turn.take(blocking=False) is False
    turn.give_back()


def test_bad_settings_and_bad_frames_are_one_line_errors(tiny_random):
    with pytest.raises(EngineError, match="whole temporal grids"):
        LiveSession(tiny_random, engines(tiny_random, "full"), frames_per_chunk=3)
    with pytest.raises(EngineError, match="at least one token"):
        LiveSession(tiny_random, engines(tiny_random, "full"), tokens_per_turn=0)
    with pytest.raises(EngineError, match="positive number of seconds"):
        LiveSession(tiny_random, engines(tiny_random, "full"), max_waiting_s=0)
    assert LiveSession(tiny_random, engines(tiny_random, "full"), max_waiting_s=math.inf).max_waiting == math.inf
    live = LiveSession(tiny_random, engines(tiny_random, "full"))
    with pytest.raises(EngineError, match=r"\[T, H, W, 3\]"):
        live.put(np.zeros((2, 112, 112), np.uint8))
    with pytest.raises(EngineError, match="feed at least one frame"):
        live.ask("What?")
    assert live.received == 0 and math.isclose(live.lag(), 0.0)
