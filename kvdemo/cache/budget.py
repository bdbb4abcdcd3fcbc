"""The budget of one engine: ``M`` (visual tokens held at most) and ``C`` (kept by a compression), a value
resolved once where the user's input enters, sized to the stream's chunks once, then only read.

Two steps, each in one place:

1. :meth:`Budget.resolve`: the user's numbers for a policy (the takes-C rule: ``full`` takes neither, a selection
   policy takes ``M`` and ``C < M``, a policy with a summary region (:class:`~kvdemo.policies.contract.SummaryRegion`,
   e.g. ProtoKV) takes ``M`` alone and splits it into summary slots and a window of real tokens). The CLI, the app,
   the library's :class:`~kvdemo.stream.engine.StreamEngine` and the lmms-eval model call it where the numbers
   arrive, before any model loads.
2. :meth:`Budget.sized`: the budget for chunks of a given number of visual tokens (a summary policy's split may need
   the chunk size), with the check that such chunks fit; every message advises values that are accepted. The front
   ends size it as soon as they know a chunk's size (before the model loads); an engine given an unsized budget sizes
   it at its first chunk, once.

The engine, the memory and the policies read the sized budget; nobody fits it again. Each later chunk is only
checked against it (:meth:`Budget.check_chunk`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..errors import BudgetError
from ..policies.contract import Policy, SummaryRegion

#: The largest M or C accepted: token counts are int32 in the memory's provenance, and no stream reaches it
#: (a larger M would never compress: that is the ``full`` policy).
MAX_TOKENS = 2**31 - 1
#: ``C`` as a share of ``M`` where a front end lets the user leave ``C`` out (the CLI, lmms-eval, the benchmarks).
DEFAULT_KEEP_RATIO = 0.75
#: The largest ``M`` :func:`auto_budget` picks (InfiniPot-V's budget).
AUTO_MAX = 6144


@dataclass(frozen=True)
class Budget:
    """``M`` and ``C`` of one engine (see the module docstring). ``M`` is None for an unbounded policy; ``C`` is None
    for one sized by ``M`` alone, whose ``summary`` slots come out of ``M``. ``chunk``: the visual tokens per chunk
    it was sized for (0: not sized yet); ``split_text`` and ``window_name`` say the split in words, for messages."""

    M: int | None = None
    C: int | None = None
    summary: int = 0
    chunk: int = 0
    split_text: str = ""
    window_name: str = "window"

    # --- the two steps ------------------------------------------------------------------------
    @classmethod
    def resolve(
        cls,
        policy: Policy | type[Policy],
        budget: Any = None,
        keep: Any = None,
        *,
        default_ratio: float | None = None,
        exact: bool = False,
    ) -> Budget:
        """The budget ``policy`` (a class, or an instance whose parameters may change how ``M`` splits) takes of the
        ``M`` (``budget``) and ``C`` (``keep``) a user typed. Blank (None or "") is missing. A policy that takes
        ``C`` and got none gets ``C = default_ratio * M`` when a ratio is given; a policy sized by ``M`` alone
        ignores ``C``, unless ``exact`` (the library: a program that passes one means something the policy does not
        do). What is missing, or a number that cannot work, is a :class:`BudgetError` with a one-line reason."""
        policy_cls = policy if isinstance(policy, type) else type(policy)
        if not policy_cls.bounded:
            return cls()
        takes_keep = policy_cls.takes_keep()
        if exact and not takes_keep and _blank_is_none(keep) is not None:
            raise BudgetError(f"policy {policy_cls.name!r} is sized by M alone; C does not apply (leave it out)")
        budget, keep = _blank_is_none(budget), (_blank_is_none(keep) if takes_keep else None)
        if takes_keep and keep is None and budget is not None and default_ratio is not None:
            keep = int(token_count("M", budget) * default_ratio)
        if budget is None or (takes_keep and keep is None):
            needed = "a budget M" if not takes_keep or default_ratio is not None else "a budget M and a keep size C"
            defaulted = f"; C defaults to {default_ratio:g} M" if takes_keep and default_ratio is not None else ""
            raise BudgetError(f"policy {policy_cls.name!r} needs {needed} (visual tokens{defaulted})")
        M = token_count("M", budget)
        if not takes_keep:
            region = _region(policy)
            return cls(M, None, region.summary_slots(M), 0, region.describe_split(M), region.window_name)
        C = token_count("C", keep)
        if C >= M:
            lower = f"lower C to at most {M - 1} or " if M > 1 else ""
            raise BudgetError(
                f"C={C} is not smaller than M={M}: C must be smaller than M (a compression keeps C of the M tokens); "
                f"{lower}raise M to at least {C + 1}"
            )
        return cls(M, C)

    def sized(self, policy: Policy | type[Policy], tokens: int, shape: str = "", seconds: float = 0.0) -> Budget:
        """This budget for chunks of ``tokens`` visual tokens (``shape`` says them in words, e.g. "1 temporal grid(s)
        of 9x15 tokens"): a summary policy's split for that chunk size (ProtoKV's near window holds the newest chunk
        while the next comes in), checked as :meth:`check_chunk` checks. Itself when already sized for ``tokens``.
        ``seconds``: how much video one chunk holds, when the caller knows it: the policy checks its own windows
        against it (:meth:`~kvdemo.policies.contract.Policy.check_stream`)."""
        if seconds > 0:
            (policy if isinstance(policy, Policy) else policy()).check_stream(seconds)
        if self.M is None or self.chunk == tokens:
            return self
        if self.C is None:
            region = _region(policy)
            summary = region.summary_slots(self.M, tokens)  # the policy's own one-line reason where M cannot split
            fitted = replace(self, summary=summary, split_text=region.describe_split(self.M, tokens), chunk=tokens)
            if fitted.window < tokens:
                raise BudgetError(fitted._window_message(tokens, shape, smallest_fitting(region, tokens)))
            return fitted
        self.check_chunk(policy, tokens, shape)
        return replace(self, chunk=tokens)

    # --- what it says -------------------------------------------------------------------------
    @property
    def bounded(self) -> bool:
        return self.M is not None

    @property
    def is_sized(self) -> bool:
        """Whether chunks have sized it (an unbounded budget needs no sizing)."""
        return self.M is None or self.chunk > 0

    @property
    def window(self) -> int | None:
        """Real visual tokens held at most: ``M`` less the summary slots."""
        return None if self.M is None else self.M - self.summary

    def keep_for(self, incoming: int) -> int:
        """Real visual tokens a compression keeps when ``incoming`` tokens are about to arrive: ``C``, or for a
        policy sized by ``M`` alone the newest ``window - incoming`` (Alg. 1 of ProtoKV: evict while the
        near window would exceed ``W``)."""
        if self.C is not None:
            return self.C
        return max(0, self.window - incoming)

    def check_chunk(self, policy: Policy | type[Policy], tokens: int, shape: str = "") -> None:
        """Raise :class:`BudgetError` if a chunk of ``tokens`` visual tokens cannot fit this budget as sized for
        ``policy``: ``M`` below one chunk, ``M - C`` too small to take one after a compression, or a window smaller
        than one chunk. Each message advises values that are accepted for such chunks."""
        if self.M is None:
            return
        (policy if isinstance(policy, Policy) else policy()).check_window(self.C, tokens)
        said = f" = {shape}" if shape else ""
        if self.C is None:
            if tokens > self.window:
                raise BudgetError(self._window_message(tokens, shape, smallest_fitting(_region(policy), tokens)))
            return
        if tokens > self.M or self.M - self.C < tokens:
            smallest = self.C + tokens  # M - C must take a chunk, and then M takes one too
            lower = f"lower C to at most {self.M - tokens} or " if self.M - tokens >= 1 else ""
            what = (
                f"M={self.M} is smaller than one chunk ({tokens} visual tokens{said})"
                if tokens > self.M
                else f"M - C = {self.M - self.C} leaves no room for one chunk ({tokens} visual tokens{said})"
            )
            raise BudgetError(f"{what}; {lower}raise M to at least {smallest} (or lower max pixels / frames per chunk)")

    def _window_message(self, tokens: int, shape: str, smallest: int) -> str:
        said = f" = {shape}" if shape else ""
        return (
            f"the {self.window_name} W={self.window} (M={self.M}: {self.split_text}) is smaller than one chunk "
            f"({tokens} visual tokens{said}); raise M to at least {smallest}"
        )

    def describe(self) -> str:
        """``M=96, C=72``, ``M=96`` (sized by M alone) or ``unbounded``."""
        if self.M is None:
            return "unbounded"
        return f"M={self.M}" + (f", C={self.C}" if self.C is not None else "")


def auto_budget(
    policy: Policy | type[Policy], chunk_tokens: int, stream_tokens: int, ratio: float = DEFAULT_KEEP_RATIO
) -> Budget:
    """A budget that makes compression visible on a stream of ``stream_tokens`` visual tokens, sized for chunks of
    ``chunk_tokens``: ``M`` a third of the stream (at most :data:`AUTO_MAX`), at least ``chunk_tokens / (1 - ratio)``
    so that ``M - C`` takes a chunk, and ``C = ratio * M`` for a policy that takes one; a policy sized by ``M`` alone
    gets at least the smallest ``M`` whose window holds a chunk."""
    floor_m = int(math.ceil(chunk_tokens / (1 - ratio)))
    M = max(floor_m, min(AUTO_MAX, stream_tokens // 3))
    policy_cls = policy if isinstance(policy, type) else type(policy)
    if policy_cls.bounded and not policy_cls.takes_keep():
        M = max(M, smallest_fitting(_region(policy), chunk_tokens))
    return Budget.resolve(policy, M, None, default_ratio=ratio).sized(policy, chunk_tokens)


def smallest_fitting(region: SummaryRegion, tokens: int) -> int:
    """The smallest ``M`` whose window holds chunks of ``tokens`` under ``region``'s split (a policy sized by ``M``
    alone)."""
    candidate = max(tokens, 1)
    while True:
        try:
            if candidate - region.summary_slots(candidate, tokens) >= tokens:
                return candidate
        except BudgetError:
            pass
        candidate += 1


def _region(policy: Policy | type[Policy]) -> SummaryRegion:
    """The summary policy whose split rule sizes ``M`` (an instance's own parameters, or the class's defaults)."""
    return policy if isinstance(policy, SummaryRegion) else policy()


def _blank_is_none(value: Any) -> Any:
    """None for a field left blank (None, or a string of spaces), else ``value`` as given."""
    return None if value is None or (isinstance(value, str) and not value.strip()) else value


def token_count(name: str, value: Any) -> int:
    """``value`` as a positive whole number of tokens no larger than :data:`MAX_TOKENS`."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BudgetError(f"{name} is a number of visual tokens, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise BudgetError(f"{name} is a number of visual tokens, got {value!r}")
    if number != int(number):
        raise BudgetError(f"M and C are token counts (whole numbers), got {name}={number:g}")
    if number <= 0:
        raise BudgetError(f"M and C must be positive, got {name}={number:g}")
    if number > MAX_TOKENS:
        # The advice names what every front end offers (the app has no "full" policy to pick: its full cache is the
        # baseline beside the policy): an M the stream never reaches keeps every token and costs what the stream holds.
        raise BudgetError(
            f"{name}={number:g} is more visual tokens than any stream holds (at most {MAX_TOKENS:,}); "
            "to keep every token, set M above the stream's visual tokens (e.g. M=1000000): it never "
            "compresses"
        )
    return int(number)
