"""Grading an answer about a generated stream against what the generator drew (:class:`~kvdemo.world.scene.Episode`).

The generator knows every object it showed, so more than its own questions can be graded:

- a question of the streams' forms about a shown object: right or wrong against its colour (or the first shape);
- the same question about an object shown later than it was asked: says when its evidence appears;
- a colour question about a shape the stream never showed ("What colour was the square?"): wrong, whatever colour
  is answered, and the note says which shapes it did show;
- a follow-up that names only a shape after a colour question ("And the diamond?"): the same colour question about
  that shape, graded as such;
- anything else: no ground truth.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .scene import COLOUR_QUESTION, DECOY_SHAPES, SHAPES, Episode, Question, normalise_question

#: Shapes a colour question may name: the questions' vocabulary and the moving kind's decoys (no question of the
#: generator names a decoy, but it knows each one's colour).
NAMED_SHAPES = SHAPES + DECOY_SHAPES
#: A colour question once normalised (:func:`~kvdemo.world.scene.normalise_question`), e.g. "what colour was the star".
_COLOUR_FORM = re.compile(r"^what colour (?:was|is) the ([a-z]+)$")


@dataclass(frozen=True)
class Grade:
    """How an answer compares with a generated stream's ground truth (``correct`` is None when there is
    nothing to compare with); ``note`` says it in a few words for the chat."""

    expected: str | None
    correct: bool | None
    note: str


def colour_subject(question: str) -> str | None:
    """The shape a colour question asks about ("What colour was the star?" -> "star"), else None."""
    found = _COLOUR_FORM.match(normalise_question(question))
    return found.group(1) if found else None


def asked_question(question: str, earlier: Sequence[str] = ()) -> str:
    """``question`` as a question of the streams' forms: a follow-up that names one shape and nothing that is a
    question of its own ("And the diamond?") after a colour question in ``earlier`` (the dialogue's questions so far,
    oldest first) asks that colour question about its shape; any other question is as it was asked."""
    previous = None
    for before in earlier:
        previous = _followed(before, previous)
    return _followed(question, previous)


def _followed(question: str, previous: str | None) -> str:
    """``question`` after ``previous`` (already resolved; None at the start of a dialogue)."""
    if previous is None or colour_subject(question) is not None or colour_subject(previous) is None:
        return question
    named = [word for word in normalise_question(question).split() if word in NAMED_SHAPES]
    return COLOUR_QUESTION.format(shape=named[0]) if len(named) == 1 else question


def grade(episode: Episode, question: str, answer: str, time_s: float, earlier: Sequence[str] = ()) -> Grade:
    """Compare ``answer`` to ``question`` asked at stream time ``time_s`` (after the dialogue's ``earlier``
    questions, oldest first) with what ``episode`` showed (see the module docstring)."""
    asked = asked_question(question, earlier)
    known = episode.answer_for(asked)
    subject = colour_subject(asked)
    if known is None and subject in NAMED_SHAPES:
        shown = [item for item in episode.objects + episode.decoys if item.shape == subject]
        if not shown:
            listed = ", ".join(item.shape for item in sorted(episode.objects, key=lambda item: item.first_frame))
            return Grade(
                None, False, f"✗ no {subject} was shown in this stream (it showed {listed}), so no colour is right"
            )
        colours = sorted({item.colour for item in shown})
        if len(colours) > 1:
            return Grade(None, None, f"no single answer: the stream showed a {' and a '.join(colours)} {subject}")
        seconds = 1.0 / episode.video.fps
        shown_s = min(item.first_frame for item in shown) * seconds
        known = Question(
            "colour", asked, colours[0], subject, shown_s, (max(i.last_frame for i in shown) + 1) * seconds
        )
    if known is None:
        return Grade(None, None, "no ground truth for this question in the generated stream")
    about = "" if asked == question else f" (read as “{asked}”)"
    if time_s <= known.shown_s:
        return Grade(None, None, f"its evidence appears at {known.shown_s:g} s, later in the stream{about}")
    if grade_answer(known.answer, answer):
        return Grade(known.answer, True, f"✓ matches the ground truth ({known.answer}){about}")
    return Grade(known.answer, False, f"✗ the ground truth is {known.answer}{about}")


def grade_answer(expected: str, answer: str) -> bool:
    """An answer is right when it is the expected word (case, spacing and final punctuation ignored)."""
    return (answer or "").strip().strip(".!").casefold() == expected.casefold()
