"""The budget of one engine, resolved once: ``M`` (visual tokens held at most) and ``C`` (kept by a
compression), from a policy and the user's numbers, with the one rule that says whether chunks fit.

Who takes what: ``full`` takes neither (unbounded); a selection policy takes ``M`` and ``C`` with ``C < M``;
a policy with a summary region (:class:`~kvdemo.policies.base.SummaryRegion`, e.g. ProtoKV) takes ``M``
alone and splits it into its summary slots and a window of real tokens held exactly. :meth:`Budget.from_user` is
the one place that decides this for what a user typed; the engine, the CLI, the app, the evaluation and the
benchmarks hold the :class:`Budget` it returns (through :mod:`kvdemo.stream.lineup`) and never decide it again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..policies.base import BudgetError, Policy, SummaryRegion

#: The largest M or C accepted: token counts are int32 in the memory's provenance, and no stream reaches it
#: (a larger M would never compress: that is the ``full`` policy).
MAX_TOKENS = 2**31 - 1
#: ``C`` as a share of ``M`` where a front end lets the user leave ``C`` out (the CLI, lmms-eval, the benchmarks).
DEFAULT_KEEP_RATIO = 0.75


@dataclass(frozen=True)
class Budget:
    """``M`` and ``C`` of one engine (see the module docstring). ``M`` is None for an unbounded policy; ``C``
    is None for one sized by ``M`` alone, whose ``summary`` slots come out of ``M``."""

    M: int | None = None
    C: int | None = None
    summary: int = 0
    #: The policy's split of ``M`` in words, and its rule (``M -> summary slots``), for the messages.
    split_text: str = ""
    window_name: str = "window"
    #: The policy's split rules, ``(M, chunk tokens) -> summary slots`` and ``-> the split in words``.
    summary_of: Callable[[int, int], int] | None = field(default=None, compare=False, repr=False)
    describe_of: Callable[[int, int], str] | None = field(default=None, compare=False, repr=False)
    #: Visual tokens per chunk the split was fitted to (:meth:`fit_chunk`; 0 = not yet).
    chunk: int = 0

    # --- resolving ------------------------------------------------------------------------
    @classmethod
    def from_user(
        cls, policy: Policy | type[Policy], budget: Any = None, keep: Any = None, default_ratio: float | None = None
    ) -> "Budget":
        """The budget ``policy`` (a class or an instance: an instance's parameters may change how ``M`` splits)
        takes of the ``M`` (``budget``) and ``C`` (``keep``) a user typed: the takes-C rule, decided here and
        nowhere else. ``full`` ignores both; a policy sized by ``M`` alone ignores ``C``; a policy that takes
        ``C`` and got none gets ``C = default_ratio * M`` when a ratio is given. Blank (None or "") is missing;
        what is missing, or a number that cannot work, is a :class:`BudgetError` with a one-line reason."""
        policy_cls = policy if isinstance(policy, type) else type(policy)
        if not policy_cls.bounded:
            return cls()
        takes_keep = policy_cls.takes_keep()
        budget, keep = _blank_is_none(budget), (_blank_is_none(keep) if takes_keep else None)
        if takes_keep and keep is None and budget is not None and default_ratio is not None:
            keep = int(token_count("M", budget) * default_ratio)
        if budget is None or (takes_keep and keep is None):
            needed = "a budget M" if not takes_keep or default_ratio is not None else "a budget M and a keep size C"
            defaulted = f"; C defaults to {default_ratio:g} M" if takes_keep and default_ratio is not None else ""
            raise BudgetError(f"policy {policy_cls.name!r} needs {needed} (visual tokens{defaulted})")
        M = token_count("M", budget)
        if not takes_keep:
            splitter = policy if isinstance(policy, SummaryRegion) else policy_cls()
            summary = splitter.summary_slots(M)  # raises if M cannot be split as the policy needs
            return cls(
                M,
                None,
                summary,
                splitter.describe_split(M),
                splitter.window_name,
                splitter.summary_slots,
                splitter.describe_split,
            )
        C = token_count("C", keep)
        if C >= M:
            raise BudgetError(f"C must be smaller than M (a compression keeps C of the M tokens), got M={M}, C={C}")
        return cls(M, C)

    @classmethod
    def resolve(cls, policy: Policy | type[Policy], budget: Any = None, keep: Any = None) -> "Budget":
        """The library's exact form of :meth:`from_user` (e.g. ``StreamEngine(model, policy, budget=M, keep=C)``):
        the same rule, except that a ``C`` given to a policy sized by ``M`` alone is a :class:`BudgetError` (a
        program that passes one means something the policy does not do)."""
        policy_cls = policy if isinstance(policy, type) else type(policy)
        if policy_cls.bounded and not policy_cls.takes_keep() and _blank_is_none(keep) is not None:
            raise BudgetError(f"policy {policy_cls.name!r} is sized by M alone; C does not apply (leave it out)")
        return cls.from_user(policy, budget, keep)

    @classmethod
    def auto(
        cls, policy: Policy | type[Policy], chunk_tokens: int, stream_tokens: int, ratio: float = DEFAULT_KEEP_RATIO
    ) -> "Budget":
        """A budget that makes compression visible on a stream of ``stream_tokens`` visual tokens: ``M`` a third
        of them (at most 6144, InfiniPot-V's budget), at least ``chunk_tokens / (1 - ratio)`` so that ``M - C``
        takes a chunk, and ``C = ratio * M`` for a policy that takes one."""
        floor_m = int(math.ceil(chunk_tokens / (1 - ratio)))
        return cls.from_user(policy, max(floor_m, min(6144, stream_tokens // 3)), None, default_ratio=ratio)

    # --- what it says -------------------------------------------------------------------------
    @property
    def bounded(self) -> bool:
        return self.M is not None

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

    def check_chunk(self, tokens: int, shape: str = "") -> None:
        """Raise :class:`BudgetError` if chunks of ``tokens`` visual tokens can never fit: ``M`` below one chunk,
        ``M - C`` too small to take one after a compression, or a window smaller than one chunk. ``shape``
        describes the chunk (e.g. "1 temporal grid(s) of 9x15 tokens")."""
        if self.M is None:
            return
        if self.C is None and self.summary_of is not None and self.summary_of(self.M, tokens) != self.summary:
            self.fit_chunk(tokens, shape)  # the policy's own rule for chunks of this size (raises if M is too small)
            return
        shape = f" = {shape}" if shape else ""
        if self.C is None:
            if tokens > self.window:
                raise BudgetError(
                    f"the {self.window_name} W={self.window} (M={self.M}: {self.split_text}) is smaller than one chunk "
                    f"({tokens} visual tokens{shape}); raise M to at least {self.smallest_fitting(tokens)}"
                )
            return
        if tokens > self.M:
            raise BudgetError(
                f"M={self.M} is smaller than one chunk ({tokens} visual tokens{shape}); "
                "raise M, or lower max pixels / frames per chunk"
            )
        if self.M - self.C < tokens:
            raise BudgetError(
                f"M - C = {self.M - self.C} leaves no room for one chunk ({tokens} visual tokens{shape}); "
                f"lower C to at most {self.M - tokens} or raise M"
            )

    def fit_chunk(self, tokens: int, shape: str = "") -> "Budget":
        """This budget re-split for chunks of ``tokens`` visual tokens (a policy sized by ``M`` alone may need the
        chunk size, e.g. ProtoKV's near window holds the newest chunk while the next comes in), checked as
        :meth:`check_chunk` checks; itself for any other policy. :class:`BudgetError` where ``M`` cannot hold both."""
        if self.C is not None or self.summary_of is None:
            self.check_chunk(tokens, shape)
            return self
        fitted = replace(
            self,
            summary=self.summary_of(self.M, tokens),
            split_text=self.describe_of(self.M, tokens) if self.describe_of else self.split_text,
            chunk=tokens,
        )
        fitted.check_chunk(tokens, shape)
        return fitted

    def smallest_fitting(self, tokens: int) -> int:
        """The smallest ``M`` whose window holds ``tokens`` (a policy sized by ``M`` alone)."""
        candidate = max(tokens, 1)
        while True:
            try:
                if candidate - self.summary_of(candidate, tokens) >= tokens:
                    return candidate
            except BudgetError:
                pass
            candidate += 1

    def describe(self) -> str:
        """``M=96, C=72``, ``M=96`` (sized by M alone) or ``unbounded``."""
        if self.M is None:
            return "unbounded"
        return f"M={self.M}" + (f", C={self.C}" if self.C is not None else "")


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
