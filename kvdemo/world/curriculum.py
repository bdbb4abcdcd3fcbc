"""The tiny model's curriculum (``python -m kvdemo train-tiny``; the trainer is :mod:`kvdemo.world.training`): each
stage a :class:`TrainConfig` (learning-rate schedule, loss weights, the streams' seed tag) of :class:`Phase` s
(steps, streams per step, their lengths and kinds, the share asked in a multiple-choice prompt).

The base stage (:data:`RECIPE`), from scratch: A) vision heads only on short streams; B) short streams; C) long
streams (as long as the delay benchmark's); B and C share one learning-rate schedule (linear warm-up, cosine
decay). ``--from DIR`` runs the choice stages (:data:`CHOICE_STAGES`: the bundled weights are the base stage's
followed by these), each from the previous stage's weights with fresh heads and its own optimiser and schedule:
D) streams of up to 24 s, each with probability ``Phase.choices`` a multiple-choice stream
(:mod:`kvdemo.world.batches`: VideoMME's or OVO-Bench's prompt, answered by the option letter), otherwise asked its
bare questions as in B and C, with the option heads (:class:`~kvdemo.world.training.Heads`); E) the same with the
pointer loss; F) the same with the letter answered weighed 5 times (:attr:`TrainConfig.letter_weight`); G) F at
half the learning rate. The vision heads' loss is off in D to G (the encoder already knows shape and colour).
"""

from __future__ import annotations

from dataclasses import dataclass

from .synthetic import STREAM_KINDS

#: Seed-sequence tags of training streams (1, 3, 5, 9, 11; evaluation uses 2 and the local lmms-eval tasks 4: held out).
TRAIN_STREAMS = 1
CHOICE_STREAMS = 3


@dataclass(frozen=True)
class Phase:
    """One phase of a stage of the curriculum: ``steps`` steps of ``batch`` streams of ``pairs`` frame pairs
    (one length per step, drawn in the range) with ``objects`` objects each; stream ``i`` of a batch is of
    kind ``kinds[i % len(kinds)]``; with probability ``choices`` a stream's questions are asked in VideoMME's
    multiple-choice format (:func:`~kvdemo.world.batches.asked_questions`)."""

    name: str
    steps: int
    batch: int
    pairs: tuple[int, int]
    objects: tuple[int, int] = (2, 4)
    vision_only: bool = False
    kinds: tuple[str, ...] = STREAM_KINDS
    choices: float = 0.0


PHASES = (
    Phase("A vision", 200, 16, (3, 3), (4, 4), vision_only=True),
    Phase("B short", 1800, 8, (2, 10)),
    Phase("C long", 800, 8, (4, 48)),
)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    #: torch threads. One: on a shared 2-core machine two OpenMP threads stall whenever either is
    #: descheduled (measured here at load 9: 20x slower evaluation); data generation runs on a second
    #: Python thread meanwhile, so both cores work.
    threads: int = 1
    phases: tuple[Phase, ...] = PHASES
    vision_lr: float = 2e-3
    vision_warmup: int = 50
    lr: float = 1.5e-3
    final_lr: float = 1.5e-4
    warmup: int = 100
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    clip: float = 1.0
    question_weight: float = 0.5
    question_layer: int = 2
    #: Weight of the colour and shape heads' losses on the visual tokens.
    vision_weight: float = 1.0
    #: Weight of each option head's loss (multiple-choice questions only; see :class:`~kvdemo.world.training.Heads`).
    option_weight: float = 0.5
    #: The option heads read the hidden state after these layers: what an option says (its word and letter),
    #: then whether it is right and which word the answer position retrieved.
    option_layer: int = 2
    verdict_layer: int = 3
    #: Weight of the pointer loss: one attention head of the last layer, at the position that answers a
    #: multiple-choice question, is taught to look at the right option's word (``-log`` of that attention weight).
    #: kvdemo's own aid: the option heads taught every option's verdict, but the last layer did not learn to copy the
    #: letter of the option judged right (measured: the letter stayed at chance). Needs eager attention (weights out).
    pointer_weight: float = 0.0
    pointer_head: int = 0
    #: Extra weight on the cross-entropy of the letter answering a multiple-choice question (kvdemo's: LETTER_STAGE).
    letter_weight: float = 0.0
    #: The streams' seed-sequence tag.
    streams: int = TRAIN_STREAMS


#: The choice stage (``python -m kvdemo train-tiny --from DIR``): from the base stage's weights, bare and
#: multiple-choice questions mixed, with the option heads (:class:`~kvdemo.world.training.Heads`) guiding the lookup
#: from the word seen to its option's letter.
CHOICE_STAGE = TrainConfig(
    phases=(Phase("D choices", 1500, 6, (2, 24), choices=0.75),),
    lr=1e-3,
    final_lr=1e-4,
    warmup=100,
    vision_weight=0.0,
    streams=CHOICE_STREAMS,
)
#: The pointer stage: after D every option knew whether it was right (its verdict head at 0.99) but the letter
#: answered stayed at chance; E adds the pointer loss (:attr:`TrainConfig.pointer_weight`). Measured: the pointer head
#: learned to look at the right option (0.97 of its weight) and the letter still rose only to 0.33 (docs/tiny-model.md).
POINTER_STAGE = TrainConfig(
    phases=(Phase("E pointer", 300, 6, (2, 24), choices=0.75),),
    lr=1e-3,
    final_lr=1e-4,
    warmup=20,
    vision_weight=0.0,
    streams=5,
    pointer_weight=1.0,
)
#: The letter stage: after E a probe read each option's letter from its word (held out 1.00) and the pointer head
#: looked at the right option, yet the last layer did not carry the letter (one token among every answer's in the
#: answer loss). F weighs it 5 times (:attr:`TrainConfig.letter_weight`): the letter rose from 0.33 to 0.93.
LETTER_STAGE = TrainConfig(
    phases=(Phase("F letters", 200, 6, (2, 24), choices=0.75),),
    lr=1e-3,
    final_lr=1e-4,
    warmup=20,
    vision_weight=0.0,
    streams=9,
    pointer_weight=1.0,
    letter_weight=5.0,
)
#: G settles F at half its learning rate on new streams.
SETTLE_STAGE = TrainConfig(
    phases=(Phase("G settle", 300, 6, (2, 24), choices=0.75),),
    lr=5e-4,
    final_lr=5e-5,
    warmup=20,
    vision_weight=0.0,
    streams=11,
    pointer_weight=1.0,
    letter_weight=5.0,
)
CHOICE_STAGES = (CHOICE_STAGE, POINTER_STAGE, LETTER_STAGE, SETTLE_STAGE)
#: ``python -m kvdemo train-tiny``: the base stage from scratch (the bundled weights).
RECIPE = (TrainConfig(),)
