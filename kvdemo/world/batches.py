"""Training sequences for the tiny model: each stream's dialogue as token ids in the adapter's own template, and the
positions the training losses read (:mod:`kvdemo.world.training` trains on them).

A stream is asked its bare questions ("What colour was the star?" -> "red"), or, in a multiple-choice stream,
:data:`CHOICE_QUESTIONS` of them in VideoMME's or OVO-Bench's prompt (:mod:`kvdemo.world.choices`), answered by the
option letter. Besides the answer tokens, a sequence marks where the question head reads (from the question's "?"
to its answer) and, for a multiple-choice question, the last character of each option's word and the position that
answers (the option heads and the pointer loss of :mod:`kvdemo.world.training`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..models.qwen2_vl import Qwen2VL, mrope_positions
from .choices import CHOICE_FORMATS, LETTERS, MultipleChoice, multiple_choice
from .synthetic import COLOUR_NAMES, SHAPES, Episode, Question

#: The question head's classes: the shape asked about, or "which shape appeared first".
QUESTION_CLASSES = (*SHAPES, "first")
#: The option heads' classes: every word an option can hold (colour names, then shape names).
OPTION_WORDS = (*COLOUR_NAMES, *SHAPES)
#: A multiple-choice stream is asked this many questions (each is ~310 tokens long: VideoMME's instructions).
CHOICE_QUESTIONS = 2


@dataclass
class Batch:
    """One training step's tensors.

    pixels ``[N, 3*2*14*14]`` and grid_thw ``[B, 3]`` (the vision encoder's input); input_ids ``[B, L]``
    (video placeholders at ``visual``), positions ``[3, B, L]``; colour/shape labels ``[B * tokens]``;
    answer_at/question_at ``[2, n]`` (row, position) with their targets, answer_of ``[n]`` the question
    each answer token belongs to (for question accuracy), first_kind ``[questions]`` True for "which shape
    appeared first?"; moving_tokens ``[B * tokens]`` / moving_questions ``[questions]``: from a moving stream;
    choice_kind ``[questions]`` True for a multiple-choice question; option_at ``[2, o]`` (row, position) of each
    option's last word character with option_targets ``[3, o]`` (word, letter, right); choice_at ``[2, c]`` the
    positions answering multiple-choice questions with choice_words ``[c]`` (the word the right letter stands for).
    """

    pixels: torch.Tensor
    grid_thw: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    visual: slice
    colour_labels: torch.Tensor
    shape_labels: torch.Tensor
    answer_at: torch.Tensor
    answer_targets: torch.Tensor
    answer_of: torch.Tensor
    question_at: torch.Tensor
    question_targets: torch.Tensor
    questions: int
    first_kind: torch.Tensor
    moving_tokens: torch.Tensor | None = None
    moving_questions: torch.Tensor | None = None
    choice_kind: torch.Tensor | None = None
    option_at: torch.Tensor | None = None
    option_targets: torch.Tensor | None = None
    choice_at: torch.Tensor | None = None
    choice_words: torch.Tensor | None = None


@dataclass
class Turns:
    """One stream's dialogue as token ids (answers filled in) and where its supervised positions are.

    ``answers``: ``(start, length)`` spans of the answer tokens (word + ``<|im_end|>``); ``questions``:
    ``(start, stop, class)`` spans from the question's "?" to the last token before its answer; ``options``:
    ``(position, word, letter, right)`` at the last character of each multiple-choice option's word;
    ``choice_answers``: ``(position, word)``, the position whose logits give a multiple-choice answer's letter
    and the word that letter stands for."""

    ids: list[int]
    answers: list[tuple[int, int]]
    questions: list[tuple[int, int, int]]
    options: list[tuple[int, int, int, bool]]
    choice_answers: list[tuple[int, int]]


def dialogue(adapter: Qwen2VL, questions: list[Question | MultipleChoice], order: np.ndarray) -> Turns:
    """Token ids after the video for every one of ``questions`` in ``order`` (a multiple-choice question asked in
    its benchmark's prompt, answered by its letter), as the engine would encode the dialogue (the adapter's own
    ``question_text``), with the answers filled in. Each turn's text is a prefix of the next one's, so positions
    are found by tokenizing prefixes."""
    asked = [questions[i] for i in order]
    history: list[tuple[str, str]] = []
    turns = Turns([], [], [], [], [])
    question_mark = adapter.tokenize("?")[0]
    for item in asked:
        question = item.as_question() if isinstance(item, MultipleChoice) else item
        text = adapter.question_text(history, question.text)
        prompt = adapter.tokenize(text)
        mark = len(prompt) - 1 - prompt[::-1].index(question_mark)  # the options and instructions hold no "?"
        target = QUESTION_CLASSES.index("first" if question.kind == "first" else question.subject)
        turns.questions.append((mark, len(prompt), target))
        turns.answers.append((len(prompt), len(adapter.tokenize(question.answer)) + 1))
        if isinstance(item, MultipleChoice):
            begin = text.rindex(question.text)
            for letter, (option, word) in enumerate(zip(item.options, item.words)):
                end = text.index(option, begin) + len(option)
                turns.options.append(
                    (
                        len(adapter.tokenize(text[:end])) - 1,
                        OPTION_WORDS.index(word),
                        letter,
                        LETTERS[letter] == item.letter,
                    )
                )
            turns.choice_answers.append((len(prompt) - 1, OPTION_WORDS.index(item.question.answer)))
        history.append((question.text, question.answer))
    last = asked[-1].as_question() if isinstance(asked[-1], MultipleChoice) else asked[-1]
    turns.ids = adapter.tokenize(adapter.question_text(history[:-1], last.text) + last.answer + "<|im_end|>")
    return turns


def asked_questions(episode: Episode, choices: float, rng: np.random.Generator) -> list[Question | MultipleChoice]:
    """With probability ``choices``, a multiple-choice stream: :data:`CHOICE_QUESTIONS` of ``episode``'s
    questions (drawn at random) in their multiple-choice form (VideoMME's or OVO-Bench's prompt, drawn per
    question), nothing else; otherwise its bare questions."""
    if choices <= 0 or rng.random() >= choices:
        return list(episode.questions)
    picked = rng.permutation(len(episode.questions))[:CHOICE_QUESTIONS]
    forms = [CHOICE_FORMATS[int(rng.integers(len(CHOICE_FORMATS)))] for _ in picked]
    return [multiple_choice(episode.questions[i], rng, form) for i, form in zip(sorted(picked), forms)]


def build_batch(
    adapter: Qwen2VL, episodes: list[Episode], rng: np.random.Generator, with_text: bool = True, choices: float = 0.0
) -> Batch:
    """Tensors for ``episodes`` (all of the same length): text right-padded, positions by the engine's rule;
    ``choices``: the share of questions asked in VideoMME's multiple-choice format."""
    pairs = episodes[0].pairs
    if any(e.pairs != pairs for e in episodes):
        raise ValueError("a batch holds streams of one length")
    flats, grids = zip(*(adapter.pixel_values(e.video.frames) for e in episodes))
    grid_t, grid_h, grid_w = grids[0]
    rows, cols = grid_h // adapter.merge_size, grid_w // adapter.merge_size
    tokens = pairs * rows * cols
    prefix = adapter.tokenize(adapter.prefix_text())
    local = torch.arange(tokens)
    visual_positions = mrope_positions(
        local // (rows * cols),
        (local % (rows * cols)) // cols,
        local % cols,
        len(prefix),
        adapter.temporal_patch_size / episodes[0].video.fps,
        adapter.tokens_per_second,
    )
    supervised = Supervised()
    if with_text:
        for row, episode in enumerate(episodes):
            questions_asked = asked_questions(episode, choices, rng) if choices > 0 else episode.questions
            turns = dialogue(adapter, questions_asked, rng.permutation(len(questions_asked)))
            supervised.add(row, episode, turns, len(prefix) + tokens)
    input_ids, positions = token_layout(adapter, len(episodes), prefix, visual_positions, supervised.texts)
    return Batch(
        pixels=torch.cat(flats),
        grid_thw=torch.tensor([[grid_t, grid_h, grid_w]] * len(episodes)),
        input_ids=input_ids,
        positions=positions[:, None, :].expand(3, len(episodes), -1),
        visual=slice(len(prefix), len(prefix) + tokens),
        colour_labels=torch.from_numpy(np.concatenate([e.colour_labels.ravel() for e in episodes])),
        shape_labels=torch.from_numpy(np.concatenate([e.shape_labels.ravel() for e in episodes])),
        moving_tokens=torch.tensor([e.kind == "moving" for e in episodes]).repeat_interleave(tokens),
        **supervised.tensors(),
    )


@dataclass
class Supervised:
    """What a batch's text supervises, gathered row by row (:meth:`add`): each row's token ids after the video, and
    the positions the losses read as (row, position in the sequence) with their targets (see :class:`Batch`)."""

    texts: list[list[int]] = field(default_factory=list)
    answer_at: list[tuple[int, int]] = field(default_factory=list)
    answer_targets: list[int] = field(default_factory=list)
    answer_of: list[int] = field(default_factory=list)
    question_at: list[tuple[int, int]] = field(default_factory=list)
    question_targets: list[int] = field(default_factory=list)
    first_kind: list[bool] = field(default_factory=list)
    moving_questions: list[bool] = field(default_factory=list)
    choice_kind: list[bool] = field(default_factory=list)
    option_at: list[tuple[int, int]] = field(default_factory=list)
    option_targets: list[tuple[int, int, int]] = field(default_factory=list)
    choice_at: list[tuple[int, int]] = field(default_factory=list)
    choice_words: list[int] = field(default_factory=list)
    questions: int = 0

    def add(self, row: int, episode: Episode, turns: Turns, offset: int) -> None:
        """Row ``row``'s dialogue (``turns`` about ``episode``), its text starting at ``offset`` in the sequence."""
        ids = turns.ids
        choice_starts = {position + 1 for position, _ in turns.choice_answers}
        for position, word, letter, right in turns.options:
            self.option_at.append((row, offset + position))
            self.option_targets.append((word, letter, int(right)))
        for position, word in turns.choice_answers:
            self.choice_at.append((row, offset + position))
            self.choice_words.append(word)
        for (start, length), (mark, stop, target) in zip(turns.answers, turns.questions):
            self.choice_kind.append(start in choice_starts)
            for k in range(length):
                self.answer_at.append((row, offset + start + k - 1))  # the logits at j-1 predict token j
                self.answer_targets.append(ids[start + k])
                self.answer_of.append(self.questions)
            for position in range(mark, stop):
                self.question_at.append((row, offset + position))
                self.question_targets.append(target)
            self.first_kind.append(QUESTION_CLASSES[target] == "first")
            self.moving_questions.append(episode.kind == "moving")
            self.questions += 1
        self.texts.append(ids)

    def tensors(self) -> dict[str, Any]:
        """The :class:`Batch` fields of what was gathered (each ``*_at`` as ``[2, n]``: rows, positions)."""
        return dict(
            answer_at=_row_position(self.answer_at),
            answer_targets=torch.tensor(self.answer_targets, dtype=torch.long),
            answer_of=torch.tensor(self.answer_of, dtype=torch.long),
            question_at=_row_position(self.question_at),
            question_targets=torch.tensor(self.question_targets, dtype=torch.long),
            questions=self.questions,
            first_kind=torch.tensor(self.first_kind, dtype=torch.bool),
            moving_questions=torch.tensor(self.moving_questions, dtype=torch.bool),
            choice_kind=torch.tensor(self.choice_kind, dtype=torch.bool),
            option_at=_row_position(self.option_at),
            option_targets=torch.tensor(self.option_targets, dtype=torch.long).reshape(-1, 3).t(),
            choice_at=_row_position(self.choice_at),
            choice_words=torch.tensor(self.choice_words, dtype=torch.long),
        )


def _row_position(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).t()


def token_layout(
    adapter: Qwen2VL, rows: int, prefix: list[int], visual_positions: torch.Tensor, texts: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [rows, L]`` (the prefix, a video placeholder per visual position, then each row's text of
    ``texts``, right-padded) and the positions ``[3, L]`` every row shares: the prefix's, ``visual_positions``, then
    the text's from the largest position so far + 1."""
    tokens = visual_positions.shape[1]
    text_start = max(len(prefix) - 1, int(visual_positions.max())) + 1
    length = len(prefix) + tokens + max((len(t) for t in texts), default=0)
    pad = adapter.tokenizer.special_to_id["<|endoftext|>"]
    video_pad = adapter.tokenizer.special_to_id["<|video_pad|>"]
    input_ids = torch.full((rows, length), pad, dtype=torch.long)
    input_ids[:, : len(prefix)] = torch.tensor(prefix)
    input_ids[:, len(prefix) : len(prefix) + tokens] = video_pad
    for row, ids in enumerate(texts):
        input_ids[row, len(prefix) + tokens : len(prefix) + tokens + len(ids)] = torch.tensor(ids)
    text_len = length - len(prefix) - tokens
    positions = torch.cat(
        [
            torch.arange(len(prefix)).expand(3, -1),
            visual_positions,
            torch.arange(text_start, text_start + text_len).expand(3, -1),
        ],
        dim=1,
    )
    return input_ids, positions
