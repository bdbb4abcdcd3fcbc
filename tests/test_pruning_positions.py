"""Positions are the crux of pruning before the LLM: the tokens that enter keep the positions the model gives them in
the full video, and Qwen3-VL's timestamps stay with their frames (even a frame pruned whole). Per family, in float64
on the random tiny models: the logits after a pruned stream equal transformers' own language model run over the
same kept tokens (the embeddings transformers' full forward builds from the family processor's prompt) at the
positions of the full prompt (transformers' ``get_rope_index`` for Qwen3-VL/3.5, the original rule restated for
Qwen2.5-VL, one per token for LLaVA-OneVision); the same tokens at positions renumbered as if the pruned ones never
existed answer otherwise (the misalignment an open vLLM bug report describes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdemo.models.loading import load_model
from kvdemo.stream.engine import StreamEngine
from test_families import QUESTION, processor_inputs, stream_frames

pytestmark = pytest.mark.slow  # a float64 stream and transformers' forward per family (seconds to a minute each)

FAMILIES = ("tiny-random", "tiny-random-qwen3-vl", "tiny-random-qwen3.5", "tiny-random-llava-ov")
FPS = 2.0
#: Qwen3.5's linear-attention kernels cast to float32 and chunk by 64 (shared/notes/model-families.md): a chunked
#: prefill is float32-exact there; every other family is exact to float64 rounding.
TOLERANCE = {"tiny-random-qwen3.5": 2e-5}


def float64_model(name: str):
    model = load_model(name)
    model.hf.double()
    model.dtype = torch.float64
    return model


def pruned_stream(model, frames: np.ndarray, prune: str) -> tuple[StreamEngine, torch.Tensor]:
    """``frames`` streamed two at a time through the full cache behind ``prune``; the engine and which tokens of the
    whole prompt (prefix, every chunk, question) entered."""
    engine = StreamEngine(model, "full", fps=FPS, prune=prune)
    masks, prune_chunk = [], engine.pruning.prune
    engine.pruning.prune = lambda chunk: masks.append(prune_chunk(chunk)) or masks[-1]
    for start in range(0, len(frames), 2):
        engine.feed(frames[start : start + 2])
    engine.flush()
    prefix = model.prefix_embeds().shape[0]
    question = model.question_embeds([], QUESTION).shape[0]
    ones = torch.ones
    return engine, torch.cat(
        [ones(prefix, dtype=torch.bool), *(m.cpu() for m in masks), ones(question, dtype=torch.bool)]
    )


def qwen25_positions(ids: torch.Tensor, grid_thw: torch.Tensor, temporal_step: float) -> torch.Tensor:
    """Qwen2.5-VL's original rule, token by token: text advances every axis by one; the g-th temporal grid of a video
    starting at ``s`` is at ``(s + floor(g * second_per_grid * tokens_per_second), s + row, s + col)``; text after the
    video starts at the largest position so far + 1."""
    t, h, w = (int(x) // m for x, m in zip(grid_thw, (1, 2, 2)))
    positions, next_position, start, index = [], 0, None, 0
    for token in ids.tolist():
        if token == 261:  # <|video_pad|>
            start = next_position if start is None else start
            g, rest = divmod(index, h * w)
            r, c = divmod(rest, w)
            index += 1
            position = (start + int(np.floor(g * temporal_step)), start + r, start + c)
            positions.append(position)
            next_position = max(next_position, max(position) + 1)
        else:
            positions.append((next_position,) * 3)
            next_position += 1
    return torch.tensor(positions).t()


def full_prompt(model, frames: np.ndarray) -> dict:
    """What transformers makes of the whole prompt: the inputs its language model receives from the full forward
    (embeddings with the video features in place, DeepStack's), and the positions of every token."""
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in processor_inputs(model, frames).items()}
    if model.family == "qwen2_5_vl":  # kvdemo's pixels (equal to the processor's to float32 rounding: test_families)
        inputs["pixel_values_videos"] = model.pixel_values(frames)[0].double()
    captured = {}

    def capture(module, args, kwargs):
        captured.update(kwargs)

    hook = model.hf.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.inference_mode():
            model.hf(**inputs)
    finally:
        hook.remove()
    ids = inputs["input_ids"]
    if model.family.startswith("qwen3"):
        positions, _ = model.hf.model.get_rope_index(
            ids, inputs["mm_token_type_ids"], video_grid_thw=inputs["video_grid_thw"]
        )
        positions = positions[:, 0]
    elif model.family == "qwen2_5_vl":
        step = (2 / FPS) * float(model.hf.config.vision_config.tokens_per_second)
        positions = qwen25_positions(ids[0], inputs["video_grid_thw"][0], step)
    else:
        positions = torch.arange(ids.shape[1]).expand(3, -1)
    return {**captured, "positions": positions}


def language_model_logits(model, prompt: dict, kept: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Last-token logits of transformers' language model and head over the ``kept`` tokens of ``prompt`` at
    ``positions [3, n_kept]``."""
    extras = {}
    if prompt.get("visual_pos_masks") is not None:
        visual = prompt["visual_pos_masks"][0]
        extras = {
            "visual_pos_masks": visual[kept][None],
            "deepstack_visual_embeds": [f[kept[visual]] for f in prompt["deepstack_visual_embeds"]],
        }
    position_ids = positions[:, None] if model.position_axes == 3 else positions[:1]
    with torch.inference_mode():
        out = model.hf.model.language_model(
            inputs_embeds=prompt["inputs_embeds"][:, kept], position_ids=position_ids, **extras
        )
        return model.hf.lm_head(out.last_hidden_state[:, -1])[0]


@pytest.mark.parametrize("prune", ["evs:0.5", "vidcom2:0.4"])
@pytest.mark.parametrize("name", FAMILIES)
def test_pruned_logits_equal_transformers_over_the_kept_tokens_at_their_full_video_positions(name, prune):
    model = float64_model(name)
    frames = stream_frames(model, 8)
    frames[2:4] = frames[0:2]  # a repeated frame pair: EVS prunes its grid(s) whole (their stream text stays)
    engine, kept = pruned_stream(model, frames, prune)
    prompt = full_prompt(model, frames)
    assert kept.shape[0] == prompt["inputs_embeds"].shape[1], "kvdemo's stream and the processor's prompt align"
    report = engine.report()["pruning"]
    assert 0 < report["entered"] < report["offered"] and engine.memory.visual_tokens == report["entered"] + (
        engine.memory.text_tokens
    )
    if prune.startswith("evs"):
        assert any(grid["entered"] == 0 for grid in report["grids"]), "a grid pruned whole"
    ours = engine.question_logits(QUESTION)
    positions = prompt["positions"][:, kept]
    theirs = language_model_logits(model, prompt, kept, positions)
    print(name, prune, "max |logit difference|", float((ours - theirs).abs().max()))
    assert torch.allclose(ours, theirs, atol=TOLERANCE.get(name, 1e-10), rtol=0), float((ours - theirs).abs().max())
    renumbered = torch.arange(int(kept.sum())).expand(3, -1)
    assert float((language_model_logits(model, prompt, kept, renumbered) - ours).abs().max()) > 1e-3
    # What the memory recorded: each held token at its full-video position (the full cache holds them in order).
    store = engine.memory.layers[0]
    held = store.packed[0, : store.visual_len + store.text_len, 4:7]
    prefix = model.prefix_embeds().shape[0]
    entered = positions[:, prefix : prefix + store.visual_len + store.text_len]
    assert sorted(map(tuple, held.tolist())) == sorted(map(tuple, entered.t().tolist()))


def test_qwen3_timestamps_of_a_grid_pruned_whole_stay_at_their_frame():
    """The timestamp and delimiters of a grid whose every visual token was pruned enter at the positions of their
    grid in the full video (not those of the next grid, nor the tokens after the last one)."""
    model = float64_model("tiny-random-qwen3-vl")
    frames = stream_frames(model, 8)
    frames[2:4] = frames[0:2]
    engine, kept = pruned_stream(model, frames, "evs:0.5")
    prompt = full_prompt(model, frames)
    whole = [g["grid"] for g in engine.report()["pruning"]["grids"] if g["entered"] == 0]
    assert whole, "a grid pruned whole"
    store = engine.memory.layers[0]
    text = store.packed[0, store.visual_len : store.visual_len + store.text_len]
    prefix = model.prefix_embeds().shape[0]
    per_grid = (len(kept) - prefix - model.question_embeds([], QUESTION).shape[0]) // 4
    for grid in whole:
        rows = text[text[:, 0] == grid]
        first = prefix + grid * per_grid
        expected = prompt["positions"][:, first : first + per_grid][
            :, ~prompt["visual_pos_masks"][0, first : first + per_grid]
        ]
        assert rows.shape[0] == expected.shape[1] > 0
        assert torch.equal(rows[:, 4:7].t().long(), expected)
