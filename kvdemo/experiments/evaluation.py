"""``python -m kvdemo eval``: accuracy vs query delay on held-out generated streams (ProtoKV's protocol).

Every episode is one generated stream (:mod:`kvdemo.world.synthetic`) fed frame pair by frame pair through
one :class:`~kvdemo.stream.engine.FrameStream` (one vision encoding per chunk) into one engine per policy.
Each question is asked of every engine at every delay ``d`` after its evidence left view: once the
frame pair starting at ``left_s + d`` (or the first one after it) has been fed, so even at ``d = 0``
the newest frames no longer show the evidence. Asking never changes the memory, and the dialogue is
reset after each question, so every answer comes from the memory alone.

Stream kinds (``--kind``): ``static`` (the default: a fixed camera), ``moving`` (camera motion,
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

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EvaluationSettingError, PolicyChoiceError, StreamSettingError
from ..media.video import frames_for
from ..pruning import entry_label, split_entry
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
#: What a question asks about: an object's colour, or which shape came first (the report's ``by_kind``).
QUESTION_KINDS = ("colour", "first")
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


def engine_names(entries: list[str]) -> list[str]:
    """The engines' names of ``entries`` (a policy, or ``METHOD:VALUE+POLICY`` with pruning in front of it), written
    as the lineup names them (``evs:.75+full`` is ``evs:0.75+full``)."""
    return [entry_label(*split_entry(entry)) for entry in entries]


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
                                "stream_s": engine.frames_fed / video.fps,
                                "offloaded_bytes": engine.memory.offloaded_bytes,
                                "answer_ms": answer.ms,
                            }
                        )
                    yield i, d, name, right
            if newest >= last:
                return


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
    ``mixed``; see the module docstring), ``questions`` bare or in a benchmark's multiple-choice form. ``spec``,
    when given, is every episode's spec (its kind wins).

    Returns the JSON report: ``chance``, ``episodes``, ``budget``, ``keep``, ``accuracy[policy][delay]``,
    plus ``interval`` (95%), ``by_kind`` (question kinds), ``by_stream`` (``[policy][delay][stream kind]``:
    accuracy and question count), ``questions``, the engines' actual ``budgets``, and per policy ``tokens_held`` (the
    mean visual tokens its memory held when asked: what "equal memory" compares), ``answer_ms`` and
    ``host_mb_per_min`` (:func:`answer_costs`).
    """
    check_settings(policies, episodes, delays, questions)
    policies = engine_names(policies)
    predictions = predictions if predictions is not None else []  # their tokens held make tokens_held
    specs = [spec] if spec is not None else [eval_spec(delays, kind=k) for k in stream_kinds(kind)]
    kind = spec.kind if spec is not None else kind
    budgets = {
        name: {"budget": e.budget.M, "keep": e.budget.C}
        for name, e in build_engines(model, policies, budget, keep, specs[0].fps).items()
    }
    tally = Tally.empty(policies, len(delays))
    bar = _progress_bar(episodes) if progress else None
    for index in range(episodes):
        episode, items = held_out_items(index, seed, specs, delays, questions)
        if items:
            results = run_episode(model, episode, items, policies, budget, keep, delays, predictions)
            tally.add(episode.kind, items, results)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(questions=len(tally.items))
    if bar is not None:
        bar.close()
    accuracy, interval, by_kind, by_stream = tally.rates(delays)
    counts, total = tally.question_counts(), len(tally.items)
    return {
        "chance": sum(item.chance for item in tally.items) / total if total else 0.0,
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
            **{f"{k} streams": n for k, n in tally.stream_counts().items()},
        },
        "delays_s": [_delay_key(d) for d in delays],
        "kind": kind,
        "question_form": questions,
        "stream_pairs": specs[0].pairs[0],
        "seed": seed,
        "model": model.name,
        "budgets": budgets,
        **answer_costs(predictions, policies),
    }


def answer_costs(predictions: list[dict[str, Any]], policies: list[str]) -> dict[str, dict[str, float]]:
    """Per policy, over its answers: ``tokens_held`` (mean visual tokens in the cache when asked), ``answer_ms`` (mean
    time to answer, retrieval included) and ``host_mb_per_min`` (megabytes, 1e6, in host memory per minute of stream
    fed: the offloaded bytes summed over the answers over the stream minutes summed over them; 0 for a policy that
    offloads nothing)."""
    costs: dict[str, dict[str, float]] = {"tokens_held": {}, "answer_ms": {}, "host_mb_per_min": {}}
    for name in policies:
        own = [p for p in predictions if p["policy"] == name]
        minutes = sum(p.get("stream_s", 0.0) for p in own) / 60
        costs["tokens_held"][name] = round(float(np.mean([p["tokens_held"] for p in own] or [0])), 1)
        costs["answer_ms"][name] = round(float(np.mean([p["answer_ms"] for p in own] or [0])), 1)
        host = sum(p.get("offloaded_bytes", 0) for p in own) / 1e6
        costs["host_mb_per_min"][name] = round(host / minutes, 3) if minutes else 0.0
    return costs


def check_settings(policies: list[str], episodes: int, delays: tuple[float, ...], questions: str) -> None:
    """The settings :func:`evaluate` refuses, each a user error naming what is wrong, before any engine exists."""
    if not policies:
        raise PolicyChoiceError("name at least one policy")
    if episodes <= 0:
        raise EvaluationSettingError(f"--episodes must be positive, got {episodes}")
    if not delays or min(delays) < 0:
        raise StreamSettingError(f"delays must be non-negative seconds, got {list(delays)}")
    if questions not in QUESTION_FORMS:
        raise EvaluationSettingError(f"unknown question form {questions!r}: one of {', '.join(QUESTION_FORMS)}")


def held_out_items(
    index: int, seed: int, specs: list[StreamSpec], delays: tuple[float, ...], questions: str
) -> tuple[Episode, list[Item]]:
    """Held-out episode ``index`` (of ``specs[index % len(specs)]``) and its questions askable at every delay, in
    the ``questions`` form (a multiple-choice form draws the options from ``(seed, 2, index, 1)``)."""
    episode = generate_episode((seed, EVAL_STREAMS, index), specs[index % len(specs)])
    items = valid_items(episode, index, delays)
    if questions != "bare":
        rng = np.random.default_rng((seed, EVAL_STREAMS, index, 1))
        items = [
            replace(item, question=multiple_choice(item.question, rng, questions).as_question(), choice=True)
            for item in items
        ]
    return episode, items


@dataclass
class Tally:
    """Right answers so far per policy, question kind (:data:`QUESTION_KINDS`) and delay, and per policy, stream
    kind and delay; the items asked and the stream kind of each."""

    correct: dict[str, list[list[int]]]
    by_stream: dict[str, dict[str, list[int]]]
    items: list[Item] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)

    @classmethod
    def empty(cls, policies: list[str], delays: int) -> Tally:
        return cls(
            {name: [[0] * delays for _ in QUESTION_KINDS] for name in policies},
            {name: {k: [0] * delays for k in STREAM_KINDS} for name in policies},
        )

    def add(self, stream_kind: str, items: list[Item], results: dict[str, list[list[bool]]]) -> None:
        """One episode's answers (:func:`run_episode`'s ``[policy][item][delay] -> correct``)."""
        for name, per_item in results.items():
            for item, row in zip(items, per_item):
                question_kind = QUESTION_KINDS.index(item.question.kind)
                for d, right in enumerate(row):
                    self.correct[name][question_kind][d] += int(right)
                    self.by_stream[name][stream_kind][d] += int(right)
        self.items.extend(items)
        self.streams.extend([stream_kind] * len(items))

    def question_counts(self) -> list[int]:
        """Questions asked of each question kind."""
        return [sum(item.question.kind == k for item in self.items) for k in QUESTION_KINDS]

    def stream_counts(self) -> dict[str, int]:
        """Questions asked about streams of each kind (kinds never asked about left out)."""
        return {k: self.streams.count(k) for k in STREAM_KINDS if self.streams.count(k)}

    def rates(self, delays: tuple[float, ...]) -> tuple[dict[str, Any], ...]:
        """``accuracy``, ``interval``, ``by_kind`` and ``by_stream`` of the report, each ``[policy][delay]``."""
        counts, stream_counts, total = self.question_counts(), self.stream_counts(), len(self.items)
        accuracy, interval, by_kind, by_stream = {}, {}, {}, {}
        for name, correct in self.correct.items():
            accuracy[name], interval[name], by_kind[name], by_stream[name] = {}, {}, {}, {}
            for d, delay in enumerate(delays):
                right = correct[0][d] + correct[1][d]
                key = _delay_key(delay)
                accuracy[name][key] = right / total if total else 0.0
                interval[name][key] = list(wilson(right, total))
                by_kind[name][key] = {
                    question_kind: correct[k][d] / counts[k]
                    for k, question_kind in enumerate(QUESTION_KINDS)
                    if counts[k]
                }
                by_stream[name][key] = {k: self.by_stream[name][k][d] / n for k, n in stream_counts.items()}
        return accuracy, interval, by_kind, by_stream


def _progress_bar(episodes: int) -> Any:
    from tqdm import tqdm  # deferred: only with a progress bar

    return tqdm(total=episodes, unit="stream", desc="eval", file=sys.stderr, dynamic_ncols=True)


def _delay_key(delay: float) -> str:
    return f"{delay:g}"
