"""How ProtoKV splits its budget ``M`` (paper 003, Sec. 3, Table 5): a near window of ``W`` exact tokens and
``K_max`` prototypes of ``S`` pseudo-tokens each, ``W : K_max S = near_share : 1 - near_share`` (the paper's 1 : 3),
with kvdemo's rule that the near window holds two chunks (see :mod:`.policy`)."""

from __future__ import annotations

from ...errors import BudgetError

#: The near window holds at least this many chunks (kvdemo's rule, see :mod:`.policy`): the newest chunk, still
#: exact while the next one is prefilled.
NEAR_CHUNKS = 2


def near_and_bank(budget: int, chunk: int, near_share: float, pseudo_tokens: int) -> tuple[int, int]:
    """``(W, K_max)`` for budget ``M`` and chunks of ``chunk`` visual tokens (0 = not known yet): the paper's
    ``K_max = floor((1 - near_share) M / S)``, lowered until the near window holds two chunks
    (:data:`NEAR_CHUNKS`: the newest chunk stays exact while the next one comes in); ``W = M - K_max S``.
    :class:`~kvdemo.errors.BudgetError` (one line, naming the smallest ``M`` that works) when ``M`` cannot hold
    both."""
    near_min = NEAR_CHUNKS * int(chunk)
    prototypes = min(int((1.0 - near_share) * budget), budget - near_min) // pseudo_tokens
    near = budget - prototypes * pseudo_tokens
    if prototypes < 1 or near < max(1, near_min):
        if near_min:
            raise BudgetError(
                f"M={budget} cannot hold ProtoKV's near window of {near_min} tokens (the newest chunk of {chunk} "
                f"stays exact while the next comes in) and one prototype of S={pseudo_tokens} pseudo-tokens; "
                f"raise M to at least {smallest_budget(near_min, near_share, pseudo_tokens)}"
            )
        raise BudgetError(
            f"M={budget} is too small for ProtoKV: it needs room for a near window and at least one prototype "
            f"of S={pseudo_tokens} pseudo-tokens; raise M to at least {smallest_budget(1, near_share, pseudo_tokens)}"
        )
    return near, prototypes


def smallest_budget(near_min: int, near_share: float, pseudo_tokens: int) -> int:
    """The smallest ``M`` that holds a near window of ``near_min`` tokens and one prototype."""
    budget = near_min + pseudo_tokens
    while int((1.0 - near_share) * budget) < pseudo_tokens:
        budget += 1
    return budget
