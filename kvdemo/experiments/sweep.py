"""The eval protocol live, for the app: the bundled sample, then held-out generated streams of its kind, asked
every question at every delay by every policy (:mod:`.evaluation`), the accuracy yielded after every answer
round as a :class:`Sweep` that draws its own chart."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..views import Chart, Series, counted
from ..world.synthetic import generate_episode
from .evaluation import EVAL_STREAMS, engine_names, episode_answers, eval_spec, valid_items

if TYPE_CHECKING:  # the model's module imports torch: a type only
    from ..models.base import VideoLM


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
    policies = engine_names(policies)
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
