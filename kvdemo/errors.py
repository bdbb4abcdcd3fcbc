"""What a user can cause: one base, :class:`UserError`, whose message is one line that the CLI prints as
``error: ...`` (exit status 2) and the app shows as is, and the specific kinds below it. Anything else raised is a
bug: a traceback in the log.

The kinds here are the settings every front end shares; the modules that own a kind of input keep theirs,
also below :class:`UserError`: :class:`kvdemo.media.video.VideoError` (a file), :class:`kvdemo.models.base.ModelError`
(a model), :class:`kvdemo.dialogue.QuestionError` (a question), :class:`kvdemo.stream.engine.EngineError` (a request the
engine cannot serve), :class:`kvdemo.cli.UsageError` (a command-line argument).

This module imports nothing from kvdemo, so every layer can raise and catch these without importing torch.
"""

from __future__ import annotations


class UserError(ValueError):
    """Input that cannot work; the message is one line that says which input and why (shown as is)."""


class BudgetError(UserError):
    """An impossible budget: ``M`` or ``C`` (their values, ``C >= M``, ``M`` below one chunk, a split ``M``
    cannot hold); the message says which numbers and why."""


class PolicyChoiceError(UserError):
    """A choice of policies that cannot work: none, too many, one twice, the full cache as a contender."""


class UnknownPolicyError(PolicyChoiceError):
    """A policy name that is not registered (the message lists the registered ones)."""


class PolicyParameterError(UserError):
    """A policy parameter the policy does not have, or a value it cannot take (the message names both)."""


class StreamSettingError(UserError):
    """A setting of the stream or of the questions over it: sampling fps, frame pixels, question delays, a
    memory cap."""


class EvaluationSettingError(UserError):
    """A setting of an evaluation run that cannot work (episodes, question form)."""


class PruningSettingError(UserError):
    """A pruning choice that cannot work: an unknown method, or a rate outside (0, 1) (the message names the field)."""


#: Every kind defined here, for the tests and the docs.
KINDS = (
    BudgetError,
    PolicyChoiceError,
    UnknownPolicyError,
    PolicyParameterError,
    StreamSettingError,
    EvaluationSettingError,
    PruningSettingError,
)
