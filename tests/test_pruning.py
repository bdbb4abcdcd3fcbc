"""Pruning before the LLM, checked independently: EVS's and VidCom2's scores and kept sets restated by hand (plain
loops per token and frame, Python floats) on small tensors, kept sets pinned on hand-worked examples, the streaming
rules (the video so far) restated chunk by chunk, vLLM's own functions (or, where vLLM is not installed, a
restatement of their code) on the real clip's patch embeddings, and the choice read from text."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvdemo.errors import PruningSettingError, UserError
from kvdemo.pruning import PruneSpec, entry_label, parse_prune, split_entry
from kvdemo.pruning.evs import EVS, evs_scores, top_scores
from kvdemo.pruning.stage import Pruning
from kvdemo.pruning.vidcom2 import VidCom2
from kvdemo.stream.engine import StreamEngine

# --- plain restatements (Python lists and floats, one token and one frame at a time) -------------------------


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def loop_evs_scores(frames: list[list[list[float]]], previous: list[list[float]] | None) -> list[list[float]]:
    """1 - cos against the same token of the frame before; the stream's first frame scores 255."""
    out = []
    for t, frame in enumerate(frames):
        before = previous if t == 0 else frames[t - 1]
        out.append([255.0 if before is None else 1 - cosine(token, before[p]) for p, token in enumerate(frame)])
    return out


def loop_evs_kept(scores: list[float], per_frame: int, rate: float) -> set[int]:
    """vLLM's rule on a whole video: the max(P, int(T P (1 - q))) highest scores, ties to the earlier token."""
    count = max(per_frame, int(len(scores) * (1 - rate)))
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return set(order[:count])


def as_lists(t: torch.Tensor) -> list:
    return t.double().tolist()


def loop_vidcom2(frames: list[list[list[float]]], rate: float, channels: list[int] | None = None, past=None):
    """VidCom2 on one chunk, every step a loop; ``past``: (mean of the normalised tokens so far, their count) for the
    streaming video centre. Returns (kept [T][P] bools, channels, (centre, count))."""
    T, P, D = len(frames), len(frames[0]), len(frames[0][0])
    tokens = [token for frame in frames for token in frame]
    if channels is None:
        variance = []
        for c in range(D):
            values = [token[c] for token in tokens]
            mean = sum(values) / len(values)
            variance.append(sum((v - mean) ** 2 for v in values) / len(values))
        channels = sorted(range(D), key=lambda c: (variance[c], c))[: max(1, int(D * 0.5))]
    normalised = []
    for frame in frames:
        rows = []
        for token in frame:
            picked = [token[c] for c in channels]
            norm = max(math.sqrt(sum(v * v for v in picked)), 1e-12)
            rows.append([v / norm for v in picked])
        normalised.append(rows)
    C = len(channels)
    chunk_mean = [sum(normalised[t][p][c] for t in range(T) for p in range(P)) / (T * P) for c in range(C)]
    if past is None:
        centre, seen = chunk_mean, T * P
    else:
        old, count = past
        seen = count + T * P
        centre = [old[c] * count / seen + chunk_mean[c] * T * P / seen for c in range(C)]

    def gaussian(x, c):
        d2 = sum((a - b) ** 2 for a, b in zip(x, c))
        return sum(math.exp(-d2 / (2 * 2.0**k)) for k in range(-3, 2))

    to_video = [[gaussian(normalised[t][p], centre) for p in range(P)] for t in range(T)]
    similarity = []
    for t in range(T):
        frame_centre = [sum(normalised[t][p][c] for p in range(P)) / P for c in range(C)]
        similarity.append([to_video[t][p] + gaussian(normalised[t][p], frame_centre) for p in range(P)])
    distinct = [-sum(row) / P for row in to_video]
    top = max(distinct)
    weights = [math.exp((d - top) / 0.01) for d in distinct]
    share = [w / sum(weights) for w in weights]
    mean_share = sum(share) / T
    budgets = [min(P, max(1, round(min(1.0, (1 - rate) * (1 + s - mean_share)) * P))) for s in share]
    kept = [[False] * P for _ in range(T)]
    for t in range(T):
        for p in sorted(range(P), key=lambda p: (similarity[t][p], p))[: budgets[t]]:
            kept[t][p] = True
    target = max(T, min(int(T * P * (1 - rate)), T * P))
    held = [(t, p) for t in range(T) for p in range(P) if kept[t][p]]
    if len(held) > target:
        for t, p in sorted(held, key=lambda tp: -similarity[tp[0]][tp[1]])[: len(held) - target]:
            kept[t][p] = False
    elif len(held) < target:
        others = [(t, p) for t in range(T) for p in range(P) if not kept[t][p]]
        for t, p in sorted(others, key=lambda tp: similarity[tp[0]][tp[1]])[: target - len(held)]:
            kept[t][p] = True
    return kept, channels, (centre, seen)


def kept_set(mask: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask.flatten()).flatten().tolist())


# --- EVS ----------------------------------------------------------------------------------------------------


def test_evs_scores_equal_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    frames = torch.randn(3, 5, 4, generator=g)
    previous = torch.randn(5, 4, generator=g)
    for before in (None, previous):
        ours = evs_scores(frames, before)
        theirs = loop_evs_scores(as_lists(frames), None if before is None else as_lists(before))
        torch.testing.assert_close(ours.double(), torch.tensor(theirs, dtype=torch.float64), atol=1e-6, rtol=0)


def hand_worked_frames() -> torch.Tensor:
    """3 frames of 4 two-channel tokens: frame 1 turns token 2 by 90 degrees (score 1) and token 3 by 180 (score 2);
    frame 2 turns token 0 of frame 1 by 45 degrees (score 1 - cos 45 = 0.293) and token 1 by 120 (score 1.5)."""
    first = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [1.0, 1.0]])
    second = first.clone()
    second[2] = torch.tensor([0.0, 3.0])
    second[3] = torch.tensor([-1.0, -1.0])
    third = second.clone()
    third[0] = torch.tensor([1.0, 1.0])
    third[1] = torch.tensor([math.sin(math.radians(120)) * 2, math.cos(math.radians(120)) * 2])
    return torch.stack([first, second, third])


def test_evs_keeps_the_first_frame_and_the_most_changed_tokens_hand_worked():
    frames = hand_worked_frames()
    scores = evs_scores(frames, None)
    torch.testing.assert_close(scores[1], torch.tensor([0.0, 0.0, 1.0, 2.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(scores[2], torch.tensor([1 - math.cos(math.pi / 4), 1.5, 0.0, 0.0]), atol=1e-6, rtol=0)
    # q = 0.5 keeps max(4, int(12 * 0.5)) = 6: the first frame, then the two highest scores (2 and 1.5).
    assert kept_set(EVS(0.5).select(frames)) == {0, 1, 2, 3, 4 + 3, 8 + 1}
    # q = 0.3 keeps int(12 * 0.7) = 8: next come 1 (frame 1, token 2) and 0.293 (frame 2, token 0).
    assert kept_set(EVS(0.3).select(frames)) == {0, 1, 2, 3, 4 + 2, 4 + 3, 8 + 0, 8 + 1}
    # q = 0.9 keeps max(4, int(1.2)) = 4: the first frame alone (it scores above any change).
    assert kept_set(EVS(0.9).select(frames)) == {0, 1, 2, 3}


def test_top_scores_ties_go_to_the_earlier_token_as_a_stable_sort():
    scores = torch.tensor([0.5, 1.0, 0.5, 0.5, 2.0, 0.5])
    assert kept_set(top_scores(scores, 4)) == {4, 1, 0, 2}
    assert kept_set(top_scores(scores, 0)) == set() and kept_set(top_scores(scores, 9)) == set(range(6))


@pytest.mark.parametrize("rate", [0.3, 0.75])
def test_streaming_evs_is_vllms_rule_on_the_video_so_far(rate):
    """Fed one or two frames a chunk, a chunk's token enters iff vLLM's rule on every frame so far keeps it; fed as
    one chunk, the mask is vLLM's on the whole video."""
    g = torch.Generator().manual_seed(1)
    frames = torch.randn(7, 6, 5, generator=g)
    flat_scores = [s for row in loop_evs_scores(as_lists(frames), None) for s in row]
    whole = EVS(rate).select(frames)
    assert kept_set(whole) == loop_evs_kept(flat_scores, 6, rate)
    evs, start = EVS(rate), 0
    for size in (1, 2, 1, 3):
        chunk = evs.select(frames[start : start + size])
        so_far = loop_evs_kept(flat_scores[: (start + size) * 6], 6, rate)
        assert kept_set(chunk) == {i - start * 6 for i in so_far if i >= start * 6}, (start, size)
        start += size


# --- VidCom2 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.5, 0.8])
def test_vidcom2_keeps_what_a_plain_loop_keeps(rate):
    g = torch.Generator().manual_seed(2)
    frames = torch.randn(4, 6, 8, generator=g) + torch.linspace(0, 3, 4)[:, None, None]
    ours = VidCom2(rate).select(frames)
    theirs, _, _ = loop_vidcom2(as_lists(frames), rate)
    assert ours.tolist() == theirs
    assert int(ours.sum()) == max(4, min(int(24 * (1 - rate)), 24))


def test_vidcom2_streams_with_the_video_so_far_as_its_centre():
    """Chunk by chunk: the channels chosen on the first chunk, the video centre the mean of every normalised token
    so far; the count of each chunk is vLLM's for that chunk."""
    g = torch.Generator().manual_seed(3)
    frames = torch.randn(6, 5, 6, generator=g) * torch.linspace(0.2, 2, 6)
    method, channels, past = VidCom2(0.6), None, None
    for start, size in ((0, 2), (2, 1), (3, 3)):
        chunk = frames[start : start + size]
        ours = method.select(chunk)
        theirs, channels, past = loop_vidcom2(as_lists(chunk), 0.6, channels, past)
        assert ours.tolist() == theirs, start
    assert method.seen == 30


def test_vidcom2_gives_a_distinctive_frame_more_and_reconciles_to_the_count():
    """Hand-worked: channels 2-3 are loud noise, so the similarities live in channels 0-1, where three frames point
    near (1, 0) and frame 2 near (0, 1), away from the video centre (~(0.75, 0.25)). At q = 0.5 frame 2's softmax share
    is ~1: its budget is round(4 * 0.5 * (1 + 1 - 1/4)) = round(3.5) = 4 (all of it), the others' round(4 * 0.5 *
    (1 - 1/4)) = round(1.5) = 2; 4 + 3 * 2 = 10 is over the count max(4, int(16 * 0.5)) = 8, so the two most similar
    kept tokens (near both centres: frame 2's are far from the video's) leave."""
    noise = torch.tensor([[10.0, -12.0], [-9.0, 11.0], [12.0, 9.0], [-11.0, -10.0]])
    near_x = torch.tensor([[1.0, 0.1], [1.0, -0.1], [1.0, 0.05], [1.0, -0.05]])
    frames = torch.stack(
        [
            torch.cat([near_x + 0.01 * k, noise * (1 + k)], dim=1)
            if k != 2
            else torch.cat([near_x.flip(1), noise * (1 + k)], dim=1)
            for k in range(4)
        ]
    )
    kept = VidCom2(0.5).select(frames)
    theirs, channels, _ = loop_vidcom2(as_lists(frames), 0.5)
    assert sorted(channels) == [0, 1] and kept.tolist() == theirs
    assert kept[2].all() and int(kept.sum()) == 8 and sorted(kept.sum(dim=1).tolist()) == [1, 1, 2, 4]


# --- vLLM's own functions on the real clip's patch embeddings ---------------------------------------------------


def vllm_functions():
    """vLLM's ``evs`` and ``vidcom2`` modules when vLLM is installed, loaded from its files (they import torch
    alone; importing them through the ``vllm`` package needs its whole dependency tree); else None."""
    found = importlib.util.find_spec("vllm")
    if found is None:
        return None
    folder = Path(list(found.submodule_search_locations)[0]) / "multimodal" / "video_prune"
    modules = {}
    for name in ("evs", "vidcom2"):
        spec = importlib.util.spec_from_file_location(f"vllm_video_prune_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module.compute_retention_mask
    return modules


def restated_vllm_evs(embeds: torch.Tensor, thw: tuple[int, int, int], merge: int, q: float) -> torch.Tensor:
    """vLLM's EVS ``compute_retention_mask`` restated: frames [T, H/m, W/m, D], dissimilarity to the previous frame,
    the first frame at 255, a stable descending sort, the first max(P, int(T P (1 - q)))."""
    T, H, W = thw
    video = embeds.reshape(T, H // merge, W // merge, -1)
    changed = 1 - F.cosine_similarity(video[1:], video[:-1], dim=-1)
    scores = torch.cat([torch.full_like(video[:1, :, :, 0], 255.0), changed]).flatten()
    per_frame = (H // merge) * (W // merge)
    count = max(per_frame, int(per_frame * T * (1 - q)))
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[torch.argsort(scores, descending=True, stable=True)[:count]] = True
    return mask


def restated_vllm_vidcom2(embeds: torch.Tensor, thw: tuple[int, int, int], merge: int, q: float) -> torch.Tensor:
    """vLLM's VidCom2 ``compute_retention_mask`` restated: its five steps on the whole video, a loop over frames for
    the per-frame top-k as vLLM writes it."""
    T, H, W = thw
    per_frame = (H // merge) * (W // merge)
    total = T * per_frame
    target = max(T, min(int(total * (1.0 - q)), total))
    low = torch.topk(embeds.var(dim=0, unbiased=False), k=max(1, int(embeds.shape[-1] * 0.5)), largest=False).indices
    frames = F.normalize(embeds.index_select(-1, low).view(T, per_frame, -1), dim=-1)

    def gaussian(x, c):
        d2 = ((x - c) ** 2).sum(dim=-1)
        return sum(torch.exp(-d2 / (2.0 * a)) for a in (0.125, 0.25, 0.5, 1.0, 2.0))

    to_video = gaussian(frames, frames.mean(dim=(0, 1), keepdim=True))
    similarity = to_video + gaussian(frames, frames.mean(dim=1, keepdim=True))
    distinct = -to_video.mean(dim=-1)
    share = F.softmax((distinct - distinct.max()) / 0.01, dim=0)
    budgets = ((1.0 - q) * (1.0 + share - share.mean())).clamp(max=1.0)
    budgets = (budgets * per_frame).round().long().clamp(min=1, max=per_frame).tolist()
    mask = torch.zeros(T, per_frame, dtype=torch.bool)
    for t, k in enumerate(budgets):
        mask[t, torch.topk(similarity[t], k=k, largest=False).indices] = True
    flat, scores = mask.view(-1), similarity.view(-1)
    if sum(budgets) > target:
        held = flat.nonzero().squeeze(-1)
        flat[held[torch.topk(scores[held], k=sum(budgets) - target).indices]] = False
    elif sum(budgets) < target:
        free = (~flat).nonzero().squeeze(-1)
        flat[free[torch.topk(scores[free], k=min(target - sum(budgets), free.numel()), largest=False).indices]] = True
    return flat


@pytest.fixture(scope="module")
def clip_embeddings(pancake, tiny_random):
    """The real clip's patch embeddings (the random tiny Qwen2.5-VL's vision tower, every grid): ``[T, P, D]``, the
    grid (T, H, W) in patches, the merge size."""
    chunk = tiny_random.encode(pancake.frames, 0, pancake.times_s, pancake.fps)
    merge = tiny_random.merge_size
    thw = (chunk.num_grids, chunk.rows * merge, chunk.cols * merge)
    return chunk.embeds.float().view(chunk.num_grids, chunk.tokens_per_grid, -1), thw, merge


@pytest.mark.slow
@pytest.mark.parametrize("method,rate", [("evs", 0.75), ("evs", 0.5), ("vidcom2", 0.75), ("vidcom2", 0.3)])
def test_one_chunk_keeps_what_vllm_keeps_on_the_real_clip(clip_embeddings, method, rate):
    """The whole clip as one chunk: kvdemo's kept tokens equal vLLM's ``compute_retention_mask`` on the same
    embeddings (vLLM's own files where vLLM is installed; here vLLM is not, so its code restated above)."""
    frames, thw, merge = clip_embeddings
    functions = vllm_functions()
    theirs_fn = functions[method] if functions else {"evs": restated_vllm_evs, "vidcom2": restated_vllm_vidcom2}[method]
    print("vLLM's own files" if functions else "vLLM not installed: its code restated in this test")
    theirs = theirs_fn(frames.reshape(-1, frames.shape[-1]), thw, merge, rate)
    ours = Pruning(PruneSpec(method, rate)).selector.select(frames).flatten()
    assert frames.shape[0] >= 10 and torch.equal(ours.cpu(), theirs.cpu())


@pytest.mark.slow
def test_streamed_evs_on_the_real_clip_is_vllm_on_each_prefix(clip_embeddings):
    """Grid by grid, the tokens that enter are vLLM's mask on the clip so far, restricted to the newest grid."""
    frames, (_, H, W), merge = clip_embeddings
    functions = vllm_functions()
    evs_fn = functions["evs"] if functions else restated_vllm_evs
    evs = EVS(0.75)
    per_frame = frames.shape[1]
    for t in range(frames.shape[0]):
        ours = evs.select(frames[t : t + 1]).flatten()
        prefix = evs_fn(frames[: t + 1].reshape(-1, frames.shape[-1]), (t + 1, H, W), merge, 0.75)
        assert torch.equal(ours, prefix[t * per_frame :]), t


# --- the choice as text -------------------------------------------------------------------------------------


def test_a_choice_reads_as_its_method_and_rate():
    assert parse_prune("evs:0.75") == PruneSpec("evs", 0.75)
    assert parse_prune("vidcom2:0.25") == PruneSpec("vidcom2", 0.75)  # a retention ratio: a quarter kept
    assert parse_prune("vidcom2:video_pruning_rate=0.75") == parse_prune(" VidCom2:video-retention-ratio=0.25 ")
    assert parse_prune("evs:video_pruning_rate=0.5").rate == 0.5
    assert parse_prune(None) is None and parse_prune("") is None and parse_prune("none") is None
    spec = parse_prune("vidcom2:0.25")
    assert spec.text == "vidcom2:0.25" and spec.parameter == {"video_retention_ratio": 0.25}
    assert parse_prune(spec.text) == spec
    assert split_entry("evs:0.75+full") == (PruneSpec("evs", 0.75), "full")
    assert split_entry("cords") == (None, "cords")
    assert entry_label(PruneSpec("evs", 0.5), "full") == "evs:0.5+full" and entry_label(None, "full") == "full"


@pytest.mark.parametrize(
    "text,words",
    [
        ("fast:0.5", ["--prune", "unknown pruning method 'fast'", "evs, vidcom2"]),
        ("evs:1.5", ["--prune", "video_pruning_rate", "strictly between 0 and 1", "1.5"]),
        ("evs:0", ["--prune", "video_pruning_rate", "between 0 and 1"]),
        ("vidcom2:1", ["--prune", "video_retention_ratio", "between 0 and 1"]),
        ("evs:nan", ["--prune", "between 0 and 1"]),
        ("evs:half", ["--prune", "must be a number", "'half'"]),
        ("evs", ["--prune", "after a colon"]),
        ("evs:video_retention_ratio=0.2", ["--prune", "evs takes video_pruning_rate"]),
    ],
)
def test_a_bad_choice_is_one_line_naming_the_field(text, words):
    with pytest.raises(PruningSettingError) as caught:
        parse_prune(text, "--prune")
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert all(word in message for word in words), message


def test_the_stage_records_what_each_grid_offered_and_let_in():
    g = torch.Generator().manual_seed(4)
    from kvdemo.cache.chunk import VisualChunk

    def chunk(first: int, grids: int) -> VisualChunk:
        local = torch.arange(grids * 6)
        return VisualChunk(
            embeds=torch.randn(grids * 6, 8, generator=g),
            grid=first + local // 6,
            row=(local % 6) // 3,
            col=local % 3,
            first_grid=first,
            num_grids=grids,
            rows=2,
            cols=3,
            grid_times_s=[float(first + k) for k in range(grids)],
            frames=2 * grids,
            second_per_grid=1.0,
            end_time_s=float(first + grids),
        )

    stage = Pruning("evs:0.5")
    keeps = [stage.prune(chunk(0, 2)), stage.prune(chunk(2, 1))]
    report = stage.report()
    assert [g["grid"] for g in report["grids"]] == [0, 1, 2]
    assert all(g["offered"] == 6 for g in report["grids"]) and report["offered"] == 18
    assert [g["entered"] for g in report["grids"]] == [6, int(keeps[0][6:].sum()), int(keeps[1].sum())]
    assert report["entered"] == sum(int(k.sum()) for k in keeps) and report["rate"] == 0.5
    pruned = stage.pruned_map()
    assert pruned.shape == (3, 2, 3) and not pruned[0].any()
    assert pruned[2].flatten().tolist() == (~keeps[1]).tolist()
    assert stage.points[-1][1:] == (18, report["entered"])


# --- in front of a policy, in the engine ------------------------------------------------------------------------


def stream_chunks(engine: StreamEngine, video, frames_per_chunk: int = 2) -> StreamEngine:
    for start in range(0, video.num_frames, frames_per_chunk):
        engine.feed(video.frames[start : start + frames_per_chunk], video.times_s[start : start + frames_per_chunk])
    engine.flush()
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("prune", ["evs:0.5", "vidcom2:0.5"])
def test_the_budget_counts_what_entered(tiny_random, pancake, prune):
    """In front of a bounded policy: the memory holds at most M of the tokens that entered, compresses less often
    than without pruning, and what entered (the report's count) is what the memory took in."""
    plain = stream_chunks(StreamEngine(tiny_random, "sliding-window", budget=540, keep=405), pancake)
    pruned = stream_chunks(StreamEngine(tiny_random, "sliding-window", budget=540, keep=405, prune=prune), pancake)
    report = pruned.report()["pruning"]
    assert report["offered"] == plain.memory.tokens_seen == sum(c["offered_tokens"] for c in pruned.stats.per_chunk)
    assert report["entered"] == pruned.memory.tokens_seen == sum(c["entered_tokens"] for c in pruned.stats.per_chunk)
    assert report["entered"] < report["offered"]
    assert max(e.visual_tokens for e in pruned.memory.timeline) <= 540
    assert pruned.stats.compressions < plain.stats.compressions
    before = [t.clone() for t in pruned.memory.keys]
    pruned.answer("What is in the video?", 4)
    assert all(torch.equal(a, b) for a, b in zip(before, pruned.memory.keys))


@pytest.mark.slow
def test_pruning_state_crosses_a_process_boundary(tiny_random, pancake):
    """An engine pickled mid-stream (a ZeroGPU call) and attached again prunes the rest as one that never left."""
    import pickle

    whole = stream_chunks(StreamEngine(tiny_random, "full", prune="evs:0.6"), pancake)
    first = StreamEngine(tiny_random, "full", prune="evs:0.6")
    half = pancake.num_frames // 2 // 2 * 2
    for start in range(0, half, 2):
        first.feed(pancake.frames[start : start + 2], pancake.times_s[start : start + 2])
    resumed = pickle.loads(pickle.dumps(first.to("cpu"))).bind(tiny_random)
    for start in range(half, pancake.num_frames, 2):
        resumed.feed(pancake.frames[start : start + 2], pancake.times_s[start : start + 2])
    resumed.flush()
    assert resumed.report()["pruning"] == {
        **whole.report()["pruning"],
        "prune_ms": resumed.pruning.report()["prune_ms"],
    }
    assert torch.equal(resumed.question_logits("What?"), whole.question_logits("What?"))


# --- engines named by their pruning: the lineup, compare's lines ------------------------------------------------


def test_the_lineup_names_each_engine_by_its_pruning_and_policy(tiny_random):
    from kvdemo.experiments.compare import parse_overrides
    from kvdemo.stream.lineup import Contender, make_engines

    engines = make_engines(tiny_random, ["full", "evs:.75+full", Contender("full", prune="vidcom2:0.5")], fps=2.0)
    assert list(engines) == ["full", "evs:0.75+full", "vidcom2:0.5+full"]
    assert engines["full"].pruning is None and engines["evs:0.75+full"].pruning.spec == PruneSpec("evs", 0.75)
    contenders = parse_overrides(
        ["sliding-window", "evs:0.5+sliding-window", "evs:0.5+full"],
        "evs:0.5+sliding-window: M=96 C=64\nsliding-window: prune=vidcom2:0.25",
        prune="evs:0.9",
    )
    assert [c.label for c in contenders] == ["vidcom2:0.25+sliding-window", "evs:0.5+sliding-window", "evs:0.5+full"]
    assert (contenders[1].budget, contenders[1].keep) == ("96", "64")
    with pytest.raises(UserError, match="'full' is always compared"):
        parse_overrides(["full"], "")
    with pytest.raises(UserError, match="'evs:0.5\\+full' is named twice: each policy once"):
        parse_overrides(["evs:0.5+full", "evs:0.5+full"], "")
    with pytest.raises(PruningSettingError, match="sliding-window's prune: unknown pruning method 'x'"):
        parse_overrides(["sliding-window"], "sliding-window: prune=x:0.5")


@pytest.mark.slow
def test_bench_times_the_prefill_pruning_saves():
    """``bench --prune``: the four engines on one stream, each chunk's offered and entered tokens, and the saving
    each pruned engine's prefill makes against its unpruned twin (computed from their own timings)."""
    from kvdemo.bench.pruning import pruning_benchmark, pruning_table
    from kvdemo.cache.budget import Budget
    from kvdemo.policies import make_policy

    policy = make_policy("sliding-window")
    result = pruning_benchmark(policy, 8, Budget.resolve(policy, 400, 300), PruneSpec("evs", 0.75))
    engines = result["engines"]
    assert list(engines) == ["full", "evs:0.75+full", "sliding-window", "evs:0.75+sliding-window"]
    assert [row["offered_tokens"] for row in engines["evs:0.75+full"]["per_chunk"]] == [96] * 4
    assert engines["evs:0.75+full"]["entered"] < engines["full"]["entered"] == 384
    saved = result["saved"]["evs:0.75+full"]
    assert saved["prefill_ms"] == pytest.approx(engines["full"]["prefill_ms"] - engines["evs:0.75+full"]["prefill_ms"])
    assert "evs:0.75+sliding-window: prefill" in pruning_table(result)
