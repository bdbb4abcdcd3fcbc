"""The engines of one run, built in one place: one :class:`~kvdemo.stream.engine.StreamEngine` per contender (a policy,
its parameters and its budget) and, when asked, the full-cache baseline beside them, stopped at its byte cap.

Every front end builds its engines here: ``python -m kvdemo run``, ``compare`` and ``eval``, the app, the
lmms-eval model and the benchmarks (a single engine is a lineup of one). The budget each contender takes of the
user's ``M`` and ``C`` is :meth:`~kvdemo.cache.budget.Budget.resolve`'s (the takes-C rule lives there, once): a
policy sized by ``M`` alone ignores ``C``, ``full`` ignores both, and what is missing is a one-line message. A front
end that knows the stream's chunk size sizes every budget here (:func:`size_lineup`), before any model loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..cache.budget import Budget
from ..dialogue import DEFAULT_MAX_NEW_TOKENS
from ..errors import StreamSettingError
from ..models.base import VideoLM
from ..policies import BudgetError, Policy, make_policy
from ..pruning import PruneSpec, entry_label, parse_prune, split_entry

if TYPE_CHECKING:
    from .engine import StreamEngine

#: Engine name of the full-cache baseline (and the unbounded policy it runs).
FULL = "full"


@dataclass
class Contender:
    """One engine of a run: ``name`` (the engine's name, and the registered policy it runs unless ``policy`` is
    given), the policy's parameters, and its own ``M`` (``budget``: as typed, or an already resolved
    :class:`~kvdemo.cache.budget.Budget`) and ``C`` (``keep``); None takes the run's shared ones. ``policy``: an
    instance to run as is (its state is the engine's: give a name to get a fresh policy at each build). ``prune``:
    pruning before the LLM in front of the policy (``"evs:0.75"`` or a :class:`~kvdemo.pruning.PruneSpec`; read at
    once, so a bad one fails before any model loads); the engine is then named :attr:`label`, and a ``name`` written
    as a label (``"evs:0.75+full"``) is read back into the policy's name and its pruning."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    budget: Any = None
    keep: Any = None
    policy: Policy | None = None
    prune: PruneSpec | str | None = None

    def __post_init__(self) -> None:
        own, self.name = split_entry(self.name)
        self.prune = parse_prune(self.prune, f"{self.name}'s pruning") or own

    @property
    def label(self) -> str:
        """The engine's name: the policy's, behind its pruning when it has one (``evs:0.75+full``)."""
        return entry_label(self.prune, self.name)

    def policy_and_budget(
        self, budget: Any = None, keep: Any = None, default_ratio: float | None = None
    ) -> tuple[Policy, Budget]:
        """The policy (made from ``name`` and ``params``, or the given instance) and the budget it takes of this
        contender's ``M``/``C``, else of the shared ``budget``/``keep`` (:meth:`Budget.resolve`, with
        ``default_ratio`` for a ``C`` left out); a budget given as a :class:`Budget` is taken as it is."""
        policy = self.policy if self.policy is not None else make_policy(self.name, **self.params)
        if isinstance(self.budget, Budget):
            return policy, self.budget
        own_m = self.budget if self.budget is not None else budget
        own_c = self.keep if self.keep is not None else keep
        return policy, Budget.resolve(policy, own_m, own_c, default_ratio=default_ratio)


def contender(entry: str | Policy | Contender) -> Contender:
    """``entry`` as a :class:`Contender`: a registered name (behind a pruning choice: ``evs:0.75+full``), a policy
    instance (run as is) or a contender."""
    if isinstance(entry, Contender):
        return entry
    if isinstance(entry, Policy):
        return Contender(entry.name, policy=entry)
    return Contender(str(entry))


def lineup_budgets(
    contenders: Sequence[str | Policy | Contender],
    budget: Any = None,
    keep: Any = None,
    default_ratio: float | None = None,
    baseline: bool = False,
) -> dict[str, tuple[Policy, Budget]]:
    """Engine name -> (policy, budget) for every contender (:meth:`Contender.policy_and_budget`), with nothing loaded: the
    checks a run makes before its model, each a :class:`BudgetError` with a one-line reason (a name twice, or
    the baseline's name taken while ``baseline`` is asked for)."""
    entries = [contender(entry) for entry in contenders]
    names = [entry.label for entry in entries] + ([FULL] if baseline else [])
    for name in names:
        if names.count(name) > 1:
            raise BudgetError(
                f"each engine once: {name!r} is named twice"
                + (" (the full cache is the baseline)" if baseline and name == FULL else "")
            )
    return {entry.label: entry.policy_and_budget(budget, keep, default_ratio) for entry in entries}


def size_lineup(
    lineup: dict[str, tuple[Policy, Budget]],
    tokens: int,
    shape: str = "",
    named: bool | None = None,
    seconds: float = 0.0,
) -> dict[str, tuple[Policy, Budget]]:
    """Every budget of ``lineup`` (:func:`lineup_budgets`) sized for chunks of ``tokens`` visual tokens and ``seconds``
    of video (:meth:`Budget.sized`, ``shape`` in words); a :class:`BudgetError` names the engine it is about when
    ``named`` (default: when there are several)."""
    named = len(lineup) > 1 if named is None else named
    sized = {}
    for name, (policy, budget) in lineup.items():
        try:
            sized[name] = policy, budget.sized(policy, tokens, shape, seconds)
        except BudgetError as exc:
            if not named:
                raise
            raise BudgetError(f"{name}: {exc}") from None
    return sized


def make_engines(
    model: VideoLM,
    contenders: Sequence[str | Policy | Contender],
    budget: Any = None,
    keep: Any = None,
    *,
    fps: float,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    baseline: bool = False,
    baseline_cap_bytes: int | None = None,
    default_ratio: float | None = None,
) -> dict[str, StreamEngine]:
    """The run's engines, in order: one per contender (name -> engine, under the budget :func:`lineup_budgets`
    gives it of its own or the shared ``budget`` = M and ``keep`` = C), then, with ``baseline``, the full cache
    as :data:`FULL` (stopped by :class:`~kvdemo.stream.engine.MemoryCapError` at ``baseline_cap_bytes``; None: no cap).
    Every engine samples at ``fps`` and answers with at most ``max_new_tokens``; a contender's pruning stands in
    front of its engine (named :attr:`Contender.label`)."""
    from .engine import StreamEngine  # deferred on purpose: resolving a lineup (the CLI's checks) needs no transformers

    entries = [contender(entry) for entry in contenders]
    resolved = lineup_budgets(entries, budget, keep, default_ratio, baseline)
    engines = {
        entry.label: StreamEngine(
            model, policy, budget=bounds, fps=fps, max_new_tokens=max_new_tokens, prune=entry.prune
        )
        for entry, (policy, bounds) in zip(entries, resolved.values())
    }
    if baseline:
        engines[FULL] = StreamEngine(
            model, FULL, fps=fps, max_cache_bytes=baseline_cap_bytes, max_new_tokens=max_new_tokens
        )
    return engines


def cap_bytes(megabytes: float | None) -> int | None:
    """A baseline cap typed in MB as bytes; None for no cap (None or 0).
    :class:`~kvdemo.errors.StreamSettingError` below 0."""
    if megabytes is not None and megabytes < 0:
        raise StreamSettingError(f"the baseline memory cap must be 0 (no cap) or more MB, got {megabytes:g}")
    return int(megabytes * 2**20) if megabytes else None
