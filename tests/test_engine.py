"""The streaming engine end to end on the tiny model (the true transformers classes) and real frames."""

import json

import numpy as np
import pytest
import torch

from kvdemo.policies import BudgetError, make_policy, policy_names
from kvdemo.stream.engine import EngineError, FrameStream, MemoryCapError, StreamEngine
from kvdemo.stream.streaming import stream_video


def feed_all(model, video, engines, frames_per_chunk=2):
    return list(stream_video(model, video, engines, frames_per_chunk))


@pytest.mark.parametrize("policy", [p for p in policy_names() if p != "full"])
@pytest.mark.parametrize("budget, keep", [(270, 135), (540, 405), (700, 300)])
def test_visual_tokens_never_exceed_budget(tiny_random, pancake, policy, budget, keep):
    sized_by_m = not type(make_policy(policy)).takes_keep()  # ProtoKV: M alone, near window W = M - K_max S
    if sized_by_m and budget < 500:
        budget = 560  # its near window must take a 135-token grid
    engine = StreamEngine(tiny_random, policy, budget=budget, keep=None if sized_by_m else keep, fps=pancake.fps)
    if policy == "rekv" and keep < 2 * 135 - 1:  # its window, C less a reserve of C // 2, must hold a grid of 135
        with pytest.raises(BudgetError, match="raise C to at least 269$"):
            feed_all(tiny_random, pancake, {"p": engine})
        return
    feed_all(tiny_random, pancake, {"p": engine})
    timeline = engine.memory.timeline
    assert max(e.visual_tokens for e in timeline) <= budget
    expected = engine.memory.summary_slots + engine.budget.keep_for(135) if sized_by_m else keep
    if policy == "rekv":  # whole grids of 135: the reserve min(topk, C/2) and the window what is left of C
        reserve = min(64, keep // 2 // 135) * 135
        expected = reserve + (keep - reserve) // 135 * 135
    assert all(e.visual_tokens == expected for e in timeline if e.event == "compress")
    assert any(e.event == "compress" for e in timeline)
    for layer in range(tiny_random.num_layers):
        assert engine.memory.keys[layer].shape[2] == engine.memory.visual_start + engine.memory.frame[layer].shape[1]


def test_full_cache_grows_by_tokens_per_grid(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "full", fps=pancake.fps)
    feed_all(tiny_random, pancake, {"full": engine})
    tokens = [e.visual_tokens for e in engine.memory.timeline]
    assert tokens == [135 * (i + 1) for i in range(10)]
    per_token = tiny_random.num_layers * 2 * tiny_random.num_kv_heads * tiny_random.head_dim * 4  # K and V, fp32
    sizes = [e.cache_bytes for e in engine.memory.timeline]
    assert all(b - a == 135 * per_token for a, b in zip(sizes, sizes[1:]))
    assert engine.memory.nbytes == sum(t.numel() * t.element_size() for t in engine.memory.keys + engine.memory.values)


def test_one_encoding_feeds_several_engines_identically(tiny_random, small_video):
    """Two full-cache engines fed the same chunks hold the same cache as one fed alone."""
    a, b = StreamEngine(tiny_random, "full", fps=2.0), StreamEngine(tiny_random, "full", fps=2.0)
    feed_all(tiny_random, small_video, {"a": a, "b": b})
    alone = StreamEngine(tiny_random, "full", fps=2.0)
    alone.feed(small_video.frames, small_video.times_s)
    for x, y, z in zip(a.memory.keys, b.memory.keys, alone.memory.keys):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, atol=1e-5, rtol=1e-5)


def test_provenance_gathers_agree_with_kept_keys(tiny_random, pancake):
    """Layer-0 keys depend only on a token's embedding and position, so every kept layer-0 key must equal
    the full cache's key of the token its provenance names."""
    full = StreamEngine(tiny_random, "full", fps=pancake.fps)
    bounded = StreamEngine(tiny_random, "uniform", budget=540, keep=300, fps=pancake.fps)
    feed_all(tiny_random, pancake, {"full": full, "uniform": bounded})
    rows, cols = full.memory.grid_shape
    p = full.memory.prefix_len
    full_keys = full.memory.keys[0][0, :, p:]  # [H, L_full, D], whole frames in stream order
    kept_keys = bounded.memory.keys[0][0, :, p:]
    flat = (bounded.memory.frame[0].long() * rows + bounded.memory.row[0].long()) * cols + bounded.memory.col[0].long()
    expected = torch.gather(full_keys, 1, flat[..., None].expand(-1, -1, full_keys.shape[-1]))
    torch.testing.assert_close(kept_keys, expected, atol=1e-5, rtol=1e-5)


def test_ask_leaves_memory_bit_identical_and_keeps_the_dialogue(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "sliding-window", budget=540, keep=405, fps=pancake.fps, max_new_tokens=12)
    feed_all(tiny_random, pancake, {"p": engine})
    memory = engine.memory
    before = [t.clone() for t in memory.keys + memory.values + memory.frame + memory.row + memory.col]
    timeline_before = len(memory.timeline)
    pieces = list(engine.ask("What is in the pan?"))
    second = engine.answer("And after that?")
    after = memory.keys + memory.values + memory.frame + memory.row + memory.col
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert len(memory.timeline) == timeline_before
    assert "".join(pieces) == engine.answers[0].answer
    assert engine.history == [("What is in the pan?", engine.answers[0].answer), ("And after that?", second.answer)]
    assert 0 < engine.answers[0].ttft_ms <= engine.answers[0].ms


def test_multi_turn_replays_the_dialogue_as_text(tiny_random):
    text = tiny_random.question_text([("Q1", "A1")], "Q2")
    assert text.startswith("<|vision_end|>Q1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2")
    assert text.endswith("<|im_start|>assistant\n")


def test_question_positions_start_after_every_visual_position(tiny_random, pancake, monkeypatch):
    engine = StreamEngine(tiny_random, "full", fps=pancake.fps, max_new_tokens=1)
    feed_all(tiny_random, pancake, {"p": engine})
    # 10 grids at 2 fps on Qwen2.5: last temporal position = s + 9 * 2; rows/cols reach s + 14
    s = engine.memory.prefix_len
    assert engine.memory.cursor.next - 1 == s + 18
    seen = []
    original = tiny_random.forward
    monkeypatch.setattr(tiny_random, "forward", lambda e, pos, c: seen.append(pos) or original(e, pos, c))
    engine.answer("Where?")
    assert seen[0][:, 0].tolist() == [s + 19] * 3


def test_asking_before_any_frame_and_empty_questions_are_clear_errors(tiny_random):
    engine = StreamEngine(tiny_random, "full")
    with pytest.raises(EngineError, match="feed at least one frame"):
        engine.ask("hello?")
    engine.feed(np.zeros((2, 56, 56, 3), dtype=np.uint8))
    with pytest.raises(EngineError, match="empty"):
        engine.ask("   ")


@pytest.mark.parametrize(
    "budget, keep, message",
    [
        (100, 100, "C must be smaller than M"),
        (100, 200, "C must be smaller than M"),
        (0, -1, "positive"),
        (None, 10, "needs a budget"),
        (10.5, 3, "whole numbers"),
    ],
)
def test_impossible_budgets_are_rejected_at_construction(tiny_random, budget, keep, message):
    with pytest.raises(BudgetError, match=message):
        StreamEngine(tiny_random, "uniform", budget=budget, keep=keep)


def test_budget_smaller_than_a_chunk_is_rejected_before_any_change(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "uniform", budget=100, keep=50, fps=2.0)
    with pytest.raises(BudgetError, match="smaller than one chunk"):
        engine.feed(pancake.frames[:2])
    assert engine.memory.is_empty
    engine = StreamEngine(tiny_random, "uniform", budget=300, keep=200, fps=2.0)
    with pytest.raises(BudgetError, match="leaves no room for one chunk"):
        engine.feed(pancake.frames[:2])


def test_odd_frames_wait_for_a_pair_and_flush_pads(tiny_random, small_video):
    stream = FrameStream(tiny_random, 2.0)
    assert stream.push(small_video.frames[:1]) is None
    chunk = stream.push(small_video.frames[1:4])
    assert chunk.num_grids == 2 and chunk.frames == 4
    chunk = stream.flush()
    assert chunk is None
    assert stream.push(small_video.frames[4:5]) is None
    last = stream.flush()
    assert last.num_grids == 1 and last.frames == 1 and last.first_grid == 2


def test_memory_cap_stops_the_baseline_with_a_message(tiny_random, pancake):
    capped = StreamEngine(tiny_random, "full", fps=2.0, max_cache_bytes=1_000_000)
    free = StreamEngine(tiny_random, "uniform", budget=540, keep=405, fps=2.0)
    steps = feed_all(tiny_random, pancake, {"full": capped, "uniform": free})
    assert "full" in steps[-1].stopped and "MB cap" in steps[-1].stopped["full"]
    assert capped.memory.nbytes <= 1_000_000
    assert free.frames_fed == pancake.num_frames
    stream = FrameStream(tiny_random, 2.0)
    stream.next_grid = capped.memory.num_grids
    with pytest.raises(MemoryCapError):
        capped.feed_chunk(stream.push(pancake.frames[:2]))


def test_report_follows_the_contract(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "uniform", budget=540, keep=405, fps=pancake.fps, max_new_tokens=4)
    feed_all(tiny_random, pancake, {"p": engine})
    engine.answer("What?")
    report = json.loads(json.dumps(engine.report()))
    for key in (
        "model",
        "policy",
        "params",
        "budget",
        "keep",
        "fps",
        "frames",
        "tokens_per_grid",
        "timeline",
        "peak_visual_tokens",
        "peak_cache_bytes",
        "survivors",
        "answers",
    ):
        assert key in report
    assert report["frames"] == 20 and report["tokens_per_grid"] == 135
    assert {e["event"] for e in report["timeline"]} == {"append", "compress"}
    assert len(report["survivors"]) == 10
    assert report["survivors"][-1]["kept_fraction"] == 1.0  # the newest grid is always whole under uniform
    kept = sum(s["kept_fraction"] for s in report["survivors"]) * 135
    assert kept == pytest.approx(engine.memory.visual_tokens)
    assert report["answers"][0]["question"] == "What?"


def test_the_dialogue_replay_follows_the_models_own_bound(tiny_random):
    """The replay keeps the newest turns within ``model.max_dialogue_tokens`` (the trained tiny model: 512, it was
    trained on short dialogues; others 1024), counted in the tokens the turns add to the prompt."""
    from kvdemo.dialogue import MAX_DIALOGUE_TOKENS, replayed_dialogue
    from kvdemo.models.loading import load_model
    from kvdemo.models.tiny import TRAINED_DIALOGUE_TOKENS

    assert tiny_random.max_dialogue_tokens == MAX_DIALOGUE_TOKENS == 1024
    assert load_model("tiny").max_dialogue_tokens == TRAINED_DIALOGUE_TOKENS == 512
    history = [(f"turn {i}: " + "words " * 10, "red") for i in range(6)]
    question = "What colour was the circle?"
    alone = len(tiny_random.tokenize(tiny_random.question_text([], question)))
    added = [
        len(tiny_random.tokenize(tiny_random.question_text(history[len(history) - k :], question))) - alone
        for k in range(7)
    ]
    for bound in (0, added[1], added[2] + 1, added[6]):
        tiny_random.max_dialogue_tokens = bound
        try:
            _, dropped = replayed_dialogue(tiny_random, history, question)
        finally:
            tiny_random.max_dialogue_tokens = MAX_DIALOGUE_TOKENS
        kept = max(k for k in range(7) if added[k] <= bound)
        assert dropped == 6 - kept, (bound, dropped)
