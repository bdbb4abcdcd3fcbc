import math

import pytest
import torch

from kvdemo.cache.chunk import VisualChunk
from kvdemo.models.qwen2_vl import mrope_positions
from kvdemo.models.tiny import ByteTokenizer


def _positions(grids, rows, cols, start, fps, tokens_per_second, temporal_patch_size=2):
    g, r, c = torch.meshgrid(torch.arange(grids), torch.arange(rows), torch.arange(cols), indexing="ij")
    return mrope_positions(g.flatten(), r.flatten(), c.flatten(), start, temporal_patch_size / fps, tokens_per_second)


@pytest.mark.parametrize(
    "fps, expected_temporal",
    [
        (2.0, [0, 2, 4, 6, 8]),  # second_per_grid = 1.0: 2 positions per grid
        (3.0, [0, 1, 2, 4, 5]),  # second_per_grid = 2/3: floor(g * 4/3)
        (1.5, [0, 2, 5, 8, 10]),  # second_per_grid = 4/3: floor(g * 8/3)
        (0.5, [0, 8, 16, 24, 32]),  # second_per_grid = 4.0
    ],
)
def test_qwen25_positions_follow_the_rule(fps, expected_temporal):
    start = 17
    pos = _positions(5, 2, 3, start, fps, tokens_per_second=2)
    assert pos.shape == (3, 5 * 2 * 3)
    temporal = pos[0].view(5, 6)[:, 0] - start
    assert temporal.tolist() == expected_temporal
    # rows and columns: s + row, s + col for every grid
    assert (pos[1].view(5, 2, 3) - start == torch.arange(2).view(1, 2, 1)).all()
    assert (pos[2].view(5, 2, 3) - start == torch.arange(3).view(1, 1, 3)).all()


def test_qwen2_positions_step_one_per_grid():
    pos = _positions(4, 1, 2, 5, fps=3.0, tokens_per_second=None)
    assert pos[0].tolist() == [5, 5, 6, 6, 7, 7, 8, 8]
    assert pos[2].tolist() == [5, 6] * 4


def test_visual_positions_agree_with_transformers_rope_index(tiny_random):
    """For a whole clip, transformers' own get_rope_index gives the same visual positions."""
    grids, rows, cols, fps = 3, 4, 5, 3.0
    prefix = tiny_random.tokenize(tiny_random.prefix_text())
    video_id = tiny_random.hf.config.video_token_id
    ids = prefix + [video_id] * (grids * rows * cols) + tiny_random.tokenize("<|vision_end|>hi")
    token_type = [0] * len(prefix) + [2] * (grids * rows * cols) + [0] * (len(ids) - len(prefix) - grids * rows * cols)
    hf_pos, _ = tiny_random.hf.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([token_type]),
        video_grid_thw=torch.tensor([[grids, rows * 2, cols * 2]]),
        second_per_grid_ts=torch.tensor([2 / fps]),
    )
    ours = _positions(grids, rows, cols, len(prefix), fps, tiny_random.tokens_per_second)
    visual = slice(len(prefix), len(prefix) + grids * rows * cols)
    assert torch.equal(hf_pos[:, 0, visual], ours)


def test_text_after_a_long_video_starts_after_the_largest_position(tiny_random, monkeypatch):
    """A question starts at the largest position used so far + 1: the original Qwen2-VL / Qwen2.5-VL rule
    (``st_idx = llm_pos_ids_list[-1].max() + 1`` for text after a vision block, in Qwen's release code and
    transformers 4.x), the one the models were trained with.

    transformers 5.23's ``get_rope_index`` instead advances by ``max(h, w) / merge`` after a video and ignores
    its temporal extent. Five minutes at 1 fps (150 temporal grids of 2 x 3 tokens, 2 s each, the tiny model's
    ``tokens_per_second = 2``: 4 temporal positions per grid) end at temporal position s + 149 * 4 = s + 596,
    so the original rule starts the question at s + 597, while transformers 5.23 starts it at s + 3: 594
    positions earlier, back inside the video's first seconds, where the question would sit among the video's
    own temporal positions. kvdemo keeps the original rule (and computes positions itself)."""
    from kvdemo.stream.engine import StreamEngine

    fps, grids, rows, cols, per_chunk = 1.0, 150, 2, 3, 10
    per_grid = rows * cols
    engine = StreamEngine(tiny_random, "sliding-window", budget=120, keep=60, fps=fps)
    g = torch.Generator().manual_seed(0)
    width = tiny_random.embed_text([0]).shape[-1]
    local = torch.arange(per_chunk * per_grid)
    for first in range(0, grids, per_chunk):
        engine.feed_chunk(
            VisualChunk(
                embeds=0.02 * torch.randn(len(local), width, generator=g),
                grid=first + local // per_grid,
                row=(local % per_grid) // cols,
                col=local % cols,
                first_grid=first,
                num_grids=per_chunk,
                rows=rows,
                cols=cols,
                grid_times_s=[2 * (first + k) / fps for k in range(per_chunk)],
                frames=2 * per_chunk,
                second_per_grid=2 / fps,
                end_time_s=(2 * (first + per_chunk) - 1) / fps,
            )
        )
    seen = []
    forward = tiny_random.forward
    monkeypatch.setattr(
        tiny_random,
        "forward",
        lambda embeds, positions, cache: seen.append(positions.clone()) or forward(embeds, positions, cache),
    )
    engine.answer("What moved?", max_new_tokens=1)
    question = seen[0]  # the question's prefill: [3, n] positions
    s = engine.memory.prefix_len
    assert tiny_random.tokens_per_second == 2 and s == len(tiny_random.tokenize(tiny_random.prefix_text()))
    last_video = s + (grids - 1) * 4
    n = question.shape[1]
    assert torch.equal(question, torch.arange(last_video + 1, last_video + 1 + n).expand(3, -1))

    # The same token sequence through transformers 5.23's get_rope_index.
    prefix = tiny_random.tokenize(tiny_random.prefix_text())
    text = tiny_random.tokenize(tiny_random.question_text([], "What moved?"))
    video = grids * per_grid
    ids = prefix + [tiny_random.hf.config.video_token_id] * video + text
    hf_pos, _ = tiny_random.hf.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([[0] * len(prefix) + [2] * video + [0] * len(text)]),
        video_grid_thw=torch.tensor([[grids, rows * 2, cols * 2]]),
        second_per_grid_ts=torch.tensor([2 / fps]),
    )
    g_, r_, c_ = torch.meshgrid(torch.arange(grids), torch.arange(rows), torch.arange(cols), indexing="ij")
    ours_video = mrope_positions(g_.flatten(), r_.flatten(), c_.flatten(), s, 2 / fps, tiny_random.tokens_per_second)
    assert torch.equal(hf_pos[:, 0, s : s + video], ours_video)  # the video itself agrees
    assert int(ours_video.max()) == last_video == s + 596
    hf_question = hf_pos[:, 0, s + video :]
    assert torch.equal(hf_question, torch.arange(s + max(rows, cols), s + max(rows, cols) + n).expand(3, -1))
    assert int(question[0, 0] - hf_question[0, 0]) == 594 == math.floor((grids - 1) * 2 / fps * 2) + 1 - max(rows, cols)


def test_chunked_encoding_equals_whole_clip(tiny_random, pancake):
    frames, times = pancake.frames[:8], pancake.times_s[:8]
    whole = tiny_random.encode(frames, 0, times, fps=2.0)
    parts = [tiny_random.encode(frames[i : i + 2], i // 2, times[i : i + 2], fps=2.0) for i in range(0, 8, 2)]
    torch.testing.assert_close(torch.cat([p.embeds for p in parts]), whole.embeds, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([p.grid for p in parts]), whole.grid)
    assert whole.num_grids == 4 and whole.rows == 9 and whole.cols == 15
    assert whole.grid_times_s == [0.0, 1.0, 2.0, 3.0]


def test_tiny_model_is_the_transformers_class_and_deterministic(tiny_random):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from kvdemo.models.qwen2_vl import build_tiny_model

    assert isinstance(tiny_random.hf, Qwen2_5_VLForConditionalGeneration)
    assert tiny_random.random_weights
    again = build_tiny_model()
    for a, b in zip(tiny_random.hf.parameters(), again.hf.parameters()):
        assert torch.equal(a, b)


def test_byte_tokenizer_round_trips_text_and_special_tokens():
    tokenizer = ByteTokenizer()
    text = "<|im_start|>user\nWhat's in the vidéo?<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.special_to_id["<|im_start|>"]
    assert ids[-1] == tokenizer.special_to_id["<|im_end|>"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nWhat's in the vidéo?"


def test_unknown_model_family_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    from kvdemo.models.base import ModelError
    from kvdemo.models.loading import load_model

    GPT2Config(n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(
        ModelError, match="'gpt2' model is not supported; kvdemo supports the families llava_onevision, qwen2_5_vl"
    ):
        load_model(str(tmp_path))


def test_auto_resolves_to_tiny_without_cuda(monkeypatch):
    from kvdemo.models.catalog import chosen_model_name

    monkeypatch.delenv("KVDEMO_MODEL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert chosen_model_name("auto") == "tiny"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert chosen_model_name(None) == "Qwen/Qwen2.5-VL-3B-Instruct"
    monkeypatch.setenv("KVDEMO_MODEL", "tiny")
    assert chosen_model_name(None) == "tiny"
