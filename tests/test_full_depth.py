"""The doctor's real-shape passes and its full-depth streams (random weights at real configs), on the CPU at
small sizes: the same code that runs at full size on a GPU."""

import json

import pytest
import torch

from kvdemo.bench import fulldepth
from kvdemo.bench.doctor import real_shape_passes
from kvdemo.models.catalog import released_configs
from kvdemo.policies import make_policy, policy_names
from kvdemo.testing import QWEN3B_SHAPE, QWEN7B_SHAPE

BOUNDED = [p for p in policy_names() if make_policy(p).bounded]


def test_real_shape_passes_run_every_bounded_policy_with_the_rotation():
    """Every bounded policy's pass at a small shape; ProtoKV keeps keys before RoPE, so the doctor's real-shape
    passes hand every policy the rotation (without it, ProtoKV's pass raises)."""
    small = dict(num_layers=2, num_kv_heads=2, head_dim=128, budget=512, keep=384, grid=(8, 8))
    rows = real_shape_passes(torch.device("cpu"), repeats=1, shapes=(("small", small),))
    assert [r["policy"] for r in rows] == BOUNDED
    assert all(r["total_ms"] > 0 for r in rows)


@pytest.mark.parametrize("name, shape", [("qwen2.5-vl-3b", QWEN3B_SHAPE), ("qwen2.5-vl-7b", QWEN7B_SHAPE)])
def test_the_real_configs_have_the_cache_geometry_the_benchmarks_use(name, shape):
    """The released configs kept in REAL_CONFIGS give the per-layer cache shape the pass benchmarks state."""
    text = released_configs()[name]["text_config"]
    assert text["num_hidden_layers"] == shape["num_layers"]
    assert text["num_key_value_heads"] == shape["num_kv_heads"]
    assert text["hidden_size"] // text["num_attention_heads"] == shape["head_dim"]


@pytest.mark.slow
def test_a_shrunk_real_config_streams_every_policy_through_a_written_checkpoint(tmp_path):
    """The full-depth path on the CPU: a checkpoint written with random weights and the byte tokenizer, loaded back
    as a user's folder, every policy streamed over 12 s of 1280 x 720 frames at the family's default budget."""
    rows = fulldepth.full_depth(["shrunk-qwen2.5-vl"], "cpu", 12, tmp_path)
    assert not (tmp_path / "shrunk-qwen2.5-vl").exists()  # removed after its runs
    assert sorted(r["policy"] for r in rows) == sorted(policy_names())
    # 1280 x 720 under Qwen2.5-VL's rule (28-pixel tokens, at most 768 * 28 * 28 pixels): 1008 x 560, 36 x 20 tokens.
    assert {r["tokens_per_grid"] for r in rows} == {720}
    # Two layers, two KV heads of 32 in float32: 2 * 2 * 32 * 2 (K and V) * 4 bytes = 1 KiB per token; M = 6144.
    for row in rows:
        assert row["stopped"] is None and row["chunks"] == 12, row
        if row["policy"] == "full":
            assert row["peak_visual_tokens"] == 12 * 720 and row["compressions"] == 0
        else:
            assert row["bound_mb"] == pytest.approx(6.0)
            assert row["peak_visual_tokens"] <= 6144 and row["compressions"] > 0, row


def test_a_written_checkpoint_holds_the_released_structure(tmp_path):
    folder = fulldepth.write_random_checkpoint("shrunk-qwen2.5-vl", tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    assert config["vision_config"]["fullatt_block_indexes"] == [1] and config["vision_config"]["window_size"] == 112
    assert config["text_config"]["num_hidden_layers"] == 2 and (folder / "tokenizer.json").is_file()


def test_the_doctor_names_the_configs_it_knows(capsys):
    from kvdemo.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["doctor", "--device", "cpu", "--full-depth", "qwen9-vl"])
    assert all(name in str(stopped.value) for name in ("qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen3-vl-8b", "not qwen9-vl"))


def test_the_app_check_reads_model_work_per_second_from_a_run_report(tmp_path):
    """Prefill and compression ms over the stream's seconds (the last event's time plus one sampling period)."""
    from kvdemo.bench.appcheck import _report_of, _work

    report = {
        "fps": 2.0,
        "timeline": [{"time_s": 0.5, "ms": 10.0}, {"time_s": 1.5, "ms": 30.0}, {"time_s": 1.5, "ms": 4.0}],
    }
    assert _work(report) == pytest.approx(44.0 / 2.0)
    assert _work({"timeline": []}) is None
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert _report_of(["status", {"path": str(path)}, None]) == report and _report_of(["status", "a.png"]) is None
