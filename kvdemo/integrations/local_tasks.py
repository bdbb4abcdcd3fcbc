"""``python -m kvdemo make-tasks DIR``: offline lmms-eval tasks on generated streams, in the benchmarks' own layouts.

Four tasks, each a JSON-lines file, its videos (H.264 mp4 at 2 fps, 112 x 112) and a task YAML (from the
templates shipped in ``kvdemo/integrations/tasks/``, the data folder written in):

- ``kvdemo_videomme``: VideoMME's row format (``videoID``, ``question``, ``options`` ``["A. red", ...]``,
  ``answer`` letter, ``duration``/``domain``/``sub_category``/``task_type``), scored by VideoMME's own functions
  (prompt, video lookup, letter extraction, aggregation). VideoMME looks videos up in
  ``$HF_HOME/videomme/data/<videoID>.mp4``: run it with ``HF_HOME=DIR/hf``. Streams of 16 s = 32 frames, the
  frame count lmms-eval's own ``qwen2_5_vl`` samples, so the two models see the same frames (the cross-check).
- ``kvdemo_ovo_backward``: OVO-Bench's backward rows (``id``, ``task`` ``EPM``, ``question``, ``options`` words,
  ``gt`` index), each with its clip cut at the question's time (``DIR/ovobench/chunked_videos/<id>.mp4``: 4 s
  after the evidence left view), scored by OVO-Bench's own functions.
- ``kvdemo_ovo_forward``: OVO-Bench's multi-round forward rows (task ``CRR``: "is there enough in the video so far
  to answer ...?", Yes once the asked object has appeared), one clip per round (``<id>_<i>.mp4``, longer prefixes
  of one stream). The tiny model was never trained on this question: the task tests the multi-round mechanics.
- ``kvdemo_bare``: the stream's own questions ("What colour was the star?" -> a word), each asked at a stream
  time (``ask_s``, the model argument ``time_field=ask_s``) 0, 4 or 8 s after its evidence left view; scored here.

Streams are :mod:`kvdemo.world.synthetic`'s, of seeds ``(seed, 4, i)`` (training uses tags 1 and 3, ``kvdemo eval`` 2),
static and moving alternating. The options' draws: :func:`kvdemo.world.choices.multiple_choice`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..media.video import write_video
from ..usage import UsageError
from ..world.choices import multiple_choice
from ..world.synthetic import Episode, StreamSpec, generate_episode, grade_answer

TASK_STREAMS = 4
TASKS = ("kvdemo_videomme", "kvdemo_ovo_backward", "kvdemo_ovo_forward", "kvdemo_bare")
#: VideoMME's categories the rows claim (its aggregation counts answers per category).
VIDEOMME_TASK_TYPE = {"colour": "Attribute Perception", "first": "Temporal Perception"}
BARE_DELAYS = (0.0, 4.0, 8.0)
OVO_ROUNDS = (4.0, 8.0, 12.0, 16.0, 20.0)


def make_tasks(folder: str | Path, streams: int = 8, seed: int = 0) -> dict[str, int]:
    """Write the four tasks' data and YAMLs under ``folder``; returns the number of rows per task."""
    folder = Path(folder).resolve()
    rows: dict[str, list[dict[str, Any]]] = {task: [] for task in TASKS}
    for i in range(streams):
        kind = ("static", "moving")[i % 2]
        short = generate_episode((seed, TASK_STREAMS, i), StreamSpec(pairs=(16, 16), kind=kind))
        rows["kvdemo_videomme"] += _videomme_rows(
            folder, short, f"kvdemo-{seed}-{i:03d}", np.random.default_rng((seed, TASK_STREAMS, i, 1))
        )
        long = generate_episode((seed, TASK_STREAMS, streams + i), StreamSpec(pairs=(24, 24), kind=kind))
        rng = np.random.default_rng((seed, TASK_STREAMS, streams + i, 1))
        rows["kvdemo_ovo_backward"] += _ovo_backward_rows(folder, long, f"kvdemo-{seed}-{i:03d}", rng)
        rows["kvdemo_ovo_forward"] += _ovo_forward_rows(folder, long, f"kvdemo-fwd-{seed}-{i:03d}")
        rows["kvdemo_bare"] += _bare_rows(folder, long, f"kvdemo-{seed}-{i:03d}")
    for task, task_rows in rows.items():
        (folder / f"{task}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in task_rows))
        template = resources.files("kvdemo.integrations").joinpath("tasks", f"{task}.yaml").read_text()
        (folder / f"{task}.yaml").write_text(template.replace("@DATA@", str(folder)))
    return {task: len(task_rows) for task, task_rows in rows.items()}


def make_tasks_command(args) -> int:
    """``python -m kvdemo make-tasks``: write the tasks and print the lmms-eval command that runs them offline."""
    if args.streams <= 0:
        raise UsageError(f"--streams must be positive, got {args.streams}")
    counts = make_tasks(args.folder, args.streams, args.seed)
    folder = Path(args.folder).resolve()
    print(", ".join(f"{task}: {n} rows" for task, n in counts.items()))
    print(
        f"run: HF_HOME={folder / 'hf'} HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m lmms_eval --model kvdemo "
        f"--tasks kvdemo_videomme --include_path {folder} --output_path {folder / 'results'}"
    )
    return 0


def _write(path: Path, episode: Episode, frames: int | None = None) -> None:
    video = episode.video
    write_video(path, video.frames[:frames] if frames else video.frames, video.fps)


def _videomme_rows(folder: Path, episode: Episode, video_id: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    _write(folder / "hf" / "videomme" / "data" / f"{video_id}.mp4", episode)
    rows = []
    for j, question in enumerate(episode.questions):
        choice = multiple_choice(question, rng)
        rows.append(
            {
                "video_id": video_id,
                "duration": "short",
                "domain": "Knowledge",
                "sub_category": "Humanity & History",
                "url": "",
                "videoID": video_id,
                "question_id": f"{video_id}-{j}",
                "task_type": VIDEOMME_TASK_TYPE[question.kind],
                "question": question.text,
                "options": list(choice.options),
                "answer": choice.letter,
            }
        )
    return rows


def _frames_until(episode: Episode, time_s: float) -> int:
    """Frames shown up to stream time ``time_s`` (whole frame pairs, at least one pair)."""
    pairs = max(1, min(episode.pairs, int(np.ceil(time_s / episode.pair_seconds - 1e-9))))
    return pairs * 2


def _ovo_backward_rows(folder: Path, episode: Episode, stem: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    rows = []
    for j, question in enumerate(episode.questions):
        row_id = f"{stem}-{j}"
        frames = _frames_until(episode, question.left_s + 4.0)
        _write(folder / "ovobench" / "chunked_videos" / f"{row_id}.mp4", episode, frames)
        choice = multiple_choice(question, rng, "ovobench")
        rows.append(
            {
                "id": row_id,
                "task": "EPM",
                "question": question.text,
                "options": list(choice.words),
                "gt": "ABCD".index(choice.letter),
                "realtime": frames / episode.video.fps,
            }
        )
    return rows


def _ovo_forward_rows(folder: Path, episode: Episode, stem: str) -> list[dict[str, Any]]:
    rows = []
    for j, question in enumerate(q for q in episode.questions if q.kind == "colour"):
        row_id = f"{stem}-{j}"
        test_info = []
        for i, time_s in enumerate(OVO_ROUNDS):
            _write(
                folder / "ovobench" / "chunked_videos" / f"{row_id}_{i}.mp4", episode, _frames_until(episode, time_s)
            )
            test_info.append({"realtime": time_s, "type": int(question.shown_s < time_s)})
        rows.append({"id": row_id, "task": "CRR", "question": question.text, "test_info": test_info})
    return rows


def _bare_rows(folder: Path, episode: Episode, stem: str) -> list[dict[str, Any]]:
    path = folder / "bare" / f"{stem}.mp4"
    _write(path, episode)
    end = episode.pairs * episode.pair_seconds
    return [
        {
            "id": f"{stem}-{j}-{delay:g}",
            "video": str(path),
            "question": question.text,
            "answer": question.answer,
            "kind": question.kind,
            "ask_s": question.left_s + delay,
            "delay_s": delay,
        }
        for j, question in enumerate(episode.questions)
        for delay in BARE_DELAYS
        if question.left_s + delay < end
    ]


# --- the bare-question task's functions (named by its YAML as ``!function kvdemo.integrations.local_tasks.*``) ---


def bare_doc_to_visual(doc: dict[str, Any]) -> list[str]:
    return [doc["video"]]


def bare_doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    return doc["question"]


def bare_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Right when the answer is the expected word (:func:`kvdemo.world.synthetic.grade_answer`)."""
    return {"accuracy": float(grade_answer(doc["answer"], results[0]))}
