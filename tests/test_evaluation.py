"""The query-delay benchmark: the protocol's arithmetic, the command end to end, and the committed
trained weights (full cache right, a window that lost the evidence wrong)."""

import json

import pytest

from kvdemo.cli import main
from kvdemo.evaluation import ask_grids, evaluate, valid_items, wilson
from kvdemo.synthetic import Question, StreamSpec, generate_episode


def test_wilson_interval_matches_the_formula_worked_by_hand():
    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416, half 1.96 * sqrt(0.016 + 0.009604) / 1.38416
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4) and high == pytest.approx(0.94332, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)


def test_questions_are_asked_once_the_pair_starting_at_left_plus_delay_is_fed():
    question = Question("colour", "What colour was the star?", "red", "star", 2.0, 5.0)
    assert ask_grids(question, (0, 4, 2.5), pair_seconds=1.0) == (5, 9, 8)
    # At delay 0 the newest pair is the first one without the evidence (its last pair was 4).
    assert ask_grids(question, (0,), pair_seconds=2.0) == (3,)


def test_only_questions_askable_at_every_delay_count():
    episode = generate_episode(8, StreamSpec(pairs=(30, 30), objects=(4, 4)))
    delays = (0, 8, 16)
    kept = valid_items(episode, 0, delays)
    for question in episode.questions:
        last_grid = int(question.left_s + 16)  # 1 s per pair at 2 fps
        assert any(item.question == question for item in kept) == (last_grid < 30)
    for item in kept:
        assert item.ask_after == tuple(int(item.question.left_s) + d for d in delays)


def test_the_eval_command_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", "--policies", "full,sliding-window", "--delays", "0,4", "--episodes", "3", "--seed", "5",
                 "--budget", "48", "--keep", "32", "--json", str(out), "--quiet"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["episodes"] == 3 and report["budget"] == 48 and report["keep"] == 32
    assert set(report["accuracy"]) == {"full", "sliding-window"}
    assert set(report["accuracy"]["full"]) == {"0", "4"}
    assert 0 < report["chance"] < 0.2 and report["questions"]["total"] > 0
    assert report["budgets"]["full"] == {"budget": None, "keep": None}
    printed = capsys.readouterr()
    assert "sliding-window" in printed.out and "chance" in printed.out


@pytest.mark.parametrize("extra, message", [(["--policies", "full,nope"], "unknown policy"),
                                            (["--policies", "uniform", "-C", "80"], "C must be smaller than M"),
                                            (["--policies", "uniform", "-M", "1e25"], "more visual tokens than any stream holds"),
                                            (["--delays", "0,soon"], "--delays takes seconds")])
def test_eval_user_errors_are_one_line(capsys, extra, message):
    assert main(["eval", "--episodes", "1", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_committed_weights_answer_from_the_evidence():
    """On held-out streams the full cache answers >= 90% right; a sliding window of two frame pairs, which
    has lost the evidence 16 s later, cannot."""
    from kvdemo.models.loading import load_model

    model = load_model("tiny")
    assert not model.random_weights
    report = evaluate(model, ["full", "sliding-window"], delays=(0, 16), episodes=30, seed=1234, budget=48, keep=32)
    assert report["questions"]["total"] >= 30
    assert min(report["accuracy"]["full"].values()) >= 0.9
    assert report["accuracy"]["sliding-window"]["16"] <= 0.5
