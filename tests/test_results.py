"""Run folders and ``kvdemo results``: metrics restated from hand-made predictions, the table, the chart's lines."""

import json

import numpy as np
import pytest
from PIL import Image

from kvdemo.cli import main
from kvdemo.experiments.results import (
    accuracy_chart,
    accuracy_metrics,
    grade_prediction,
    read_run,
    results_table,
    write_eval_run,
)
from kvdemo.viz.png import chart_png


def _predictions(policy: str, right: list[bool], delays: list[float]) -> list[dict]:
    return [
        {
            "question": f"q{i}",
            "answer": "red" if r else "blue",
            "truth": "red",
            "correct": r,
            "delay_s": d,
            "policy": policy,
            "tokens_held": 64,
        }
        for i, (r, d) in enumerate(zip(right, delays))
    ]


def _run(tmp_path, name: str, policy: str, budget: int | None, right: list[bool], delays: list[float]):
    config = {
        "harness": "kvdemo eval",
        "model": "tiny",
        "policy": policy,
        "M": budget,
        "C": None,
        "fps": 2.0,
        "seed": 0,
    }
    return write_eval_run(tmp_path / name, config, {}, _predictions(policy, right, delays))


def test_metrics_are_the_share_of_right_answers_overall_and_per_delay():
    predictions = _predictions("full", [True, False, True, True], [0, 0, 4, 4]) + [{"correct": None, "delay_s": 8}]
    metrics = accuracy_metrics(predictions)
    assert metrics["answers"] == 5 and metrics["graded"] == 4 and metrics["accuracy"] == 0.75
    assert metrics["by_delay"] == {"0": 0.5, "4": 1.0}


def test_a_prediction_is_graded_against_the_documents_truth():
    assert grade_prediction({"answer": "C"}, "C") == {"truth": "C", "correct": True}
    assert grade_prediction({"answer": "C"}, "C. green") == {"truth": "C", "correct": True}
    assert grade_prediction({"answer": "C"}, "Cyan") == {"truth": "C", "correct": False}
    assert grade_prediction({"gt": 1}, " B") == {"truth": "B", "correct": True}  # OVO-Bench's option index
    assert grade_prediction({"answer": "red"}, "Red.") == {"truth": "red", "correct": True}
    assert grade_prediction({"question": "?"}, "red") == {"truth": None, "correct": None}


def test_results_tabulate_folders_and_chart_accuracy_against_the_budget(tmp_path, capsys):
    folders = [
        _run(tmp_path, "full", "full", None, [True] * 4, [0] * 4),
        _run(tmp_path, "sw32", "sliding-window", 32, [True, False, False, False], [0] * 4),
        _run(tmp_path, "sw64", "sliding-window", 64, [True, True, True, False], [0] * 4),
    ]
    runs = [read_run(f) for f in folders]
    table = results_table(runs).splitlines()
    assert len(table) == 5 and "1.000" in table[1] and "0.250" in table[2] and "0.750" in table[3]
    assert table[4].startswith("d=... s: accuracy by delay") and "(runs without a task)" in table[4]
    chart = accuracy_chart(runs)
    (series,) = chart.parts
    assert series.x == [32.0, 64.0] and series.lines == {"sliding-window": [0.25, 0.75]} and series.limit == 1.0
    assert main(["results", *map(str, folders), "--chart", str(tmp_path / "chart")]) == 0
    assert "sliding-window" in capsys.readouterr().out
    html = (tmp_path / "chart.html").read_text()
    assert "plotly" in html and "sliding-window" in html
    png = np.asarray(Image.open(tmp_path / "chart.png").convert("RGB"))
    assert png.shape == (520, 900, 3)
    # The line's colour is drawn, and its right end (M = 64, 0.75) sits higher than its left end (M = 32, 0.25).
    line = np.all(png == np.array([0x2C, 0xA0, 0x2C]), axis=-1)[:, :680]
    rows, cols = np.nonzero(line)
    assert rows.size and rows[cols == cols.max()].mean() < rows[cols == cols.min()].mean()


def test_delay_chart_has_a_line_per_run_and_a_bad_folder_says_why(tmp_path, capsys):
    folder = _run(tmp_path, "full", "full", None, [True, True, False, True], [0, 0, 8, 8])
    chart = accuracy_chart([read_run(folder)], "delay")
    assert chart.parts[0].x == [0.0, 8.0] and chart.parts[0].lines == {"full": [1.0, 0.5]}
    assert chart_png(chart).size == (900, 520)
    with pytest.raises(ValueError, match="no run of a bounded policy"):
        accuracy_chart([read_run(folder)], "budget")
    assert main(["results", str(tmp_path / "nowhere")]) == 2
    assert "not a run folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"policy": "full"}))
    assert main(["results", str(tmp_path / "empty")]) == 2
    assert "did the run finish" in capsys.readouterr().err
    # An unfinished run beside a finished one is skipped with a word; the finished one is still tabulated.
    assert main(["results", str(folder), str(tmp_path / "empty"), "--x", "delay"]) == 0
    out, err = capsys.readouterr()
    assert f"skipped {tmp_path / 'empty'}: no predictions" in err and folder.name in out


def test_an_lmms_eval_run_has_a_row_per_task_with_its_full_name_and_the_delay_columns_say_whose(tmp_path):
    """Three tasks in one run, scored by different scorers, are three rows (not one blended accuracy); only
    kvdemo_bare asks at several delays, and the line under the table says the d= columns are its."""
    name = "lmms-eval-infinipot-v-20261128-101512-123456"
    folder = tmp_path / name
    folder.mkdir()
    config = {"harness": "lmms-eval", "model": "tiny", "policy": "infinipot-v", "M": 64, "C": 48}
    (folder / "config.json").write_text(json.dumps(config))
    rows = [("kvdemo_videomme", True, None)] * 3 + [("kvdemo_videomme", False, None)]
    rows += [("kvdemo_ovo_backward", True, None)] * 2
    rows += [("kvdemo_bare", True, 0), ("kvdemo_bare", True, 0), ("kvdemo_bare", True, 4), ("kvdemo_bare", False, 4)]
    lines = [json.dumps({"task": t, "correct": r, "delay_s": d}) for t, r, d in rows]
    (folder / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    table = results_table([read_run(folder)]).splitlines()
    assert table[0].split("  ")[0].strip() == "run" and "task" in table[0] and table[0].rstrip().endswith("d=4 s")
    cells = {line.split()[5]: line.split() for line in table[1:4]}
    assert set(cells) == {"kvdemo_bare", "kvdemo_ovo_backward", "kvdemo_videomme"}
    assert all(row[0] == name for row in cells.values()), "full run names"
    assert cells["kvdemo_videomme"][6:] == ["4", "0.750", "-", "-"]
    assert cells["kvdemo_ovo_backward"][6:] == ["2", "1.000", "-", "-"]
    assert cells["kvdemo_bare"][6:] == ["4", "0.750", "1.000", "0.500"]
    assert "(kvdemo_bare)" in table[4]
