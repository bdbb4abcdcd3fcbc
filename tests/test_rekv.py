"""ReKV: blocks scored and chosen as the code does (restated by hand on small tensors), the window and the store
under M on a real clip, asking leaving the memory and the store bit-identical, and its bad inputs."""

import pytest
import torch

from kvdemo.cache.budget import Budget
from kvdemo.cache.offload import OffloadStore
from kvdemo.cache.offload_layer import OffloadLayer
from kvdemo.errors import BudgetError
from kvdemo.policies import RetrievalRule, make_policy
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import stream_video


def test_each_layer_retrieves_the_blocks_whose_mean_key_best_matches_the_mean_query_summed_over_heads():
    """Three blocks per head (one block id each, 2 tokens); the question's queries averaged over its tokens, dotted
    with each block's mean key, summed over the layer's 4 query heads (2 per KV head): one ranking for every head,
    the top 2 blocks, kept for every later forward of the question."""
    g = torch.Generator().manual_seed(7)
    heads, dim, tokens = 2, 4, 6
    keys, values = torch.randn(1, heads, tokens, dim, generator=g), torch.randn(1, heads, tokens, dim, generator=g)
    valid = torch.ones(1, heads, tokens, dtype=torch.bool)
    block = torch.tensor([0, 0, 1, 1, 2, 2]).expand(1, heads, -1)
    frame = block.clone()
    store = OffloadStore.empty(1, heads, dim, 2, torch.float32, torch.device("cpu"))
    store.rule = RetrievalRule(shared=True, per_question=True)
    prov = {"frame": frame, "row": frame, "col": frame, "order": torch.arange(tokens).expand(1, heads, -1)}
    store.add_tokens(keys, values, valid, prov, block=block)
    layer = OffloadLayer(store, 0)
    layer.retrieve = torch.tensor([4, 4])  # two blocks of 2 tokens
    query = torch.randn(4, 3, dim, generator=g)  # [H_q, q, D]
    # by hand: score[b] = sum over query heads h of mean_q(h) . mean_k(kv(h), b)
    score = [0.0, 0.0, 0.0]
    for b in range(3):
        for h in range(4):
            kv = h // 2
            mean_key = (keys[0, kv, 2 * b] + keys[0, kv, 2 * b + 1]) / 2
            score[b] += float(query[h].mean(dim=0) @ mean_key)
    best = sorted(sorted(range(3), key=lambda b: -score[b])[:2])
    k, v, bias = layer.fetch(query, scale=1.0)
    assert sorted(set(k.shape)) == sorted({2, 4, dim}) and bool((bias == 0).all())
    for head in range(heads):
        want = torch.cat([keys[0, head, 2 * b : 2 * b + 2] for b in best])
        got = k[head].view(2, 2, dim)
        assert sorted(got.sum(dim=(1, 2)).tolist()) == pytest.approx(
            sorted(want.view(2, 2, dim).sum(dim=(1, 2)).tolist())
        )
    assert layer.retrieved[0, :3].tolist() == [b in best for b in range(3)]
    # a later forward of the same question brings back the same blocks whatever its query
    again = layer.fetch(-query, scale=1.0)
    assert torch.equal(again[0], k)
    store.release()
    assert not store.held


@pytest.fixture(scope="module")
def streamed(tiny_random, pancake):
    engine = StreamEngine(
        tiny_random, make_policy("rekv", topk=2), budget=1080, keep=810, fps=pancake.fps, max_new_tokens=4
    )
    list(stream_video(tiny_random, pancake, {"p": engine}))
    return engine


@pytest.mark.slow
def test_the_device_holds_the_window_and_the_reserve_within_m_and_the_rest_is_stored(streamed):
    memory = streamed.memory
    assert max(e.visual_tokens for e in memory.timeline) <= 1080
    report = streamed.report()["policy_state"]
    # C = 810: a reserve of 2 blocks of 135 (at most half of C), the window the rest in whole blocks
    assert report["retrieved_blocks"] == 2 and report["local_window"] == 540 and report["block_tokens"] == 135
    stored = memory.retrieved_frames()[0]  # [layers, grids] tokens stored per frame, over the 2 heads
    assert (stored.sum(axis=1) == 2 * 135 * report["stored_blocks"]).all()
    # a stored frame is never also on the device (the window keeps whole blocks)
    for layer in range(memory.num_layers):
        resident = set(memory.frame[layer].flatten().tolist())
        assert not resident & {int(f) for f in stored[layer].nonzero()[0]}


@pytest.mark.slow
def test_asking_leaves_the_memory_and_the_store_bit_identical_and_releases_the_retrieved_blocks(streamed):
    memory = streamed.memory
    stores = [group.offload for group in memory.groups if group.offload is not None]

    def state():
        device = [t.clone() for t in memory.keys + memory.values + memory.order]
        host = [
            t.clone()
            for s in stores
            for t in (s.keys[: s.used], s.values[: s.used], s.valid[: s.used], s.table, s.mean_keys, s.count)
        ]
        return device + host

    before = state()
    streamed.answer("What is in the pan?")
    after = state()
    assert stores and all(torch.equal(x, y) for x, y in zip(before, after))
    assert all(not s.held for s in stores)  # released after the answer
    fetched = memory.retrieved_frames()[1]
    assert (fetched.sum(axis=1) == 2 * 2 * 135).all()  # every layer retrieved 2 blocks for both heads


def test_topk_larger_than_the_blocks_stored_is_clamped_with_a_note():
    from kvdemo.testing import synthetic_memory

    policy = make_policy("rekv", topk=50)
    memory = synthetic_memory(2, 2, 8, 48, (2, 4), torch.float32, seed=3)  # 6 grids of 8 tokens
    memory.apply(policy.compress(memory.slices(), 40))
    report = policy.report()
    assert report["retrieved_blocks"] == 2  # half of C=40 holds 2 blocks of 8
    assert report["stored_blocks"] < 50
    assert any("clamped" in note for note in report["notes"])
    assert any("more than the" in note for note in report["notes"])


def test_a_window_shorter_than_one_chunk_is_refused_before_the_model_loads():
    policy = make_policy("rekv", n_local=100)
    budget = Budget.resolve(policy, 1080, 810)
    with pytest.raises(BudgetError, match="shorter than one chunk"):
        budget.sized(policy, 270)
    Budget.resolve(make_policy("rekv"), 1080, 810).sized(make_policy("rekv"), 270)  # the defaults fit
