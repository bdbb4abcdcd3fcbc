"""Multiple-choice questions about generated streams, in VideoMME's own prompt format.

lmms-eval's VideoMME task (``lmms_eval.tasks.videomme.utils.videomme_doc_to_text`` with the task's default
``post_prompt``) asks every question as::

    Select the best answer to ... of the correct option.
    <question>
    A. <option>
    B. <option>
    C. <option>
    D. <option>

    Answer with the option's letter from the given choices directly.

and scores the first option letter found in the answer (``videomme_process_results``). kvdemo keeps a copy of
that text here (kvdemo imports no lmms-eval; ``tests/test_lmms_eval.py`` checks the copy against lmms-eval's
function), so the tiny model can be trained on it, ``python -m kvdemo eval --questions choice`` can measure it,
and the local VideoMME-format task (``python -m kvdemo make-tasks``) is scored by lmms-eval's own scorer.

kvdemo's own choices: the three wrong options are drawn without replacement from the rest of the answer's
vocabulary (colour names for a colour question, shape names for "which shape appeared first?"), the right one
goes to a uniformly drawn letter, options are written ``"A. red"``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .scene import COLOUR_NAMES, SHAPES, Question

#: VideoMME's instruction line (``videomme_doc_to_text``'s ``option_prompt``), word for word.
VIDEOMME_INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video and the subtitles. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
#: VideoMME's default ``post_prompt`` (``videomme.yaml``, ``lmms_eval_specific_kwargs.default``).
VIDEOMME_POST_PROMPT = "\nAnswer with the option's letter from the given choices directly."
LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class MultipleChoice:
    """``question`` with four ``options`` (``"A. red"``, ...) of which ``letter`` is right."""

    question: Question
    options: tuple[str, ...]
    letter: str

    @property
    def prompt(self) -> str:
        return videomme_prompt(self.question.text, self.options)

    def as_question(self) -> Question:
        """The same question asked in VideoMME's format: the prompt as its text, the letter as its answer."""
        return replace(self.question, text=self.prompt, answer=self.letter)


def videomme_prompt(question: str, options: tuple[str, ...] | list[str]) -> str:
    """What ``videomme_doc_to_text`` makes of a row with this question and these options (default kwargs)."""
    return VIDEOMME_INSTRUCTION + "\n" + question + "\n" + "\n".join(options) + "\n" + VIDEOMME_POST_PROMPT


def multiple_choice(question: Question, rng: np.random.Generator) -> MultipleChoice:
    """``question`` with three wrong options from its answer's vocabulary and the right one at a random letter."""
    vocabulary = COLOUR_NAMES if question.kind == "colour" else SHAPES
    others = [word for word in vocabulary if word != question.answer]
    words = [others[i] for i in rng.permutation(len(others))[: len(LETTERS) - 1]]
    slot = int(rng.integers(len(LETTERS)))
    words.insert(slot, question.answer)
    return MultipleChoice(question, tuple(f"{letter}. {word}" for letter, word in zip(LETTERS, words)), LETTERS[slot])
