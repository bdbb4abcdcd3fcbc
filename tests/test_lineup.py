"""The takes-C rule (kvdemo.cache.budget.Budget.resolve, the one place that decides what a policy takes of the user's M
and C) and the one engine factory (kvdemo.stream.lineup). Expected budgets are worked by hand: a selection policy keeps
the C it was given (or 3/4 of M when C is left out and the ratio is 0.75); ProtoKV at M = 540 splits into a near
window of 140 and 50 prototypes x 8 pseudo-tokens = 400 summary slots (its Table 5 ratio, tests/test_protokv.py),
at M = 64 into 16 and 6 x 8 = 48."""

from __future__ import annotations

import re

import pytest

from kvdemo.cache.budget import Budget
from kvdemo.errors import StreamSettingError
from kvdemo.policies import BudgetError, make_policy
from kvdemo.stream.lineup import FULL, Contender, cap_bytes, lineup_budgets, make_engines

NEEDS_M_AND_C = "policy 'uniform' needs a budget M and a keep size C (visual tokens)"
NEEDS_M = "policy 'protokv' needs a budget M (visual tokens)"

# policy, M, C, default ratio -> (M, C, summary slots) or the one-line message
TABLE = [
    ("uniform", 96, 72, None, (96, 72, 0)),
    ("uniform", "96", "72", None, (96, 72, 0)),  # as a form or a command line types them
    ("uniform", 96, None, None, NEEDS_M_AND_C),
    ("uniform", None, 72, None, NEEDS_M_AND_C),
    ("uniform", " ", "", None, NEEDS_M_AND_C),  # blank fields are missing, not "not a number"
    (
        "uniform",
        96,
        96,
        None,
        "C=96 is not smaller than M=96: C must be smaller than M (a compression keeps C of the M tokens); lower C to at "
        "most 95 or raise M to at least 97",
    ),
    ("uniform", 96, 0, None, "M and C must be positive, got C=0"),
    ("uniform", 96, None, 0.75, (96, 72, 0)),
    ("uniform", 100, None, 0.75, (100, 75, 0)),
    ("uniform", 96, 50, 0.75, (96, 50, 0)),  # a C given wins over the ratio
    ("uniform", None, None, 0.75, "policy 'uniform' needs a budget M (visual tokens; C defaults to 0.75 M)"),
    ("protokv", 540, None, None, (540, None, 400)),
    ("protokv", 540, 405, None, (540, None, 400)),  # C ignored: sized by M alone
    ("protokv", 540, "not a number", 0.75, (540, None, 400)),  # ignored, so never read
    ("protokv", 64, None, 0.75, (64, None, 48)),
    ("protokv", None, 405, None, NEEDS_M),
    ("protokv", None, None, 0.75, NEEDS_M),
    ("full", None, None, None, (None, None, 0)),
    ("full", 96, 72, None, (None, None, 0)),  # the full cache takes neither
]


@pytest.mark.parametrize("name, M, C, ratio, expected", TABLE)
def test_what_each_policy_takes_of_the_users_m_and_c(name, M, C, ratio, expected):
    for policy in (make_policy(name), type(make_policy(name))):  # an instance or its class
        if isinstance(expected, str):
            with pytest.raises(BudgetError) as error:
                Budget.resolve(policy, M, C, default_ratio=ratio)
            assert str(error.value) == expected
        else:
            budget = Budget.resolve(policy, M, C, default_ratio=ratio)
            assert (budget.M, budget.C, budget.summary) == expected


def test_the_librarys_exact_form_refuses_a_c_the_policy_does_not_take():
    with pytest.raises(BudgetError) as error:
        Budget.resolve(make_policy("protokv"), 540, 405, exact=True)
    assert str(error.value) == "policy 'protokv' is sized by M alone; C does not apply (leave it out)"
    assert Budget.resolve(make_policy("protokv"), 540, exact=True) == Budget.resolve(make_policy("protokv"), 540, 405)
    assert (Budget.resolve(make_policy("uniform"), 96, 72).M, Budget.resolve(make_policy("uniform"), 96, 72).C) == (
        96,
        72,
    )
    assert Budget.resolve(make_policy("full"), None, None) == Budget() == Budget.resolve(make_policy("full"), 96, 72)


def test_a_policy_instance_splits_m_with_its_own_parameters():
    # 4 pseudo-tokens per prototype: M = 6144 -> near window 1536 + 1152 prototypes x 4 (tests/test_protokv.py)
    assert Budget.resolve(make_policy("protokv", pseudo_tokens=4), 6144).summary == 4608
    assert Budget.resolve(make_policy("protokv", pseudo_tokens=4), 6144).window == 1536


def test_a_lineup_takes_each_contenders_own_m_and_c_else_the_shared_ones():
    resolved = lineup_budgets(
        [
            Contender("uniform"),
            Contender("hybridkv", {"share": 0.5}, 480, 360),
            "protokv",
            make_policy("cords", beta=0.5),
        ],
        96,
        72,
    )
    assert list(resolved) == ["uniform", "hybridkv", "protokv", "cords"]
    assert [(b.M, b.C) for _, b in resolved.values()] == [(96, 72), (480, 360), (96, None), (96, 72)]
    assert resolved["hybridkv"][0].share == 0.5 and resolved["cords"][0].beta == 0.5
    given = Budget.resolve(make_policy("uniform"), 200, 100)
    assert lineup_budgets([Contender("uniform", budget=given)], 96, 72)["uniform"][1] is given  # resolved: as is


@pytest.mark.parametrize(
    "contenders, baseline, message",
    [
        (["uniform", "uniform"], False, "each engine once: 'uniform' is named twice"),
        (["full"], True, "each engine once: 'full' is named twice (the full cache is the baseline)"),
        ([Contender("cords", budget=96)], False, "policy 'cords' needs a budget M and a keep size C (visual tokens)"),
    ],
)
def test_a_lineup_that_cannot_run_is_one_line(contenders, baseline, message):
    with pytest.raises(BudgetError) as error:
        lineup_budgets(contenders, baseline=baseline)
    assert str(error.value) == message


def test_make_engines_builds_the_contenders_then_the_capped_baseline(tiny_random):
    engines = make_engines(
        tiny_random,
        ["uniform", Contender("protokv", budget=64)],
        96,
        72,
        fps=4.0,
        max_new_tokens=5,
        baseline=True,
        baseline_cap_bytes=3 * 2**20,
    )
    assert list(engines) == ["uniform", "protokv", FULL]
    assert [(e.budget.M, e.budget.C) for e in engines.values()] == [(96, 72), (64, None), (None, None)]
    assert [e.policy.name for e in engines.values()] == ["uniform", "protokv", "full"]
    assert all(e.fps == 4.0 and e.max_new_tokens == 5 for e in engines.values())
    assert [e.max_cache_bytes for e in engines.values()] == [None, None, 3 * 2**20]
    assert engines["protokv"].memory.summary_slots == 48  # the memory sized by the resolved budget


def test_each_build_gets_fresh_policies_unless_given_an_instance(tiny_random):
    first, second = (make_engines(tiny_random, ["protokv"], 64, fps=2.0)["protokv"] for _ in range(2))
    assert first.policy is not second.policy  # a name: a fresh policy (its state is the engine's)
    mine = make_policy("protokv", warmup=16)
    assert make_engines(tiny_random, [mine], 64, fps=2.0)["protokv"].policy is mine
    assert list(make_engines(tiny_random, ["full"], fps=2.0)) == ["full"]  # the full cache as a contender of its own


@pytest.mark.parametrize("megabytes, expected", [(None, None), (0, None), (1, 2**20), (2.5, 5 * 2**19)])
def test_the_baseline_cap_in_megabytes(megabytes, expected):
    assert cap_bytes(megabytes) == expected


def test_a_negative_cap_is_one_line():
    with pytest.raises(StreamSettingError) as error:
        cap_bytes(-1)
    assert str(error.value) == "the baseline memory cap must be 0 (no cap) or more MB, got -1"


def advised(message: str) -> list[tuple[str, int]]:
    """The values a budget message advises: ``("C", n)`` for "lower C to at most n", ``("M", n)`` for "raise M to at
    least n"."""
    found = [("C", int(n)) for n in re.findall(r"lower C to at most (\d+)", message)]
    return found + [("M", int(n)) for n in re.findall(r"raise M to at least (\d+)", message)]


@pytest.mark.parametrize("name", ["uniform", "infinipot-v", "protokv"])
def test_every_budget_message_advises_values_that_are_accepted(name):
    """Fed back, each value a refusal advises is accepted (the other number kept as typed): for every M and C up to
    a few chunks, chunks of 1, 16 and 135 tokens (the random tiny model's grid on the real clip)."""
    policy = make_policy(name)
    refused = 0
    for tokens in (1, 16, 135):
        for M in sorted({1, 2, 8, 16, 24, 39, 40, 64, tokens - 1, tokens, tokens + 1, 2 * tokens, 3 * tokens} - {0}):
            for C in sorted({1, M // 2, M - 1, M, M + 3} - {0}) if type(policy).takes_keep() else [None]:

                def steps(m: int, c: int | None, sizing: bool) -> None:  # resolve, then (when sizing) size
                    budget = Budget.resolve(policy, m, c)
                    if sizing:
                        budget.sized(policy, tokens)

                for sizing in (False, True):  # the step that refuses is the step the advice is fed back to
                    try:
                        steps(M, C, sizing)
                        continue
                    except BudgetError as error:
                        message = str(error)
                    refused += 1
                    advice = advised(message)
                    assert advice, f"M={M}, C={C}, chunk {tokens}: no advice in {message!r}"
                    for field, value in advice:
                        steps(*((value, C) if field == "M" else (M, value)), sizing)  # raises if refused
                    break
    assert refused > 5  # the grid reaches the refusals it is about
