"""StreamingVLM (``streamingvlm``): its windows restated by hand with plain loops on small tensors, over a matrix of
parameter sets (kvpress-style); the gap closing (``positions=contiguous``) restated grid by grid; the re-rotated
memory against transformers' own forward at the shifted positions (float64, a one-layer random tiny model, whose
keys and values depend on the token and its position alone); and bad input refused with advice that is accepted."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from kvdemo.cache.budget import Budget
from kvdemo.errors import BudgetError, PolicyParameterError
from kvdemo.policies import LayerSlice, make_policy
from kvdemo.policies.streamingvlm import (
    REASON_SINK,
    REASON_TEXT_WINDOW,
    REASON_VISION_WINDOW,
    first_window_grid,
    grid_shifts,
)


def stream_slice(grids: int, per_grid: int = 4, heads: int = 2, times=None, layer: int = 0, seed: int = 0):
    """A slice of ``grids`` whole grids in stream order, the slots shuffled (a memory's slots are not in stream
    order), grid ``g`` at time ``times[g]``; positions ``(10 + 2 g, 10 + row, 10 + col)`` (Qwen2.5-VL at 2 fps)."""
    g = torch.Generator().manual_seed(seed)
    n = grids * per_grid
    slots = torch.randperm(n, generator=g)  # slot i holds the token of arrival number slots[i]
    frame = slots // per_grid
    cell = slots % per_grid
    position = torch.stack([10 + 2 * frame, 10 + cell // 2, 10 + cell % 2], dim=-1)
    rows = lambda x: x.int().expand(heads, -1).contiguous()  # noqa: E731
    return LayerSlice(
        layer=layer,
        num_layers=1,
        keys=torch.randn(heads, n, 4, generator=g),
        values=torch.randn(heads, n, 4, generator=g),
        frame=rows(frame),
        row=rows(cell // 2),
        col=rows(cell % 2),
        grid=(2, 2),
        newest_frame=grids - 1,
        order=rows(slots),
        position=position.int().expand(heads, -1, -1).contiguous(),
        grid_times_s=list(times) if times is not None else [float(k) for k in range(grids)],
    )


def expected_keep(view: LayerSlice, window_size: float, sink: int, text: int, keep: int) -> dict[int, int]:
    """The policy restated token by token: arrival number -> reason of every kept token of head 0."""
    times = view.grid_times_s
    newest = times[view.newest_frame]
    vision_grids = {g for g in range(len(times)) if newest - times[g] < window_size}
    tokens = list(zip(view.order[0].tolist(), view.frame[0].tolist()))
    window_start = min(o for o, f in tokens if f in vision_grids)
    classes = []
    for order, frame in tokens:
        if frame in vision_grids:
            classes.append((3, order, order, REASON_VISION_WINDOW))
        elif order < sink:
            classes.append((2, -order, order, REASON_SINK))
        elif window_start - text <= order < window_start:
            classes.append((1, order, order, REASON_TEXT_WINDOW))
    classes.sort(reverse=True)
    return {order: reason for _, _, order, reason in classes[: min(keep, len(classes))]}


MATRIX = list(
    itertools.product(
        [0.5, 1.0, 2.5, 16.0],  # window_size (s)
        [0, 3, 9],  # text_sink
        [0, 2, 5],  # text_sliding_window
        [2, 7, 40],  # keep
    )
)


@pytest.mark.parametrize("window_size, sink, text, keep", MATRIX)
def test_the_windows_keep_what_a_token_by_token_restatement_keeps(window_size, sink, text, keep):
    times = [0.0, 1.0, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0]  # uneven: the window is by seconds, not grids
    views = [stream_slice(8, times=times, layer=layer, seed=layer) for layer in range(2)]
    for view in views:
        view.num_layers = 2
    policy = make_policy("streamingvlm", window_size=window_size, text_sink=sink, text_sliding_window=text)
    policy.positions = "kept"
    selection = policy.compress(views, keep)
    for layer, view in enumerate(views):
        expected = expected_keep(view, window_size, sink, text, keep)
        for head in range(view.num_heads):
            index = selection.indices[layer][head]
            kept = dict(zip(view.order[head][index].tolist(), selection.info["reason"][layer][head].tolist()))
            assert kept == expected, (layer, head)
    assert selection.shift is None


def test_the_vision_window_is_measured_in_seconds_from_the_newest_grid():
    times = [0.0, 0.5, 1.0, 1.5, 2.0, 4.0]
    assert first_window_grid(times, 5, 16.0) == 0
    assert first_window_grid(times, 5, 2.5) == 4  # 4.0 - 2.0 < 2.5; 4.0 - 1.5 is not
    assert first_window_grid(times, 5, 0.5) == 5  # the newest grid is always in
    assert first_window_grid(times, 3, 1.0) == 2  # measured from grid 3 (1.5 s): 1.0 s and 1.5 s
    assert first_window_grid([], 9, 3.0) == 7  # without times, one grid per second


def restated_shifts(frame, position, kept, grids):
    """grid_shifts with loops: each held grid's first temporal position; the span to the next held grid; the spans of
    grids without a kept token summed over the grids before each grid."""
    start = {}
    for f, p in zip(frame.tolist(), position[:, 0].tolist()):
        start[f] = min(start.get(f, p), p)
    kept_grids = {f for f, k in zip(frame.tolist(), kept.tolist()) if k}
    held = sorted(start)
    span = {g: (start[held[i + 1]] - start[g] if i + 1 < len(held) else 0) for i, g in enumerate(held)}
    shifts, total = [], 0
    for g in range(grids):
        shifts.append(total)
        if g in start and g not in kept_grids:
            total += span[g]
    return shifts


@pytest.mark.parametrize("seed", range(6))
def test_grid_shifts_close_exactly_the_spans_of_the_grids_evicted_whole(seed):
    g = torch.Generator().manual_seed(seed)
    grids, per_grid = 9, 3
    present = torch.rand(grids, generator=g) < 0.8  # grids evicted by earlier passes (or pruned) hold nothing
    present[-1] = True
    steps = torch.randint(1, 4, (grids,), generator=g)  # uneven spans (floor(g * step) rounding, 1-D families)
    starts = 7 + torch.cumsum(steps, 0) - steps
    frame = torch.arange(grids).repeat_interleave(per_grid)[present.repeat_interleave(per_grid)]
    position = torch.stack([starts[frame] + torch.arange(len(frame)) % per_grid] * 3, dim=-1)
    kept = torch.rand(len(frame), generator=g) < 0.5
    kept[frame == grids - 1] = True
    shuffle = torch.randperm(len(frame), generator=g)
    frame, position, kept = frame[shuffle], position[shuffle], kept[shuffle]
    assert grid_shifts(frame, position, kept, grids).tolist() == restated_shifts(frame, position, kept, grids)


def test_contiguous_positions_shift_every_grid_after_an_evicted_one_and_the_later_tokens():
    view = stream_slice(8)  # grids 1 s apart, positions 10 + 2 g
    policy = make_policy("streamingvlm", window_size=3.0, text_sink=4, text_sliding_window=2)
    view.rotary = object()
    selection = policy.compress([view], 100)
    # kept: grid 0 (sinks), the last 2 tokens of grid 4 (text window), grids 5-7 (vision window): grids 1-3 close
    assert selection.shift.by_grid.tolist() == [0, 0, 2, 4, 6, 6, 6, 6]
    assert selection.shift.rotary is view.rotary


@pytest.mark.parametrize("window_size", [0.25, 0.99])
def test_a_window_shorter_than_one_chunk_is_refused_with_advice_that_is_accepted(window_size):
    policy = make_policy("streamingvlm", window_size=window_size)
    budget = Budget.resolve(policy, 96, 72)
    with pytest.raises(BudgetError) as error:
        budget.sized(policy, 16, seconds=1.0)
    message = str(error.value)
    assert "\n" not in message and "window_size" in message, message
    advised = float(re.search(r"raise window_size to at least ([0-9.]+)", message).group(1))
    fixed = make_policy("streamingvlm", window_size=advised)
    assert Budget.resolve(fixed, 96, 72).sized(fixed, 16, seconds=1.0).chunk == 16


@pytest.mark.parametrize("params", [{"window_size": 0}, {"window_size": -1}, {"text_sink": -1}, {"positions": "x"}])
def test_bad_parameters_are_one_line_errors(params):
    with pytest.raises(PolicyParameterError) as error:
        make_policy("streamingvlm", **params)
    assert "\n" not in str(error.value)


def test_the_cli_refuses_a_short_window_before_the_model_loads(monkeypatch, capsys):
    import kvdemo.models.loading as loading
    from kvdemo.cli import main

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code = main(["run", "--policy", "streamingvlm", "--param", "window_size=0.5", "--budget", "96", "--quiet"])
    assert code != 0
    assert "raise window_size to at least 1" in capsys.readouterr().err


# --- the re-rotated memory against transformers' forward (float64) -----------------------------------------------


def one_layer_float64_tiny():
    """The random tiny Qwen2.5-VL in float64 with its first language layer only: its keys and values are a function of
    each token and its position, so a memory that evicted and re-rotated must answer as transformers' forward over
    the kept tokens at the shifted positions does."""
    from test_pruning_positions import float64_model

    model = float64_model("tiny-random")
    language = model.hf.model.language_model
    language.layers = language.layers[:1]
    language.config.num_hidden_layers = 1
    if getattr(language.config, "layer_types", None):
        language.config.layer_types = language.config.layer_types[:1]
    model.num_layers, model.layer_map = 1, [0]
    return model


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["contiguous", "kept"])
def test_the_answer_equals_transformers_forward_over_the_kept_tokens_at_the_shifted_positions(positions):
    from kvdemo.stream.engine import StreamEngine
    from test_families import FPS, QUESTION, stream_frames
    from test_pruning_positions import full_prompt, language_model_logits

    model = one_layer_float64_tiny()
    frames = stream_frames(model, 16)  # 8 temporal grids of 96 tokens
    params = dict(window_size=2.0, text_sink=48, text_sliding_window=24, positions=positions)
    engine = StreamEngine(model, "streamingvlm", budget=480, keep=384, fps=FPS, policy_params=params)
    for start in range(0, len(frames), 2):
        engine.feed(frames[start : start + 2])
    prompt = full_prompt(model, frames)
    prefix = int(model.prefix_embeds().shape[0])
    rows, cols = engine.memory.grid_shape
    store = engine.memory.layers[0]
    held = store.packed[0, : store.visual_len, :3].long()  # frame, row, col of every held token
    length = prompt["inputs_embeds"].shape[1]
    video_end = prefix + 8 * rows * cols
    kept = torch.zeros(length, dtype=torch.bool)
    kept[:prefix] = True
    kept[prefix + held[:, 0] * rows * cols + held[:, 1] * cols + held[:, 2]] = True
    kept[video_end:] = True
    # The shifts restated: every kept token after a grid that kept nothing moves back, on every axis, by that grid's
    # temporal step (Qwen2.5-VL: floor(g * 2 / fps * tokens_per_second)); the question by all of them.
    step = 2 / FPS * float(model.hf.config.vision_config.tokens_per_second)
    temporal = [int(g * step // 1) for g in range(9)]
    kept_grids = set(held[:, 0].tolist())
    evicted = [g for g in range(8) if g not in kept_grids]
    assert evicted and REASON_SINK in store.packed[0, : store.visual_len, 7].tolist(), "sinks kept, grids evicted"
    shift = torch.zeros(length, dtype=torch.long)
    for g in range(8):
        closed = sum(temporal[e + 1] - temporal[e] for e in evicted if e < g)
        shift[prefix + g * rows * cols : prefix + (g + 1) * rows * cols] = closed
    shift[video_end:] = sum(temporal[e + 1] - temporal[e] for e in evicted)
    contiguous = prompt["positions"] - shift
    expected, other = (
        (contiguous, prompt["positions"]) if positions == "contiguous" else (prompt["positions"], contiguous)
    )
    assert engine.memory.position_shift == (int(shift[-1]) if positions == "contiguous" else 0)
    recorded = store.packed[0, : store.visual_len, 4:7].long()
    index = prefix + held[:, 0] * rows * cols + held[:, 1] * cols + held[:, 2]
    assert torch.equal(recorded, expected[:, index].t()), "the memory records each key's new position"
    ours = engine.question_logits(QUESTION)
    theirs = language_model_logits(model, prompt, kept, expected[:, kept])
    print(positions, "max |logit difference|", float((ours - theirs).abs().max()))
    # transformers' rotary module computes RoPE's angles in float32 (it upcasts whatever the dtype), so a key rotated
    # at p and then by -s differs from one rotated at p - s by float32 angle rounding; kept positions rotate nothing.
    tolerance = 2e-6 if positions == "contiguous" else 1e-10
    assert torch.allclose(ours, theirs, atol=tolerance, rtol=0), float((ours - theirs).abs().max())
    assert float((language_model_logits(model, prompt, kept, other[:, kept]) - ours).abs().max()) > 1e-3
