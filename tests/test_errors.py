"""One user-error base: every kind a user can cause is a ``UserError`` (a ``ValueError``) with a one-line message,
each bad input raises its own kind, and ``kvdemo.errors`` imports nothing from kvdemo."""

import ast
from pathlib import Path

import pytest

from kvdemo import errors
from kvdemo.app.sessions import RunSettings
from kvdemo.app.settings import USER_ERRORS, settings_lineup
from kvdemo.cache.budget import Budget
from kvdemo.cli import UsageError
from kvdemo.dialogue import QuestionError, check_question_text
from kvdemo.errors import (
    BudgetError,
    EvaluationSettingError,
    PolicyChoiceError,
    PolicyParameterError,
    StreamSettingError,
    UnknownPolicyError,
    UserError,
)
from kvdemo.experiments.compare import parse_overrides
from kvdemo.experiments.evaluation import evaluate
from kvdemo.media.video import VideoError, open_video
from kvdemo.models.base import ModelError
from kvdemo.policies import make_policy
from kvdemo.stream.engine import EngineError, MemoryCapError

OWNED_KINDS = (VideoError, ModelError, QuestionError, EngineError, MemoryCapError, UsageError)


def test_every_kind_is_a_user_error_and_a_value_error():
    for kind in (*errors.KINDS, *OWNED_KINDS):
        assert issubclass(kind, UserError) and issubclass(kind, ValueError), kind
    assert issubclass(UnknownPolicyError, PolicyChoiceError)
    # The budget and the policies name the errors module's class, not a copy of it.
    from kvdemo.cache.budget import BudgetError as from_budget
    from kvdemo.policies import BudgetError as from_policies

    assert from_budget is from_policies is BudgetError
    assert USER_ERRORS == (UserError,)


def test_the_errors_module_imports_nothing_from_kvdemo():
    tree = ast.parse(Path(errors.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(node) for node in imports] == ["from __future__ import annotations"]


def run_settings(**changes) -> RunSettings:
    values = dict(
        model="tiny-random",
        policy="uniform",
        params={},
        budget=96,
        keep=72,
        fps=2.0,
        max_pixels=200704,
        baseline=False,
        cap_mb=0.0,
    )
    return RunSettings(**{**values, **changes})


@pytest.mark.parametrize(
    "call, kind, message",
    [
        (lambda: Budget.resolve(make_policy("uniform"), 100, 200), BudgetError, "C must be smaller than M"),
        (lambda: Budget.resolve(make_policy("uniform"), "abc", 72), BudgetError, "M is a number of visual tokens"),
        (lambda: make_policy("nope"), UnknownPolicyError, "unknown policy 'nope'"),
        (lambda: make_policy("uniform", alpha=1), PolicyParameterError, "has no parameter(s) alpha"),
        (lambda: parse_overrides([]), PolicyChoiceError, "choose at least one policy to compare"),
        (lambda: parse_overrides(["cords", "cords"]), PolicyChoiceError, "each policy once"),
        (
            lambda: parse_overrides(["cords"], "cords: M96"),
            PolicyParameterError,
            "'M96' in cords's line is not key=value",
        ),
        (lambda: evaluate(None, []), PolicyChoiceError, "name at least one policy"),
        (lambda: evaluate(None, ["full"], episodes=0), EvaluationSettingError, "--episodes must be positive, got 0"),
        (lambda: evaluate(None, ["full"], delays=(-1.0,)), StreamSettingError, "delays must be non-negative seconds"),
        (lambda: evaluate(None, ["full"], questions="essay"), EvaluationSettingError, "unknown question form 'essay'"),
        (lambda: settings_lineup(run_settings(fps=0)), StreamSettingError, "sampling fps must be positive, got 0"),
        (lambda: settings_lineup(run_settings(max_pixels=10)), StreamSettingError, "max pixels must be at least"),
        (lambda: settings_lineup(run_settings(cap_mb=-1.0)), StreamSettingError, "the baseline memory cap must be 0"),
        (lambda: settings_lineup(run_settings(keep=None)), BudgetError, "needs a budget M and a keep size C"),
        (lambda: settings_lineup(run_settings(policy="nope")), UnknownPolicyError, "unknown policy 'nope'"),
        (lambda: check_question_text(""), QuestionError, "empty"),
        (lambda: open_video("no/such/file.mp4"), VideoError, "no such file"),
    ],
)
def test_each_bad_input_raises_its_own_kind_in_one_line(call, kind, message):
    with pytest.raises(kind) as error:
        call()
    assert message in str(error.value) and "\n" not in str(error.value)
    assert isinstance(error.value, UserError)
