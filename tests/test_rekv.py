"""ReKV: blocks scored and chosen as the code does (restated by hand on small tensors), the window and the store
under M on a real clip, asking leaving the memory and the store bit-identical, the answer equal to transformers' forward
over the whole stream with each layer's unretrieved keys masked (float64), and its bad inputs."""

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


# --- the answer against transformers' forward over the whole stream, masked per layer (float64) --------------------

MASKED_ATTENTION = "rekv_test_masked"


def masked_stream_logits(model, prompt: dict, seen_before: list, resident: list, prefix: int, grid: int, choose):
    """Last-token logits of transformers' language model and head over the whole prompt (prefix, every grid of the
    video, the question) at the full prompt's positions, each layer's attention under a mask of its own: the
    prefix causal; grid ``k``'s tokens see the prefix, the visual tokens ``seen_before[k][layer] [H_kv, N]`` (bool
    over the prompt) and grid ``k`` causally; the question sees the prefix, ``resident[layer] [H_kv, N]``, itself
    causally and the stored grids (every grid not resident) ``choose`` takes from them ranked by how well their mean
    key before RoPE (``k_proj``'s output) matches the question's mean query before RoPE (``q_proj``'s), the dot
    products summed over the query heads, best first. Returns the logits and each layer's chosen grids."""
    from transformers import AttentionInterface

    language = model.hf.model.language_model
    length = prompt["inputs_embeds"].shape[1]
    question = length - prefix - len(seen_before) * grid
    projected: dict[tuple[int, str], torch.Tensor] = {}
    chosen: dict[int, list[int]] = {}

    def keep_output(layer: int, name: str):
        def hook(module, args, output):
            projected[layer, name] = output[0]

        return hook

    def masked_attention(module, query, key, value, attention_mask, **kwargs):
        layer, kv_heads, q_heads = module.layer_idx, key.shape[1], query.shape[1]
        group, dim = q_heads // kv_heads, query.shape[-1]
        visible = torch.zeros(kv_heads, length, length, dtype=torch.bool)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        visible[:, :prefix, :prefix] = causal[:prefix, :prefix]
        for k, seen in enumerate(seen_before):
            rows = slice(prefix + k * grid, prefix + (k + 1) * grid)
            visible[:, rows, :prefix] = True
            visible[:, rows] |= seen[layer][:, None, :]
            visible[:, rows, rows] = causal[:grid, :grid]
        # The question's retrieval restated: stored grids scored by mean query . mean key, summed over query heads.
        queries = projected[layer, "q"].view(length, q_heads, dim)[-question:].mean(dim=0)  # [H_q, D]
        keys = projected[layer, "k"].view(length, kv_heads, dim)
        on_device = resident[layer][0, prefix : length - question].view(-1, grid).all(dim=1)
        stored = [g for g in range(len(seen_before)) if not on_device[g]]
        scores = {
            g: sum(
                float(queries[h] @ keys[prefix + g * grid : prefix + (g + 1) * grid, h // group].mean(dim=0))
                for h in range(q_heads)
            )
            for g in stored
        }
        chosen[layer] = sorted(choose(sorted(stored, key=lambda g: -scores[g])))
        rows = slice(length - question, length)
        visible[:, rows, :prefix] = True
        visible[:, rows] |= resident[layer][:, None, :]
        for g in chosen[layer]:
            visible[:, rows, prefix + g * grid : prefix + (g + 1) * grid] = True
        visible[:, rows, rows] = causal[:question, :question]
        # Plain attention in the model's dtype (transformers' eager function takes its softmax in float32).
        logits = query[0] @ key[0].repeat_interleave(group, dim=0).transpose(1, 2) * kwargs["scaling"]
        logits.masked_fill_(~visible.repeat_interleave(group, dim=0), float("-inf"))
        out = torch.softmax(logits, dim=-1) @ value[0].repeat_interleave(group, dim=0)  # [H_q, N, D]
        return out.transpose(0, 1)[None].contiguous(), None

    AttentionInterface.register(MASKED_ATTENTION, masked_attention)
    config = language.config
    implementation = config._attn_implementation
    hooks = [
        hook
        for index, decoder in enumerate(language.layers)
        for hook in (
            decoder.self_attn.q_proj.register_forward_hook(keep_output(index, "q")),
            decoder.self_attn.k_proj.register_forward_hook(keep_output(index, "k")),
        )
    ]
    config._attn_implementation = MASKED_ATTENTION
    try:
        with torch.inference_mode():
            out = language(inputs_embeds=prompt["inputs_embeds"], position_ids=prompt["positions"][:, None])
            logits = model.hf.lm_head(out.last_hidden_state[:, -1])[0]
    finally:
        config._attn_implementation = implementation
        for hook in hooks:
            hook.remove()
    return logits, chosen


@pytest.mark.slow
def test_the_answer_equals_transformers_forward_over_the_whole_stream_with_what_was_not_retrieved_masked_per_layer(
    monkeypatch,
):
    """A float64 stream of 8 temporal grids of 96 tokens under M=480, C=384, topk=2: the window keeps 2 grids after
    each compression and 5 grids end in the store. The question's logits equal transformers' forward over every
    token the stream produced, at the full prompt's positions, where each layer's question attends to the prefix,
    the resident grids and the 2 stored grids the restated scoring picks for that layer, and each grid's prefill to
    what was resident then (recorded from the memory before each chunk; the stream's eviction is not what this
    checks). The stores marked the same grids, and another choice of grids answers otherwise."""
    from test_families import FPS, QUESTION, stream_frames
    from test_pruning_positions import float64_model, full_prompt

    model = float64_model("tiny-random")
    frames = stream_frames(model, 16)
    engine = StreamEngine(model, "rekv", budget=480, keep=384, fps=FPS, policy_params=dict(topk=2))
    prompt = full_prompt(model, frames)
    prefix = int(model.prefix_embeds().shape[0])
    grid = 96  # 224 x 336 frames: 8 x 12 merged patches per temporal grid
    length = prompt["inputs_embeds"].shape[1]
    memory = engine.memory

    def on_device() -> list[torch.Tensor]:
        """Each layer's resident visual tokens as ``[H_kv, N]`` bool over the prompt."""
        out = []
        for store in memory.layers:
            assert store.text_len == 0 and store.valid is None  # Qwen2.5-VL's stream: visual tokens only, not ragged
            held = store.packed[:, : store.visual_len, :3].long()  # [H_kv, L, (frame, row, col)]
            cols = memory.grid_shape[1] if store.visual_len else 0
            index = prefix + held[..., 0] * grid + held[..., 1] * cols + held[..., 2]
            out.append(torch.zeros(held.shape[0], length, dtype=torch.bool).scatter_(1, index, True))
        return out

    seen_before = []
    forward = model.forward

    def recording(embeds, positions, cache, chunk=None):
        if chunk is not None:
            seen_before.append(on_device())
        return forward(embeds, positions, cache, chunk)

    monkeypatch.setattr(model, "forward", recording)
    for start in range(0, len(frames), 2):
        engine.feed(frames[start : start + 2])
    monkeypatch.undo()
    assert memory.grid_shape == (8, 12) and len(seen_before) == 8
    heads = model.hf.config.text_config.num_key_value_heads
    resident = on_device()
    report = engine.report()["policy_state"]
    assert report["stored_blocks"] == 5 and report["retrieved_blocks"] == 2 and report["block_tokens"] == grid
    assert length == prefix + 8 * grid + int(model.question_embeds([], QUESTION).shape[0])

    ours = engine.question_logits(QUESTION)
    theirs, chosen = masked_stream_logits(model, prompt, seen_before, resident, prefix, grid, lambda r: r[:2])
    print("grids each layer retrieved", chosen, "max |logit difference|", float((ours - theirs).abs().max()))
    assert torch.allclose(ours, theirs, atol=1e-10, rtol=0), float((ours - theirs).abs().max())
    fetched = memory.retrieved_frames()[1]  # [layers, grids] tokens the question retrieved, over the heads
    for layer, grids in chosen.items():
        assert fetched[layer].nonzero()[0].tolist() == grids
        assert all(fetched[layer, g] == heads * grid for g in grids)
    assert len({tuple(grids) for grids in chosen.values()}) > 1, "the layers chose differently (per layer, not one)"
    # Another choice (the lowest-scoring stored grids) answers otherwise: the comparison tells choices apart.
    others, _ = masked_stream_logits(model, prompt, seen_before, resident, prefix, grid, lambda r: r[-2:])
    assert float((others - ours).abs().max()) > 1e-3


@pytest.fixture(scope="module")
def small_streams(tiny_random):
    """A small generated video (6 grids of 24 tokens) in the full cache and in rekv (3 blocks stored, 1 retrieved)."""
    from kvdemo.world.synthetic import synthetic_video

    video = synthetic_video(num_frames=12, height=112, width=168, fps=2.0, seed=3)
    engines = {
        "full": StreamEngine(tiny_random, "full", fps=2.0),
        "rekv": StreamEngine(tiny_random, make_policy("rekv", topk=1), budget=96, keep=72, fps=2.0),
    }
    list(stream_video(tiny_random, video, engines))
    assert engines["rekv"].report()["policy_state"]["stored_blocks"] == 3
    return engines


def test_compare_s_fidelity_probe_retrieves_as_answering_does(small_streams):
    """``compare --fidelity`` on a rekv engine: the probe scores the stored blocks with the question's queries before
    RoPE as answering does, so its first-token KL is that of the engine's own question logits against the full
    cache's, and it leaves no retrieval marks behind."""
    from kvdemo.analysis.explain import fidelity, first_token_kl

    engines = small_streams
    question = "What is in the video?"
    results = fidelity(engines["full"], engines, question)
    assert not engines["rekv"].memory.retrieved_frames()[1].any()
    own, full = engines["rekv"].question_logits(question), engines["full"].question_logits(question)
    assert (engines["rekv"].memory.retrieved_frames()[1].sum(axis=1) == 2 * 24).all()  # a block for both heads
    assert results["rekv"]["first_token_kl"] == pytest.approx(first_token_kl(full, own), abs=1e-6)
    assert min(results["rekv"]["layer_error"]) > 0


def test_what_a_question_retrieved_survives_the_round_trip_of_an_answer_answered_elsewhere(small_streams):
    """The app applies what answering changed (a ZeroGPU worker sends back only that) outside inference mode: the
    retrieval marks the views draw stay as the question left them, and a later question does not change the state
    already sent."""
    engine = small_streams["rekv"]
    engine.answer("What is in the video?", 2)
    marks = engine.memory.retrieved_frames()[1]
    assert marks.sum() == 4 * 2 * 24  # each of the 4 layers retrieved one block for both heads
    state = engine.answer_state()
    engine.load_answer_state(state)
    assert (engine.memory.retrieved_frames()[1] == marks).all()
    sent = [t.clone() for t in state["retrieved"]]
    with torch.inference_mode():
        engine.memory.reset_retrieved()  # what the next question does first
    assert all(torch.equal(a, b) for a, b in zip(sent, state["retrieved"]))
    engine.load_answer_state(state)
    assert (engine.memory.retrieved_frames()[1] == marks).all()
