"""Multiple-choice questions about generated streams, in VideoMME's and OVO-Bench's own prompt formats.

lmms-eval's VideoMME task (``lmms_eval.tasks.videomme.utils.videomme_doc_to_text`` with the task's default
``post_prompt``) asks every question as::

    Select the best answer to ... of the correct option.
    <question>
    A. <option>
    B. <option>
    C. <option>
    D. <option>

    Answer with the option's letter from the given choices directly.

and scores the first option letter found in the answer (``videomme_process_results``). OVO-Bench's backward and
realtime tasks (``lmms_eval.tasks.ovobench.utils.build_prompt``) write the options on one line,
``"A. red; B. blue; C. green; D. white;"``, inside their ``BR_PROMPT_TEMPLATE``, and count an answer right when
it contains the right letter. kvdemo keeps a copy of both texts here (kvdemo imports no lmms-eval;
``tests/test_lmms_eval.py`` checks the copies against lmms-eval's functions), so the tiny model is trained on
them, ``python -m kvdemo eval --questions videomme|ovobench`` measures them, and the local tasks
(``python -m kvdemo make-tasks``) are scored by lmms-eval's own scorers.

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
#: OVO-Bench's ``BR_PROMPT_TEMPLATE`` (backward and realtime tasks), character for character.
OVOBENCH_TEMPLATE = (
    "\nQuestion: {}\nOptions:\n{}\n\nRespond only with the letter corresponding to your chosen option (e.g., A, B, C). "
    "\nDo not include any additional text or explanation in your response.\n"
)
LETTERS = ("A", "B", "C", "D")
#: The multiple-choice formats: the benchmark whose prompt is used.
CHOICE_FORMATS = ("videomme", "ovobench")


@dataclass(frozen=True)
class MultipleChoice:
    """``question`` with four ``options`` (``"A. red"``, ...) of which ``letter`` is right, asked in ``form``'s prompt."""

    question: Question
    options: tuple[str, ...]
    letter: str
    form: str = "videomme"

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(option.split(". ", 1)[1] for option in self.options)

    @property
    def prompt(self) -> str:
        if self.form == "ovobench":
            return ovobench_prompt(self.question.text, self.words)
        return videomme_prompt(self.question.text, self.options)

    def as_question(self) -> Question:
        """The same question in the benchmark's format: the prompt as its text (stripped, as the engine strips every
        question: OVO-Bench's begins and ends with a newline), the letter as its answer."""
        return replace(self.question, text=self.prompt.strip(), answer=self.letter)


def videomme_prompt(question: str, options: tuple[str, ...] | list[str]) -> str:
    """What ``videomme_doc_to_text`` makes of a row with this question and these options (default kwargs)."""
    return VIDEOMME_INSTRUCTION + "\n" + question + "\n" + "\n".join(options) + "\n" + VIDEOMME_POST_PROMPT


def ovobench_prompt(question: str, words: tuple[str, ...] | list[str]) -> str:
    """What OVO-Bench's ``build_prompt`` makes of a backward/realtime row with this question and these options."""
    return OVOBENCH_TEMPLATE.format(question, "; ".join(f"{chr(65 + i)}. {word}" for i, word in enumerate(words)) + ";")


def multiple_choice(question: Question, rng: np.random.Generator, form: str = "videomme") -> MultipleChoice:
    """``question`` with three wrong options from its answer's vocabulary and the right one at a random letter,
    in ``form``'s prompt (one of :data:`CHOICE_FORMATS`)."""
    if form not in CHOICE_FORMATS:
        raise ValueError(f"unknown multiple-choice format {form!r}: one of {', '.join(CHOICE_FORMATS)}")
    vocabulary = COLOUR_NAMES if question.kind == "colour" else SHAPES
    others = [word for word in vocabulary if word != question.answer]
    words = [others[i] for i in rng.permutation(len(others))[: len(LETTERS) - 1]]
    slot = int(rng.integers(len(LETTERS)))
    words.insert(slot, question.answer)
    return MultipleChoice(
        question, tuple(f"{letter}. {word}" for letter, word in zip(LETTERS, words)), LETTERS[slot], form
    )
