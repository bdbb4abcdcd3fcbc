"""The query-delay benchmark: the protocol's arithmetic, the command end to end, and the committed
trained weights (full cache right, a window that lost the evidence wrong)."""

import json

import pytest

from kvdemo.cli import build_parser, check_eval_arguments, main
from kvdemo.experiments.evaluation import (
    answer_costs,
    ask_grids,
    eval_spec,
    evaluate,
    stream_kinds,
    valid_items,
    wilson,
)
from kvdemo.world.synthetic import Question, StreamSpec, generate_episode


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


@pytest.mark.slow
def test_the_eval_command_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(
        [
            "eval",
            "--policies",
            "full,sliding-window",
            "--delays",
            "0,4",
            "--episodes",
            "3",
            "--seed",
            "5",
            "--budget",
            "48",
            "--keep",
            "32",
            "--json",
            str(out),
            "--quiet",
            "--runs",
            str(tmp_path / "runs"),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    # One run folder per policy; its predictions restate the report's accuracy (kvdemo.experiments.results).
    folders = sorted((tmp_path / "runs").iterdir())
    assert [f.name.split("-2")[0] for f in folders] == ["eval-full", "eval-sliding-window"]
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        lines = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
        assert config["M"] == (48 if config["policy"] == "sliding-window" else None) and config["seed"] == 5
        assert len(lines) == 2 * report["questions"]["total"] and {p["policy"] for p in lines} == {config["policy"]}
        for delay in ("0", "4"):
            at = [p["correct"] for p in lines if f"{p['delay_s']:g}" == delay]
            assert sum(at) / len(at) == pytest.approx(report["accuracy"][config["policy"]][delay])
        assert all(p["truth"] and isinstance(p["tokens_held"], int) for p in lines)
    assert report["episodes"] == 3 and report["budget"] == 48 and report["keep"] == 32
    assert set(report["accuracy"]) == {"full", "sliding-window"}
    assert set(report["accuracy"]["full"]) == {"0", "4"}
    assert 0 < report["chance"] < 0.2 and report["questions"]["total"] > 0
    assert report["budgets"]["full"] == {"budget": None, "keep": None}
    assert set(report["answer_ms"]) == {"full", "sliding-window"} and report["host_mb_per_min"]["full"] == 0
    printed = capsys.readouterr()
    assert "sliding-window" in printed.out and "chance" in printed.out and "answer ms" in printed.out


def test_answer_costs_are_means_over_each_policys_answers_and_host_bytes_per_stream_minute():
    """Worked by hand: rekv answered twice, after 30 s holding 3 MB and after 90 s holding 9 MB in host memory: 12 MB
    over 2 minutes of stream is 6 MB a minute; a policy that offloads nothing has 0."""
    predictions = [
        {"policy": "rekv", "tokens_held": 64, "answer_ms": 10.0, "stream_s": 30.0, "offloaded_bytes": 3_000_000},
        {"policy": "rekv", "tokens_held": 60, "answer_ms": 20.0, "stream_s": 90.0, "offloaded_bytes": 9_000_000},
        {"policy": "full", "tokens_held": 400, "answer_ms": 7.0, "stream_s": 30.0, "offloaded_bytes": 0},
    ]
    costs = answer_costs(predictions, ["full", "rekv", "uniform"])
    assert costs["tokens_held"] == {"full": 400.0, "rekv": 62.0, "uniform": 0.0}
    assert costs["answer_ms"] == {"full": 7.0, "rekv": 15.0, "uniform": 0.0}
    assert costs["host_mb_per_min"] == {"full": 0.0, "rekv": 6.0, "uniform": 0.0}


def test_kind_is_parsed_and_defaults_to_the_static_streams(capsys):
    parse = build_parser().parse_args
    assert parse(["eval"]).kind == "static"
    assert [parse(["eval", "--kind", k]).kind for k in ("static", "moving", "mixed")] == ["static", "moving", "mixed"]
    with pytest.raises(SystemExit) as exit_info:
        parse(["eval", "--kind", "sideways"])
    assert exit_info.value.code == 2 and "invalid choice: 'sideways'" in capsys.readouterr().err
    args = parse(["eval", "--kind", "moving", "--delays", "0,8"])
    check_eval_arguments(args)
    assert args.kind == "moving" and args.delays == (0.0, 8.0)
    assert stream_kinds("mixed") == ("static", "moving") and stream_kinds("moving") == ("moving",)
    with pytest.raises(ValueError, match="unknown stream kind"):
        stream_kinds("sideways")
    assert eval_spec((0, 32), kind="moving").kind == "moving" and eval_spec((0, 32)).pairs == (48, 48)


def test_moving_questions_are_asked_after_the_last_sighting():
    """Delays count from when the subject was last seen: an object seen twice is asked about after its
    second sighting, never between the two."""
    for index in range(20):
        episode = generate_episode((0, 2, index), eval_spec((0, 8), kind="moving"))
        for item in valid_items(episode, index, (0, 8)):
            subject = next(o for o in episode.objects if o.shape == item.question.subject)
            assert item.ask_after[0] == (subject.shown[-1] + 1 + 1) // 2  # the first pair wholly after its last frame
            if len(subject.appearances) > 1:
                return
    raise AssertionError("no reappearing object was asked about in 20 streams")


@pytest.mark.slow
def test_the_eval_command_alternates_kinds_when_mixed(tmp_path):
    out = tmp_path / "eval.json"
    code = main(
        [
            "eval",
            "--runs",
            "",
            "--policies",
            "full",
            "--delays",
            "0",
            "--episodes",
            "4",
            "--kind",
            "mixed",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "mixed" and set(report["by_stream"]["full"]["0"]) == {"static", "moving"}
    expected = {}
    for index in range(4):
        episode = generate_episode((0, 2, index), eval_spec((0,), kind=("static", "moving")[index % 2]))
        kind = episode.kind
        expected[kind] = expected.get(kind, 0) + len(valid_items(episode, index, (0,)))
    assert {k: report["questions"][f"{k} streams"] for k in expected} == expected


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policies", "full,nope"], "unknown policy"),
        (["--policies", "uniform", "-C", "80"], "C must be smaller than M"),
        (["--policies", "uniform", "-M", "1e25"], "more visual tokens than any stream holds"),
        (["--delays", "0,soon"], "--delays takes seconds"),
    ],
)
def test_eval_user_errors_are_one_line(capsys, extra, message):
    assert main(["eval", "--runs", "", "--episodes", "1", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["static", "moving"])
def test_the_committed_weights_answer_from_the_evidence(kind):
    """On held-out streams of either kind the full cache answers >= 90% right; a sliding window of two frame
    pairs, which has lost the evidence 16 s later, cannot."""
    from kvdemo.models.loading import load_model

    model = load_model("tiny")
    assert not model.random_weights
    report = evaluate(
        model, ["full", "sliding-window"], delays=(0, 16), episodes=30, seed=1234, budget=48, keep=32, kind=kind
    )
    assert report["kind"] == kind and report["questions"]["total"] >= 30
    assert min(report["accuracy"]["full"].values()) >= 0.9
    assert report["accuracy"]["sliding-window"]["16"] <= 0.5


@pytest.mark.slow
def test_the_delay_sweep_is_the_eval_protocol_on_the_sample_then_held_out_streams():
    """The app's delay sweep: the bundled sample's questions askable at every delay, then held-out streams, each
    answer round yielded as it happens; its totals equal the evaluation's on the same held-out streams."""
    from kvdemo.experiments.evaluation import valid_items
    from kvdemo.experiments.sweep import delay_sweep
    from kvdemo.models.loading import load_model
    from kvdemo.world.synthetic import sample_episode

    model = load_model("tiny")
    delays = (0, 8)
    states = [
        (s.streams, {k: list(v) for k, v in s.asked.items()}, s.accuracy())
        for s in delay_sweep(model, ["sliding-window", "full"], delays, 48, 32, more_streams=2)
    ]
    sample_items = len(valid_items(sample_episode(), 0, delays))
    asked = [sum(a["full"]) for _, a, _ in states]
    assert asked == sorted(asked) and asked[-1] > asked[0]  # redrawn as answers come in
    streams, final_asked, accuracy = states[-1]
    assert streams == 3 and final_asked["full"] == final_asked["sliding-window"]
    held_out = evaluate(model, ["sliding-window", "full"], delays=delays, episodes=2, budget=48, keep=32)
    assert sum(final_asked["full"]) == len(delays) * (sample_items + held_out["questions"]["total"])
    assert accuracy["full"] == [1.0, 1.0]
    assert accuracy["sliding-window"][1] < 1.0  # a window of two frame pairs forgets
