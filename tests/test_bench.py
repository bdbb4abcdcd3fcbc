"""The benchmarks' harnesses on small shapes: the pass against its floor, what policies declare worth
measuring (update, decode), and the comparison with the authors' code on a stand-in with their signature."""

import json

import pytest
import torch


def test_pass_benchmark_times_selection_apply_and_the_floor_on_a_small_shape():
    from kvdemo.bench.passes import pass_benchmark, pass_table
    from kvdemo.policies import make_policy

    shape = dict(num_layers=3, num_kv_heads=2, head_dim=16, budget=96, keep=72, grid=(3, 4))
    results = pass_benchmark(make_policy("infinipot-v"), repeats=2, shape=shape, compiled=False)
    for policy in ("infinipot-v", "uniform", "sliding-window"):
        for dtype in ("float32", "bfloat16"):
            row = results["pass_7b"][policy][dtype]
            assert row["total_ms"] == pytest.approx(row["select_ms"] + row["apply_ms"], rel=0.5)
            assert row["floor_ms"] > 0 and row["total_over_floor"] > 0
            # the read is part of each timed floor, so its median cannot exceed the floor's
            assert 0 < row["floor_read_ms"] <= row["floor_ms"]
            # apply moves at most M - C tokens per head: 24 x K and V x 2 heads x 16 dims x 3 layers
            assert 0 < row["moved_bytes"] <= 24 * 2 * 2 * 16 * 3 * (4 if dtype == "float32" else 2)
    append = results["append_7b"]["float32"]
    assert append["kvdemo"]["bytes_copied"] == 12 * 2 * 2 * 16 * 3 * 4  # one 3x4 grid, all layers
    assert append["dynamic_cache"]["bytes_copied"] > append["kvdemo"]["bytes_copied"]
    table = pass_table(results["pass_7b"])
    assert "total/floor" in table and "the floor's read, ms (median over the rows): float32 " in table


def test_protokv_and_hybridkv_benchmarks_on_a_small_shape():
    """The simulated streams run the engine's trigger: ProtoKV passes once per grid after its near window
    fills and reports its phases; HybridKV's pass offloads and its decode-step attention runs."""
    from kvdemo.bench.policies import decode_benchmark, decode_table, update_benchmark, update_table
    from kvdemo.policies import make_policy

    shape = dict(num_layers=2, num_kv_heads=2, num_heads=4, head_dim=16, budget=256, keep=192, grid=(2, 8))
    result = update_benchmark(make_policy("protokv", warmup=16), grids=20, factor=2, window=4, shape=shape)
    near = make_policy("protokv").split(256)[0]  # 64 tokens = 4 grids
    assert result["1x"]["passes"] == 20 - near // 16 and result["2x"]["passes"] == 40 - near // 16
    assert result["1x bfloat16"]["passes"] == result["1x"]["passes"]  # the same stream with a bfloat16 cache
    assert {"assignment", "update", "residuals", "maintenance", "synthesis", "total"} <= set(
        result["1x"]["per_frame_ms"]
    )
    assert result["infinipot_v"]["passes"] >= 1 and "InfiniPot-V" in update_table(result, "protokv")
    assert result["synthesis_all_ms"] > 0, "a policy with a summary region times synthesising every entry at once"
    decode = decode_benchmark(make_policy("hybridkv"), stream_tokens=512, shape=shape, repeats=1)
    assert decode["hybridkv_offloaded_bytes"] > 0 and decode["hybridkv_resident_bytes"] < decode["full_cache_bytes"]
    assert "decode-step attention" in decode_table(decode, None, "hybridkv")


def test_the_long_stream_benchmark_reports_every_pass_and_the_frames_the_memory_holds():
    """InfiniPot-V keeps tokens of old frames, so a later pass meets a memory holding tokens of more frames than the
    first pass's whole ones; the sliding window always holds its newest whole frames."""
    from kvdemo.bench.policies import long_stream_benchmark, long_stream_table
    from kvdemo.policies import make_policy

    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, budget=96, keep=72, grid=(3, 4))
    result = long_stream_benchmark(make_policy("infinipot-v"), grids=40, shape=shape)
    passes = result["passes"]
    assert len(passes) >= 5 and [p["grid"] for p in passes] == sorted(p["grid"] for p in passes)
    assert passes[0]["frames_held"] == 96 // 12  # the first pass: M's worth of whole frames
    assert passes[-1]["frames_held"] > passes[0]["frames_held"]
    assert all({"scoring", "pooling", "selection"} <= set(p["phases_ms"]) for p in passes)
    table = long_stream_table(result, "infinipot-v")
    assert "frames held" in table and f"frames held 8 -> {passes[-1]['frames_held']}" in table
    window = long_stream_benchmark(make_policy("sliding-window"), grids=40, shape=shape)["passes"]
    assert {p["frames_held"] for p in window} == {96 // 12}


def test_rekvs_host_store_holds_every_block_that_left_its_window():
    """Restated by hand: with C = 72 and blocks of one 16-token grid, ReKV keeps a window of 2 blocks and a retrieval
    reserve of 2 (topk=2), so after a pass at grid g (g grids fed) the store holds g - 2 blocks of 16 tokens, each
    token's keys and values 2 layers x 2 KV heads x 16 dims x 2 bytes (bfloat16) twice; it grows 16 tokens a second."""
    from kvdemo.bench.host_store import host_store_benchmark, host_store_table
    from kvdemo.bench.plans import bench_plan
    from kvdemo.policies import make_policy

    assert "store" in bench_plan(make_policy("rekv")).benchmarks  # declared by the policy, run by the bench
    shape = dict(num_layers=2, num_kv_heads=2, num_heads=4, head_dim=16, budget=96, keep=72, grid=(4, 4))
    result = host_store_benchmark(make_policy("rekv", topk=2), grids=30, shape=shape)
    token_bytes = 2 * 2 * 2 * 16 * 2
    passes = result["passes"]
    assert len(passes) >= 5 and result["token_bytes"] == token_bytes
    for p in passes:
        assert p["offloaded_bytes"] == (p["grid"] - 2) * 16 * token_bytes, p
    assert result["offloaded_bytes"] == passes[-1]["offloaded_bytes"]
    assert result["report"]["stored_blocks"] == passes[-1]["grid"] - 2
    assert result["mb_per_minute"] == pytest.approx(16 * token_bytes * 60 / 1e6)
    assert result["device_tokens"] <= 96 and result["full_cache_bytes"] == 30 * 16 * token_bytes
    table = host_store_table(result, "rekv")
    assert "grows 0.2458 MB per minute of stream" in table  # 16 x 256 B a second


FAKE_REFERENCE = """
import torch

def process_kv_cache(past_key_values, model, system_size, inst_size, token_per_frame, compress_frame_num,
                     method="uniform", tar_ratio=0.5, query_ratio=0.25, adaptive_pooling=False, **unused):
    # A stand-in for the authors' kvcache_utils.py with their signature: keeps the {which} compress_frame_num frames.
    assert method == "swa" and inst_size == 0 and not adaptive_pooling
    assert len(model.model.language_model.layers) == len(past_key_values.layers) and model.config.height_width == 2
    keep = compress_frame_num * token_per_frame
    for layer in past_key_values.layers:
        for name in ("keys", "values"):
            cache = getattr(layer, name)
            visual = cache[:, :, system_size:]
            kept = visual[:, :, -keep:] if "{which}" == "newest" else visual[:, :, :keep]
            setattr(layer, name, torch.cat([cache[:, :, :system_size], kept], dim=2))
    return past_key_values
"""


@pytest.mark.parametrize("which,identical,shared", [("newest", 4, 1.0), ("oldest", 0, 0.5)])
def test_reference_comparison_loads_the_users_file_and_compares_kept_tokens(tmp_path, which, identical, shared):
    """``bench --reference``'s harness on a stand-in with the authors' signature: kvdemo's sliding window
    against a reference keeping the newest 4 of 6 frames (the same tokens in every layer-head) or the oldest
    4 (2 of 4 frames in common)."""
    from kvdemo.bench.reference import load_reference, reference_benchmark, reference_table
    from kvdemo.policies import make_policy

    (tmp_path / "kvcache_utils.py").write_text(FAKE_REFERENCE.replace("{which}", which))
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=8, budget=24, keep=16, grid=(2, 2))  # 6 frames of 4, keep 4
    result = reference_benchmark(
        load_reference(tmp_path), repeats=1, policy=make_policy("sliding-window"), method="swa", shape=shape
    )
    for dtype in ("float32", "bfloat16"):
        row = result[dtype]
        assert (row["identical_rows"], row["rows"]) == (identical, 4)
        assert row["shared_token_fraction"] == pytest.approx(shared)
        assert row["ratio"] == pytest.approx(row["kvdemo_ms"] / row["reference_ms"])
    assert f"{identical}/4 layer-heads identical" in reference_table(result)


@pytest.mark.parametrize(
    "name, params",
    [("uniform", {}), ("sliding-window", {}), ("infinipot-v", {}), ("cords", {}), ("protokv", {"warmup": 8})],
)
def test_the_simulated_stream_compresses_where_the_engine_does(tiny_random, name, params):
    """The bench's simulated stream (random keys, no model) and the engine on the tiny model compress before the
    same grids. 12 chunks of t = 135 tokens (9 x 15), M = 4t, C = 2t: a selection policy holds 4t after four
    chunks, so it compresses before chunks 4, 6, 8 and 10. ProtoKV at M = 540 with chunks of 135 has 33 prototypes
    x 8 = 264 summary slots and a near window of 276 (two chunks at least): the first two chunks fit, every later
    one overflows (split without the chunk size, as the bench did, the window was 140 and it compressed at 1)."""
    from kvdemo.bench.simulation import simulated_stream
    from kvdemo.policies import make_policy
    from kvdemo.stream.engine import FrameStream
    from kvdemo.stream.lineup import Contender, make_engines
    from kvdemo.world.synthetic import synthetic_video

    video = synthetic_video(num_frames=24, height=252, width=420, fps=2.0, seed=5).resized(tiny_random.geometry)
    stream = FrameStream(tiny_random, 2.0)
    chunks = [stream.push(video.frames[i : i + 2]) for i in range(0, 24, 2)]
    assert {(c.rows, c.cols, c.num_tokens) for c in chunks} == {(9, 15, 135)}
    engine = make_engines(tiny_random, [Contender(name, params)], 540, 270, fps=2.0)[name]
    engine_grids = [g for g, chunk in enumerate(chunks) if any(e.event == "compress" for e in engine.feed_chunk(chunk))]
    shape = dict(
        num_layers=tiny_random.num_layers,
        num_kv_heads=tiny_random.num_kv_heads,
        head_dim=tiny_random.head_dim,
        budget=540,
        keep=270,
        grid=(9, 15),
    )
    _, passes = simulated_stream(make_policy(name, **params), len(chunks), shape)
    expected = list(range(2, 12)) if name == "protokv" else [4, 6, 8, 10]
    assert engine_grids == expected
    assert [p["grid"] for p in passes] == expected


def test_kept_by_one_only_counts_the_tokens_one_selection_keeps_and_the_other_does_not():
    from kvdemo.bench.passes import _kept_by_one_only

    ours = [torch.tensor([[0, 2, 3], [1, 2, 4]]), torch.tensor([[5, 6]])]
    theirs = [torch.tensor([[0, 1, 3], [1, 2, 4]]), torch.tensor([[0, 1]])]
    assert _kept_by_one_only(ours, theirs) == 1 + 2  # layer 0 head 0: token 2; layer 1: tokens 5 and 6
    assert _kept_by_one_only(theirs, theirs) == 0


def test_the_bench_runs_its_7b_shape_passes_on_another_device():
    """``bench --device``: a simulated stream on the emulated device holds the same keys, values and provenance as
    on the host after every pass, and the pass benchmark runs there with no host tensor meeting a device one."""
    from kvdemo.bench.passes import pass_benchmark
    from kvdemo.bench.simulation import simulated_stream
    from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice
    from kvdemo.policies import make_policy

    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, budget=96, keep=72, grid=(3, 4))
    host, host_passes = simulated_stream(make_policy("infinipot-v"), 30, shape)
    mode = EmulatedDevice()
    with mode:
        moved, passes = simulated_stream(make_policy("infinipot-v"), 30, shape, device=DEVICE)
        assert all(mode.on_device(store.keys) for store in moved.layers)
        results = pass_benchmark(make_policy("sliding-window"), repeats=1, shape=shape, compiled=False, device=DEVICE)
    assert len(passes) == len(host_passes) >= 5
    for ours, theirs in zip(moved.layers, host.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert torch.equal(ours.packed, theirs.packed)
    assert results["device"] == str(DEVICE) and results["pass_7b"]["sliding-window"]["bfloat16"]["moved_bytes"] > 0


def test_bench_count_writes_every_bounded_policys_launches_and_host_reads(tmp_path, capsys):
    from kvdemo.cli import main
    from kvdemo.policies import make_policy, policy_names

    out = tmp_path / "counts.json"
    assert main(["bench", "--count", "--layers", "1,2", "--json", str(out)]) == 0
    counts = json.loads(out.read_text())["count"]
    assert set(counts) == {name for name in policy_names() if make_policy(name).bounded}
    for by_depth in counts.values():
        assert set(by_depth) == {"1", "2"}
        assert all(c["launches"] > 0 and c["host_reads"] >= 0 for c in by_depth.values())
    assert "counted on the emulated device" in capsys.readouterr().out
    assert main(["bench", "--count", "--layers", "0"]) == 2
