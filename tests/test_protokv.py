"""ProtoKV (paper 003) and the attention seam it reads through: budgets, keys before RoPE, the log-mass
bias against duplicated tokens through a real forward, Alg. 1 restated token by token, maintenance,
beam search against brute force, and whole streams that stay within M."""

import contextlib
import itertools
import math

import numpy as np
import pytest
import torch

from kvdemo.cache.attention import ATTN_IMPLEMENTATION, MemoryCache
from kvdemo.cache.budget import Budget
from kvdemo.cache.memory import KVMemory
from kvdemo.models.qwen2_vl import Qwen2VL, RegionCursor, mrope_positions
from kvdemo.models.tiny import ByteTokenizer, tiny_config
from kvdemo.policies import BudgetError, PolicyParameterError, Selection, make_policy
from kvdemo.policies.contract import SummaryUpdate, slice_stacks
from kvdemo.policies.protokv.absorption import record_residuals
from kvdemo.policies.protokv.assignment import ASSIGNMENT_BLOCK, assign
from kvdemo.policies.protokv.bank import Tokens
from kvdemo.policies.protokv.ema import mahalanobis
from kvdemo.policies.protokv.gathering import gather_tokens
from kvdemo.policies.protokv.pq import beam_search, pq_decode, pq_encode, train_codebooks
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import stream_video
from kvdemo.testing import synthetic_chunk

# --- budget ---------------------------------------------------------------------------------------


def test_budget_split_follows_table_5():
    policy = make_policy("protokv")
    assert policy.split(6144) == (1536, 576)  # W : K_max*S = 1536 : 4608 = 1 : 3, S = 8
    assert policy.split(540) == (140, 50)
    assert policy.summary_slots(6144) == 4608
    assert make_policy("protokv", pseudo_tokens=4).split(6144) == (1536, 1152)
    with pytest.raises(BudgetError, match="too small"):
        policy.split(8)


def split_by_search(budget: int, chunk: int, share: float = 0.25, s: int = 8) -> tuple[int, int] | None:
    """The near-window rule restated as a search: the most prototypes ``K`` whose ``K * S`` slots fit the paper's
    far share of ``M`` and leave a near window of two chunks; None when not even one does."""
    best = None
    for k in range(1, budget // s + 1):
        if k * s <= (1 - share) * budget and budget - k * s >= 2 * chunk:
            best = (budget - k * s, k)
    return best


@pytest.mark.parametrize("chunk", [0, 1, 16, 135, 300])
def test_the_near_window_holds_two_chunks_and_the_bank_takes_the_rest(chunk):
    policy = make_policy("protokv")
    for budget in range(11, 1400, 7):
        expected = split_by_search(budget, chunk)
        if expected is None:
            with pytest.raises(BudgetError):
                policy.split(budget, chunk)
        else:
            assert policy.split(budget, chunk) == expected, budget
    # the tiny model's 16-token chunks at the eval's M = 64: W = 32 (two chunks), K_max = 4 (paper: 16 and 6)
    assert policy.split(64, 16) == (32, 4) and policy.split(64) == (16, 6)
    assert policy.split(6144, 256) == (1536, 576)  # at the 7B budget the paper's split already holds two chunks


def test_a_budget_that_cannot_hold_two_chunks_and_a_prototype_is_one_line():
    from kvdemo.cache.budget import Budget

    budget = Budget.resolve(make_policy("protokv"), 39)
    with pytest.raises(BudgetError) as error:
        budget.sized(make_policy("protokv"), 16, "1 temporal grid(s) of 4x4 tokens")
    message = str(error.value)
    assert "\n" not in message and "M=39 cannot hold ProtoKV's near window of 32 tokens" in message
    assert message.endswith("raise M to at least 40")
    fitted = Budget.resolve(make_policy("protokv"), 40).sized(make_policy("protokv"), 16)
    assert (fitted.window, fitted.summary, fitted.chunk) == (32, 8, 16)
    assert fitted.split_text == "a near window of 32 exact tokens + 1 prototypes x 8 pseudo-tokens"
    with pytest.raises(BudgetError, match="raise M to at least 40"):
        budget.check_chunk(make_policy("protokv"), 16)  # a later chunk checked against it says the same


def test_engine_takes_m_alone_and_checks_the_near_window(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "protokv", budget=540, fps=2.0)
    assert engine.budget.C is None and engine.memory.summary_slots == 400  # the paper's split until chunks are sized
    engine.feed(pancake.frames[:2])  # one 135-token grid: W = 540 - 33 * 8 = 276 >= 2 x 135
    assert (engine.budget.window, engine.memory.summary_slots, engine.memory.visual_capacity) == (276, 264, 276)
    with pytest.raises(BudgetError, match="C does not apply"):
        StreamEngine(tiny_random, "protokv", budget=540, keep=400)
    small = StreamEngine(tiny_random, "protokv", budget=277, fps=2.0)  # room for two grids, none for a prototype
    with pytest.raises(BudgetError, match="M=277 cannot hold ProtoKV's near window of 270 tokens"):
        small.feed(pancake.frames[:2])


def test_the_newest_chunk_stays_exact_through_every_compression(tiny_random):
    """At the eval's M = 64 on 16-token grids, after every chunk the memory holds every token of the two newest
    grids exactly (read from its provenance), so a question asked right after the evidence left view sees it."""
    from kvdemo.world.synthetic import synthetic_video

    video = synthetic_video(num_frames=24, height=112, width=112, fps=2.0, seed=3)
    engine = StreamEngine(tiny_random, "protokv", budget=64, fps=2.0)
    for start in range(0, 24, 2):
        engine.feed(video.frames[start : start + 2])
        newest = engine.memory.num_grids - 1
        for layer in range(tiny_random.num_layers):
            frames = engine.memory.layers[layer].provenance["frame"][:, : engine.memory.layers[layer].visual_len]
            for grid in (newest - 1, newest):
                if grid >= 0:
                    assert (frames == grid).sum(dim=1).tolist() == [16] * tiny_random.num_kv_heads
    # summary slots count from the start: chunks 1-2 fit 32 + 32 <= 64, each of chunks 3-12 needs a compression
    assert engine.stats.compressions == 10 and engine.memory.summary_slots == 32


# --- keys before RoPE -----------------------------------------------------------------------------


def rotate_by_hand(x: torch.Tensor, position: torch.Tensor, inv_freq: torch.Tensor, section: list[int]) -> torch.Tensor:
    """M-RoPE restated: frequency i of the first half rotates the pair (i, i + D/2) by position[axis(i)] *
    inv_freq[i], axis 0/1/2 (temporal/height/width) by mrope_section."""
    half = x.shape[-1] // 2
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    angle = position[..., axis].double() * inv_freq.double()  # [..., half]
    cos, sin = torch.cos(angle), torch.sin(angle)
    first, second = x[..., :half].double(), x[..., half:].double()
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).float()


def qwen2_vl_model():
    from transformers import Qwen2VLForConditionalGeneration

    from test_loading import qwen2_config

    ids = ByteTokenizer().special_to_id
    model = Qwen2VLForConditionalGeneration._from_config(qwen2_config(ids), attn_implementation=ATTN_IMPLEMENTATION)
    return Qwen2VL(model.eval(), ByteTokenizer(), name="tiny-qwen2-vl", random_weights=True)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_unrotate_then_rotate_returns_the_cached_key(tiny_random, family):
    model = tiny_random if family == "qwen2_5_vl" else qwen2_vl_model()
    chunk = synthetic_chunk(3, 2, (4, 5))
    tokens_per_second = model.tokens_per_second  # None for Qwen2-VL: temporal = s + g
    positions = mrope_positions(chunk.grid, chunk.row, chunk.col, 17, 1.0, tokens_per_second).t()  # [n, 3]
    keys = torch.randn(model.num_kv_heads, chunk.num_tokens, model.head_dim)
    rotated = model.rotary.rotate(keys, positions.expand(model.num_kv_heads, -1, -1))
    rotary = model.hf.model.language_model.rotary_emb
    section = (
        rotary.mrope_section
        if hasattr(rotary, "mrope_section")
        else model.hf.config.text_config.rope_parameters["mrope_section"]
    )
    torch.testing.assert_close(rotated, rotate_by_hand(keys, positions, rotary.inv_freq, section), atol=1e-5, rtol=1e-5)
    back = model.rotary.unrotate(rotated, positions.expand(model.num_kv_heads, -1, -1))
    torch.testing.assert_close(back, keys, atol=1e-5, rtol=1e-5)


def test_unrotated_cached_keys_are_the_projection_before_rope(tiny_random, small_video):
    """End to end: the keys the memory caches for a chunk, un-rotated at their stored positions, equal
    layer 0's key projection of the chunk's embeddings (which never saw a position)."""
    from kvdemo.stream.engine import FrameStream

    engine = StreamEngine(tiny_random, "full", fps=2.0)
    stream = FrameStream(tiny_random, 2.0)
    chunk = stream.push(small_video.frames[:4])
    engine.feed_chunk(chunk)
    view = engine.memory.slices(tiny_random.rotary)[0]
    attention = tiny_random.hf.model.language_model.layers[0]
    hidden = attention.input_layernorm(chunk.embeds[None])
    projected = (
        attention.self_attn.k_proj(hidden)
        .view(chunk.num_tokens, tiny_random.num_kv_heads, tiny_random.head_dim)
        .transpose(0, 1)
    )
    unrotated = tiny_random.rotary.unrotate(view.keys, view.position)
    torch.testing.assert_close(unrotated, projected, atol=1e-4, rtol=1e-4)


# --- the attention seam ---------------------------------------------------------------------------


def prefill(model, memory: KVMemory, grids: int = 2, seed: int = 0):
    """Prefix and ``grids`` random 3x4 grids through the real model into ``memory``."""
    g = torch.Generator().manual_seed(seed)
    ids = model.tokenize(model.prefix_text())
    cache = MemoryCache(memory)
    model.forward(model.embed_text(ids), torch.arange(len(ids)).expand(3, -1), cache)
    memory.commit_prefix(len(ids))
    chunk = synthetic_chunk(0, grids, (3, 4))
    embeds = torch.randn(chunk.num_tokens, model.hf.config.text_config.hidden_size, generator=g)
    positions = mrope_positions(chunk.grid, chunk.row, chunk.col, memory.prefix_len, 1.0, 2.0)
    model.forward(embeds, positions, MemoryCache(memory))
    memory.commit_append(chunk, positions)
    memory.cursor = RegionCursor(int(positions.max()) + 1, memory.prefix_len)
    return embeds


def question_logits(model, memory: KVMemory) -> torch.Tensor:
    ids = model.tokenize("<|vision_end|>What colour?<|im_end|>\n<|im_start|>assistant\n")
    start = memory.cursor.next
    with torch.inference_mode():
        return model.forward(
            model.embed_text(ids), torch.arange(start, start + len(ids)).expand(3, -1), MemoryCache(memory)
        )


def test_the_seam_without_extras_equals_sdpa(tiny_random):
    """kvdemo's attention with nothing supplied = transformers' sdpa on the same weights and inputs."""
    from transformers import DynamicCache, Qwen2_5_VLForConditionalGeneration

    reference = Qwen2_5_VLForConditionalGeneration._from_config(tiny_config(), attn_implementation="sdpa")
    reference.load_state_dict(tiny_random.hf.state_dict())
    reference.eval()
    memory = KVMemory(tiny_random.num_layers, tiny_random.num_kv_heads)
    embeds = prefill(tiny_random, memory)
    ours = question_logits(tiny_random, memory)
    ids = tiny_random.tokenize(tiny_random.prefix_text())
    text = tiny_random.tokenize("<|vision_end|>What colour?<|im_end|>\n<|im_start|>assistant\n")
    chunk = synthetic_chunk(0, 2, (3, 4))
    visual = mrope_positions(chunk.grid, chunk.row, chunk.col, len(ids), 1.0, 2.0)
    start = int(visual.max()) + 1
    positions = torch.cat(
        [torch.arange(len(ids)).expand(3, -1), visual, torch.arange(start, start + len(text)).expand(3, -1)], 1
    )
    all_embeds = torch.cat([tiny_random.embed_text(ids), embeds, tiny_random.embed_text(text)])
    with torch.inference_mode():
        out = reference(
            inputs_embeds=all_embeds[None], position_ids=positions[:, None], cache=DynamicCache(), use_cache=True
        )
    torch.testing.assert_close(ours, out.logits[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mass", [1, 3, 7])
@torch.inference_mode()
def test_a_prototype_of_mass_n_attends_like_n_duplicates(tiny_random, mass):
    """S = 1, no residual: one pseudo-token with bias log n = n copies of that key/value, in every layer and
    KV head (GQA: 4 query heads over 2 KV heads), through a real forward of the tiny model."""
    chosen = 5  # the visual token that becomes the prototype
    summarised = KVMemory(tiny_random.num_layers, tiny_random.num_kv_heads, Budget(summary=1))
    prefill(tiny_random, summarised)
    duplicated = KVMemory(tiny_random.num_layers, tiny_random.num_kv_heads)
    prefill(tiny_random, duplicated)
    others = torch.tensor([i for i in range(24) if i != chosen]).expand(tiny_random.num_kv_heads, -1)
    updates = []
    for layer in range(tiny_random.num_layers):
        view = summarised.slices()[layer]
        k, v = view.keys[:, chosen : chosen + 1].clone(), view.values[:, chosen : chosen + 1].clone()
        bias = torch.full((tiny_random.num_kv_heads, 1), math.log(mass))
        updates.append(SummaryUpdate(k, v, bias))
    summarised.apply(Selection([others] * tiny_random.num_layers, summary=updates))
    # The duplicate memory: drop the chosen token, then append `mass` copies of it.
    copies = [
        (update.keys.expand(-1, mass, -1)[None].clone(), update.values.expand(-1, mass, -1)[None].clone())
        for update in updates
    ]
    duplicated.apply(Selection([others] * tiny_random.num_layers))
    cache = MemoryCache(duplicated)
    for layer, (k, v) in zip(cache.layers, copies):
        layer.update(k, v)
    chunk = synthetic_chunk(2, 1, (3, 4))
    chunk.embeds, chunk.grid, chunk.row, chunk.col = (
        chunk.embeds[:mass],
        chunk.grid[:mass],
        chunk.row[:mass],
        chunk.col[:mass],
    )
    duplicated.commit_append(chunk, torch.zeros(3, mass, dtype=torch.long))
    duplicated.cursor = summarised.cursor
    torch.testing.assert_close(
        question_logits(tiny_random, summarised), question_logits(tiny_random, duplicated), atol=1e-4, rtol=1e-4
    )


def test_a_hidden_summary_slot_changes_nothing(tiny_random):
    """Unused summary slots carry -inf: attention equals a memory without a summary region."""
    with_region = KVMemory(tiny_random.num_layers, tiny_random.num_kv_heads, Budget(summary=4))
    prefill(tiny_random, with_region)
    plain = KVMemory(tiny_random.num_layers, tiny_random.num_kv_heads)
    prefill(tiny_random, plain)
    torch.testing.assert_close(
        question_logits(tiny_random, with_region), question_logits(tiny_random, plain), atol=1e-4, rtol=1e-4
    )


# --- Alg. 1 token by token ------------------------------------------------------------------------


def alg1_reference(bank: dict, tokens: list[dict], policy) -> list[int]:
    """Alg. 1 restated with plain Python numbers, one token at a time; mutates ``bank`` (lists of floats)
    and returns the prototype each token went to. Residual histograms are not part of this check."""
    a, eta = policy.centre_rate, policy.spatial_rate
    chosen = []
    for token in tokens:
        k, v, s, t = token["k"], token["v"], token["s"], token["t"]
        empty = [j for j, used in enumerate(bank["used"]) if not used]
        if empty:
            j = empty[0]
            bank["c"][j], bank["p"][j], bank["n"][j] = list(k), list(v), 1
            bank["mu"][j], bank["sigma"][j], bank["tau"][j], bank["used"][j] = (
                list(s),
                [[1.0, 0.0], [0.0, 1.0]],
                t,
                True,
            )
            chosen.append(j)
            continue
        best, best_cost = None, float("inf")
        for j in range(len(bank["c"])):
            if bank["n"][j] <= 0:
                continue
            c = bank["c"][j]
            cos = sum(x * y for x, y in zip(k, c)) / (
                math.sqrt(sum(x * x for x in k)) * math.sqrt(sum(y * y for y in c))
            )
            (s00, s01), (_, s11) = bank["sigma"][j]
            s00, s11 = s00 + 1e-4, s11 + 1e-4  # the policy's documented floor
            det = s00 * s11 - s01 * s01
            dx, dy = s[0] - bank["mu"][j][0], s[1] - bank["mu"][j][1]
            mah = math.sqrt(max(0.0, (s11 * dx * dx - 2 * s01 * dx * dy + s00 * dy * dy) / det))
            cost = -cos + policy.lambda_sp * mah + policy.lambda_idle * (t - bank["tau"][j] > policy.t_idle)
            if cost < best_cost:
                best, best_cost = j, cost
        j = best
        bank["c"][j] = [(1 - a) * c + a * x for c, x in zip(bank["c"][j], k)]
        bank["p"][j] = [(1 - a) * c + a * x for c, x in zip(bank["p"][j], v)]
        bank["n"][j] += 1
        bank["tau"][j] = t
        bank["mu"][j] = [(1 - eta) * m + eta * x for m, x in zip(bank["mu"][j], s)]
        d = [x - m for x, m in zip(s, bank["mu"][j])]
        bank["sigma"][j] = [
            [(1 - eta) * bank["sigma"][j][r][c] + eta * d[r] * d[c] for c in range(2)] for r in range(2)
        ]
        chosen.append(j)
    return chosen


def fresh_bank(policy, prototypes: int, dim: int, rows: int = 1):
    return policy._new_bank(rows, prototypes, dim, (4, 4), torch.device("cpu"))


def run_batched(policy, bank, tokens):
    keys = torch.tensor([[tok["k"] for tok in tokens]], dtype=torch.float32)
    values = torch.tensor([[tok["v"] for tok in tokens]], dtype=torch.float32)
    spatial = torch.tensor([[tok["s"] for tok in tokens]], dtype=torch.float32)
    n = len(tokens)
    position = torch.zeros(1, n, 3, dtype=torch.long)
    frame = torch.zeros(1, n, dtype=torch.long)
    rowcol = torch.zeros(1, n, dtype=torch.long)
    policy.absorb(bank, keys, values, spatial, position, frame, rowcol, rowcol, tokens[0]["t"])


def as_lists(bank):
    return {
        "c": bank.centre_k[0].tolist(),
        "p": bank.centre_v[0].tolist(),
        "n": bank.mass[0].tolist(),
        "mu": bank.mu[0].tolist(),
        "sigma": bank.sigma[0].tolist(),
        "tau": bank.tau_time[0].tolist(),
        "used": bank.used[0].tolist(),
    }


def near_tokens(keys, values, spatial, position, order) -> Tokens:
    """Near-window tokens of the bank's rows (``keys [B, n, D]``), as ``near(count)`` returns them."""
    keys, values = torch.as_tensor(keys, dtype=torch.float32), torch.as_tensor(values, dtype=torch.float32)
    rows = keys.shape[0]
    spatial = torch.as_tensor(spatial, dtype=torch.float32).reshape(rows, -1, 2)
    position = torch.as_tensor(position).long().reshape(rows, -1, 3)
    order = torch.as_tensor(order).long().reshape(rows, -1)
    zeros = torch.zeros_like(order)
    return Tokens(keys, values, spatial, position, zeros, zeros, zeros, order)


def random_tokens(rng, count, dim, t, around=None, spread=0.05):
    tokens = []
    for i in range(count):
        base = around[i % len(around)] if around is not None else rng.normal(size=dim)
        tokens.append(
            {
                "k": list(base + spread * rng.normal(size=dim)),
                "v": list(rng.normal(size=dim)),
                "s": list(rng.uniform(size=2)),
                "t": t,
            }
        )
    return tokens


def test_alg1_batched_equals_token_by_token_when_prototypes_get_one_token_each():
    policy = make_policy("protokv")
    rng = np.random.default_rng(0)
    dim, prototypes = 8, 5
    anchors = [np.eye(dim)[i] * 3 for i in range(prototypes)]
    bank = fresh_bank(policy, prototypes, dim)
    first = random_tokens(rng, prototypes + 2, dim, t=1, around=anchors)  # fills the 5 fresh slots, then 2 more
    reference = as_lists(bank)
    alg1_reference(reference, first, policy)
    run_batched(policy, bank, first)
    second = random_tokens(rng, 3, dim, t=2, around=[anchors[4], anchors[0], anchors[2]])  # one per prototype
    alg1_reference(reference, second, policy)
    run_batched(policy, bank, second)
    got = as_lists(bank)
    assert got["n"] == reference["n"] and got["tau"] == reference["tau"] and got["used"] == reference["used"]
    for name in ("c", "p", "mu", "sigma"):
        np.testing.assert_allclose(np.array(got[name]), np.array(reference[name]), atol=1e-5, err_msg=name)


def test_alg1_batched_drift_when_many_tokens_share_a_prototype(monkeypatch):
    """Same assignments, twelve tokens on one prototype: centres, mass, spatial mean and covariance still
    follow the sequential updates exactly; the PQ residuals use the chunk-start centre, and drift from
    Alg. 1's (measured here against the restatement's ``x - c_after``)."""
    policy = make_policy("protokv")
    rng = np.random.default_rng(1)
    dim = 8
    anchors = [np.eye(dim)[i] * 3 for i in range(3)]
    bank = fresh_bank(policy, 3, dim)
    reference = as_lists(bank)
    setup = random_tokens(rng, 3, dim, t=1, around=anchors)
    alg1_reference(reference, setup, policy)
    run_batched(policy, bank, setup)
    crowd = random_tokens(rng, 12, dim, t=2, around=[anchors[1]], spread=0.5)
    exact_residuals = []
    centre = list(reference["c"][1])
    for token in crowd:  # Alg. 1 line 13: residual against the centre right after the token's update
        centre = [(1 - policy.centre_rate) * c + policy.centre_rate * x for c, x in zip(centre, token["k"])]
        exact_residuals.append([x - c for x, c in zip(token["k"], centre)])
    assigned = alg1_reference(reference, crowd, policy)
    assert set(assigned) == {1}
    captured = {}
    monkeypatch.setattr(policy, "_record_residuals", lambda bank, cell, mask, rk, rv: captured.update(rk=rk[mask]))
    run_batched(policy, bank, crowd)
    got = as_lists(bank)
    assert got["n"] == reference["n"] == [1, 13, 1]
    for name in ("c", "p", "mu", "sigma"):
        np.testing.assert_allclose(np.array(got[name]), np.array(reference[name]), atol=1e-5, err_msg=name)
    batched = captured["rk"].numpy()
    exact = np.array(exact_residuals)
    np.testing.assert_allclose(batched[0], exact[0], atol=1e-5)  # the first token sees the chunk-start centre
    drift = np.linalg.norm(batched - exact, axis=1) / np.linalg.norm(exact, axis=1)
    assert drift[-1] > drift[1] > 0  # grows with the tokens before it on the prototype
    assert drift.max() < 0.5, drift


def test_fresh_slots_take_evicted_tokens_before_any_absorption():
    policy = make_policy("protokv", subquantizers=2)
    bank = fresh_bank(policy, 4, 4)
    tokens = random_tokens(np.random.default_rng(2), 6, 4, t=0)
    reference = as_lists(fresh_bank(policy, 4, 4))
    assigned = alg1_reference(reference, tokens, policy)
    run_batched(policy, bank, tokens)
    assert assigned[:4] == [0, 1, 2, 3]  # the first four tokens open the four fresh slots, in order
    assert bank.used[0].all() and int(bank.mass.sum()) == 6
    for slot in range(4):
        if int(bank.mass[0, slot]) == 1:  # untouched since it was opened: its centre is its token
            torch.testing.assert_close(bank.centre_k[0, slot], torch.tensor(tokens[slot]["k"], dtype=torch.float32))


# --- maintenance ----------------------------------------------------------------------------------


def test_aging_merging_and_recycling():
    policy = make_policy("protokv", t_idle=5, decay=0.5, subquantizers=2)
    bank = fresh_bank(policy, 4, 4)
    bank.used[:] = True
    bank.centre_k[0] = torch.tensor([[1.0, 0, 0, 0], [1.0, 0.01, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]])
    bank.centre_v[0] = torch.tensor([[0, 0, 0, 2.0], [0, 0, 0.01, 2.0], [3.0, 0, 0, 0], [0, 3.0, 0, 0]])
    bank.mass[0] = torch.tensor([3, 5, 9, 1])
    bank.tau_time[0] = torch.tensor([10, 10, 2, 10])  # prototype 2 idle at t=10 (10 - 2 > 5)
    near_key = torch.tensor([[[0.5, 0.5, 0.5, 0.5]]])

    def near(count):
        return near_tokens(near_key, 2 * near_key, [[0.25, 0.75]], [[4, 5, 6]], order=[[40]])

    touched = policy.maintain(bank, near, t=10)
    # aging: 9 -> floor(4.5) = 4; merging: 1 into 0 (mass 3 + 5), centre weighted 3:5; recycling: slot 1 refilled
    # from the near token, with no mass until that token leaves the window
    assert bank.mass[0].tolist() == [8, 0, 4, 1]
    torch.testing.assert_close(bank.centre_k[0, 0], torch.tensor([1.0, 0.05 / 8, 0, 0]))
    torch.testing.assert_close(bank.centre_k[0, 1], near_key[0, 0])
    assert bank.tau_pos[0, 1].tolist() == [4, 5, 6]
    assert touched[0].tolist() == [True, True, False, False]
    assert (
        bank.seed_order.tolist() == [[40]] and bank.seed_slot.tolist() == [[1]] and bank.open[0].tolist() == [True] * 4
    )
    # the seed leaves the window: slot 1 gets its mass, and nothing else moves (no second EMA step, no residual)
    centre = bank.centre_k[0, 1].clone()
    policy.absorb(
        bank,
        near_key,
        near_key,
        torch.tensor([[[0.25, 0.75]]]),
        torch.tensor([[[4, 5, 6]]]),
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.long),
        t=11,
        order=torch.tensor([[40]]),
    )
    assert bank.mass[0].tolist() == [8, 1, 4, 1] and bank.seed_order.shape == (1, 0)
    torch.testing.assert_close(bank.centre_k[0, 1], centre)


def test_the_churn_counts_each_passes_merges_and_recyclings_per_row():
    """Row 0: one merge (1 into 0) and one recycling (slot 1) at t=10; row 1: nothing. A second pass at t=11 with
    nothing to merge or recycle. The ring holds both passes, oldest first; the report averages per row and pass."""
    policy = make_policy("protokv", subquantizers=2)
    bank = fresh_bank(policy, 3, 4, rows=2)
    bank.used[:] = True
    e = torch.eye(4)
    bank.centre_k[:] = torch.stack([e[0], e[0] + 0.01 * e[1], e[2]])
    bank.centre_v[:] = bank.centre_k.clone()
    bank.centre_k[1, 1] = e[3]  # row 1's prototypes are far apart
    bank.mass[:] = torch.tensor([2, 3, 4])
    bank.tau_time[:] = 10
    near_key = torch.tensor([[[0.5, 0.5, 0.5, 0.5]], [[0.5, 0.5, 0.5, 0.5]]])

    def near(count):
        return near_tokens(near_key, near_key, [[0.25, 0.75]] * 2, [[4, 5, 6]] * 2, order=[[40], [40]])

    policy.maintain(bank, near, t=10)
    bank.close_pass(10)
    policy.maintain(bank, near, t=11, changed=torch.zeros(2, 3, dtype=torch.bool))
    bank.close_pass(11)
    assert bank.churn.tolist() == [[[1, 0], [1, 0]], [[0, 0], [0, 0]]]  # [pass, (merged, recycled), row]
    assert bank.churn_grid.tolist() == [10, 11] and bank.passes == 2
    policy._bank = bank
    assert policy.churn(0) == {
        "grids": [10, 11],
        "merged": [1, 0],
        "recycled": [1, 0],
        "merged_per_pass": 0.5,
        "recycled_per_pass": 0.5,
    }
    report = policy.report()
    assert report["merged_per_row_pass"] == 0.25 and report["recycled_per_row_pass"] == 0.25  # 1 / (2 passes x 2 rows)


def test_merges_and_recyclings_differ_once_aging_empties_a_slot_and_the_churn_chart_says_which():
    """Not equal by construction: with t_idle = 1 and decay = 1 a prototype idle for 10 grids loses all its mass, so
    its slot is recycled in a pass that merged nothing (row 0's prototypes are far apart). The churn chart's axis
    counts slots per pass, and its caption says whether the two series agree and why."""
    from kvdemo.policies.protokv.views import prototype_views
    from kvdemo.views import ViewContext

    policy = make_policy("protokv", subquantizers=2, t_idle=1, decay=1.0)
    bank = fresh_bank(policy, 3, 4, rows=1)
    bank.used[:] = True
    bank.centre_k[:] = torch.eye(4)[:3]
    bank.centre_v[:] = bank.centre_k.clone()
    bank.mass[:] = torch.tensor([2, 3, 4])
    bank.tau_time[:] = torch.tensor([[10, 0, 10]])  # prototype 1 idle since grid 0
    near_key = torch.tensor([[[0.5, 0.5, 0.5, 0.5]]])

    def near(count):
        return near_tokens(near_key, near_key, [[0.25, 0.75]], [[4, 5, 6]], order=[[40]])

    policy.maintain(bank, near, t=10)
    bank.close_pass(10)
    assert bank.churn.tolist() == [[[0], [1]]]  # [pass, (merged, recycled), row]: recycled, never merged
    policy._bank = bank
    context = ViewContext(1, 1, (2, 2), [float(t) for t in range(11)], [], 24)
    data = {"grids": [], "prototype": [], "mass": np.array([2, 0, 4])}
    differ = prototype_views(data, policy.churn(0), context, 0, 0)[-1]
    assert differ.parts[2].y_title == "slots merged / recycled per pass"
    assert "slots emptied by aging are refilled too" in differ.caption
    same = {"grids": [10, 11], "merged": [1, 0], "recycled": [1, 0], "merged_per_pass": 0.5, "recycled_per_pass": 0.5}
    assert "the same in every pass" in prototype_views(data, same, context, 0, 0)[-1].caption


# --- residuals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("groups,codewords,modes,beam", [(3, 4, 6, 64), (4, 5, 8, 32), (5, 3, 4, 4)])
def test_beam_search_finds_the_brute_force_top_tuples(groups, codewords, modes, beam):
    g = torch.Generator().manual_seed(3)
    hist = torch.randint(0, 9, (5, groups, codewords), generator=g)  # 5 prototypes
    codes = beam_search(hist, modes=modes, beam=beam, smoothing=0.1)
    assert codes.shape == (5, modes, groups)
    for p in range(5):
        logp = torch.log((hist[p].double() + 0.1) / (hist[p].sum(-1, keepdim=True).double() + 0.1 * codewords))
        tuples = sorted(
            itertools.product(range(codewords), repeat=groups),
            key=lambda z: -sum(float(logp[i, c]) for i, c in enumerate(z)),
        )
        best = [sum(float(logp[i, c]) for i, c in enumerate(z)) for z in tuples[:modes]]
        found = [sum(float(logp[i, c]) for i, c in enumerate(z)) for z in codes[p].tolist()]
        np.testing.assert_allclose(found, best, atol=1e-5)


@pytest.mark.parametrize(
    "params, message",
    [
        (
            {"beam": 2},
            "beam=2 is narrower than S=8 pseudo-tokens (it would repeat code tuples); use beam >= 8, or 0 for 4 S",
        ),
        ({"beam": "7"}, "beam=7 is narrower than S=8"),
        ({"beam": 3, "pseudo_tokens": 4}, "beam=3 is narrower than S=4"),
    ],
)
def test_a_beam_narrower_than_s_is_refused_in_one_line(params, message):
    with pytest.raises(PolicyParameterError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        make_policy("protokv", **params)
    assert "\n" not in str(error.value)
    assert make_policy("protokv", beam=8).beam == 8 and make_policy("protokv", beam=0).beam == 0  # 0 = 4 S


def test_the_cli_refuses_a_narrow_beam_before_the_model_loads(capsys):
    from kvdemo.cli import main

    assert main(["run", "--policy", "protokv", "--param", "beam=2", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: beam=2 is narrower than S=8 pseudo-tokens (it would repeat code tuples); use beam >= 8, or 0 for 4 S"
    ]


@pytest.mark.parametrize("groups,codewords,modes", [(3, 5, 6), (4, 4, 8), (2, 6, 8)])
def test_beam_search_orders_tied_tuples_as_its_rule_says(groups, codewords, modes):
    """Histograms with few counts (many codewords with equal counts, so many tuples with equal scores): the search
    returns exactly the first ``modes`` tuples of an exhaustive enumeration sorted by the stated rule (the
    fixed-point score sum_g round(2^32 log P), higher first; equal scores to the lexicographically smaller tuple)."""
    g = torch.Generator().manual_seed(7)
    hist = torch.randint(0, 3, (40, groups, codewords), generator=g)
    codes = beam_search(hist, modes=modes, beam=4 * modes, smoothing=0.1)
    for p in range(hist.shape[0]):
        total = [int(hist[p, i].sum()) for i in range(groups)]
        score = [
            [
                round(math.log((int(hist[p, i, c]) + 0.1) / (total[i] + 0.1 * codewords)) * 2**32)
                for c in range(codewords)
            ]
            for i in range(groups)
        ]
        ranked = sorted(
            itertools.product(range(codewords), repeat=groups),
            key=lambda z: (-sum(score[i][c] for i, c in enumerate(z)), z),
        )
        assert codes[p].tolist() == [list(z) for z in ranked[:modes]], p


def test_beam_search_refuses_histograms_too_full_to_rank_by_count():
    """Codewords are ranked by their counts, which matches the score order only while two counts differ by more than
    2^-32 in log-probability: a histogram of 2^31 residuals or more is refused, one below is searched."""
    with pytest.raises(ValueError, match="fewer than 2\\^31 residuals"):
        beam_search(torch.full((1, 2, 4), 2**29), modes=2, beam=8, smoothing=0.1)
    codes = beam_search(torch.tensor([[[2**29 - 1, 2**29, 2**29, 7]] * 2]), modes=2, beam=8, smoothing=0.1)
    assert codes.tolist() == [[[1, 1], [1, 2]]]  # the two tied largest counts, lower codeword first


def test_pq_codebooks_encode_and_decode_clustered_residuals():
    g = torch.Generator().manual_seed(4)
    centres = torch.randn(2, 16, 8, generator=g) * 5  # two rows, 16 clusters in an 8-d space
    labels = torch.arange(256) % 16
    points = centres[:, labels] + 0.01 * torch.randn(2, 256, 8, generator=g)
    codebook = train_codebooks(points, groups=2, codewords=16)
    codes = pq_encode(points, codebook)
    decoded = pq_decode(codes[:, :, None, :], codebook)[:, :, 0]
    assert (decoded - points).abs().max() < 0.2


def test_mahalanobis_matches_the_plain_formula():
    g = torch.Generator().manual_seed(5)
    spatial, mu = torch.rand(2, 7, 2, generator=g), torch.rand(2, 3, 2, generator=g)
    a = torch.randn(2, 3, 2, 2, generator=g)
    sigma = a @ a.transpose(-1, -2) + 0.1 * torch.eye(2)
    got = mahalanobis(spatial, mu, sigma)
    inverse = torch.linalg.inv(sigma.double() + 1e-4 * torch.eye(2, dtype=torch.float64))
    diff = spatial.double()[:, :, None] - mu.double()[:, None]
    expected = torch.einsum("bekx,bkxy,beky->bek", diff, inverse, diff).sqrt()
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


# --- whole streams --------------------------------------------------------------------------------


def test_protokv_streams_the_real_clip_within_m_and_answers(tiny_random, pancake):
    engine = StreamEngine(
        tiny_random, "protokv", budget=540, fps=pancake.fps, max_new_tokens=6, policy_params={"warmup": 64}
    )
    list(stream_video(tiny_random, pancake, {"p": engine}))
    timeline = engine.memory.timeline
    assert max(e.visual_tokens for e in timeline) <= 540
    assert engine.stats.compressions == 8
    # near window: W = 276 (two 135-token grids and 6 more): the newest 276 - 135 + 135 tokens, all from the newest grids
    assert engine.memory.visual_tokens == 264 + 276
    report = engine.report()
    bank = report["policy_state"]
    slots = engine.policy._bank
    # every slot holds mass or waits for its seed token to leave the window (then hidden from attention)
    assert (
        int((slots.active | slots.seeded).sum()) == 33 * tiny_random.num_layers * tiny_random.num_kv_heads
        and bank["codebooks_trained"]
    )
    assert bank["mass_total"] == tiny_random.num_layers * tiny_random.num_kv_heads * (
        engine.memory.tokens_seen - 276
    )  # decay never ran
    answer = engine.answer("What is in the pan?")
    assert answer.tokens >= 1 and report["keep"] is None
    visible = slots.active.view(tiny_random.num_layers, tiny_random.num_kv_heads, -1).sum(-1).double().mean(-1) * 8
    assert engine.memory.summary_active == round(float(visible.max()))


@pytest.mark.slow
def test_protokv_bookkeeping_stays_bounded_on_a_long_stream(tiny_random):
    from kvdemo.world.synthetic import synthetic_video

    video = synthetic_video(num_frames=120, height=112, width=112, fps=2.0, seed=2)
    engine = StreamEngine(tiny_random, "protokv", budget=96, fps=2.0, policy_params={"warmup": 32, "history": 8})
    list(stream_video(tiny_random, video, {"p": engine}))
    assert max(e.visual_tokens for e in engine.memory.timeline) <= 96
    bank = engine.policy._bank
    assert bank.assign_map.shape == (tiny_random.num_layers * tiny_random.num_kv_heads, 8, 4, 4)
    held = set(bank.assign_grid.tolist()) - {-1}
    assert held and max(held) <= 59 and len(held) <= 8
    assert (
        engine.memory.layers[0].capacity <= engine.memory.prefix_len + 96 + 256
    )  # summary + window = M, never past it


def test_merging_checks_pairs_with_a_changed_prototype_from_either_side():
    """Pairs (0, 1) and (2, 3) qualify; only 0 and 3 changed. Prototype 1 merges into 0 (found from 0's
    row), 3 into 2 (found from 3's own row); the untouched, distant 4 stays."""
    policy = make_policy("protokv", subquantizers=2)
    bank = fresh_bank(policy, 5, 4)
    bank.used[:] = True
    e = torch.eye(4)
    bank.centre_k[0] = torch.stack([e[0], e[0] + 0.01 * e[1], e[1], e[1] + 0.01 * e[2], e[3]])
    bank.centre_v[0] = bank.centre_k[0].clone()
    bank.mass[0] = torch.tensor([2, 2, 3, 1, 4])
    bank.tau_time[0] = 5
    changed = torch.tensor([[True, False, False, True, False]])
    no_near = near_tokens(
        torch.zeros(1, 0, 4), torch.zeros(1, 0, 4), torch.zeros(1, 0, 2), torch.zeros(1, 0, 3), order=torch.zeros(1, 0)
    )
    policy.maintain(bank, lambda count: no_near, t=5, changed=changed)  # nothing to recycle from
    assert bank.mass[0].tolist() == [4, 0, 4, 0, 4]
    torch.testing.assert_close(bank.centre_k[0, 2], (3 * e[1] + (e[1] + 0.01 * e[2])) / 4)


def plain_merge(centre_k, centre_v, mass, candidates, eps_k, eps_v):
    """Alg. 2's merge decision restated as plain loops over one row: each active prototype's partner is the
    lowest-index active prototype below it whose unit key and value centres are within (eps_k, eps_v), the pair
    having a candidate on either side; a prototype merges when its partner merges nowhere itself."""
    slots = len(mass)

    def unit(c):
        norm = max(math.sqrt(sum(x * x for x in c)), 1e-12)
        return [x / norm for x in c]

    unit_k, unit_v = [unit(c) for c in centre_k], [unit(c) for c in centre_v]

    def close(i, j):
        dk = math.sqrt(sum((a - b) ** 2 for a, b in zip(unit_k[i], unit_k[j])))
        dv = math.sqrt(sum((a - b) ** 2 for a, b in zip(unit_v[i], unit_v[j])))
        return dk < eps_k and dv < eps_v

    partner = [None] * slots
    for j in range(slots):
        if mass[j] > 0:
            partner[j] = next(
                (i for i in range(j) if mass[i] > 0 and (candidates[i] or candidates[j]) and close(i, j)), None
            )
    merging = [p is not None and partner[p] is None for p in partner]
    new_mass = list(mass)
    for j, p in enumerate(partner):
        if merging[j]:
            new_mass[p] += mass[j]
            new_mass[j] = 0
    pending = [p is not None and not m for p, m in zip(partner, merging)]
    return new_mass, pending


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "block, pairs, dense", [(1 << 22, 1 << 16, False), (1, 7, False), (3 * 48 * 5, 64, False), (1 << 22, 1 << 16, True)]
)
def test_merging_matches_a_plain_loop_over_clustered_prototypes(seed, block, pairs, dense, monkeypatch):
    """Three rows of 48 prototypes drawn around 5 directions (many close pairs, chains of them, some close in keys
    but not values), half of them changed: the masses after merging and the pairs left pending are those of a
    plain per-pair loop, whether the candidates go in one block or in blocks of one or five, and the close pairs'
    value centres all at once or 7 or 64 at a time; and in the dense form a GPU's bank takes (every pair of a row at
    once, the fold through masks over every slot)."""
    from kvdemo.policies.protokv import merging
    from kvdemo.policies.protokv.bank import ProtoBank

    monkeypatch.setattr(merging, "MERGE_BLOCK", block)
    monkeypatch.setattr(merging, "MERGE_PAIRS", pairs)
    monkeypatch.setattr(ProtoBank, "dense", property(lambda bank: dense))
    g = torch.Generator().manual_seed(seed)
    policy = make_policy("protokv", subquantizers=2)
    rows, slots, dim = 3, 48, 8
    bank = fresh_bank(policy, slots, dim, rows=rows)
    bank.used[:] = True
    directions = torch.randn(5, dim, generator=g)
    pick = torch.randint(0, 5, (rows, slots), generator=g)
    bank.centre_k[:] = directions[pick] + 0.02 * torch.randn(rows, slots, dim, generator=g)
    other = torch.where(
        torch.rand(rows, slots, generator=g) < 0.3, torch.randint(0, 5, (rows, slots), generator=g), pick
    )
    bank.centre_v[:] = directions[other] + 0.02 * torch.randn(rows, slots, dim, generator=g)
    bank.mass[:] = torch.randint(0, 4, (rows, slots), generator=g)  # some empty slots
    changed = torch.rand(rows, slots, generator=g) < 0.5
    expected = [
        plain_merge(
            bank.centre_k[r].tolist(),
            bank.centre_v[r].tolist(),
            bank.mass[r].tolist(),
            changed[r].tolist(),
            policy.merge_k,
            policy.merge_v,
        )
        for r in range(rows)
    ]
    merging.merge(bank, changed, policy.merge_k, policy.merge_v)
    assert bank.mass.tolist() == [mass for mass, _ in expected]
    assert bank.pending.tolist() == [pending for _, pending in expected]
    assert bank.merged > 0 and bool(bank.pending.any())  # the case exercises merges and chains


def test_the_assignment_view_follows_merges_and_marks_recycled_prototypes_lost():
    policy = make_policy("protokv", subquantizers=2)
    bank = policy._new_bank(1, 3, 4, (1, 3), torch.device("cpu"))
    e = torch.eye(4)
    keys = torch.stack([e[0], e[1], e[2]])[None]  # three tokens of grid 5 open the three fresh slots
    zero = torch.zeros(1, 3, dtype=torch.long)
    policy.absorb(
        bank,
        keys,
        keys.clone(),
        torch.rand(1, 3, 2),
        torch.zeros(1, 3, 3, dtype=torch.long),
        torch.full((1, 3), 5),
        zero,
        torch.arange(3)[None],
        t=5,
    )
    policy._bank = bank
    assert policy.assignments(0, 0, 1)["prototype"].tolist() == [[[0, 1, 2]]]
    bank.centre_k[0, 1] = bank.centre_k[0, 0]  # prototype 1 becomes a copy of 0: they merge
    bank.centre_v[0, 1] = bank.centre_v[0, 0]
    near_key = torch.tensor([[[0.0, 0, 0, 1], [0.0, 0, 1, 1]]])

    def near(count):  # the two newest near-window tokens, newest first
        return near_tokens(
            near_key[:, :count],
            near_key[:, :count],
            [[0.5, 0.5], [0.5, 0.6]][:count],
            [[0, 0, 0], [0, 0, 0]][:count],
            order=[[99, 98][:count]],
        )

    policy.maintain(bank, near, t=6)
    view = policy.assignments(0, 0, 1)
    assert view["prototype"].tolist() == [[[0, 0, 2]]]  # the merged-away patch reads as its partner
    assert view["mass"].tolist()[0] == 2 and view["grids"] == [5]
    bank.mass[0, 2] = (
        0  # prototype 2 empties; recycling refills its slot with the newest near token not seeding already
    )
    policy.maintain(bank, near, t=7, changed=torch.zeros(1, 3, dtype=torch.bool))
    assert policy.assignments(0, 0, 1)["prototype"].tolist() == [[[0, 0, -2]]]
    assert bank.seed_slot.tolist() == [[2, 1]] and bank.seed_order.tolist() == [[98, 99]]


# --- what the paper's quantities mean ------------------------------------------------------------


@pytest.mark.slow
def test_every_token_counts_once_in_the_bank_mass(tiny_random):
    """``n_k`` counts the tokens a prototype summarises: with aging off, every row's total mass equals the tokens
    that left its near window (counted from the memory: tokens fed minus tokens held), on the bundled sample at
    M=128, where prototypes merge and slots are recycled many times."""
    from kvdemo.world.synthetic import sample_episode

    video = sample_episode().video
    engine = StreamEngine(tiny_random, "protokv", budget=128, fps=video.fps, policy_params={"decay": 0.0})
    list(stream_video(tiny_random, video, {"p": engine}))
    state = engine.report()["policy_state"]
    assert state["merged"] > 10 and state["recycled"] > 10
    memory = engine.memory
    for layer in range(tiny_random.num_layers):
        left = memory.tokens_seen - memory.head_counts(layer)  # [H]: tokens fed minus tokens held exactly
        rows = slice(layer * tiny_random.num_kv_heads, (layer + 1) * tiny_random.num_kv_heads)
        assert engine.policy._bank.mass[rows].sum(dim=1).tolist() == left.tolist()
    assert state["mass_total"] == sum(
        int((memory.tokens_seen - memory.head_counts(l)).sum()) for l in range(tiny_random.num_layers)
    )


def test_zero_residuals_stay_out_of_the_codebook_training():
    """A residual that is exactly zero (a token equal to its prototype's centre) never enters the warm-up
    reservoir the codebooks are trained on: the reservoir holds each row's nonzero residuals in arrival order."""
    policy = make_policy("protokv", subquantizers=2, warmup=8)
    bank = fresh_bank(policy, 2, 4)
    g = torch.Generator().manual_seed(6)
    residual_k, residual_v = torch.randn(1, 6, 4, generator=g), torch.randn(1, 6, 4, generator=g)
    residual_k[0, [1, 3]] = 0.0
    residual_v[0, [1, 3]] = 0.0
    record_residuals(
        bank, torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.bool), residual_k, residual_v
    )
    assert bank.reservoir_len == 4
    assert torch.equal(bank.reservoir_k[0, :4], residual_k[0, [0, 2, 4, 5]])
    assert torch.equal(bank.reservoir_v[0, :4], residual_v[0, [0, 2, 4, 5]])


def test_keys_are_unrotated_in_float32_before_any_rounding():
    """A bfloat16 cache's keys, un-rotated for the bank, equal the float64 inverse rotation of those bfloat16 keys
    (computed by hand) to float32 precision: the key before RoPE is not rounded back to bfloat16."""
    from kvdemo.testing import qwen7b_rotation, synthetic_memory

    rotary = qwen7b_rotation(16)
    memory = synthetic_memory(1, 2, 16, budget=16, grid=(2, 4), dtype=torch.bfloat16)
    view = memory.slices(rotary)[0]
    index = torch.arange(16).expand(2, -1)  # [B = 1 layer x 2 heads, E]
    tokens = gather_tokens(slice_stacks([view]), index)
    section = [2, 3, 3]
    expected = rotate_by_hand(view.keys.double(), -view.position.long(), rotary.rotary_emb.inv_freq, section)
    assert tokens.keys.dtype == torch.float32
    assert float((tokens.keys.double() - expected.double()).abs().max()) < 1e-5


@pytest.mark.parametrize("placement", ["host", "split"])
def test_the_stack_wise_window_and_gather_equal_a_per_layer_restatement(placement):
    """The near window and the gather read every layer of a stack at once (kvdemo's batching over layers); restated
    layer by layer (argsort of each layer's arrival numbers, one gather per field, each layer's keys un-rotated on
    their own), the same indices and the same tokens, bit for bit, in the bank's row order (layer, head). Split as a
    ``device_map`` splits a model, layers 0 and 2 on the host and 1 and 3 on the (emulated) device, the stacks come
    out of layer order, and the rows still go layer by layer, on the first layer's device."""
    from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice
    from kvdemo.policies.protokv.gathering import near_window
    from kvdemo.testing import qwen7b_rotation, synthetic_memory

    rotary, keep, heads = qwen7b_rotation(16), 10, 2
    split = placement == "split"
    with EmulatedDevice() if split else contextlib.nullcontext(), torch.inference_mode():
        memory = synthetic_memory(4, heads, 16, 32, (2, 4), torch.float32, visual_tokens=32)
        memory.to({0: "cpu", 1: DEVICE, 2: "cpu", 3: DEVICE} if split else "cpu")
        slices = memory.slices(rotary)
        assert [stack.layers for stack in slices.stacks] == ([(0, 2), (1, 3)] if split else [(0, 1, 2, 3)])
        indices, reasons, evict, newest = near_window(slices.stacks, 4, keep, torch.device("cpu"), 0)
        tokens = gather_tokens(slices.stacks, evict)
        per_layer = [{name: getattr(x, name).cpu() for name in FIELDS} for x in slices]
    expected = {name: [] for name in ("evict", "newest", *FIELDS)}
    for layer, fields in enumerate(per_layer):
        ranked = torch.argsort(fields["order"], dim=1)
        cut = ranked.shape[1] - keep
        assert torch.equal(indices[layer].cpu(), ranked[:, cut:].sort(dim=1).values)
        assert reasons[layer].dtype == torch.int8 and not reasons[layer].any()
        expected["evict"].append(ranked[:, :cut])
        expected["newest"].append(ranked[:, cut:].flip(1))
        for name in FIELDS:
            source = fields[name]
            index = ranked[:, :cut] if source.dim() == 2 else ranked[:, :cut, None].expand(-1, -1, source.shape[-1])
            gathered = torch.gather(source, 1, index)
            if name == "keys":
                gathered = rotary.unrotate(gathered.float(), torch.gather(fields["position"], 1, index[..., :3]).long())
            expected[name].append(gathered)
    assert evict.device.type == "cpu" and tokens.keys.device.type == "cpu"
    assert torch.equal(evict, torch.cat(expected["evict"])) and torch.equal(newest, torch.cat(expected["newest"]))
    for name in FIELDS:
        got = getattr(tokens, name)
        assert torch.equal(got, torch.cat(expected[name]).to(got.dtype)), name
    rows, cols = (2, 4)
    spatial = torch.stack([(tokens.row + 0.5) / rows, (tokens.col + 0.5) / cols], dim=-1)
    assert torch.equal(tokens.spatial, spatial.float())


#: The fields of a layer's slice that ProtoKV gathers for the bank.
FIELDS = ("keys", "values", "position", "frame", "row", "col", "order")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_forms_on_a_device_leave_the_bank_and_memory_the_cpu_leaves(dtype):
    """On a device the bank takes its dense forms (masks over every slot, no count read back) and the summary of every
    layer is one update; on the CPU the sparse forms and one update per layer. A 30-grid stream of 3 layers with
    merges, recycling, aging and trained codebooks, on the emulated device and on the CPU: the same bank (every
    field, the seed records without the dense form's padding) and the same memory (keys, values, bias, provenance),
    bit for bit."""
    from kvdemo.bench.simulation import simulated_stream
    from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice

    params = dict(warmup=8, subquantizers=2, codewords=4, merge_k=1.1, merge_v=1.2, t_idle=2, decay=0.5)
    shape = dict(num_layers=3, num_kv_heads=2, head_dim=16, budget=96, keep=None, grid=(2, 4))

    def run(device):
        policy = make_policy("protokv", **params)
        memory, passes = simulated_stream(policy, 30, shape, dtype=dtype, device=device)
        memory.to("cpu")
        return policy._bank, memory, len(passes)

    host_bank, host_memory, host_passes = run("cpu")
    mode = EmulatedDevice()
    with mode:
        device_bank, device_memory, device_passes = run(DEVICE)
        assert device_bank.dense and not host_bank.dense
    assert mode.ops > 1000
    assert host_passes == device_passes > 20
    assert host_bank.merged > 0 and host_bank.recycled > 0 and host_bank.codebook_k is not None  # every form ran
    for name, value in vars(host_bank).items():
        if name in ("seed_order", "seed_slot"):
            continue
        other = getattr(device_bank, name)
        same = torch.equal(value, other.cpu()) if isinstance(value, torch.Tensor) else value == other
        assert same, name

    def seeds(bank):
        return [
            sorted(zip(order.tolist(), slot.tolist()))
            for order, slot in zip(bank.seed_order.cpu(), bank.seed_slot.cpu())
        ]

    strip = lambda rows: [[pair for pair in row if pair[1] >= 0] for row in rows]  # noqa: E731
    assert strip(seeds(host_bank)) == strip(seeds(device_bank))
    for host, device in zip(host_memory.layers, device_memory.layers):
        for name in ("keys", "values", "bias", "packed"):
            assert torch.equal(getattr(host, name), getattr(device, name)), name


def test_the_bias_of_a_bfloat16_memory_is_log_mass_in_float32():
    """The summary bias a bfloat16 memory holds for every pseudo-token is float32(log n_k) of its prototype (n_k
    read from the bank, the log taken here in float64), and -inf on empty slots: not bfloat16(log n_k)."""
    from kvdemo.bench.simulation import simulated_stream

    policy = make_policy("protokv", warmup=8)
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, budget=64, keep=None, grid=(2, 4))
    memory, passes = simulated_stream(policy, 24, shape, dtype=torch.bfloat16)
    assert passes and memory.layers[0].keys.dtype == torch.bfloat16
    mass = policy._bank.mass.view(2, 2, -1)  # [layers, H, K]
    assert int(mass.max()) > 2  # masses whose log bfloat16 cannot hold
    for layer in range(2):
        expected = torch.tensor(
            [[math.log(n) if n > 0 else -math.inf for n in row for _ in range(8)] for row in mass[layer].tolist()],
            dtype=torch.float64,
        ).float()
        store = memory.layers[layer]
        assert torch.equal(store.bias[:, memory.prefix_len : memory.visual_start], expected)


def attend_to_a_prototype_of_mass(mass: int, others: int, device: torch.device) -> torch.Tensor:
    """bfloat16 queries, keys and values on ``device`` through kvdemo's attention function, every logit 0 but the
    pseudo-token's bias ``log mass``; the pseudo-token alone has value 1, so its weight is output channel 0."""
    from kvdemo.cache.attention import kvdemo_attention

    memory = KVMemory(1, 1, Budget(summary=1))
    cache = MemoryCache(memory)
    zeros = lambda n: torch.zeros(1, 1, n, 8, dtype=torch.bfloat16, device=device)  # noqa: E731
    cache.layers[0].update(zeros(1), zeros(1))
    memory.commit_prefix(1)
    chunk = synthetic_chunk(0, others // 64, (8, 8))
    MemoryCache(memory).layers[0].update(zeros(others), zeros(others))
    memory.commit_append(chunk, torch.zeros(3, others, dtype=torch.long))
    value = torch.zeros(1, 1, 8, device=device)
    value[..., 0] = 1.0
    bias = torch.tensor([[math.log(mass)]], device=device)
    memory.apply(
        Selection(
            [torch.arange(others, device=device)[None]],
            summary=[SummaryUpdate(torch.zeros(1, 1, 8, device=device), value, bias)],
        )
    )
    step = MemoryCache(memory)
    key, val = step.layers[0].update(zeros(1), zeros(1))

    class Layer(torch.nn.Module):
        layer_idx = 0

    query = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16, device=device)  # 4 query heads over the one KV head
    out, _ = kvdemo_attention(Layer(), query, key, val, None, kvdemo=step)
    return out[..., 0].cpu().double()


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@torch.inference_mode()
def test_bfloat16_attention_reads_the_log_mass_unrounded(device, monkeypatch):
    """The pseudo-token's weight equals 838 / (838 + the other tokens), computed here in float64, to within
    bfloat16's output rounding (5e-4 at 0.2), on the CPU (SDPA with a float32 mask) and on a device whose kernels
    take the mask only in the query's dtype (the emulated device: the float32 softmax). Through SDPA there a
    bfloat16 bias (log 838 read as log ~828) would be 1.9e-3 off: the control below measures it."""

    from kvdemo.cache import attention
    from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice

    mass, others = 838, 3328
    expected = mass / (mass + 1 + others + 1)  # prefix, near tokens and the new token each weigh e^0
    target = DEVICE if device == "emulated" else torch.device("cpu")
    with EmulatedDevice() if device == "emulated" else contextlib.nullcontext():
        assert float((attend_to_a_prototype_of_mass(mass, others, target) - expected).abs().max()) < 1e-3
        monkeypatch.setattr(attention, "bias_needs_float32", lambda query, cache: False)
        through_sdpa = attend_to_a_prototype_of_mass(mass, others, target)
    rounded = math.exp(float(torch.tensor(math.log(mass), dtype=torch.bfloat16)))  # 827.7
    if device == "emulated":  # the mask in bfloat16: the weight of mass bf16(log 838), as the kernel would give
        assert float((through_sdpa - expected).abs().min()) > 1.5e-3
        assert float((through_sdpa - rounded / (rounded + others + 2)).abs().max()) < 1e-3
    else:  # the CPU's kernels take the float32 mask anyway
        assert float((through_sdpa - expected).abs().max()) < 1e-3


def test_only_a_narrow_mask_with_a_summary_region_takes_the_float32_softmax():
    from kvdemo.cache.attention import bias_needs_float32
    from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice

    with_region, without = KVMemory(1, 1, Budget(summary=8)), KVMemory(1, 1)
    with_region.summary_open = without.summary_open = True
    with EmulatedDevice():
        for dtype, needs in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
            query = torch.zeros(1, 2, 1, 8, dtype=dtype).to(DEVICE)
            assert bias_needs_float32(query, MemoryCache(with_region)) is needs
            assert bias_needs_float32(query, MemoryCache(without)) is False  # 0 and -inf are exact in any dtype
    assert bias_needs_float32(torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16), MemoryCache(with_region)) is False  # CPU


def test_assignment_in_blocks_matches_eq1_restated_per_token():
    """Eq. 1's choice (assign: costs formed ASSIGNMENT_BLOCK tokens at a time) against the cost restated per token and
    prototype in float64: -cos + lambda_sp * Mahalanobis (Sigma + 1e-4 I) + lambda_idle * idle, +inf on closed slots."""
    policy = make_policy("protokv")
    rows, prototypes, dim, tokens, t = 2, 6, 8, 2 * ASSIGNMENT_BLOCK + 6, 200  # three blocks, the last partial
    bank = fresh_bank(policy, prototypes, dim, rows)
    g = torch.Generator().manual_seed(11)
    bank.centre_k.copy_(torch.randn(rows, prototypes, dim, generator=g))
    bank.mass.copy_(torch.tensor([[3, 1, 0, 2, 5, 1], [0, 4, 2, 2, 0, 1]], dtype=bank.mass.dtype))  # 0: closed
    bank.mu.copy_(torch.rand(rows, prototypes, 2, generator=g) * 4)
    a = torch.randn(rows, prototypes, 2, 2, generator=g) * 0.5
    bank.sigma.copy_(a @ a.transpose(-1, -2) + 0.2 * torch.eye(2))
    bank.tau_time.copy_(torch.tensor([[190, 10, 0, 195, 50, 199], [0, 5, 198, 60, 0, 200]], dtype=bank.tau_time.dtype))
    keys = torch.randn(rows, tokens, dim, generator=g)
    spatial = torch.rand(rows, tokens, 2, generator=g) * 4
    got = assign(bank, keys, spatial, t, policy.lambda_sp, policy.lambda_idle, policy.t_idle)
    for r in range(rows):
        for e in range(tokens):
            costs = []
            for k in range(prototypes):
                if bank.mass[r, k] <= 0:
                    costs.append(math.inf)
                    continue
                key, centre = keys[r, e].double(), bank.centre_k[r, k].double()
                cos = float(key @ centre / (key.norm() * centre.norm()))
                d = (spatial[r, e] - bank.mu[r, k]).double()
                sigma = bank.sigma[r, k].double() + 1e-4 * torch.eye(2, dtype=torch.float64)
                mahal = math.sqrt(float(d @ torch.linalg.inv(sigma) @ d))
                idle = policy.lambda_idle * float(t - int(bank.tau_time[r, k]) > policy.t_idle)
                costs.append(-cos + policy.lambda_sp * mahal + idle)
            assert int(got[r, e]) == min(range(prototypes), key=costs.__getitem__), (r, e)
