"""What ``python -m kvdemo bench`` measures about one policy beyond its compression pass: the bench's plan for it,
filled from what the policy declares in its card (:class:`kvdemo.policies.registry.BenchDeclaration`, data beside
the class; the class itself holds no bench facts). The runners are the bench's own (:data:`.policies.BENCHMARKS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..policies import Policy, policy_card


@dataclass(frozen=True)
class BenchPlan:
    """benchmarks: names of the policy benchmarks to run (``update``, ``decode``: :data:`.policies.BENCHMARKS`).
    variants: label -> the policy with a declared parameter change, its pass timed beside the policy's own.
    refresh_all: ``refresh_all(policy, rotary, heads)`` recomputes every summary entry at once (None: the policy
    owns no summary region, or declares no such cost). host_reads, launches: the targets of its pass's count
    (:mod:`.counts`)."""

    benchmarks: tuple[str, ...]
    variants: dict[str, Policy]
    refresh_all: Callable[[Policy, Any, int], None] | None
    host_reads: int = 8
    launches: int | None = None


def bench_plan(policy: Policy) -> BenchPlan:
    """The bench's plan for ``policy`` (an instance: its variants start from its own parameters)."""
    declared = policy_card(policy.name).bench
    variants = {label: dataclasses.replace(policy, **change) for label, change in declared.variants.items()}
    return BenchPlan(tuple(declared.benchmarks), variants, declared.refresh_all, declared.host_reads, declared.launches)
