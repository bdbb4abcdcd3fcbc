"""The dialogue a question is asked in: how long a question may be, and which earlier turns are replayed (as text,
after the video memory) before it. Both are bounded in tokens, so a long chat neither grows without bound nor
spoils later answers: past :data:`MAX_DIALOGUE_TOKENS` the oldest turns are left out of the replay (the engine's
answer says how many; the chat keeps them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    import torch

#: The longest question, and the most tokens of earlier turns replayed before a question (a model may hold a
#: smaller bound: ``model.max_dialogue_tokens``).
MAX_QUESTION_TOKENS = 512
MAX_DIALOGUE_TOKENS = 1024
#: The longest question in characters, checked before any tokenizer or model loads (the CLI checks its questions
#: before loading the model). kvdemo's choice: 8 characters a token, more than the tokenizers of the supported
#: families average on text (about 4) and the byte tokenizer's 1, so no question within the token limit is refused.
MAX_QUESTION_CHARS = 8 * MAX_QUESTION_TOKENS
#: The longest answer, in new tokens, unless a caller says otherwise.
DEFAULT_MAX_NEW_TOKENS = 64


class QuestionError(UserError):
    """A question that cannot be asked (the message says why)."""


#: The most characters of one piece of the user's input an error message or a printed report repeats.
ECHO_LIMIT = 80


def clipped(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text``'s first line, cut to ``limit`` characters with the total length said: how a user's input is
    repeated back (a 100,000-character question is not printed back whole)."""
    lines = text.splitlines()
    if len(lines) <= 1 and len(text) <= limit:
        return text
    return f"{(lines[0] if lines else '')[:limit]}... ({len(text)} characters)"


def check_question_text(question: str) -> str:
    """``question`` stripped, or :class:`QuestionError`: empty, or longer than :data:`MAX_QUESTION_CHARS` (no
    tokenizer needed)."""
    question = (question or "").strip()
    if not question:
        raise QuestionError("the question is empty")
    if len(question) > MAX_QUESTION_CHARS:
        raise QuestionError(
            f"the question is {len(question)} characters long; at most {MAX_QUESTION_CHARS} (shorten it)"
        )
    return question


def check_question(model, question: str) -> str:
    """``question`` stripped, or :class:`QuestionError`: empty, or longer than :data:`MAX_QUESTION_TOKENS`."""
    question = (question or "").strip()
    if not question:
        raise QuestionError("the question is empty")
    tokens = len(model.tokenize(question))
    if tokens > MAX_QUESTION_TOKENS:
        raise QuestionError(f"the question is {tokens} tokens long; at most {MAX_QUESTION_TOKENS} (shorten it)")
    return question


def replayed_dialogue(model, history: list[tuple[str, str]], question: str) -> tuple[torch.Tensor, int]:
    """The prompt's embeddings ``[n, d]`` for ``question`` after the newest turns of ``history`` that fit in
    ``model.max_dialogue_tokens`` (:data:`MAX_DIALOGUE_TOKENS` unless the model says less), and how many older turns
    were left out."""
    alone = int(model.question_embeds([], question).shape[0])
    dropped, embeds = 0, model.question_embeds(history, question)
    while int(embeds.shape[0]) - alone > model.max_dialogue_tokens:  # ends: with every turn left out the excess is 0
        dropped += 1
        embeds = model.question_embeds(history[dropped:], question)
    return embeds, dropped
