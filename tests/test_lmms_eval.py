"""kvdemo under lmms-eval: the benchmarks' prompts, the model on the offline local tasks (answers equal a plain
streamed loop), two processes equal one, and the cross-check against lmms-eval's own qwen2_5_vl."""

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (pip install -e '.[eval]')")

from kvdemo.integrations.local_tasks import make_tasks  # noqa: E402
from kvdemo.world.choices import VIDEOMME_POST_PROMPT, multiple_choice  # noqa: E402
from kvdemo.world.synthetic import sample_episode  # noqa: E402

pytestmark = pytest.mark.slow  # lmms-eval runs the model over its tasks

TASKS = ["kvdemo_videomme", "kvdemo_ovo_backward", "kvdemo_ovo_forward", "kvdemo_bare"]


def _videomme_yaml_post_prompt() -> str:
    """The default post_prompt in lmms-eval's own videomme.yaml (read as text: its !function tags need lmms-eval)."""
    import yaml
    from lmms_eval.tasks.videomme import utils

    text = (Path(utils.__file__).parent / "videomme.yaml").read_text()
    safe = "\n".join(line for line in text.splitlines() if "!function" not in line)
    return yaml.safe_load(safe)["lmms_eval_specific_kwargs"]["default"]["post_prompt"]


def test_the_multiple_choice_prompts_are_the_benchmarks_own():
    from lmms_eval.tasks.ovobench.utils import build_prompt
    from lmms_eval.tasks.videomme.utils import videomme_doc_to_text

    question = sample_episode().questions[0]
    rng = np.random.default_rng(3)
    videomme = multiple_choice(question, rng)
    assert VIDEOMME_POST_PROMPT == _videomme_yaml_post_prompt()
    doc = {"question": question.text, "options": list(videomme.options)}
    assert videomme.prompt == videomme_doc_to_text(doc, {"pre_prompt": "", "post_prompt": _videomme_yaml_post_prompt()})
    ovo = multiple_choice(question, rng, "ovobench")
    assert ovo.prompt == build_prompt({"task": "EPM", "question": question.text, "options": list(ovo.words)}, None)
    assert videomme.options[("ABCD".index(videomme.letter))] == f"{videomme.letter}. {question.answer}"


def test_the_manifest_names_the_model_class():
    from kvdemo.integrations.lmms_eval import KVDemoLMM, manifest

    found = manifest()
    assert found.model_id == "kvdemo" and found.simple_class_path == "kvdemo.integrations.lmms_eval.KVDemoLMM"
    assert KVDemoLMM.is_simple
    if any(e.name == "kvdemo" for e in entry_points(group="lmms_eval.models")):  # installed (pip install -e .)
        from lmms_eval.models import get_model

        assert get_model("kvdemo") is KVDemoLMM


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    counts = make_tasks(folder, streams=1)
    assert all(counts[t] > 0 for t in TASKS)
    return folder


def _evaluate(model, folder: Path, tasks: list[str]) -> dict:
    """lmms-eval's own evaluator on the local tasks (VideoMME's video lookup pointed at the task folder)."""
    import lmms_eval.tasks.videomme.utils as videomme_utils
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    videomme_utils.base_cache_dir = str(folder / "hf")  # what HF_HOME=DIR/hf sets on the command line
    return simple_evaluate(
        model=model, tasks=tasks, task_manager=TaskManager(include_path=str(folder)), log_samples=True, cli_args=None
    )


def _rows(folder: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines()]


def test_local_tasks_answer_like_a_plain_streamed_loop(tasks, tmp_path):
    """Streamed once per video and asked in time order, every answer equals the answer of a fresh engine fed the
    same frames up to the question's time; the scores are lmms-eval's own."""
    from kvdemo.integrations.lmms_eval import KVDemoLMM
    from kvdemo.media.video import open_video
    from kvdemo.stream.engine import StreamEngine

    model = KVDemoLMM(pretrained="tiny", time_field="ask_s", runs=str(tmp_path))
    out = _evaluate(model, tasks, TASKS)
    assert {"kvdemo_bare", "kvdemo_videomme", "kvdemo_ovo_backward", "kvdemo_ovo_forward"} <= set(out["results"])
    (run,) = list(tmp_path.iterdir())
    predictions = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    bare = {p["question"] + f"@{p['ask_s']}": p for p in predictions if p["task"] == "kvdemo_bare"}
    rows = _rows(tasks, "kvdemo_bare")
    assert len(bare) == len(rows)
    right = 0
    for row in rows:
        engine = StreamEngine(model.model, "full", fps=2.0)
        for _, frames, times in open_video(row["video"], fps=2.0, geometry=model.geometry).chunks(2):
            if times[0] > row["ask_s"]:
                break
            engine.feed(frames, times)
        expected = engine.answer(row["question"], 12).answer
        record = bare[row["question"] + f"@{row['ask_s']}"]
        assert record["answer"] == expected and record["frames_fed"] == engine.frames_fed
        right += record["correct"]
    assert out["results"]["kvdemo_bare"]["accuracy,none"] == pytest.approx(right / len(rows))
    # VideoMME's own scorer and the run folder's grading agree answer by answer.
    scored = {
        s["doc"]["question_id"] if "doc" in s else s["videomme_perception_score"]["question_id"]: s[
            "videomme_perception_score"
        ]["pred_answer"]
        == s["videomme_perception_score"]["answer"]
        for s in out["samples"]["kvdemo_videomme"]
    }
    videomme = [p for p in predictions if p["task"] == "kvdemo_videomme"]
    assert len(videomme) == len(scored) and sum(scored.values()) == sum(p["correct"] for p in videomme)
    # The forward task: one answer per round, each round feeding only the frames its clip adds.
    forward = [p for p in predictions if p["task"] == "kvdemo_ovo_forward"]
    rounds = sum(len(r["test_info"]) for r in _rows(tasks, "kvdemo_ovo_forward"))
    assert len(forward) == rounds
    per_doc = len(_rows(tasks, "kvdemo_ovo_forward")[0]["test_info"])
    fed = [p["frames_fed"] for p in forward[:per_doc]]
    assert fed == sorted(fed) and fed[0] < fed[-1]
    assert all(
        p["policy"] == "full" and p["tokens_held"] > 0 and p["peak_tokens"] >= p["tokens_held"] for p in predictions
    )


@pytest.mark.parametrize("policy, m, c", [("sliding-window", 32, 16), ("rekv", 64, 48)])
def test_a_bounded_policy_holds_its_budget_under_lmms_eval(tasks, tmp_path, policy, m, c):
    """rekv: its retrieval reserve counts toward M while the stream runs, and each question retrieves within it."""
    from kvdemo.integrations.lmms_eval import KVDemoLMM

    model = KVDemoLMM(pretrained="tiny", policy=policy, M=m, C=c, runs=str(tmp_path))
    _evaluate(model, tasks, ["kvdemo_videomme"])
    (run,) = list(tmp_path.iterdir())
    config = json.loads((run / "config.json").read_text())
    lines = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert config["policy"] == policy and config["M"] == m and config["versions"]["lmms_eval"]
    assert all(p["peak_tokens"] <= m and p["compressions"] > 0 and (p["M"], p["C"]) == (m, c) for p in lines)


def test_a_bounded_policy_without_m_runs_at_the_models_default_budget_and_says_so(tmp_path):
    """The app and the CLI run a policy at the model's default budget where the user gave none; so does the lmms-eval
    model, and its run's config says where the budget came from."""
    from kvdemo.integrations.lmms_eval import KVDemoLMM
    from kvdemo.models.catalog import default_budget

    M, C, _ = default_budget("tiny")
    model = KVDemoLMM(pretrained="tiny", policy="infinipot-v", runs=str(tmp_path))
    assert (model.bounds.M, model.bounds.C) == (M, C)
    (run,) = list(tmp_path.iterdir())
    config = json.loads((run / "config.json").read_text())
    assert (config["M"], config["C"]) == (M, C) and "default" in config["budget_from"]
    given = KVDemoLMM(pretrained="tiny", policy="infinipot-v", M=2 * M, runs=str(tmp_path / "given"))
    assert (given.bounds.M, given.bounds.C, given.budget_from) == (2 * M, int(1.5 * M), "model_args")


def _launch(tasks: Path, out: Path, processes: int) -> dict[int, str]:
    """``python -m lmms_eval`` (one process) or ``accelerate launch`` (several) on the bare task; answers by doc id."""
    env = {
        **os.environ,
        "HF_HOME": str(tasks / "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    args = [
        "-m",
        "lmms_eval",
        "--model",
        "kvdemo",
        "--model_args",
        f"pretrained=tiny,time_field=ask_s,runs={out / 'runs'}",
        "--tasks",
        "kvdemo_bare",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    # accelerate's --cpu flag runs one process whatever --num_processes says; --multi_gpu starts them (gloo on a CPU).
    launcher = (
        [sys.executable]
        if processes == 1
        else [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ]
    )
    done = subprocess.run(launcher + args, env=env, capture_output=True, text=True, timeout=600)
    results = list(out.rglob("*_results.json"))  # lmms-eval exits 0 even when the evaluation failed
    assert done.returncode == 0 and results, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(results[0].read_text())["results"]["kvdemo_bare"]["accuracy,none"] is not None
    samples = next(out.rglob("*_samples_kvdemo_bare.jsonl"))
    return {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, samples.read_text().splitlines())}


@pytest.mark.skipif(
    not any(e.name == "kvdemo" for e in entry_points(group="lmms_eval.models")),
    reason="kvdemo is not installed with its lmms-eval entry point (pip install -e '.[eval]')",
)
def test_two_processes_give_the_answers_of_one(tasks, tmp_path):
    one = _launch(tasks, tmp_path / "one", 1)
    two = _launch(tasks, tmp_path / "two", 2)
    assert one == two and len(one) == len(_rows(tasks, "kvdemo_bare"))
    shares = sorted((tmp_path / "two" / "runs").rglob("predictions.rank*.jsonl"))
    assert [p.name for p in shares] == ["predictions.rank0.jsonl", "predictions.rank1.jsonl"]


# lmms-eval's own qwen2_5_vl passes min_pixels/max_pixels to the processor call, which transformers deprecates: a call
# of lmms-eval's, not kvdemo's, so it stays a warning here.
@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
def test_lmms_evals_own_qwen2_5_vl_agrees_with_the_full_cache(tasks, tmp_path):
    """The trained tiny model exported as a transformers folder, run by lmms-eval's qwen2_5_vl on the VideoMME-format
    task (streams of 32 frames: the frames it samples), answers as kvdemo's full cache does."""
    pytest.importorskip("decord", reason="lmms-eval's qwen2_5_vl needs decord")
    pytest.importorskip("qwen_vl_utils", reason="lmms-eval's qwen2_5_vl needs qwen_vl_utils")
    from lmms_eval.models.simple.qwen2_5_vl import Qwen2_5_VL

    from kvdemo.integrations.lmms_eval import KVDemoLMM
    from kvdemo.models.catalog import OFFLINE_MODELS, TINY_NAME
    from kvdemo.models.tiny import TRAINED_DIR, export_transformers_folder

    geometry = OFFLINE_MODELS[TINY_NAME].geometry
    folder = export_transformers_folder(TRAINED_DIR, tmp_path / "export")
    theirs = _evaluate(
        Qwen2_5_VL(
            pretrained=str(folder),
            device="cpu",
            device_map="cpu",
            attn_implementation="sdpa",
            min_pixels=geometry.min_pixels,
            max_pixels=geometry.max_pixels,
        ),
        tasks,
        ["kvdemo_videomme"],
    )
    ours = _evaluate(KVDemoLMM(pretrained="tiny", runs=str(tmp_path / "runs")), tasks, ["kvdemo_videomme"])
    answers = [{s["doc_id"]: s["filtered_resps"] for s in out["samples"]["kvdemo_videomme"]} for out in (theirs, ours)]
    assert answers[0] == answers[1] and len(answers[0]) == len(_rows(tasks, "kvdemo_videomme"))
    letters = {answer[0] if isinstance(answer, list) else answer for answer in answers[1].values()}
    assert letters <= set("ABCD")  # the bundled model answers VideoMME's prompt with an option letter
    shutil.rmtree(folder)


def test_pruning_in_front_of_the_policy_under_lmms_eval(tasks, tmp_path):
    """``prune=evs:0.75`` in ``--model_args`` (read by lmms-eval's own parser): every video streams with EVS before the
    LLM, what entered is recorded, and the budget counts it."""
    from lmms_eval.utils import simple_parse_args_string

    from kvdemo.integrations.lmms_eval import KVDemoLMM

    arguments = simple_parse_args_string(
        f"pretrained=tiny,policy=sliding-window,M=32,C=16,prune=evs:0.75,runs={tmp_path}"
    )
    _evaluate(KVDemoLMM(**arguments), tasks, ["kvdemo_videomme"])
    (run,) = list(tmp_path.iterdir())
    config = json.loads((run / "config.json").read_text())
    lines = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert config["prune"] == "evs:0.75" and run.name.startswith("lmms-eval-evs:0.75+sliding-window")
    assert all(p["prune"] == "evs:0.75" and p["peak_tokens"] <= 32 for p in lines)
    assert all(0 < p["tokens_entered"] < p["frames_fed"] * 8 for p in lines)  # 16 tokens a pair of frames offered


def test_a_bad_pruning_argument_fails_before_the_model_loads(monkeypatch):
    from kvdemo.errors import PruningSettingError
    from kvdemo.integrations import lmms_eval

    monkeypatch.setattr(lmms_eval, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(PruningSettingError, match="prune.*video_pruning_rate.*between 0 and 1"):
        lmms_eval.KVDemoLMM(pretrained="tiny", prune="evs:2")
