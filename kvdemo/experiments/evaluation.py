"""``python -m kvdemo eval``: accuracy vs query delay on held-out generated streams (ProtoKV's protocol).

Every episode is one generated stream (:mod:`kvdemo.world.synthetic`) fed frame pair by frame pair through
one :class:`~kvdemo.stream.engine.FrameStream` (one vision encoding per chunk) into one engine per policy.
Each question is asked of every engine at every delay ``d`` after its evidence left view: once the
frame pair starting at ``left_s + d`` (or the first one after it) has been fed, so even at ``d = 0``
the newest frames no longer show the evidence. Asking never changes the memory, and the dialogue is
reset after each question, so every answer comes from the memory alone.

Stream kinds (``--kind``): ``static`` (the default, the benchmark as it was), ``moving`` (camera motion,
drifting background, reappearing objects: :mod:`kvdemo.world.synthetic`) or ``mixed`` (episode ``i`` of kind
``static`` when ``i`` is even, ``moving`` when odd; the report then also gives the accuracy per kind).
Episode ``i`` is the stream of seed ``(seed, 2, i)`` of its kind.

ProtoKV's protocol (its Sec. 4 and App. C.1): delays in seconds of stream time; only questions with
invariant ground truth (both kinds here are: shapes are unique per stream, and the first object
stays first); only questions that can be asked at every delay of the sweep inside the stream, so every
delay is measured on the same questions. An answer is right when the greedy answer is the expected word.
Chance is the mean over questions of 1 / (size of the answer vocabulary): 1/7 for colours, 1/6 for
shapes; 1/4 with ``--questions videomme`` or ``ovobench``, which ask every question in that benchmark's
multiple-choice prompt (:mod:`kvdemo.world.choices`; the options of episode ``i`` drawn from ``(seed, 2, i, 1)``)
and grade the letter. The interval is Wilson's 95% score interval over questions (questions of one stream are not
independent, so it is a little optimistic).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EvaluationSettingError, PolicyChoiceError, StreamSettingError
from ..media.video import frames_for
from ..views import Chart, Series, counted
from ..world.choices import CHOICE_FORMATS, LETTERS, multiple_choice
from ..world.synthetic import (
    COLOURS,
    SHAPES,
    STREAM_KINDS,
    Episode,
    Question,
    StreamSpec,
    generate_episode,
    grade_answer,
)

if TYPE_CHECKING:  # the engine imports torch: loaded when an evaluation runs, not with the CLI's defaults
    from ..models.base import VideoLM
    from ..stream.engine import StreamEngine

#: Seed-sequence tag of evaluation streams (training uses another, so these streams are held out).
EVAL_STREAMS = 2
DEFAULT_DELAYS = (0, 4, 8, 16, 32)
#: What ``--questions`` takes: the bare questions, or a benchmark's multiple-choice form of them.
QUESTION_FORMS = ("bare", *CHOICE_FORMATS)
#: What ``--kind`` takes: a stream kind, or both alternating.
EVAL_KINDS = (*STREAM_KINDS, "mixed")
#: Longest answer word ("triangle", "diamond", "purple", ...) plus the stop token, with room to spare.
ANSWER_TOKENS = 12


@dataclass(frozen=True)
class Item:
    """One question of one episode, asked after each grid in ``ask_after`` (one per delay)."""

    episode: int
    question: Question
    ask_after: tuple[int, ...]
    choice: bool = False

    @property
    def chance(self) -> float:
        if self.choice:
            return 1.0 / len(LETTERS)
        return 1.0 / (len(COLOURS) if self.question.kind == "colour" else len(SHAPES))


def eval_spec(delays: tuple[float, ...], lead_in: int = 14, kind: str = "static") -> StreamSpec:
    """Streams of ``kind`` long enough to ask about evidence of the first ``lead_in`` seconds at the longest delay."""
    pairs = lead_in + int(math.ceil(max(delays))) + 2
    return StreamSpec(pairs=(pairs, pairs), kind=kind)


def stream_kinds(kind: str) -> tuple[str, ...]:
    """The stream kinds episodes cycle through for ``--kind`` (``mixed``: static, moving, static, ...)."""
    if kind not in EVAL_KINDS:
        raise ValueError(f"unknown stream kind {kind!r}: one of {', '.join(EVAL_KINDS)}")
    return STREAM_KINDS if kind == "mixed" else (kind,)


def ask_grids(question: Question, delays: tuple[float, ...], pair_seconds: float) -> tuple[int, ...]:
    """For each delay, the grid after which the question is asked: the first grid starting at or after
    ``left_s + delay``."""
    return tuple(int(math.ceil((question.left_s + d) / pair_seconds - 1e-9)) for d in delays)


def valid_items(episode: Episode, index: int, delays: tuple[float, ...]) -> list[Item]:
    """The episode's questions that can be asked at every delay before the stream ends."""
    items = []
    for question in episode.questions:
        grids = ask_grids(question, delays, episode.pair_seconds)
        if max(grids) < episode.pairs:
            items.append(Item(index, question, grids))
    return items


def wilson(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for ``correct`` successes out of ``total``."""
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def build_engines(
    model: VideoLM, policies: list[str], budget: int | None, keep: int | None, fps: float
) -> dict[str, StreamEngine]:
    """One engine per policy (:func:`kvdemo.stream.lineup.make_engines`), each under the budget its policy takes of
    ``M`` and ``C`` (a policy sized by ``M`` alone gets no ``C``; ``full`` neither)."""
    from ..stream.lineup import (
        make_engines,  # deferred on purpose: the CLI imports this module for its defaults, before torch
    )

    return make_engines(model, policies, budget, keep, fps=fps, max_new_tokens=ANSWER_TOKENS)


def run_episode(
    model: VideoLM,
    episode: Episode,
    items: list[Item],
    policies: list[str],
    budget: int | None,
    keep: int | None,
    delays: tuple[float, ...] = (),
    predictions: list[dict[str, Any]] | None = None,
) -> dict[str, list[list[bool]]]:
    """Stream ``episode`` into one engine per policy and ask every item at each of its grids (``delays``: their
    delays, for ``predictions``, which gets one record per answer when given).

    Returns, per policy, ``[item][delay] -> correct``.
    """
    results = {name: [[False] * len(item.ask_after) for item in items] for name in policies}
    for i, d, name, right in episode_answers(model, episode, items, policies, budget, keep, delays, predictions):
        results[name][i][d] = right
    return results


def episode_answers(
    model: VideoLM,
    episode: Episode,
    items: list[Item],
    policies: list[str],
    budget: int | None,
    keep: int | None,
    delays: tuple[float, ...] = (),
    predictions: list[dict[str, Any]] | None = None,
) -> Iterator[tuple[int, int, str, bool]]:
    """:func:`run_episode` as it happens: ``(item, delay index, policy, correct)`` for each answer, in stream order
    (and a record per answer appended to ``predictions`` when given: :mod:`kvdemo.experiments.results`)."""
    from ..stream.streaming import EngineGroup  # deferred on purpose (torch), as above

    video = episode.video
    engines = build_engines(model, policies, budget, keep, video.fps)
    group = EngineGroup(model, engines, video.fps)
    due: dict[int, list[tuple[int, int]]] = {}
    for i, item in enumerate(items):
        for d, grid in enumerate(item.ask_after):
            due.setdefault(grid, []).append((i, d))
    last = max(due)
    for _, frames, times in video.chunks(model.geometry.frames_per_grid):
        for step in group.push(frames_for(frames, model.geometry), times):  # generated frames, sized for the model
            newest = step.chunk.first_grid + step.chunk.num_grids - 1
            for i, d in due.get(newest, []):
                question = items[i].question
                for name, engine in engines.items():
                    answer = engine.answer(question.text, ANSWER_TOKENS)
                    engine.reset_dialogue()
                    right = grade_answer(question.answer, answer.answer)
                    if predictions is not None:
                        predictions.append(
                            {
                                "episode": items[i].episode,
                                "question": question.text,
                                "answer": answer.answer,
                                "truth": question.answer,
                                "correct": right,
                                "delay_s": delays[d] if delays else None,
                                "policy": name,
                                "M": engine.budget.M,
                                "C": engine.budget.C,
                                "tokens_held": engine.memory.visual_tokens,
                                "compressions": engine.stats.compressions,
                                "frames_fed": engine.frames_fed,
                                "answer_ms": answer.ms,
                            }
                        )
                    yield i, d, name, right
            if newest >= last:
                return


@dataclass
class Sweep:
    """A delay sweep as it goes (:func:`delay_sweep`): per policy and delay, answers right and asked so far."""

    policies: list[str]
    delays: tuple[float, ...]
    right: dict[str, list[int]]
    asked: dict[str, list[int]]
    streams: int = 0
    questions: int = 0

    def accuracy(self) -> dict[str, list[float | None]]:
        return {
            name: [r / n if n else None for r, n in zip(self.right[name], self.asked[name])] for name in self.policies
        }

    def chart(self) -> Chart:
        """Accuracy against delay, one line per policy (a declared view, drawn by :mod:`kvdemo.viz`)."""
        return Chart(
            "Accuracy against delay after the evidence left view",
            f"{counted(self.questions, 'question')} from {counted(self.streams, 'stream')} so far (the bundled sample first, then "
            "held-out generated streams of its kind); each asked of every policy at every delay (the eval protocol)",
            [
                Series(
                    list(self.delays),
                    self.accuracy(),
                    "delay after the evidence left view (s)",
                    "accuracy",
                    markers=True,
                )
            ],
        )


def delay_sweep(
    model: VideoLM,
    policies: list[str],
    delays: tuple[float, ...],
    budget: int | None,
    keep: int | None,
    kind: str = "static",
    more_streams: int = 0,
    seed: int = 0,
) -> Iterator[Sweep]:
    """The eval protocol on the bundled sample of ``kind``, then on ``more_streams`` held-out streams of that kind;
    yields the :class:`Sweep` after every answer round (one question at one delay, every policy)."""
    from ..world.synthetic import sample_episode  # deferred: the bundled sample is needed only by a sweep

    if not delays or min(delays) < 0:
        raise ValueError(f"delays must be non-negative seconds, got {list(delays)}")
    state = Sweep(
        list(policies),
        tuple(delays),
        {n: [0] * len(delays) for n in policies},
        {n: [0] * len(delays) for n in policies},
    )
    episodes = [sample_episode(kind)] + [
        generate_episode((seed, EVAL_STREAMS, i), eval_spec(delays, kind=kind)) for i in range(more_streams)
    ]
    for episode in episodes:
        items = valid_items(episode, 0, delays)
        state.streams += 1
        state.questions += len(items)
        for _, d, name, right in episode_answers(model, episode, items, policies, budget, keep) if items else ():
            state.right[name][d] += int(right)
            state.asked[name][d] += 1
            if name == policies[-1]:
                yield state
    yield state


def evaluate(
    model: VideoLM,
    policies: list[str],
    delays: tuple[float, ...] = DEFAULT_DELAYS,
    episodes: int = 200,
    seed: int = 0,
    budget: int | None = None,
    keep: int | None = None,
    spec: StreamSpec | None = None,
    progress: bool = False,
    kind: str = "static",
    questions: str = "bare",
    predictions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Accuracy per policy and delay on ``episodes`` held-out streams of ``kind`` (``static``, ``moving`` or
    ``mixed``; see the module docstring), ``questions`` bare or in a benchmark's multiple-choice form. ``spec``, when given, is every episode's spec (its kind wins).

    Returns the JSON report: ``chance``, ``episodes``, ``budget``, ``keep``, ``accuracy[policy][delay]``,
    plus ``interval`` (95%), ``by_kind`` (question kinds), ``by_stream`` (``[policy][delay][stream kind]``:
    accuracy and question count), ``questions`` and the engines' actual ``budgets``.
    """
    if not policies:
        raise PolicyChoiceError("name at least one policy")
    if episodes <= 0:
        raise EvaluationSettingError(f"--episodes must be positive, got {episodes}")
    if not delays or min(delays) < 0:
        raise StreamSettingError(f"delays must be non-negative seconds, got {list(delays)}")
    if questions not in QUESTION_FORMS:
        raise EvaluationSettingError(f"unknown question form {questions!r}: one of {', '.join(QUESTION_FORMS)}")
    specs = [spec] if spec is not None else [eval_spec(delays, kind=k) for k in stream_kinds(kind)]
    kind = spec.kind if spec is not None else kind
    budgets = {
        name: {"budget": e.budget.M, "keep": e.budget.C}
        for name, e in build_engines(model, policies, budget, keep, specs[0].fps).items()
    }
    items: list[Item] = []
    item_streams: list[str] = []
    correct = {name: [[0] * len(delays) for _ in ("colour", "first")] for name in policies}
    by_stream_right = {name: {k: [0] * len(delays) for k in STREAM_KINDS} for name in policies}
    bar = None
    if progress:
        from tqdm import tqdm  # deferred: only with a progress bar

        bar = tqdm(total=episodes, unit="stream", desc="eval", file=sys.stderr, dynamic_ncols=True)
    for index in range(episodes):
        episode = generate_episode((seed, EVAL_STREAMS, index), specs[index % len(specs)])
        episode_items = valid_items(episode, index, delays)
        if questions != "bare":
            rng = np.random.default_rng((seed, EVAL_STREAMS, index, 1))
            episode_items = [
                replace(item, question=multiple_choice(item.question, rng, questions).as_question(), choice=True)
                for item in episode_items
            ]
        if episode_items:
            results = run_episode(model, episode, episode_items, policies, budget, keep, delays, predictions)
            for name, per_item in results.items():
                for item, row in zip(episode_items, per_item):
                    question_kind = ("colour", "first").index(item.question.kind)
                    for d, right in enumerate(row):
                        correct[name][question_kind][d] += int(right)
                        by_stream_right[name][episode.kind][d] += int(right)
            items.extend(episode_items)
            item_streams.extend([episode.kind] * len(episode_items))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(questions=len(items))
    if bar is not None:
        bar.close()
    counts = [sum(item.question.kind == k for item in items) for k in ("colour", "first")]
    stream_counts = {k: item_streams.count(k) for k in STREAM_KINDS if item_streams.count(k)}
    total = len(items)
    accuracy, interval, by_kind, by_stream = {}, {}, {}, {}
    for name in policies:
        accuracy[name], interval[name], by_kind[name], by_stream[name] = {}, {}, {}, {}
        for d, delay in enumerate(delays):
            right = correct[name][0][d] + correct[name][1][d]
            key = _delay_key(delay)
            accuracy[name][key] = right / total if total else 0.0
            interval[name][key] = list(wilson(right, total))
            by_kind[name][key] = {
                question_kind: correct[name][k][d] / counts[k]
                for k, question_kind in enumerate(("colour", "first"))
                if counts[k]
            }
            by_stream[name][key] = {k: by_stream_right[name][k][d] / n for k, n in stream_counts.items()}
    return {
        "chance": sum(item.chance for item in items) / total if total else 0.0,
        "episodes": episodes,
        "budget": budget,
        "keep": keep,
        "accuracy": accuracy,
        "interval": interval,
        "by_kind": by_kind,
        "by_stream": by_stream,
        "questions": {
            "total": total,
            "colour": counts[0],
            "first": counts[1],
            **{f"{k} streams": n for k, n in stream_counts.items()},
        },
        "delays_s": [_delay_key(d) for d in delays],
        "kind": kind,
        "question_form": questions,
        "stream_pairs": specs[0].pairs[0],
        "seed": seed,
        "model": model.name,
        "budgets": budgets,
    }


def _delay_key(delay: float) -> str:
    return f"{delay:g}"


def accuracy_table(report: dict[str, Any]) -> str:
    """Accuracy per policy (rows) and delay (columns) with 95% intervals, chance and the question count."""
    delays = report["delays_s"]
    width = max(14, *(len(name) for name in report["accuracy"]))
    header = f"{'policy':<{width}} {'M / C':>11} " + " ".join(f"{'delay ' + d + ' s':>17}" for d in delays)
    lines = [header]
    for name, row in report["accuracy"].items():
        budget = report["budgets"][name]
        size = (
            "-"
            if budget["budget"] is None
            else f"{budget['budget']}" + (f" / {budget['keep']}" if budget["keep"] else "")
        )
        cells = []
        for d in delays:
            low, high = report["interval"][name][d]
            cells.append(f"{row[d]:.2f} [{low:.2f},{high:.2f}]".rjust(17))
        lines.append(f"{name:<{width}} {size:>11} " + " ".join(cells))
    q = report["questions"]
    kind = report.get("kind", "static")
    streams = "static and moving, alternating," if kind == "mixed" else kind
    lines.append(
        f"chance {report['chance']:.3f}; {q['total']} questions ({q['colour']} colour, {q['first']} first-shape) "
        f"from {report['episodes']} held-out {streams} streams of {report['stream_pairs']} s; [95% Wilson interval]"
    )
    return "\n".join(lines)


def eval_command(args: argparse.Namespace) -> int:
    """``python -m kvdemo eval`` (arguments checked by the CLI before anything heavy loads)."""
    import torch  # deferred on purpose (as above)

    from ..cache.budget import DEFAULT_KEEP_RATIO, token_count  # deferred with torch
    from ..models.loading import load_model  # deferred with torch
    from ..policies import make_policy  # deferred with torch

    for name in args.policies:
        make_policy(name)  # an unknown name fails here, before the model loads
    budget = token_count("M", args.budget)  # M and C are checked by the budget's rule before the model loads
    keep = token_count("C", args.keep) if args.keep is not None else int(budget * DEFAULT_KEEP_RATIO)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    if model.notice:
        print(f"note: {model.notice}", file=sys.stderr)
    predictions: list[dict[str, Any]] = []
    report = evaluate(
        model,
        args.policies,
        args.delays,
        args.episodes,
        args.seed,
        budget,
        keep,
        progress=not args.quiet,
        kind=args.kind,
        questions=args.questions,
        predictions=predictions,
    )
    print(accuracy_table(report))
    if getattr(args, "runs", ""):
        write_policy_runs(Path(args.runs), args, report, predictions)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def write_policy_runs(
    root: Path, args: argparse.Namespace, report: dict[str, Any], predictions: list[dict[str, Any]]
) -> None:
    """One run folder per policy under ``root`` (:mod:`kvdemo.experiments.results`): the config, the report's rows of that
    policy as the metrics, its predictions."""
    from .results import new_run_folder, write_eval_run  # deferred: only when runs are written

    for name in report["accuracy"]:
        bounds = report["budgets"][name]
        config = {
            "harness": "kvdemo eval",
            "model": report["model"],
            "policy": name,
            "params": {},
            "M": bounds["budget"],
            "C": bounds["keep"],
            "fps": 2.0,
            "seed": report["seed"],
            "episodes": report["episodes"],
            "kind": report["kind"],
            "questions": report["question_form"],
            "delays_s": report["delays_s"],
        }
        own = {
            key: (value[name] if isinstance(value, dict) and name in value else value) for key, value in report.items()
        }
        folder = write_eval_run(
            new_run_folder(root, f"eval-{name}"), config, own, [p for p in predictions if p["policy"] == name]
        )
        print(f"run folder: {folder}", file=sys.stderr)
