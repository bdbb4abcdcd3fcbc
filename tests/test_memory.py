"""The KV memory at the physical limit: preallocated buffers written in place, compaction that moves only
the kept tokens beyond slot C, provenance that moves with them, the slack that answers questions, ragged
heads. Expected states are restated with plain Python over token ids, independently of the memory code."""

import copy
import threading

import pytest
import torch

from kvdemo import tensors
from kvdemo.analysis.survival import survival_counts
from kvdemo.cache.attention import MemoryCache
from kvdemo.cache.budget import Budget
from kvdemo.cache.memory import REASON_NEW, KVMemory
from kvdemo.models.qwen2_vl import mrope_positions
from kvdemo.policies import Selection
from kvdemo.policies.contract import SummaryUpdate
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import stream_video
from kvdemo.tensors import flat_nonzero, gather_rows, put_rows, rows_at, take_rows
from kvdemo.testing import synthetic_chunk, synthetic_memory

GRID = (2, 3)  # 6 tokens per temporal grid, non-square


def small_memory(
    grids: int = 4, heads: int = 2, dim: int = 8, layers: int = 2, capacity: int = 30, dtype=torch.float32
):
    """A memory whose key for token ``t`` of head ``h`` in layer ``l`` is ``(t, h, l, 0, ...)`` (values the
    negative), so every slot says which token it holds (exact in bfloat16 too)."""
    memory = KVMemory(layers, heads, Budget(capacity))
    cache = MemoryCache(memory)
    for layer in cache.layers:
        layer.update(
            torch.full((1, heads, 3, dim), -7.0, dtype=dtype), torch.full((1, heads, 3, dim), 7.0, dtype=dtype)
        )
    memory.commit_prefix(3)
    for g in range(grids):
        append_grid(memory, g, dim, dtype)
    return memory


def token_kv(memory: KVMemory, layer: int, first: int, n: int, dim: int, dtype):
    heads = memory.num_kv_heads
    keys = torch.zeros(1, heads, n, dim, dtype=torch.float64)
    keys[..., 0] = torch.arange(first, first + n, dtype=torch.float64)
    keys[..., 1] = torch.arange(heads, dtype=torch.float64)[:, None]
    keys[..., 2] = layer
    return keys.to(dtype), (-keys).to(dtype)


def append_grid(memory: KVMemory, g: int, dim: int = 8, dtype=torch.float32):
    chunk = synthetic_chunk(g, 1, GRID)
    cache = MemoryCache(memory)
    for index, layer in enumerate(cache.layers):
        layer.update(*token_kv(memory, index, memory.tokens_seen, chunk.num_tokens, dim, dtype))
    memory.commit_append(chunk, mrope_positions(chunk.grid, chunk.row, chunk.col, memory.prefix_len, 1.0, 2.0))


def held_tokens(memory: KVMemory, layer: int, head: int) -> list[int]:
    """Token ids (arrival order) a head holds, read from its keys (the fill value minus the offsets)."""
    p = memory.visual_start
    keys = memory.keys[layer][0, head, p:].double()
    assert (keys[:, 1] == head).all() and (keys[:, 2] == layer).all()
    ids = keys[:, 0].round().long()
    valid = memory.valid[layer]
    if valid is not None:
        ids = ids[valid[head]]
    return sorted(ids.tolist())


def test_appends_write_in_place_and_copy_only_the_chunk():
    memory = small_memory(grids=1)
    buffers = [store.keys.data_ptr() for store in memory.layers]
    event = None
    for g in range(1, 4):
        append_grid(memory, g)
        event = memory.record("append", 2 * (g + 1), float(g), 0.0, 6 * memory.token_bytes())
    assert [store.keys.data_ptr() for store in memory.layers] == buffers  # no reallocation, no concatenation
    assert event.moved_bytes == 6 * 2 * 2 * 8 * 4 * 2  # 6 tokens x K and V x 2 heads x 8 dims x 4 bytes x 2 layers
    assert memory.visual_tokens == 24 and held_tokens(memory, 1, 1) == list(range(24))
    assert memory.nbytes == sum(t.numel() * t.element_size() for t in memory.keys + memory.values)
    assert memory.allocated_bytes > memory.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_keeps_exactly_the_selection_and_moves_only_tokens_beyond_c(dtype):
    memory = small_memory(grids=4, dtype=dtype)  # 24 tokens, ids 0..23
    prefix_before = [k[:, :, :3].clone() for k in memory.keys]
    # Layer 0 keeps per head a different set; layer 1 keeps the first 10 (nothing to move).
    keep0 = torch.tensor([[0, 2, 5, 11, 12, 13, 19, 20, 22, 23], [1, 3, 4, 6, 7, 8, 9, 10, 14, 15]])
    keep1 = torch.arange(10).expand(2, -1)
    reasons = [torch.full((2, 10), 3, dtype=torch.int8), torch.full((2, 10), 4, dtype=torch.int8)]
    moved = memory.apply(Selection([keep0, keep1], {"reason": reasons}))
    for head in range(2):
        assert held_tokens(memory, 0, head) == keep0[head].tolist()
        assert held_tokens(memory, 1, head) == list(range(10))
    # Plain restatement of the move count: kept tokens at slots >= C=10 in each head.
    movers = sum(int((keep0[h] >= 10).sum()) for h in range(2))
    token = 2 * 8 * torch.tensor([], dtype=dtype).element_size()  # K and V of one head
    assert moved == movers * token
    # Provenance moved with the keys: the frame of every slot is its token's grid, and reasons landed.
    p = memory.visual_start
    ids = memory.keys[0][0, :, p:, 0].double().round().long()
    assert torch.equal(memory.frame[0].long(), ids // 6)
    assert torch.equal(memory.row[0].long(), (ids % 6) // 3) and torch.equal(memory.col[0].long(), ids % 3)
    assert torch.equal(memory.order[0], ids)
    assert (memory.reason[0] == 3).all() and (memory.reason[1] == 4).all()
    assert all(torch.equal(a, b[:, :, :3]) for a, b in zip(prefix_before, memory.keys))
    # The slots are no longer in stream order (token 22 sits below token 11 in head 0).
    assert not bool((memory.order[0][0, 1:] > memory.order[0][0, :-1]).all())


def test_a_new_chunk_goes_after_the_compacted_tokens_and_gets_the_new_reason():
    memory = small_memory(grids=4)
    memory.apply(Selection([torch.tensor([[1, 7, 13, 19, 23, 5]] * 2).sort().values] * 2))
    append_grid(memory, 4)
    assert held_tokens(memory, 0, 0) == [1, 5, 7, 13, 19, 23, *range(24, 30)]
    assert (memory.reason[0][:, 6:] == REASON_NEW).all()
    assert memory.frame[0][0, 6:].tolist() == [4] * 6


def test_ragged_selection_pads_with_a_minus_infinity_bias():
    memory = small_memory(grids=4)
    index = torch.tensor([[0, 5, 9, 17, 23], [2, 3, 2, 2, 2]])  # padding that repeats a kept token
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    reason = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], dtype=torch.int8)
    memory.apply(Selection([index, index], {"reason": [reason, reason]}, valid=[valid, valid]))
    assert held_tokens(memory, 0, 0) == [0, 5, 9, 17, 23] and held_tokens(memory, 0, 1) == [2, 3]
    # Each kept token carries its own reason; the entries marked invalid wrote none.
    for layer in range(2):
        by_token = {int(t): int(r) for t, r in zip(memory.order[layer][0, :5], memory.reason[layer][0, :5])}
        assert by_token == {0: 5, 5: 6, 9: 7, 17: 8, 23: 9}
        by_token = {int(t): int(r) for t, r in zip(memory.order[layer][1, :2], memory.reason[layer][1, :2])}
        assert by_token == {2: 10, 3: 11}
    assert memory.head_counts(0).tolist() == [5, 2]
    assert memory.visual_tokens == 4  # mean over KV heads: (5 + 2) / 2 rounded
    assert memory.largest_head_tokens == 5
    bias = memory.layers[0].bias
    start = memory.visual_start
    assert torch.isinf(bias[1, start + 2 : start + 5]).all() and (bias[0, start : start + 5] == 0).all()
    assert (bias[:, start + 5 :] == 0).all()  # the slack stays plain for the next forward
    counts = survival_counts(memory, layer=0)
    assert int(counts.sum()) == 7


def test_the_buffers_grow_geometrically_and_keep_their_content():
    memory = small_memory(grids=2, capacity=0)  # room for the prefix and the text reserve only
    capacities = set()
    for g in range(2, 80):
        append_grid(memory, g)
        capacities.add(memory.layers[0].capacity)
    assert held_tokens(memory, 1, 1) == list(range(480))
    assert len(capacities) < 10  # geometric, not one reallocation per chunk
    assert memory.frame[0][0].tolist() == [t // 6 for t in range(480)]


def test_a_summary_region_sits_between_prefix_and_visual_tokens():
    memory = KVMemory(1, 2, Budget(16, summary=4))
    cache = MemoryCache(memory)
    cache.layers[0].update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    memory.commit_prefix(3)
    append_grid(memory, 0)
    # Counted from the start (the budget's split), laid out only when the policy first fills it.
    assert memory.visual_tokens == 4 + 6 and memory.visual_start == 3 and memory.nbytes == 2 * 2 * 9 * 8 * 4
    visual = memory.keys[0][0, :, 3:9].clone()
    summary = SummaryUpdate(
        torch.ones(2, 4, 8), 2 * torch.ones(2, 4, 8), torch.tensor([[0.0, 1.0, float("-inf"), 2.0]] * 2)
    )
    memory.apply(Selection([torch.arange(3, 6).expand(2, -1)], summary=[summary]))
    assert memory.visual_start == 7
    assert torch.equal(memory.keys[0][0, :, 7:10], visual[:, 3:6])  # the kept visual tokens moved up with the region
    assert torch.equal(memory.keys[0][0, :, 3:7], torch.ones(2, 4, 8))
    assert memory.layers[0].bias[0, 3:7].tolist() == [0.0, 1.0, float("-inf"), 2.0]
    assert held_tokens(memory, 0, 0) == [3, 4, 5]


@pytest.mark.parametrize("layers", [(0, 1, 2), (2, 0)])
def test_a_summary_update_of_several_layers_writes_what_one_per_layer_writes(layers):
    """One SummaryUpdate covering several layers (rows stacked layer by layer, the same object at each of their
    places; in order, or not) leaves the memory bit for bit as one update per layer does, slots and bias included."""
    g = torch.Generator().manual_seed(3)
    heads, slots, dim = 2, 6, 8
    keys = torch.randn(len(layers) * heads, 4, dim, generator=g)
    values = torch.randn(len(layers) * heads, 4, dim, generator=g)
    where = torch.stack([torch.randperm(slots, generator=g)[:4] for _ in range(len(layers) * heads)])
    bias = torch.randn(len(layers) * heads, slots, generator=g).double().float()
    memories = []
    for stacked in (False, True):
        memory = KVMemory(3, heads, Budget(30, summary=slots))
        cache = MemoryCache(memory)
        for layer in cache.layers:
            layer.update(torch.zeros(1, heads, 3, dim, dtype=torch.bfloat16), torch.zeros(1, heads, 3, dim).bfloat16())
        memory.commit_prefix(3)
        for grid in range(2):
            append_grid(memory, grid, dim, torch.bfloat16)
        summary: list[SummaryUpdate | None] = [None] * 3
        if stacked:
            update = SummaryUpdate(keys, values, bias, where, layers=layers)
            for layer in layers:
                summary[layer] = update
        else:
            for part, layer in enumerate(layers):
                rows = slice(part * heads, (part + 1) * heads)
                summary[layer] = SummaryUpdate(keys[rows], values[rows], bias[rows], where[rows])
        memory.apply(Selection([torch.arange(2, 12).expand(heads, -1)] * 3, summary=summary))
        memories.append(memory)
    per_layer, stacked = memories
    for a, b in zip(per_layer.layers, stacked.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and a.biased == b.biased
        assert (a.bias is None) == (b.bias is None) and (a.bias is None or torch.equal(a.bias, b.bias))
    for part, layer in enumerate(layers):  # and it is what the update says
        rows = slice(part * heads, (part + 1) * heads)
        held = torch.gather(stacked.layers[layer].keys[0], 1, (3 + where[rows])[..., None].expand(-1, -1, dim))
        assert torch.equal(held, keys[rows].bfloat16())
        assert torch.equal(stacked.layers[layer].bias[:, 3 : 3 + slots], bias[rows])


def test_a_fork_keeps_the_memory_as_it_was_in_buffers_of_its_own():
    """KVMemory.fork copies each group's buffers (keys/values, provenance, bias; nothing shared) and makes each layer a
    view of its fork's group at the same index: a chunk and a compaction on the memory afterwards leave the fork as it
    was, and a question's tokens written into the fork's slack leave the memory as it is."""
    memory = small_memory(grids=4)
    index = torch.tensor([[0, 5, 9, 17, 23], [2, 3, 2, 2, 2]])  # ragged: a valid mask and a bias to copy
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    memory.apply(Selection([index, index], valid=[valid, valid]))
    fork = memory.fork()
    assert len(fork.groups) == len(memory.groups) == 1
    ours, theirs = memory.groups[0], fork.groups[0]
    for a, b in (
        (ours.kv, theirs.kv),
        (ours.packed, theirs.packed),
        (ours.bias, theirs.bias),
        (ours.valid, theirs.valid),
    ):
        assert a.shape == b.shape and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert [(s.group, s.index) for s in fork.layers] == [(theirs, 0), (theirs, 1)]
    before = [t.clone() for t in (*fork.keys, *fork.values, *fork.order, fork.layers[0].bias)]
    assert all(torch.equal(a, b) for a, b in zip(before, (*memory.keys, *memory.values, *memory.order)))
    assert held_tokens(fork, 0, 1) == [2, 3] and torch.equal(fork.valid[0], memory.valid[0])
    append_grid(memory, 4)  # the memory goes on: a chunk, then a compaction
    memory.apply(Selection([torch.arange(6, 11).expand(2, -1)] * 2))
    after = (*fork.keys, *fork.values, *fork.order, fork.layers[0].bias)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and held_tokens(fork, 0, 1) == [2, 3]
    assert fork.grid_times_s != memory.grid_times_s and fork.tokens_seen == 24 and memory.tokens_seen == 30
    live = [t.clone() for t in (*memory.keys, *memory.values)]
    cache = MemoryCache(fork)  # a question's tokens, in the fork's slack (never committed)
    for layer in cache.layers:
        layer.update(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8))
    assert all(torch.equal(a, b) for a, b in zip(live, (*memory.keys, *memory.values)))


def test_engine_memory_holds_m_slots_and_questions_use_the_slack(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "sliding-window", budget=540, keep=405, fps=pancake.fps, max_new_tokens=4)
    list(stream_video(tiny_random, pancake, {"p": engine}))
    store = engine.memory.layers[0]
    assert store.capacity <= engine.memory.prefix_len + 540 + 256  # grown to M and a question, never past
    pointers = [s.keys.data_ptr() for s in engine.memory.layers]
    engine.answer("What is it?")
    assert [s.keys.data_ptr() for s in engine.memory.layers] == pointers
    compress = [e for e in engine.memory.timeline if e.event == "compress"]
    assert all(e.moved_bytes <= (540 - 405) * engine.memory.token_bytes() for e in compress)
    appends = [e for e in engine.memory.timeline if e.event == "append"]
    assert all(e.moved_bytes == 135 * engine.memory.token_bytes() for e in appends)


def test_sliding_window_keeps_the_newest_frames_across_passes_with_scrambled_slots(tiny_random, pancake):
    engine = StreamEngine(tiny_random, "sliding-window", budget=405, keep=270, fps=pancake.fps)
    list(stream_video(tiny_random, pancake, {"p": engine}))
    assert engine.stats.compressions >= 3
    # 10 grids of 135: the last compression kept grids 7-8 (270 tokens), then grid 9 arrived.
    for layer in range(tiny_random.num_layers):
        assert sorted(engine.memory.frame[layer][0].unique().tolist()) == [7, 8, 9]


def test_synthetic_memory_deepcopies_for_benchmarks():
    memory = synthetic_memory(2, 2, 8, 48, GRID, torch.float32)
    twin = copy.deepcopy(memory)
    twin.apply(Selection([torch.arange(24).expand(2, -1)] * 2))
    assert memory.visual_tokens == 48 and twin.visual_tokens == 24


@pytest.mark.parametrize(
    "policy, params",
    [
        ("infinipot-v", {"budget": 540, "keep": 405}),
        ("protokv", {"budget": 560}),
        ("hybridkv", {"budget": 540, "keep": 405}),
    ],
)
def test_an_engine_pickles_without_its_model_and_continues_identically(tiny_random, pancake, policy, params):
    """What a ZeroGPU worker receives: the engine's state (live slots only) crosses a process boundary and,
    re-bound to the model, streams and answers exactly as the engine that never left."""
    import pickle

    from kvdemo.stream.engine import FrameStream

    stay = StreamEngine(tiny_random, policy, fps=2.0, max_new_tokens=5, **params)
    stream = FrameStream(tiny_random, 2.0)
    chunks = [stream.push(pancake.frames[i : i + 2]) for i in range(0, 20, 2)]
    for chunk in chunks[:6]:
        stay.feed_chunk(chunk)
    blob = pickle.dumps(stay)
    assert b"Qwen2_5_VLForConditionalGeneration" not in blob
    live = sum(t.numel() * t.element_size() for t in stay.memory.keys + stay.memory.values)
    assert len(blob) < live + 2_000_000  # the live slots, not the preallocated capacity
    moved = pickle.loads(blob).bind(tiny_random)
    for chunk in chunks[6:]:
        stay.feed_chunk(chunk)
        moved.feed_chunk(chunk)
    assert all(
        torch.equal(a, b)
        for a, b in zip(stay.memory.keys + stay.memory.values, moved.memory.keys + moved.memory.values)
    )
    assert moved.memory.layers[0].capacity == stay.memory.layers[0].capacity
    assert stay.answer("What is it?").answer == moved.answer("What is it?").answer
    assert [e.visual_tokens for e in stay.memory.timeline] == [e.visual_tokens for e in moved.memory.timeline]


@pytest.mark.parametrize(
    "policy, params",
    [
        ("infinipot-v", {"budget": 1_000_000, "keep": 750_000}),
        ("protokv", {"budget": 1_000_000}),
        ("sliding-window", {"budget": 540, "keep": 405}),
    ],
)
def test_buffers_follow_what_the_stream_holds_not_the_budget_typed(tiny_random, pancake, policy, params):
    """An M the stream never reaches allocates nothing for it (it reserved 2.2 GB for a 640-token stream); a
    reachable M grows the buffers geometrically up to what it needs and no further."""
    engine = StreamEngine(tiny_random, policy, fps=pancake.fps, max_new_tokens=4, **params)
    list(stream_video(tiny_random, pancake, {"p": engine}))
    engine.answer("What is it?")
    memory = engine.memory
    streamed = (memory.prefix_len + memory.tokens_seen) * memory.token_bytes()  # everything the stream brought
    assert memory.allocated_bytes <= 1.5 * streamed + 256 * memory.token_bytes(), (memory.allocated_bytes, streamed)
    if params["budget"] < 1000:
        assert all(s.capacity <= memory.prefix_len + params["budget"] + 256 for s in memory.layers)


@pytest.mark.parametrize(
    "dtype, dim",
    [(torch.float32, 8), (torch.bfloat16, 8), (torch.bfloat16, 3), (torch.int32, 8), (torch.int8, 5), (torch.bool, 3)],
)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("records", [True, False])
def test_row_moves_match_a_plain_loop(dtype, dim, layout, records, monkeypatch):
    """take_rows / put_rows (on a CPU each row's bytes as one numpy record, whatever the dtype and row width, for moves
    of at least RECORD_MIN_ROWS rows; smaller moves and rows that are not one contiguous block through index_select /
    index_copy_) against rows copied one at a time, and an empty index that moves nothing."""
    monkeypatch.setattr(tensors, "RECORD_MIN_ROWS", 0 if records else 10**9)
    generator = torch.Generator().manual_seed(3)
    base = (torch.randn(40, dim * 2, generator=generator) * 100).to(dtype)
    rows = base[:, :dim].contiguous() if layout == "contiguous" else base[:, ::2]  # strided: every other column
    assert rows.is_contiguous() == (layout == "contiguous")
    source = torch.tensor([7, 0, 39, 12, 12, 5])
    gathered = take_rows(rows, source)
    assert gathered.dtype == dtype and gathered.shape == (6, dim)
    for i, s in enumerate(source.tolist()):
        assert torch.equal(gathered[i], rows[s])
    target = torch.tensor([3, 30, 1, 22, 9, 0])
    expected = rows.clone()
    for i, t in enumerate(target.tolist()):
        expected[t] = gathered[i]
    put_rows(rows, target, gathered)
    assert torch.equal(rows, expected)
    nothing = torch.zeros(0, dtype=torch.long)
    assert take_rows(rows, nothing).shape == (0, dim)
    put_rows(rows, nothing, take_rows(rows, nothing))
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("mode", ["threads", "one thread", "torch"])
def test_move_rows_matches_a_plain_loop(dtype, mode, monkeypatch):
    """move_rows (a compaction's moves: kept rows into evicted ones, no row both read and written; one per layer,
    made together) against rows copied one at a time: two buffers' moves shared out between two threads (the
    threads' shares cut through the moves), moved on this thread alone, and through take_rows / put_rows below the
    records' threshold."""
    monkeypatch.setattr(tensors, "RECORD_MIN_ROWS", 10**9 if mode == "torch" else 0)
    monkeypatch.setattr(tensors, "PARALLEL_MIN_ROWS", 4 if mode == "threads" else 10**9)
    monkeypatch.setattr(tensors.os, "cpu_count", lambda: 2)  # two threads even on a one-core machine
    monkeypatch.setattr(tensors, "_pool", {"pid": None, "executor": None, "lock": threading.Lock()})  # none made yet
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(6)
        buffers = [(torch.randn(n, 12, generator=generator) * 100).to(dtype) for n in (300, 90)]
        moves = []
        for rows, count in zip(buffers, (120, 25)):
            order = torch.randperm(rows.shape[0], generator=generator)
            moves.append((rows, order[:count], order[-count:]))  # disjoint, as a compaction's holes and movers are
        expected = [rows.clone() for rows in buffers]
        for (rows, dst, src), out in zip(moves, expected):
            for d, s in zip(dst.tolist(), src.tolist()):
                out[d] = rows[s]
        tensors.move_rows(moves)
        assert all(torch.equal(rows, out) for rows, out in zip(buffers, expected))
        tensors.move_rows([(rows, dst[:0], src[:0]) for rows, dst, src in moves])
        tensors.move_rows([])
        assert all(torch.equal(rows, out) for rows, out in zip(buffers, expected))
        # the pool is made by this call exactly when the moves were shared out
        assert (tensors._pool["executor"] is not None) == (mode == "threads")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("on_device", [False, True])
def test_owners_match_a_plain_loop(on_device):
    """owners: entry i of the counts owns the next counts[i] items (numpy's repeat on the host; repeat_interleave
    on a device, here the emulated one)."""
    from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice

    counts = torch.tensor([3, 0, 2, 5, 0])
    expected = [i for i, n in enumerate(counts.tolist()) for _ in range(n)]
    if on_device:
        with EmulatedDevice():
            out = tensors.owners(counts.to(DEVICE), 10)
            assert out.device == DEVICE
    else:
        out = tensors.owners(counts, 10)
    assert out.dtype == torch.int64 and out.tolist() == expected
    assert tensors.owners(torch.zeros(0, dtype=torch.long), 0).tolist() == []


def test_gather_rows_matches_a_plain_loop():
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(0, 1000, (3, 7, 2, 4), generator=generator, dtype=torch.int32)
    index = torch.tensor([[6, 0, 0], [2, 5, 1], [3, 3, 6]])
    out = gather_rows(x, index)
    assert out.shape == (3, 3, 2, 4)
    for b in range(3):
        for u in range(3):
            assert torch.equal(out[b, u], x[b, int(index[b, u])])


@pytest.mark.parametrize("shape, transposed", [((7, 13), False), ((3, 4, 5), False), ((6, 9), True), ((0, 4), False)])
def test_flat_nonzero_matches_a_plain_loop(shape, transposed):
    """flat_nonzero: the flattened positions of the true entries, ascending, in row-major order of the mask as seen
    (a transposed view counts in its own order, not its storage's)."""
    generator = torch.Generator().manual_seed(4)
    mask = torch.rand(shape, generator=generator) < 0.4
    mask = mask.t() if transposed else mask
    flat = mask.flatten().tolist()
    expected = [i for i, bit in enumerate(flat) if bit]
    out = flat_nonzero(mask)
    assert out.dtype == torch.int64 and out.tolist() == expected


@pytest.mark.parametrize("layout", ["heads of a larger buffer", "contiguous", "transposed", "expanded"])
def test_rows_at_matches_a_plain_loop(layout):
    """rows_at (one gather over the rows of the buffer under a strided view, or advanced indexing where the view is not
    whole rows) against the rows read one at a time."""
    generator = torch.Generator().manual_seed(11)
    buffer = torch.randn(1, 6, 9, 4, generator=generator).to(torch.bfloat16)  # keys are heads 0..2 of 6, 9 slots
    x = {
        "heads of a larger buffer": buffer[0, :3, 2:7],
        "contiguous": buffer[0, :3, 2:7].contiguous(),
        "transposed": buffer[0, :3, 2:6].transpose(1, 2),
        "expanded": buffer[0, :1, 2:7].expand(3, 5, 4),
    }[layout]
    first, second = torch.tensor([2, 0, 1, 2, 0]), torch.tensor([3, 0, 2, 0, 3])
    out = rows_at(x, first, second)
    assert out.shape == (5, x.shape[-1])
    for i, (a, b) in enumerate(zip(first.tolist(), second.tolist())):
        assert torch.equal(out[i], x[a, b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_take_rows_into_a_slice_writes_in_place_what_a_plain_loop_takes(dtype):
    """``out=``: the rows land in the given slice of a larger buffer (no other row of it changes), moved as int64
    words where a row is whole words (rows of 8) and as elements where it is not (rows of 4 bfloat16 or int8)."""
    generator = torch.Generator().manual_seed(9)
    rows = torch.randint(-100, 100, (12, 8), generator=generator).to(dtype)
    index = torch.tensor([11, 0, 4, 4, 7])
    buffer = torch.full((9, 8), 55, dtype=dtype)
    before = buffer.clone()
    returned = take_rows(rows, index, out=buffer[2:7])
    assert returned.data_ptr() == buffer[2:7].data_ptr()
    for i, r in enumerate(index.tolist()):
        assert torch.equal(buffer[2 + i], rows[r])
    assert torch.equal(buffer[:2], before[:2]) and torch.equal(buffer[7:], before[7:])
    narrow = torch.randint(-100, 100, (6, 4), generator=generator).to(dtype)
    target = torch.zeros(3, 4, dtype=dtype)
    take_rows(narrow, torch.tensor([5, 1, 5]), out=target)
    assert torch.equal(target, torch.stack([narrow[5], narrow[1], narrow[5]]))


@pytest.mark.parametrize("fill", [0, False])
def test_layers_of_different_widths_stack_padded_as_a_plain_loop_pads_them(fill):
    """A compaction stacks a group's per-layer selections ``[H, K_l]`` as ``[G, H, max K]``: each layer's entries
    first, ``fill`` after them; a layer the selection says nothing of keeps its slots in order (an index) or counts
    every entry (a valid mask)."""
    from kvdemo.cache.compaction import stack_rows

    memory = synthetic_memory(4, 2, 8, 48, GRID, torch.float32, seed=3)
    g = torch.Generator().manual_seed(5)
    widths = [3, 7, None, 5]
    per_layer = [
        None if w is None else (torch.randint(0, 30, (2, w), generator=g) if fill == 0 else torch.rand(2, w) > 0.5)
        for w in widths
    ]
    out = stack_rows(memory.layers, per_layer, 6, fill)
    assert out.shape == (4, 2, 7)
    for layer, t in enumerate(per_layer):
        for head in range(2):
            for slot in range(7):
                if t is None:
                    last = memory.layers[layer].visual_len - 1
                    want = True if fill is False else min(slot, last)
                else:
                    want = t[head, slot].item() if slot < t.shape[1] else fill
                assert out[layer, head, slot].item() == want, (layer, head, slot)


def test_stacking_selections_of_different_widths_takes_as_many_launches_at_any_depth():
    """What a compaction's stacking asks of a GPU does not grow with the layers (counted on the emulated device)."""
    from kvdemo.cache.compaction import stack_rows
    from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice

    launches = []
    for layers in (4, 28):
        memory = synthetic_memory(layers, 2, 8, 48, GRID, torch.float32, seed=3)
        with EmulatedDevice(), torch.inference_mode():
            memory.to(DEVICE)
            per_layer = [torch.arange(2 * (3 + layer % 5)).view(2, -1).to(DEVICE) for layer in range(layers)]
        mode = EmulatedDevice()
        with mode, torch.inference_mode():
            stack_rows(memory.layers, per_layer, 8, 0)
        launches.append(mode.launches)
    assert launches[0] == launches[1]
