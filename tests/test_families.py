"""Every model family against transformers, with tiny random models built from configs in code: positions equal
``get_rope_index`` (or the original rule where 5.23 differs, side by side), pixels equal the family's own video
processor, chunked prefill through kvdemo's memory equals one full-sequence forward of transformers' model on the
processor's prompt, every policy stays under ``M`` on the real clip, asking leaves the memory (and Qwen3.5's
linear state) bit-identical, a budget that holds everything answers as the full cache."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import (
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)
from transformers.video_utils import VideoMetadata

from kvdemo.media.video import load_video, resize_frames
from kvdemo.models.catalog import OFFLINE_MODELS
from kvdemo.models.loading import load_model
from kvdemo.models.tiny_random import TOKEN_ID, byte_tokenizer
from kvdemo.policies import policy_names
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import EngineGroup, stream_video

FAMILIES = ("tiny-random-qwen2-vl", "tiny-random-qwen3-vl", "tiny-random-qwen3.5", "tiny-random-llava-ov")
QUESTION = "What is in the video?"
FPS = 2.0


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name) for name in FAMILIES}


def stream_frames(model, count: int = 6) -> np.ndarray:
    """``count`` random frames already on the family's grid (the same for every run)."""
    size = model.geometry.fixed_size or {28: (224, 336), 32: (192, 320)}[model.geometry.factor]
    return np.random.default_rng(7).integers(0, 255, (count, *size, 3), dtype=np.uint8)


def streamed(model, frames: np.ndarray, policy: str = "full", **budget) -> StreamEngine:
    engine = StreamEngine(model, policy, fps=FPS, **budget)
    for start in range(0, len(frames), 2):  # one temporal grid (Qwen) or two frames (LLaVA-OneVision) per chunk
        engine.feed(frames[start : start + 2])
    engine.flush()
    return engine


# --- the processors' prompts and transformers' own forward ------------------------------------------------


def video_tensor(frames: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(frames).permute(0, 3, 1, 2)


def processor_inputs(model, frames: np.ndarray, outer_wrappers: bool = False) -> dict:
    """What the family's processor makes of the prompt kvdemo streams (the chat prefix, the video, the question),
    built with transformers' processor classes and the byte tokenizer. Qwen3-VL/3.5: transformers >= 5.10 keeps
    the template's outer ``<|vision_start|>``/``<|vision_end|>`` around the per-grid wrappers; the layout the
    models were trained with has none, so they are dropped unless ``outer_wrappers``."""
    tokenizer = byte_tokenizer()
    question = model.question_text([], QUESTION)
    video = [video_tensor(frames)]
    if model.family.startswith("qwen3"):
        processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2),
            tokenizer=tokenizer,
            video_processor=model.processor,
            chat_template="",
        )
        metadata = [VideoMetadata(total_num_frames=len(frames), fps=FPS, frames_indices=list(range(len(frames))))]
        out = processor(
            text=[model.prefix_text() + "<|vision_start|><|video_pad|><|vision_end|>" + question],
            videos=video,
            video_metadata=metadata,
            do_sample_frames=False,
            do_resize=False,
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )
        if not outer_wrappers:
            ids = out["input_ids"][0]
            keep = torch.ones(len(ids), dtype=torch.bool)
            keep[(ids == TOKEN_ID["<|vision_start|>"]).nonzero()[0]] = False
            keep[(ids == TOKEN_ID["<|vision_end|>"]).nonzero()[-1]] = False
            out = {
                k: v[:, keep] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                for k, v in out.items()
            }
        return dict(out)
    if model.family == "llava_onevision":
        processor = LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(),
            tokenizer=tokenizer,
            video_processor=model.processor,
            vision_feature_select_strategy="full",
            num_image_tokens=(384 // 14) ** 2,
        )
        return dict(
            processor(
                text=[model.prefix_text() + "<video>" + question], videos=video, do_resize=False, return_tensors="pt"
            )
        )
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template="",
    )
    out = dict(
        processor(
            text=[model.prefix_text() + "<|video_pad|>" + question],
            videos=video,
            do_resize=False,
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )
    )
    out["position_ids"] = original_qwen2_positions(out["input_ids"][0], out["video_grid_thw"][0])[:, None]
    return out


def original_qwen2_positions(ids: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Qwen2-VL's original rule, restated token by token: text advances every axis by one; the g-th temporal grid
    of a video starting at ``s`` is at ``(s + g, s + row, s + col)``; text after the video starts at the largest
    position so far + 1."""
    t, h, w = (int(x) // m for x, m in zip(grid_thw, (1, 2, 2)))
    positions, next_position, video_start = [], 0, None
    video_index = 0
    for token in ids.tolist():
        if token == TOKEN_ID["<|video_pad|>"]:
            if video_start is None:
                video_start = next_position
            g, rest = divmod(video_index, h * w)
            r, c = divmod(rest, w)
            video_index += 1
            positions.append((video_start + g, video_start + r, video_start + c))
            next_position = max(next_position, video_start + max(g, r, c) + 1)
        else:
            positions.append((next_position,) * 3)
            next_position += 1
    return torch.tensor(positions).t()


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_equals_transformers_forward_on_the_processors_prompt(models, name):
    model = models[name]
    frames = stream_frames(model)
    ours = streamed(model, frames).question_logits(QUESTION)
    with torch.inference_mode():
        theirs = model.hf(**processor_inputs(model, frames)).logits[0, -1]
    assert torch.allclose(ours, theirs, atol=2e-5, rtol=1e-4), float((ours - theirs).abs().max())
    if model.family.startswith("qwen3"):
        with torch.inference_mode():
            wrapped = model.hf(**processor_inputs(model, frames, outer_wrappers=True)).logits[0, -1]
        assert float((wrapped - ours).abs().max()) > 1e-2, "the outer wrappers shift every later position"


def test_without_the_newline_llava_answers_otherwise(models):
    """The learned newline once before the question matters: leaving it out changes the logits."""
    model = models["tiny-random-llava-ov"]
    engine = streamed(model, stream_frames(model))
    with_newline = engine.question_logits(QUESTION)
    original = model.question_embeds
    model.question_embeds = lambda history, question: original(history, question)[1:]
    try:
        without = engine.question_logits(QUESTION)
    finally:
        model.question_embeds = original
    assert float((with_newline - without).abs().max()) > 1e-3


def test_without_deepstack_qwen3_vl_answers_otherwise(models):
    """DeepStack's features, passed with each chunk, matter: streaming without them changes the logits (so the
    chunked-prefill equality above is not met by a model that ignores them)."""
    model = models["tiny-random-qwen3-vl"]
    frames = stream_frames(model)
    with_deepstack = streamed(model, frames).question_logits(QUESTION)
    original = model.forward_extras
    model.forward_extras = lambda chunk, length: {}
    try:
        without = streamed(model, frames).question_logits(QUESTION)
    finally:
        model.forward_extras = original
    assert float((with_deepstack - without).abs().max()) > 1e-3


# --- positions -------------------------------------------------------------------------------------------


def streamed_positions(model, frames: np.ndarray) -> torch.Tensor:
    """Every position kvdemo gives the prompt's tokens: prefix, chunk by chunk, question."""
    prefix = model.prefix_embeds().shape[0]
    positions, cursor = model.text_positions(model.new_cursor(), prefix)
    parts = [positions]
    grid = 0
    for start in range(0, len(frames), 2):
        chunk = model.encode(frames[start : start + 2], grid, np.arange(start, start + 2) / FPS, FPS)
        grid += chunk.num_grids
        positions, cursor = model.chunk_positions(chunk, cursor)
        parts.append(positions)
    question = model.question_embeds([], QUESTION).shape[0]
    parts.append(model.text_positions(cursor, question)[0])
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("name", ["tiny-random-qwen3-vl", "tiny-random-qwen3.5"])
def test_qwen3_positions_equal_get_rope_index(models, name):
    model = models[name]
    frames = stream_frames(model)
    inputs = processor_inputs(model, frames)
    theirs, _ = model.hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], video_grid_thw=inputs["video_grid_thw"]
    )
    assert torch.equal(streamed_positions(model, frames), theirs[:, 0])


def test_qwen2_positions_follow_the_original_rule_where_get_rope_index_differs(models):
    """A video longer (4 grids) than its frames are wide (2 x 3 tokens): 5.23's rule starts the text after it too
    early, back inside the video's temporal range."""
    model = models["tiny-random-qwen2-vl"]
    frames = np.random.default_rng(5).integers(0, 255, (8, 56, 84, 3), dtype=np.uint8)
    inputs = processor_inputs(model, frames)
    ours = streamed_positions(model, frames)
    assert torch.equal(ours, inputs["position_ids"][:, 0])
    theirs, _ = model.hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], video_grid_thw=inputs["video_grid_thw"]
    )
    video = inputs["input_ids"][0] == TOKEN_ID["<|video_pad|>"]
    assert torch.equal(ours[:, video], theirs[:, 0, video]), "the video's own positions agree"
    after = int(video.nonzero()[-1]) + 1
    print(
        "text after the video starts at", int(ours[0, after]), "(original rule) vs", int(theirs[0, 0, after]), "(5.23)"
    )
    assert int(ours[0, after]) != int(theirs[0, 0, after])


def test_llava_positions_are_one_per_token(models):
    model = models["tiny-random-llava-ov"]
    frames = stream_frames(model)
    ours = streamed_positions(model, frames)
    total = processor_inputs(model, frames)["input_ids"].shape[1]
    assert torch.equal(ours, torch.arange(total).expand(3, -1))


# --- pixels ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_pixels_equal_the_familys_video_processor(models, name):
    """A clip of an odd size, resized by kvdemo (the family's geometry) then turned into pixels, equals the family's
    processor resizing it itself within the same pixel bounds."""
    model = models[name]
    geometry = model.geometry
    raw = np.random.default_rng(3).integers(0, 255, (2, 240, 426, 3), dtype=np.uint8)
    resized = resize_frames(raw, geometry)
    if model.family.startswith("qwen2"):
        ours, grid = model.pixel_values(resized)
        processor = Qwen2VLVideoProcessor(
            size={"shortest_edge": geometry.min_pixels, "longest_edge": geometry.max_pixels}
        )
    else:
        out = model.processor_inputs(resized)
        ours, grid = out["pixel_values_videos"], out.get("video_grid_thw")
        if model.family.startswith("qwen3"):
            processor = Qwen3VLVideoProcessor(
                size={"shortest_edge": 2 * geometry.min_pixels, "longest_edge": 2 * geometry.max_pixels}
            )
        else:
            # The checkpoints' own preprocessor configs normalise with SigLIP's 0.5 (the class defaults to CLIP's).
            processor = type(model.processor)(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    theirs = processor(
        videos=[video_tensor(raw)],
        do_sample_frames=False,
        return_tensors="pt",
        **({} if model.family == "llava_onevision" else {"cap_pixels_per_frame": False}),
    )
    assert ours.shape == theirs["pixel_values_videos"].shape
    assert torch.allclose(ours, theirs["pixel_values_videos"], atol=1e-5)
    if grid is not None:
        assert tuple(int(x) for x in torch.as_tensor(grid).flatten()) == tuple(
            int(x) for x in theirs["video_grid_thw"][0]
        )


# --- every policy, the real clip, asking ------------------------------------------------------------------


def state_of(engine: StreamEngine) -> list[torch.Tensor]:
    """Everything answering must not change: keys and values, provenance, biases, the linear state."""
    memory = engine.memory
    tensors = [t.clone() for t in (*memory.keys, *memory.values)]  # the live slots (a question writes after them)
    for layer, store in enumerate(memory.layers):
        tensors.append(store.packed[:, : store.visual_len + store.text_len].clone())
        if store.bias is not None:
            tensors.append(store.bias[:, : memory.live_len(layer)].clone())
    tensors += [t.clone() for state in memory.linear_state.values() for t in state.values()]
    return tensors


@pytest.fixture(scope="module")
def clips(models, media):
    return {name: load_video(media / "flipping_a_pancake.mkv", fps=1.0, model=models[name]) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_policy_stays_under_m_on_the_real_clip_and_asking_changes_nothing(models, clips, name):
    model, video = models[name], clips[name]
    # The app's budgets, but Qwen2-VL's at 4 grids of 135 tokens (at 1 fps the clip holds 5: the app's would not compress).
    M, C = (540, 405) if name == "tiny-random-qwen2-vl" else OFFLINE_MODELS[name].budget
    engines = {}
    for policy in policy_names():
        budget = {} if policy == "full" else {"budget": M} if policy == "protokv" else {"budget": M, "keep": C}
        engines[policy] = StreamEngine(model, policy, fps=video.fps, max_new_tokens=4, **budget)
    list(stream_video(model, video, engines))
    for policy, engine in engines.items():
        peak = max(event.visual_tokens for event in engine.memory.timeline)
        if policy != "full":
            assert peak <= M, (policy, peak)
            assert engine.stats.compressions > 0, policy
        before = state_of(engine)
        engine.answer(QUESTION)
        after = state_of(engine)
        assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)), policy


@pytest.mark.parametrize("name", FAMILIES)
def test_a_budget_that_holds_everything_answers_as_the_full_cache(models, name):
    model = models[name]
    frames = stream_frames(model)
    full = streamed(model, frames)
    roomy = streamed(model, frames, "sliding-window", budget=100_000, keep=50_000)
    assert roomy.stats.compressions == 0
    assert torch.equal(full.question_logits(QUESTION), roomy.question_logits(QUESTION))
    assert full.answer(QUESTION).answer == roomy.answer(QUESTION).answer


# --- what only some families have -------------------------------------------------------------------------


def test_stream_text_stays_with_its_grid_and_counts_against_m(models):
    """Qwen3-VL's timestamps and delimiters live in the memory with their grid: after every compression, a head
    holds a grid's text exactly when it holds one of that grid's visual tokens, and the text counts toward M."""
    model = models["tiny-random-qwen3-vl"]
    frames = stream_frames(model, 16)
    text_per_grid = {}
    for grid in range(8):
        text_per_grid[grid] = len(
            model.tokenize(f"<{(2 * grid + 0.5) / FPS:.1f} seconds><|vision_start|><|vision_end|>")
        )
    engine = streamed(model, frames, "sliding-window", budget=300, keep=200)
    memory = engine.memory
    assert engine.stats.compressions > 0 and memory.text_tokens > 0
    for layer, store in enumerate(memory.layers):
        prov = store.packed[..., 0]  # the grid of every slot
        for head in range(memory.num_kv_heads):
            visual = prov[head, : store.visual_len]
            if store.valid is not None:
                visual = visual[store.valid[head]]
            text = prov[head, store.visual_len : store.visual_len + store.text_len]
            if store.text_valid is not None:
                text = text[store.text_valid[head]]
            held = set(visual.tolist())
            assert set(text.tolist()) == held
            for grid in held:
                assert int((text == grid).sum()) == text_per_grid[grid]
    assert max(e.visual_tokens for e in memory.timeline) <= 300
    assert memory.visual_tokens == round(sum(memory.head_counts(0).tolist()) / memory.num_kv_heads)


def test_qwen3_5_memory_covers_its_attention_layers_and_forks_its_linear_state(models):
    model = models["tiny-random-qwen3.5"]
    assert model.layer_map == [None, None, None, 0, None, None, None, 1]
    engine = streamed(model, stream_frames(model, 4), "sliding-window", budget=300, keep=200)
    memory = engine.memory
    assert memory.num_layers == 2 and len(memory.linear_state) == 6
    assert memory.linear_state_bytes > 0 and engine.report()["linear_state_bytes"] == memory.linear_state_bytes
    recurrent = {layer: state["recurrent"] for layer, state in memory.linear_state.items()}
    snapshot = copy.deepcopy(engine).attach(model)  # the costly alternative: a full copy of every state
    first = engine.answer(QUESTION).answer
    assert all(memory.linear_state[layer]["recurrent"] is tensor for layer, tensor in recurrent.items()), (
        "a question rebinds its own state; the committed one stays the same tensor"
    )
    assert snapshot.answer(QUESTION).answer == first
    engine.reset_dialogue()
    assert engine.answer(QUESTION).answer == first, "the fork left the committed state as it was"


def test_llava_stops_with_a_message_where_its_positions_end(models):
    model = models["tiny-random-llava-ov"]
    limit = model.position_limit
    model.position_limit = 2000  # 196 positions a frame: the stream must stop after a few frames
    try:
        engine = StreamEngine(model, "sliding-window", budget=1568, keep=1176, fps=FPS)
        group = EngineGroup(model, {"p": engine}, FPS)
        frames = stream_frames(model, 12)
        for start in range(0, len(frames), 2):
            group.push(frames[start : start + 2])
    finally:
        model.position_limit = limit
    assert "trained with positions up to 2,000" in group.stopped["p"]
    assert 0 < engine.frames_fed < 12
