"""The command line: reports read back, user errors as one line with exit status 2, the benchmark."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdemo.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, budget, keep", [("full", None, None), ("uniform", 540, 405), ("sliding-window", 405, 270)]
)
def test_run_writes_a_report_that_respects_the_budget(media, tmp_path, capsys, policy, budget, keep):
    out = tmp_path / "report.json"
    args = [
        "run",
        "--video",
        str(media / "flipping_a_pancake.mkv"),
        "--policy",
        policy,
        "--json",
        str(out),
        "--quiet",
        "--max-pixels",
        str(256 * 28 * 28),
    ]
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
    assert "peak visual tokens held" in printed.out
    assert "trained on synthetic streams" in printed.err and "mean little" in printed.err


@pytest.mark.slow
def test_the_summary_reports_the_tokens_held_and_protokvs_reserved_slots_apart(media, capsys):
    """The clip is 10 temporal grids of 3 x 5 tokens on the trained tiny model: 150 visual tokens. ProtoKV at
    M = 6144 never compresses it and reserves three quarters of M (4608) for its prototypes' pseudo-tokens, unused."""
    video = str(media / "flipping_a_pancake.mkv")
    assert main(["run", "--video", video, "--model", "tiny", "--policy", "protokv", "-M", "6144", "--quiet"]) == 0
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines() if "  " in line)
    rows = {name.strip(): value.strip() for name, value in rows.items()}
    assert rows["visual tokens held"] == "150" and rows["peak visual tokens held"] == "150"
    assert rows["summary slots"] == "4608 reserved in M, 0 in use"
    assert main(["run", "--video", video, "--model", "tiny", "--policy", "full", "--quiet"]) == 0
    rows = capsys.readouterr().out
    assert re.search(r"^visual tokens held +150$", rows, re.M) and "summary slots" not in rows


@pytest.mark.slow
def test_real_videos_reach_the_trained_tiny_model_at_its_own_resolution(media, tmp_path):
    """By default frames are resized into the model's declared pixel range: the trained tiny model saw
    112 x 112 frames, so the 426 x 240 clip becomes 140 x 84 (3 x 5 tokens per frame pair)."""
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "run",
                "--video",
                str(media / "flipping_a_pancake.mkv"),
                "--policy",
                "full",
                "--quiet",
                "--ask",
                "What colour was the circle?",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["tokens_per_grid"] == 15 and report["frames"] == 20 and not report["random_weights"]
    assert report["answers"][0]["answer"].strip()


@pytest.mark.slow
def test_run_without_video_uses_the_bundled_sample(capsys):
    from kvdemo.world.synthetic import sample_episode

    question = next(q for q in sample_episode().questions if q.kind == "colour")
    assert main(["run", "--quiet", "--policy", "full", "--ask", question.text]) == 0
    printed = capsys.readouterr()
    assert "generated(seed=7): 80 frames" in printed.err
    assert f"A: {question.answer}" in printed.out and "✓ matches the ground truth" in printed.out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "uniform", "--budget", "100", "--keep", "200"], "C must be smaller than M"),
        (
            ["--policy", "uniform", "--budget", "100", "--keep", "50", "--max-pixels", str(256 * 28 * 28)],
            "smaller than one chunk",
        ),
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


@pytest.mark.slow
def test_non_video_and_damaged_files_from_a_real_process(media, tmp_path):
    junk = tmp_path / "junk.webm"
    junk.write_bytes(b"\x00garbage" * 1000)
    done = subprocess.run(
        [sys.executable, "-m", "kvdemo", "run", "--video", str(junk)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: junk.webm: not a readable video file")
    damaged = subprocess.run(
        [sys.executable, "-m", "kvdemo", "run", "--video", str(media / "corrupted.mp4"), "--quiet", "--policy", "full"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert damaged.returncode == 0, damaged.stderr
    assert "1 damaged frame could not be decoded and was skipped" in damaged.stderr
    assert "Traceback" not in damaged.stderr


@pytest.mark.slow
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


def test_bench_reference_errors_before_streaming(tmp_path, capsys):
    assert main(["bench", "--policy", "infinipot-v", "--reference", str(tmp_path)]) == 2
    assert "no kvcache_utils.py" in capsys.readouterr().err
    (tmp_path / "kvcache_utils.py").write_text("x = 1\n")
    assert main(["bench", "--policy", "infinipot-v", "--reference", str(tmp_path / "kvcache_utils.py")]) == 2
    err = capsys.readouterr().err
    assert "has no process_kv_cache" in err and "streaming" not in err


@pytest.mark.parametrize("device", ["nonsense", "cuda:7"] if not torch.cuda.is_available() else ["nonsense"])
def test_bench_refuses_a_device_it_cannot_use_before_streaming(device, capsys):
    assert main(["bench", "--device", device, "--frames", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --device {device}: ") and err.count("\n") == 1 and "streaming" not in err


def run_cli_in_a_fresh_process(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, dict[str, bool]]:
    """``python -m kvdemo`` in a new interpreter (``env``: variables set or, as None values, removed); also says
    which heavy modules it had imported at exit."""
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stdout.write('\\nimported: ' + ' '.join(m for m in ('torch', 'transformers', "
        "'kvdemo.models.loading') if m in sys.modules)))\n"
        "import runpy\n"
        f"sys.argv = ['kvdemo', *{list(args)!r}]\n"
        "runpy.run_module('kvdemo', run_name='__main__')\n"
    )
    environ = {**os.environ, **{k: v for k, v in (env or {}).items() if v is not None}}
    for name in [k for k, v in (env or {}).items() if v is None]:
        environ.pop(name, None)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, env=environ)
    imported = done.stdout.rsplit("imported:", 1)[-1].split()
    return done, {name: name in imported for name in ("torch", "transformers", "kvdemo.models.loading")}


def test_a_missing_file_fails_before_torch_is_imported(tmp_path):
    done, imported = run_cli_in_a_fresh_process("run", "--video", str(tmp_path / "missing.mp4"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.mp4'}: no such file"]
    assert not imported["torch"] and not imported["transformers"]


@pytest.mark.slow
def test_a_budget_error_comes_before_the_model_loads_on_its_own_line(media):
    done, imported = run_cli_in_a_fresh_process(
        "run",
        "--video",
        str(media / "flipping_a_pancake.mkv"),
        "--budget",
        "100",
        "--keep",
        "50",
        "--max-pixels",
        "200704",
    )
    assert done.returncode == 2
    # No progress bar, no model line: the one line is the error (426x240 -> 252x420 -> 9x15 = 135 tokens per chunk).
    assert done.stderr.strip().splitlines() == [
        "error: M=100 is smaller than one chunk (135 visual tokens = 1 temporal grid(s) of 9x15 tokens); "
        "raise M to at least 185 (or lower max pixels / frames per chunk)"
    ]
    assert not imported["kvdemo.models.loading"], "no model was loaded (the resize rule may import transformers)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fps", "-1"], "--fps: sampling fps must be positive, got -1"),
        (["--max-frames", "0"], "--max-frames must be positive"),
        (
            ["--min-pixels", "900000", "--max-pixels", "602112"],
            "--min-pixels (900000) must not exceed --max-pixels (602112)",
        ),
        (["--param", "alpha"], "--param takes key=value"),
    ],
)
def test_argument_errors_come_before_the_file_is_opened(tmp_path, args, message):
    done, imported = run_cli_in_a_fresh_process("run", "--video", str(tmp_path / "missing.mp4"), *args)
    assert done.returncode == 2 and message in done.stderr and "no such file" not in done.stderr
    assert not imported["torch"]


def test_run_defaults_to_infinipot_v(tmp_path):
    out = tmp_path / "report.json"
    assert main(["run", "--max-frames", "4", "--quiet", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["policy"] == "infinipot-v"


def test_unknown_parameter_lists_only_public_parameters(capsys):
    assert main(["run", "--param", "foo=1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "has no parameter(s) foo; it takes: alpha, cv_thresholds, recent_ratio, tar, van" in err
    assert "_calibrated" not in err


@pytest.mark.slow
def test_help_is_plain_text_with_descriptions_and_examples():
    top = subprocess.run([sys.executable, "-m", "kvdemo", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "``" not in top and "run" in top and "bench" in top
    for command in ("run", "bench"):
        text = subprocess.run(
            [sys.executable, "-m", "kvdemo", command, "--help"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        assert "``" not in text
        assert "examples:" in text and f"python -m kvdemo {command}" in text.split("examples:")[1]
        assert "infinipot-v" in text and "cords" in text, "the policies are listed"
    run_help = subprocess.run(
        [sys.executable, "-m", "kvdemo", "run", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert "default infinipot-v" in " ".join(run_help.split())  # argparse wraps lines at the terminal's width


def test_run_help_lists_every_policy_with_the_summary_its_card_declares(capsys):
    from kvdemo.policies import CARDS

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    listed = text.split("policies:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split(None, 1) for line in listed] == [[name, card.summary] for name, card in CARDS.items()]


@pytest.mark.slow
def test_min_pixels_beyond_the_models_own_maximum_is_one_line(media):
    """Without --max-pixels the model's own maximum applies: known once the model is named, still before it loads."""
    done, imported = run_cli_in_a_fresh_process(
        "run", "--video", str(media / "flipping_a_pancake.mkv"), "--model", "tiny", "--min-pixels", "900000"
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --min-pixels (900000) must not exceed --max-pixels (the model's 15680)"
    ]
    assert not imported["kvdemo.models.loading"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["-M", "1e25"], "M=1e+25 is more visual tokens than any stream holds"),
        (["-M", "1000000000000"], "M=1e+12 is more visual tokens than any stream holds"),
        (["-M", "abc"], "M is a number of visual tokens, got 'abc'"),
        (["-M", "96", "-C", "-3"], "M and C must be positive, got C=-3"),
        (["--param", "alpha=abc"], "infinipot-v's alpha takes a number (float), got 'abc'"),
        (["--param", "tar=sideways"], "infinipot-v's tar must be one of patch, frame, reverse, got 'sideways'"),
        (["--policy", "nope"], "unknown policy 'nope'; choose one of: infinipot-v, cords"),
    ],
)
def test_absurd_budgets_and_parameters_are_one_line_and_exit_2(args, message):
    done, imported = run_cli_in_a_fresh_process("run", "--quiet", *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {message}" + done.stderr.strip().split(message, 1)[-1]]
    assert not imported["kvdemo.models.loading"], "found before the model loads"


def test_eval_runs_without_options_its_help_calls_optional(capsys):
    assert (
        main(
            [
                "eval",
                "--runs",
                "",
                "--episodes",
                "1",
                "--delays",
                "0",
                "--quiet",
                "--policies",
                "full,sliding-window,protokv",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "64 / 48" in table and re.search(r"protokv\s+64 ", table), table


def test_a_long_question_is_refused_before_anything_loads_and_not_echoed():
    done, imported = run_cli_in_a_fresh_process("run", "--quiet", "--model", "tiny", "--ask", "a" * 100_000)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --ask, question 1: the question is 100000 characters long; at most 4096 (shorten it)"
    ]
    assert not imported["torch"] and not imported["kvdemo.models.loading"]


@pytest.mark.slow
def test_a_question_over_the_token_limit_is_refused_before_the_stream():
    """600 characters pass the character cap, not the trained model's byte tokenizer (600 tokens > 512): refused once
    the tokenizer has loaded, before a frame is streamed (no stream description, no answer)."""
    done, _ = run_cli_in_a_fresh_process(
        "run", "--quiet", "--model", "tiny", "--ask", "What colour?", "--ask", "b" * 600
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip().splitlines()[-1]
        == "error: --ask, question 2: the question is 600 tokens long; at most 512 (shorten it)"
    )
    assert "generated(seed=7)" not in done.stderr and "Q:" not in done.stdout


def test_a_question_is_echoed_on_one_short_line(capsys):
    question = "What colour was the circle?" + " and" * 40 + "\nsecond line"
    assert (
        main(["run", "--quiet", "--policy", "full", "--max-frames", "4", "--max-new-tokens", "2", "--ask", question])
        == 0
    )
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Q: ")]
    assert shown == [f"Q: {question[:80]}... ({len(question)} characters)"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-pixels", "0"], "--max-pixels must be positive, got 0"),
        (["--max-pixels", "-5"], "--max-pixels must be positive, got -5"),
        (["--min-pixels", "0"], "--min-pixels must be positive, got 0"),
        (["--min-pixels", "-3", "--max-pixels", "50000"], "--min-pixels must be positive, got -3"),
        (
            ["--min-pixels", "50000", "--max-pixels", "40000"],
            "--min-pixels (50000) must not exceed --max-pixels (40000)",
        ),
        (["--max-pixels", "100"], "--max-pixels must be at least 784 (one token of 28x28 pixels), got 100"),
    ],
)
def test_impossible_pixel_limits_are_one_line_and_exit_2(args, message):
    done, imported = run_cli_in_a_fresh_process("run", "--quiet", "--model", "tiny", *args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {message}"]
    assert not imported["kvdemo.models.loading"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--policy", "x" * 3000],
        ["--param", "y" * 3000],
        ["-M", "9" * 3000],
        ["--video", "z" * 3000],
        ["--sample", "w" * 3000],
    ],
)
def test_errors_repeat_at_most_a_short_line_of_the_input(args):
    done, _ = run_cli_in_a_fresh_process("run", "--quiet", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    error = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "..." in error[0] and len(error[0]) < 300, error


@pytest.mark.slow
@pytest.mark.parametrize(
    "env",
    [
        {"HF_HUB_OFFLINE": "1"},  # offline mode: the Hub is not asked
        {"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"},
    ],
)  # nothing listens there: no connection
def test_a_model_neither_local_nor_reachable_fails_once_with_one_line(env):
    done, _ = run_cli_in_a_fresh_process("run", "--quiet", "--model", "no/such-model", env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Retry" not in done.stderr, done.stderr
    assert lines[0].startswith(
        "error: model 'no/such-model' is neither a local folder nor in the Hugging Face cache, "
        "and the Hub cannot be reached"
    )
    assert "--model /path/to/folder" in lines[0] and "offline model (tiny, tiny-random" in lines[0]


@pytest.mark.slow
def test_run_prunes_before_the_llm_in_front_of_the_full_cache(media, tmp_path, capsys):
    """``--prune evs:0.75 --policy full``: the first grid of the clip's 1,350 visual tokens enters whole, then what
    EVS keeps of the stream so far; the report has the pruning section, the summary says it."""
    out = tmp_path / "report.json"
    video = str(media / "flipping_a_pancake.mkv")
    args = ["run", "--video", video, "--policy", "full", "--prune", "evs:0.75", "--quiet", "--json", str(out)]
    assert main([*args, "--max-pixels", str(256 * 28 * 28)]) == 0
    report = json.loads(out.read_text())
    pruning = report["pruning"]
    assert pruning["method"] == "evs" and pruning["rate"] == 0.75 and pruning["offered"] == 1350
    assert [g["grid"] for g in pruning["grids"]] == list(range(10)) and pruning["grids"][0]["entered"] == 135
    assert pruning["entered"] == sum(g["entered"] for g in pruning["grids"]) < 1350
    assert report["timeline"][-1]["visual_tokens"] == pruning["entered"]
    assert "pruning before the LLM" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--prune", "evs:1.5"], "error: --prune: evs's video_pruning_rate must lie strictly between 0 and 1, got 1.5"),
        (["--prune", "fast:0.5"], "error: --prune: unknown pruning method 'fast'"),
        (["--prune", "vidcom2:0"], "error: --prune: vidcom2's video_retention_ratio must lie strictly between 0 and 1"),
    ],
)
def test_a_bad_pruning_choice_is_one_line_before_torch_loads(tmp_path, args, message):
    done, imported = run_cli_in_a_fresh_process("run", "--video", str(tmp_path / "missing.mp4"), *args)
    assert done.returncode == 2 and done.stderr.strip().startswith(message), done.stderr
    assert done.stderr.strip().count("\n") == 0 and not imported["torch"]


def test_eval_and_compare_read_pruning_per_engine_before_the_model_loads(capsys):
    for argv in (
        ["eval", "--policies", "evs:2+full", "--episodes", "1"],
        ["compare", "--policies", "vidcom2:video_pruning_rate=1+full", "--max-frames", "4"],
        ["compare", "--prune", "evs:-1", "--max-frames", "4"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "between 0 and 1" in err, err


@pytest.mark.slow
def test_eval_puts_pruning_in_front_of_policies(capsys):
    """``--prune`` stands in front of every policy named without its own; ``METHOD:VALUE+POLICY`` names its own."""
    argv = ["eval", "--runs", "", "--episodes", "1", "--delays", "0", "--quiet", "-M", "64", "-C", "48"]
    assert main([*argv, "--policies", "full,vidcom2:0.5+full", "--prune", "evs:0.5"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^evs:0\.5\+full\s", table, re.M) and re.search(r"^vidcom2:0\.5\+full\s", table, re.M), table


#: Bad input a user can type, in the order one process tries it: what needs only the policies' declarations first
#: (torch), then what needs the model's family (its frame geometry: transformers), each with the start of its error.
BAD_INPUT = [
    (["compare", "--policies", "full,bogus"], "unknown policy 'bogus'", "torch"),
    (["compare", "--policies", "cords,cords"], "'cords' is named twice", "torch"),
    (["compare", "-M", "10", "-C", "20"], "C=20 is not smaller than M=10", "torch"),
    (["compare", "--override", "cords: alpha=x"], "policy 'cords' has no parameter(s) alpha", "torch"),
    (["run", "--policy", "bogus"], "unknown policy 'bogus'", "torch"),
    (["run", "-M", "10", "-C", "20"], "C=20 is not smaller than M=10", "torch"),
    (["run", "--param", "alpha=2"], "infinipot-v's alpha must be in [0, 1], got 2", "torch"),
    (["run", "-M", "10"], "M=10 is smaller than one chunk (16 visual tokens", "transformers"),
    (
        ["compare", "--policies", "infinipot-v,cords", "-M", "20", "-C", "10"],
        "infinipot-v: M - C = 10 leaves no room for one chunk (16 visual tokens",
        "transformers",
    ),
    (["run", "--model", "nosuchmodel"], "model 'nosuchmodel' is not an offline model (tiny,", "transformers"),
]


@pytest.mark.slow
def test_bad_input_is_refused_before_the_model_loads_and_before_what_it_does_not_need():
    """Each bad input's one-line error starts with the wrong value, comes before any model is loaded, and (for names,
    budgets and parameters) before transformers is imported: one fresh process tries them in order."""
    probe = (
        "import contextlib, io, json, sys\n"
        "from kvdemo.cli import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        code = main(argv + ['--quiet'] * (argv[0] == 'run'))\n"
        "    heavy = [m for m in ('torch', 'transformers', 'kvdemo.models.loading') if m in sys.modules]\n"
        "    print(json.dumps([code, err.getvalue(), heavy]))\n"
    )
    arguments = json.dumps([argv for argv, _, _ in BAD_INPUT])
    done = subprocess.run([sys.executable, "-c", probe, arguments], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(BAD_INPUT)
    for (argv, start, heaviest), (code, err, heavy) in zip(BAD_INPUT, results):
        assert code == 2 and err.startswith(f"error: {start}") and err.count("\n") == 1, (argv, err)
        assert "kvdemo.models.loading" not in heavy, argv
        if heaviest == "torch":
            assert "transformers" not in heavy, argv


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ask-at", "5"], "--ask-at needs a question"),
        (["--ask", "a?", "--ask", "b?", "--ask-at", "1,2,3"], "3 seconds for 2 questions"),
        (["--ask", "a?", "--ask-at", "5", "--max-waiting", "0"], "--max-waiting must be positive"),
    ],
)
def test_a_live_schedule_that_cannot_work_is_one_line_before_anything_loads(capsys, extra, message):
    assert main(["run", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("seconds", ["-1", "soon", ","])
def test_ask_at_takes_stream_seconds(capsys, seconds):
    with pytest.raises(SystemExit) as exited:
        main(["run", "--ask", "a?", "--ask-at", seconds])
    assert exited.value.code == 2 and "--ask-at: stream seconds" in capsys.readouterr().err


@pytest.mark.slow
def test_realtime_asks_at_stream_seconds_and_reports_the_lag(tmp_path, capsys):
    """The sample played at its own pace for 6 s, the question asked at 2 s and at 4 s while it streams: both answers
    printed with the lag behind live then, and the report has every chunk's capture and entry and no frame lost."""
    out = tmp_path / "live.json"
    args = ["run", "--model", "tiny", "-M", "64", "-C", "48", "--max-frames", "12", "--realtime", "--quiet"]
    args += ["--ask", "What colour was the circle?", "--ask-at", "2,4", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    asked = [float(at) for at in re.findall(r"^Q \(at ([\d.]+) s\): What colour was the circle\?$", printed, re.M)]
    assert len(asked) == 2 and 2 <= asked[0] < asked[1] and asked[1] >= 4  # at its second, or when the device got to it
    assert printed.count("s behind live)") == 2 and "lag behind live: mean" in printed
    live = json.loads(out.read_text())["live"]
    assert [c["frames"] for c in live["chunks"]] == [2, 4, 6, 8, 10, 12]
    assert all(0 <= c["captured_s"] <= c["entered_s"] for c in live["chunks"])
    assert [c["time_s"] for c in live["chunks"]] == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    assert live["dropped_frames"] == 0 and live["frames_received"] == 12


@pytest.mark.slow
def test_ask_at_on_a_file_prints_each_answer_with_no_ground_truth(media, capsys):
    """A file (no ground truth to grade against) as fast as the device takes it: the questions come at their stream
    seconds, the answers print without a grade, and no lag is claimed (not a live source)."""
    args = ["run", "--video", str(media / "flipping_a_pancake.mkv"), "--model", "tiny", "--max-frames", "8", "--quiet"]
    assert main([*args, "--ask", "What is cooking?", "--ask-at", "1,3"]) == 0
    printed = capsys.readouterr().out
    assert "Q (at 1 s): What is cooking?" in printed and "Q (at 3 s): What is cooking?" in printed
    assert "behind live" not in printed and "ground truth" not in printed
