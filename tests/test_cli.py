"""The command line: reports read back, user errors as one line with exit status 2, the benchmark."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdemo.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("policy, budget, keep", [("full", None, None), ("uniform", 540, 405), ("sliding-window", 405, 270)])
def test_run_writes_a_report_that_respects_the_budget(media, tmp_path, capsys, policy, budget, keep):
    out = tmp_path / "report.json"
    args = ["run", "--video", str(media / "flipping_a_pancake.mkv"), "--policy", policy, "--json", str(out), "--quiet",
            "--max-pixels", str(256 * 28 * 28)]
    if budget:
        args += ["--budget", str(budget), "--keep", str(keep)]
    args += ["--ask", "What is cooking?", "--max-new-tokens", "6"]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["policy"] == policy and report["frames"] == 20 and report["tokens_per_grid"] == 135
    tokens = [e["visual_tokens"] for e in report["timeline"]]
    if budget:
        assert max(tokens) <= budget and report["peak_visual_tokens"] <= budget
    else:
        appends = [e["visual_tokens"] for e in report["timeline"] if e["event"] == "append"]
        assert appends == [135 * (i + 1) for i in range(10)]
    assert report["answers"][0]["question"] == "What is cooking?"
    printed = capsys.readouterr()
    assert "peak visual tokens" in printed.out
    assert "trained on synthetic streams" in printed.err and "mean little" in printed.err


def test_real_videos_reach_the_trained_tiny_model_at_its_own_resolution(media, tmp_path):
    """By default frames are resized into the model's declared pixel range: the trained tiny model saw
    112 x 112 frames, so the 426 x 240 clip becomes 140 x 84 (3 x 5 tokens per frame pair)."""
    out = tmp_path / "report.json"
    assert main(["run", "--video", str(media / "flipping_a_pancake.mkv"), "--policy", "full", "--quiet",
                 "--ask", "What colour was the circle?", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens_per_grid"] == 15 and report["frames"] == 20 and not report["random_weights"]
    assert report["answers"][0]["answer"].strip()


def test_run_without_video_uses_the_bundled_sample(capsys):
    from kvdemo.synthetic import sample_episode

    question = next(q for q in sample_episode().questions if q.kind == "colour")
    assert main(["run", "--quiet", "--policy", "full", "--ask", question.text]) == 0
    printed = capsys.readouterr()
    assert "generated(seed=7): 80 frames" in printed.err
    assert f"A: {question.answer}" in printed.out and "✓ matches the ground truth" in printed.out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "uniform", "--budget", "100", "--keep", "200"], "C must be smaller than M"),
        (["--policy", "uniform", "--budget", "100", "--keep", "50", "--max-pixels", str(256 * 28 * 28)], "smaller than one chunk"),
        (["--policy", "nope"], "unknown policy"),
        (["--policy", "uniform", "--param", "alpha=1"], "no parameter"),
        (["--fps", "0"], "fps must be positive"),
    ],
)
def test_user_errors_print_one_line_and_exit_2(media, capsys, extra, message):
    code = main(["run", "--video", str(media / "flipping_a_pancake.mkv"), "--quiet", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_non_video_and_damaged_files_from_a_real_process(media, tmp_path):
    junk = tmp_path / "junk.webm"
    junk.write_bytes(b"\x00garbage" * 1000)
    done = subprocess.run([sys.executable, "-m", "kvdemo", "run", "--video", str(junk)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: junk.webm: not a readable video file")
    damaged = subprocess.run(
        [sys.executable, "-m", "kvdemo", "run", "--video", str(media / "corrupted.mp4"), "--quiet", "--policy", "full"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert damaged.returncode == 0, damaged.stderr
    assert "damaged frame(s) could not be decoded" in damaged.stderr
    assert "Traceback" not in damaged.stderr


def test_bench_shows_bounded_cache_flat_and_full_growing(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--frames", "60", "--budget", "480", "--keep", "288", "--skip-pass", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    full = result["stream"]["engines"]["full"]["per_chunk"]
    bounded = result["stream"]["engines"]["sliding-window"]["per_chunk"]
    assert [r["visual_tokens"] for r in full] == [96 * (i + 1) for i in range(30)]
    assert max(r["visual_tokens"] for r in bounded) <= 480
    assert bounded[-1]["cache_bytes"] < full[-1]["cache_bytes"] / 4
    assert "summary:" in capsys.readouterr().out
