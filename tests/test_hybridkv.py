"""HybridKV (paper 004) in the stream: classification by text-centric sparsity (restated by hand), ragged
budgets that sum to the total and show in real bytes, static pruning, the offload store and retrieval
inside attention, and answers equal to the full cache when budgets cover every token."""

import dataclasses
import math

import pytest
import torch

from kvdemo.cache.offload import OffloadStore
from kvdemo.cache.offload_layer import OffloadLayer
from kvdemo.policies import LayerSlice, PolicyParameterError, SliceStack, make_policy
from kvdemo.policies.hybridkv import capped_allocation
from kvdemo.policies.topk import select_ranked
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import stream_video


def hand_view(heads=2, frames=3, rows=2, cols=2, dim=4, probe=None, keys=None):
    per = rows * cols
    length = frames * per
    token = torch.arange(length)
    prov = lambda x: x.int().expand(heads, -1).contiguous()  # noqa: E731
    keys = keys if keys is not None else torch.randn(heads, length, dim, generator=torch.Generator().manual_seed(0))
    return LayerSlice(
        layer=0,
        num_layers=1,
        keys=keys,
        values=torch.randn(heads, length, dim),
        frame=prov(token // per),
        row=prov((token % per) // cols),
        col=prov(token % cols),
        grid=(rows, cols),
        newest_frame=frames - 1,
        probe=probe,
    )


def test_sparsity_is_the_mean_top_k_mass_of_each_text_row_over_the_group():
    """Eq. 2-3 restated: rows of the probe (both query heads of a KV head's group) attend over the visual
    tokens; each row keeps its top-k mass; the KV head's score is the mean over its rows."""
    g = torch.Generator().manual_seed(1)
    view = hand_view(heads=2, probe=torch.randn(4, 3, 4, generator=g), keys=torch.randn(2, 12, 4, generator=g))
    policy = make_policy("hybridkv", top_k=0.25, pool_kernel=1)  # k = ceil(0.25 * 12) = 3
    sparsity, prior = policy.text_centric(SliceStack.of([view], (0,)))
    sparsity = sparsity[0]
    for head in range(2):
        rows = []
        for q in (2 * head, 2 * head + 1):  # query heads 2h and 2h+1 read KV head h
            for t in range(3):
                logits = [float(view.probe[q, t] @ view.keys[head, j]) / 2.0 for j in range(12)]  # 1/sqrt(4)
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                rows.append(sum(sorted((w / total for w in weights), reverse=True)[:3]))
        assert float(sparsity[head]) == pytest.approx(sum(rows) / len(rows), abs=1e-5)
        assert float(prior[head].sum()) == pytest.approx(6.0, abs=1e-4)  # 6 rows, each summing to 1


def test_classification_by_quantile_and_by_score():
    policy = make_policy("hybridkv", theta=0.75)
    sparsity = torch.tensor([[0.5, 0.9], [0.7, 0.95]])
    q = torch.quantile(sparsity.double().flatten(), 0.75)
    assert torch.equal(sparsity > policy.threshold(sparsity), sparsity > q)
    assert int((sparsity > policy.threshold(sparsity)).sum()) == 1  # the top quarter of 4 heads
    by_score = make_policy("hybridkv", theta=0.75, cutoff="score")
    assert (sparsity > by_score.threshold(sparsity)).tolist() == [[False, True], [False, True]]


def test_top_down_budgets_follow_eq_4_and_5_and_sum_to_the_total():
    policy = make_policy("hybridkv", share=0.75, alpha=0.5)
    sparsity = torch.tensor([[0.2, 0.9, 0.6, 0.3]])
    static = torch.tensor([[False, True, True, False]])
    held = torch.full((1, 4), 1000)
    budgets = policy.budgets(sparsity, static, held, keep=100)
    # B_dyn = floor(0.75 * 100 * 2) = 150 -> 75 each; B_stat = 400 - 150 = 250:
    # static h: 0.5 * 250 / 2 + 0.5 * 250 * S_h / (0.9 + 0.6) -> 125 + 75 = 137.5 -> 137 ... and 62.5 + 50 = 112.5 -> 112
    assert budgets.tolist()[0][0] == 75 and budgets.tolist()[0][3] == 75
    assert int(budgets.sum()) == 400
    assert budgets.tolist()[0][1] in (137, 138) and budgets.tolist()[0][2] in (112, 113)


def test_a_head_never_gets_more_than_it_holds_and_the_excess_moves_to_heads_with_room():
    alloc = capped_allocation(
        torch.tensor([[300.0, 50.0, 50.0]], dtype=torch.float64), torch.tensor([[120, 200, 100]]), torch.tensor([400])
    )
    # 300 capped at 120: the 180 short goes to heads 1 and 2 in proportion to their room (150 : 50)
    assert alloc.tolist() == [[120, 185, 95]] and int(alloc.sum()) == 400


@pytest.fixture
def nan_filled_empty(monkeypatch):
    """``torch.empty`` hands out NaN-filled floating-point storage: memory the store grows but never writes shows up."""
    empty = torch.empty

    def garbage(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", garbage)


def one_layer_store(heads: int, dim: int, chunk: int, dtype: torch.dtype = torch.float32):
    """A store of one layer and what that layer reads of it, and a way to add ``[H, E, ...]`` tokens to it."""
    store = OffloadStore.empty(1, heads, dim, chunk, dtype, torch.device("cpu"))

    def add(keys, values, valid, provenance):
        return store.add_tokens(keys[None], values[None], valid[None], {k: v[None] for k, v in provenance.items()})

    return store, OffloadLayer(store, 0), add


def test_offload_store_retrieves_the_chunks_whose_mean_keys_score_highest():
    _, store, add = one_layer_store(heads=2, dim=4, chunk=2)
    keys = torch.zeros(2, 8, 4)
    for c, direction in enumerate([0, 1, 2, 3]):  # head 0: chunk c points along axis c
        keys[0, 2 * c : 2 * c + 2, direction] = 1.0
    keys[1] = -keys[0]
    valid = torch.ones(2, 8, dtype=torch.bool)
    prov = {name: torch.arange(8).expand(2, -1) for name in ("frame", "row", "col", "order")}
    add(keys, 10 * keys, valid, prov)
    assert store.count.tolist() == [4, 4] and store.nbytes == 2 * 4 * 2 * 2 * 4 * 4
    torch.testing.assert_close(store.mean_keys[0, 2], torch.tensor([0.0, 0, 1, 0]))
    store.retrieve = torch.tensor([4, 2])  # head 0: 2 chunks, head 1: 1 chunk
    query = torch.zeros(4, 1, 4)  # two query heads per KV head
    query[0, 0] = torch.tensor([0.0, 0.0, 3.0, 1.0])  # head 0 prefers chunk 2, then chunk 3
    query[1, 0] = torch.tensor([0.0, 0.0, 1.0, 0.5])
    query[2, 0] = torch.tensor([-1.0, 0.0, 0.0, 0.0])  # head 1 (keys negated) prefers chunk 0
    k, v, bias = store.fetch(query, scale=1.0)
    assert store.retrieved[0].tolist() == [False, False, True, True]
    assert store.retrieved[1].tolist() == [True, False, False, False]
    assert k.shape == (2, 4, 4) and torch.isinf(bias[1, 2:]).all() and (bias[0] == 0).all()
    torch.testing.assert_close(v[0, :2], 10 * keys[0, 4:6])


def test_a_head_retrieving_fewer_chunks_attends_to_finite_keys_and_values(nan_filled_empty):
    """Heads retrieve different numbers of chunks: the narrower head's extra picks lie past its chunks, in storage
    that was never written (NaN here); what fetch returns is finite and attention over it stays finite."""
    g = torch.Generator().manual_seed(3)
    _, store, add = one_layer_store(heads=2, dim=4, chunk=2)
    valid = torch.zeros(2, 8, dtype=torch.bool)
    valid[0] = True  # head 0: 4 chunks
    valid[1, :3] = True  # head 1: 2 chunks, the second one partial
    prov = {name: torch.arange(8).expand(2, -1) for name in ("frame", "row", "col", "order")}
    keys = torch.randn(2, 8, 4, generator=g)
    add(keys, keys + 1, valid, prov)
    store.retrieve = torch.tensor([8, 8])  # 4 chunks each, as many as head 1 holds: 2
    query = torch.randn(4, 1, 4, generator=g)
    k, v, bias = store.fetch(query, scale=0.5)
    assert k.shape == (2, 8, 4) and bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())
    assert int(torch.isfinite(bias[1]).sum()) == 3  # head 1 attends to its 3 tokens, nothing else
    weights = torch.softmax(query.view(2, 2, 4) @ k.transpose(1, 2) * 0.5 + bias[:, None], dim=-1)
    assert bool(torch.isfinite(weights @ v).all())


def test_offload_store_lays_out_ragged_adds_in_chunks_as_a_plain_loop_does(nan_filled_empty):
    """Two passes with different valid tokens per head (partial last chunks): every head's valid tokens go,
    in arrival order, into fresh chunks of 3 after its earlier ones; mean keys are per chunk; a partial chunk's
    tail is zeros although the store's new chunks start as garbage (here NaN: they are not zeroed when grown)."""
    g = torch.Generator().manual_seed(5)
    _, store, add = one_layer_store(heads=2, dim=4, chunk=3, dtype=torch.bfloat16)
    expected = {h: [] for h in range(2)}  # per head: list of chunks, each a list of (key, value, order)
    for step, length in enumerate((7, 5)):
        keys = torch.randn(2, length, 4, generator=g).to(torch.bfloat16)
        values = torch.randn(2, length, 4, generator=g).to(torch.bfloat16)
        valid = torch.rand(2, length, generator=g) < 0.7
        valid[0, 0] = True
        order = (100 * step + torch.arange(length)).expand(2, -1)
        prov = {"frame": order, "row": order + 1, "col": order + 2, "order": order}
        add(keys, values, valid, prov)
        for h in range(2):
            tokens = [e for e in range(length) if valid[h, e]]
            for start in range(0, len(tokens), 3):
                expected[h].append([(keys[h, e], values[h, e], int(order[h, e])) for e in tokens[start : start + 3]])
    stored = {name: store.by_head(name) for name in ("keys", "values", "valid", "order", "col")}
    for h in range(2):
        assert int(store.count[h]) == len(expected[h]) and int(store.tokens[h]) == sum(map(len, expected[h]))
        for name in stored:  # one head's chunks alone, as the status view reads them
            assert torch.equal(store.head_chunks(name, h), stored[name][h, : len(expected[h])])
        for c, chunk in enumerate(expected[h]):
            n = len(chunk)
            assert stored["valid"][h, c].tolist() == [True] * n + [False] * (3 - n)
            assert (stored["keys"][h, c, n:] == 0).all() and (stored["values"][h, c, n:] == 0).all()
            torch.testing.assert_close(stored["keys"][h, c, :n], torch.stack([k for k, _, _ in chunk]), rtol=0, atol=0)
            torch.testing.assert_close(
                stored["values"][h, c, :n], torch.stack([v for _, v, _ in chunk]), rtol=0, atol=0
            )
            assert stored["order"][h, c, :n].tolist() == [o for _, _, o in chunk]
            assert stored["col"][h, c, :n].tolist() == [o + 2 for _, _, o in chunk]
            mean = torch.stack([k.float() for k, _, _ in chunk]).mean(0)
            torch.testing.assert_close(store.mean_keys[h, c], mean)


def test_offload_store_fetches_a_later_pass_s_chunk_where_heads_interleave_in_the_pool():
    """Two passes put each head's chunks in the pool after the other heads' (head 0's second-pass chunks sit after
    head 1's first-pass ones): a head that prefers its last chunk gets exactly that chunk's tokens, provenance and
    validity, as a plain per-head list of chunks says."""
    g = torch.Generator().manual_seed(11)
    whole, store, add = one_layer_store(heads=2, dim=4, chunk=2)
    chunks = {0: [], 1: []}  # per head: its chunks in arrival order, each a list of (key, value, frame)
    for step, valid_rows in enumerate(([[1, 1, 1, 0], [1, 0, 1, 1]], [[0, 1, 1, 1], [1, 1, 0, 0]])):
        valid = torch.tensor(valid_rows, dtype=torch.bool)
        keys, values = torch.randn(2, 4, 4, generator=g), torch.randn(2, 4, 4, generator=g)
        frame = (10 * step + torch.arange(4)).expand(2, -1)
        add(keys, values, valid, {"frame": frame, "row": frame + 1, "col": frame + 2, "order": frame})
        for h in range(2):
            tokens = [(keys[h, e], values[h, e], int(frame[h, e])) for e in range(4) if valid[h, e]]
            chunks[h] += [tokens[i : i + 2] for i in range(0, len(tokens), 2)]
    assert store.count.tolist() == [4, 3] and whole.used == 7
    last = {h: len(chunks[h]) - 1 for h in range(2)}
    store.mean_keys.zero_()
    for h in range(2):
        store.mean_keys[h, last[h], 0] = 1.0  # each head's last chunk scores highest for a query along axis 0
    store.retrieve = torch.tensor([2, 2])  # one chunk each
    query = torch.zeros(4, 1, 4)
    query[:, 0, 0] = 1.0
    keys, values, bias = store.fetch(query, scale=1.0)
    for h in range(2):
        expected = chunks[h][last[h]]
        n = len(expected)
        assert store.retrieved[h].tolist() == [c == last[h] for c in range(store.capacity)]
        assert torch.equal(keys[h, :n], torch.stack([k for k, _, _ in expected]))
        assert torch.equal(values[h, :n], torch.stack([v for _, v, _ in expected]))
        assert (bias[h, :n] == 0).all() and torch.isinf(bias[h, n:]).all() and (keys[h, n:] == 0).all()
        assert store.last_fetched[0, h, :n].tolist() == [f for _, _, f in expected]
        assert store.last_fetched[2, h, :n].tolist() == [f + 2 for _, _, f in expected]


def test_classify_with_question_runs_one_pass_with_the_question_as_the_probe(tiny_random, pancake):
    """``classify_with=question``: asking first compresses with the question itself as the probe, so the
    classes, budgets and kept tokens equal a pass computed by hand on a copy with that probe; the default
    leaves the memory alone."""
    import copy

    question = "What is in the pan?"
    engines = {
        mode: StreamEngine(
            tiny_random,
            make_policy("hybridkv", classify_with=mode),
            budget=540,
            keep=405,
            fps=pancake.fps,
            max_new_tokens=3,
        )
        for mode in ("probe", "question")
    }
    list(stream_video(tiny_random, pancake, engines))
    engine = engines["question"]
    assert engine.memory.visual_tokens > 405  # a chunk arrived after the last compression

    def pass_on_a_copy(text):
        twin = copy.deepcopy(engine).attach(tiny_random)  # pickles without the model
        selection = twin.policy.compress(twin.memory.slices(tiny_random.rotary, twin._probe(text)), 405)
        twin.memory.apply(selection)
        return twin, selection

    twin, selection = pass_on_a_copy(question)
    _, proxy = pass_on_a_copy(engine.policy.probe_text)
    # the two probes score the heads differently (else this test could not tell them apart)
    assert not torch.equal(selection.info["sparsity"], proxy.info["sparsity"])
    passes = engine.stats.compressions
    engine.answer(question)
    assert engine.stats.compressions == passes + 1 and engine.memory.timeline[-1].event == "compress"
    assert torch.equal(engine.last_selection_info["sparsity"], selection.info["sparsity"])
    assert torch.equal(engine.last_selection_info["static"], selection.info["static"])
    assert torch.equal(engine.last_selection_info["budget"], selection.info["budget"])
    for a, b in zip(engine.memory.keys + engine.memory.values, twin.memory.keys + twin.memory.values):
        assert torch.equal(a, b)
    default = engines["probe"]
    before = [t.clone() for t in default.memory.keys]
    passes = default.stats.compressions
    default.answer(question)
    assert default.stats.compressions == passes
    assert all(torch.equal(a, b) for a, b in zip(before, default.memory.keys))
    with pytest.raises(PolicyParameterError, match="classify_with"):
        make_policy("hybridkv", classify_with="answer")


def test_ragged_budgets_are_real_bytes_and_the_memory_survives_a_question(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "hybridkv", budget=540, keep=405, fps=pancake.fps, max_new_tokens=6)
    list(stream_video(tiny_random, pancake, {"p": engine}))
    memory = engine.memory
    budgets = engine.last_selection_info["budget"]
    resident = kept = engine.last_selection_info["resident"]
    assert (budgets.sum(dim=1) == 405 * tiny_random.num_kv_heads).all()
    # every head holds its resident share of its budget plus the chunk that arrived after the last compression
    for layer in range(tiny_random.num_layers):
        assert memory.head_counts(layer).tolist() == (resident[layer] + 135).tolist()
    assert max(e.visual_tokens for e in memory.timeline) <= 540
    per_head_token = 2 * tiny_random.head_dim * 4
    resident = int((resident + 135).sum()) * per_head_token
    assert memory.nbytes - memory.padding_bytes == resident + sum(
        2 * memory.visual_start * tiny_random.num_kv_heads * tiny_random.head_dim * 4
        for _ in range(tiny_random.num_layers)
    )
    assert memory.offloaded_bytes > 0 and memory.timeline[-1].offloaded_bytes == memory.offloaded_bytes
    stores = [group.offload for group in memory.groups if group.offload is not None]
    # the offloaded tokens (a store's spare capacity past each head's chunks is left unwritten)
    before = [t.clone() for t in memory.keys + memory.values] + [s.keys[s.valid].clone() for s in stores]
    engine.answer("What is in the pan?")
    after = memory.keys + memory.values + [s.keys[s.valid] for s in stores]
    assert stores and all(torch.equal(x, y) for x, y in zip(before, after))
    for s in stores:  # every slot of the pool's chunks in use is written: tokens, then zeros in a partial chunk's tail
        keys, valid = s.keys[: s.used], s.valid[: s.used]
        assert s.used == int(s.count.sum()) and int(valid.sum()) == int(s.stored.sum())
        assert bool(torch.isfinite(keys).all()) and bool((keys[~valid] == 0).all())
    assert any(bool(s.retrieved.any()) for s in stores)  # dynamic heads retrieved while answering
    report = engine.report()
    assert report["largest_head_tokens"] == int(kept.max()) + 135  # the most a head holds (retrieval aside)
    assert report["policy_state"]["static_heads"] + report["policy_state"]["dynamic_heads"] == 8


def test_with_budgets_covering_every_token_answers_equal_the_full_cache(tiny_random, pancake):
    """Every head dynamic (score cutoff 1.0) and one compression whose retrieval budget covers everything
    offloaded: each answering forward attends to exactly the full cache's tokens."""
    policy = make_policy("hybridkv", theta=1.0, cutoff="score", accounting="resident")
    hybrid = StreamEngine(tiny_random, policy, budget=1215, keep=675, fps=pancake.fps, max_new_tokens=10)
    full = StreamEngine(tiny_random, "full", fps=pancake.fps, max_new_tokens=10)
    list(stream_video(tiny_random, pancake, {"h": hybrid, "f": full}))
    assert hybrid.stats.compressions == 1 and hybrid.memory.offloaded_bytes > 0
    a, b = hybrid.answer("What is cooking?"), full.answer("What is cooking?")
    assert a.answer == b.answer and a.tokens == b.tokens


def test_static_heads_keep_local_then_salient_tokens():
    """A head whose probe attends to tokens 1 and 6 keeps the newest (local) token, then those."""
    keys = torch.zeros(1, 12, 4)
    keys[0, 1, 0] = keys[0, 6, 0] = 8.0
    view = hand_view(heads=1, keys=keys, probe=torch.tensor([[[1.0, 0, 0, 0]]]))
    policy = make_policy("hybridkv", pool_kernel=1, local_ratio=0.34)  # ceil(0.34 * 3) = 2 local tokens
    stack = SliceStack.of([view], (0,))
    _, prior = policy.text_centric(stack)

    def select(static: bool):
        ranking = policy.rank_stack(stack, prior, torch.tensor([[static]]), torch.tensor([[3]]))
        selection, kept = select_ranked([view], [ranking], 3)
        return selection.indices[0], policy.offload(stack, kept[0], torch.tensor([[static]]), torch.tensor([[8]]))

    index, offload = select(static=True)
    assert sorted(index[0].tolist()) == [6, 10, 11] or sorted(index[0].tolist()) == [1, 10, 11]
    assert int(offload.valid.sum()) == 0 and int(offload.retrieve[0, 0]) == 0  # static heads drop, never retrieve
    index, offload = select(static=False)
    assert index[0].tolist() == [9, 10, 11]  # a dynamic head keeps its newest tokens resident
    assert offload.tokens[0, 0].tolist() == list(range(9)) and int(offload.retrieve[0, 0]) == 8


def test_hybridkv_on_a_long_stream_stays_within_m(tiny_random):
    from kvdemo.world.synthetic import synthetic_video

    video = synthetic_video(num_frames=80, height=112, width=168, fps=2.0, seed=4)
    engine = StreamEngine(tiny_random, "hybridkv", budget=96, keep=48, fps=2.0, max_new_tokens=4)
    list(stream_video(tiny_random, video, {"p": engine}))
    assert max(e.visual_tokens for e in engine.memory.timeline) <= 96
    assert engine.stats.compressions >= 10
    assert engine.answer("What moved?").tokens >= 1


def test_query_time_context_fits_the_budget_and_m_by_default(tiny_random, pancake, monkeypatch):
    """What each head attends to while answering, counted from the attention itself (its resident
    tokens in the memory plus the tokens retrieval hands the attention function), never exceeds its budget with
    the default accounting (the chunk fed after the last pass aside), and its layer's mean never exceeds M; the
    head map and the report say the same. ``accounting=resident`` (the other reading of the budget) lets a dynamic head
    attend to its budget again on top, as the report then says."""
    from kvdemo.cache.attention import MemoryCache

    fetched: dict[int, torch.Tensor] = {}
    original = MemoryCache.retrieval

    def counting(self, layer, query, scale):
        extra = original(self, layer, query, scale)
        if extra is not None:  # valid retrieved tokens per KV head: the finite entries of their key bias
            count = torch.isfinite(extra[2]).sum(dim=1)
            fetched[layer] = torch.maximum(fetched.get(layer, count), count)
        return extra

    monkeypatch.setattr(MemoryCache, "retrieval", counting)
    engines = {
        accounting: StreamEngine(
            tiny_random,
            make_policy("hybridkv", accounting=accounting),
            budget=540,
            keep=405,
            fps=pancake.fps,
            max_new_tokens=4,
        )
        for accounting in ("budget", "resident")
    }
    list(stream_video(tiny_random, pancake, engines))
    seen = {}
    for accounting, engine in engines.items():
        fetched.clear()
        engine.answer("What is in the pan?")
        assert fetched, "no head retrieved: this test would show nothing"
        state = engine.report()["policy_state"]
        assert state["accounting"] == accounting
        budget, static = (
            torch.tensor(state["budget"]),
            torch.tensor([[c == "static" for c in row] for row in state["head_class"]]),
        )
        since_pass = 135  # one chunk arrived after the last compression, in every head
        context = torch.stack(
            [
                engine.memory.head_counts(layer) + fetched.get(layer, torch.zeros(2, dtype=torch.long))
                for layer in range(tiny_random.num_layers)
            ]
        )
        seen[accounting] = (context, budget, static, since_pass)
        grid = engine.policy_views()[0].parts[0]
        assert grid.numbers.tolist() == state["query_context"]  # the head map shows the query-time context
        assert (
            torch.tensor(state["query_context"]) == torch.tensor(state["resident"]) + torch.tensor(state["retrieve"])
        ).all()
    context, budget, static, since_pass = seen["budget"]
    assert bool((context - since_pass <= budget).all()), (context, budget)
    assert float(context.double().mean(dim=1).max()) <= 540
    context, budget, static, since_pass = seen["resident"]
    over = (context - since_pass)[~static] - budget[~static]
    assert int(over.max()) > 0  # dynamic heads attend beyond their budget: the option does what it says
    assert engines["resident"].report()["policy_state"]["query_context_tokens"] > 405
    assert engines["budget"].report()["policy_state"]["query_context_tokens"] <= 405


def test_a_pass_over_layers_of_different_lengths_scores_each_layer_as_a_pass_over_it_alone():
    """After a pass the layers hold different numbers of tokens (ragged heads, different lengths); the batched pass
    pads them into one stack. Each layer's sparsity equals that of the layer stacked alone bit for bit; its prior and
    priorities up to float32 rounding (a float32 sum over the probe's rows rounds its last bit differently at another
    row length on a CPU), and the tokens each head keeps are the same."""
    from kvdemo.policies import padded_stacks
    from kvdemo.testing import append_random, synthetic_chunk, synthetic_memory, synthetic_probe

    policy = make_policy("hybridkv")
    memory = synthetic_memory(4, 2, 8, 48, (2, 4), torch.float32, seed=3)
    probe = synthetic_probe(4, 4, 8, torch.float32, seed=1)
    memory.apply(policy.compress(memory.slices(None, probe), 32))
    append_random(memory, synthetic_chunk(memory.num_grids, 1, (2, 4)), torch.Generator().manual_seed(2))
    slices = memory.slices(None, probe)
    (stack,) = padded_stacks(slices)
    assert stack.lengths is not None and len(set(stack.lengths)) > 1, "the layers should differ in length"
    sparsity, prior = policy.text_centric(stack)
    budget = torch.tensor([[20, 12]] * 4)
    static = torch.tensor([[True, False]] * 4)
    ranking = policy.rank_stack(stack, prior, static, budget)
    _, (kept,) = select_ranked(slices, [ranking], 20)
    for layer, length in enumerate(stack.lengths):
        alone = SliceStack.of([slices[layer]], (layer,))
        own_sparsity, own_prior = policy.text_centric(alone)
        rows = slice(2 * layer, 2 * layer + 2)
        assert torch.equal(sparsity[layer], own_sparsity[0])
        torch.testing.assert_close(prior[rows, :length], own_prior, rtol=1e-6, atol=0)
        own = policy.rank_stack(alone, own_prior, static[layer : layer + 1], budget[layer : layer + 1])
        torch.testing.assert_close(ranking.priority[rows, :length], own.priority, rtol=1e-5, atol=0)
        assert bool((ranking.priority[rows, length:] == -1).all())  # padding is never kept
        _, (own_kept,) = select_ranked([slices[layer]], [dataclasses.replace(own, layers=(0,))], 20)
        assert torch.equal(kept[rows, :length], own_kept) and not kept[rows, length:].any()
