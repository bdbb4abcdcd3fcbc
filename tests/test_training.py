"""Training the tiny model: sequences are what the engine feeds, the schedule, a few steps lower the loss,
and the same seed trains the same weights."""

import numpy as np
import pytest
import torch

from kvdemo.world.batches import QUESTION_CLASSES, build_batch
from kvdemo.world.curriculum import Phase, TrainConfig
from kvdemo.world.synthetic import StreamSpec, generate_episode
from kvdemo.world.training import TinyTrainer

TINY_PHASES = (Phase("A", 2, 4, (2, 2), (3, 3), vision_only=True), Phase("B", 3, 2, (2, 3)))


@pytest.fixture(scope="module")
def trainer():
    return TinyTrainer(TrainConfig(phases=TINY_PHASES))


def test_a_sequence_is_what_the_engine_feeds(trainer):
    """Text: the chat prefix, one placeholder per visual token, then the dialogue in the adapter's own
    template. Positions: the project's M-RoPE rule, restated here for 3 pairs of 4 x 4 tokens."""
    adapter = trainer.adapter
    episode = generate_episode(21, StreamSpec(pairs=(3, 3), objects=(2, 2)))
    batch = build_batch(adapter, [episode], np.random.default_rng(0))
    ids = batch.input_ids[0].tolist()
    text = adapter.tokenizer.decode(ids)
    prefix = adapter.prefix_text()
    assert text.startswith(prefix + "<|video_pad|>" * 48 + "<|vision_end|>")
    asked = [q for q in episode.questions]
    # Every question appears once, each followed by its answer and <|im_end|>, in the template.
    for q in asked:
        assert f"{q.text}<|im_end|>\n<|im_start|>assistant\n{q.answer}<|im_end|>" in text
    assert text.endswith("<|im_end|>")
    p = len(adapter.tokenize(prefix))
    positions = batch.positions[:, 0]
    assert positions[:, :p].tolist() == [list(range(p))] * 3
    grid, row, col = np.meshgrid(np.arange(3), np.arange(4), np.arange(4), indexing="ij")
    assert positions[0, p : p + 48].tolist() == (p + 2 * grid.ravel()).tolist()  # 2 positions per second, 1 s per pair
    assert positions[1, p : p + 48].tolist() == (p + row.ravel()).tolist()
    assert positions[2, p : p + 48].tolist() == (p + col.ravel()).tolist()
    first_text = p + max(2 * 2, 3) + 1  # after the largest position so far
    assert positions[:, p + 48].tolist() == [first_text] * 3
    # Answer targets spell the answers (+ <|im_end|>) in the order asked; question targets name what is asked.
    targets = adapter.tokenizer.decode(batch.answer_targets.tolist())
    im_end = "<|im_end|>"
    order = [q for q in sorted(asked, key=lambda q: text.index(q.text + im_end))]
    assert targets == "".join(q.answer + im_end for q in order)
    assert (batch.input_ids[0, batch.answer_at[1] + 1] == batch.answer_targets).all()
    classes = {QUESTION_CLASSES[int(t)] for t in batch.question_targets}
    assert classes == {("first" if q.kind == "first" else q.subject) for q in asked}
    assert batch.input_ids[0, batch.question_at[1][0]].item() == ord("?")


def test_a_step_draws_both_stream_kinds_and_the_same_streams_every_time(trainer):
    """Stream i of a batch is of kind kinds[i % 2] (static, moving), and a step's batch is a pure function
    of (seed, phase, step): training data is reproducible whatever order the steps are built in."""
    first, other, again = trainer.batch(1, 2), trainer.batch(1, 1), trainer.batch(1, 2)
    for name in (
        "pixels",
        "input_ids",
        "positions",
        "colour_labels",
        "shape_labels",
        "answer_targets",
        "question_targets",
    ):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert not torch.equal(first.pixels, other.pixels) or not torch.equal(first.input_ids, other.input_ids)
    tokens = first.colour_labels.numel() // 2
    assert first.moving_tokens.tolist() == [False] * tokens + [True] * tokens
    assert first.moving_questions.any() and not first.moving_questions.all()
    assert TINY_PHASES[1].kinds == ("static", "moving")


def test_the_schedule_warms_up_then_decays(trainer):
    config = TrainConfig(
        phases=(Phase("A", 10, 2, (1, 1), vision_only=True), Phase("B", 300, 2, (1, 1)), Phase("C", 100, 2, (1, 1)))
    )
    probe = TinyTrainer.__new__(TinyTrainer)
    probe.config = config
    assert probe.learning_rate(0, 0) == pytest.approx(2e-3 / 50)
    assert probe.learning_rate(0, 9) == pytest.approx(2e-3 * 10 / 50)
    assert probe.learning_rate(1, 0) == pytest.approx(1.5e-3 / 100)
    assert probe.learning_rate(1, 99) == pytest.approx(1.5e-3)
    assert probe.learning_rate(2, 99) == pytest.approx(1.5e-4 + 1.35e-3 * 0.5 * (1 + np.cos(np.pi * 299 / 300)))
    # B and C share one schedule: C continues where B stopped.
    assert probe.learning_rate(2, 0) < probe.learning_rate(1, 299)


@pytest.mark.slow
def test_a_few_steps_lower_the_loss():
    torch.set_num_threads(2)
    trainer = TinyTrainer(TrainConfig(phases=(Phase("B", 8, 4, (2, 2)),), lr=3e-3, warmup=1))
    batch = trainer.batch(0, 0)
    with torch.no_grad():
        before, _ = trainer.losses(batch, vision_only=False)
    for _ in range(8):
        trainer.step(0, 0)  # the same streams each time: the loss on them must fall
    with torch.no_grad():
        after, _ = trainer.losses(batch, vision_only=False)
    assert after.item() < 0.8 * before.item()


def test_the_same_seed_trains_the_same_weights():
    from kvdemo.world.training import train_tiny

    config = TrainConfig(phases=TINY_PHASES)
    first, record = train_tiny(config, out=None, progress=False)
    second, _ = train_tiny(config, out=None, progress=False)
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert [p["phase"] for p in record["stages"][0]["phases"]] == ["A", "B"] and record["parameters"] > 900_000
    assert not torch.are_deterministic_algorithms_enabled()  # global settings restored


def test_a_choice_stream_asks_its_questions_in_the_benchmarks_format():
    from kvdemo.world.batches import CHOICE_QUESTIONS, asked_questions
    from kvdemo.world.choices import LETTERS

    episode = generate_episode(4, StreamSpec(pairs=(12, 12), objects=(4, 4)))
    always = [item.as_question() for item in asked_questions(episode, 1.0, np.random.default_rng(0))]
    assert len(always) == CHOICE_QUESTIONS and all(q.answer in LETTERS for q in always)
    assert all(q.text == q.text.strip() and q.subject in q.text and "A. " in q.text for q in always)
    assert {q.kind for q in always} <= {"colour", "first"}
    assert asked_questions(episode, 0.0, np.random.default_rng(0)) == list(episode.questions)


@pytest.mark.slow
def test_a_later_stage_continues_from_the_earlier_ones_weights():
    """Two stages in one call train what the second stage trains when started from the first stage's weights."""
    from kvdemo.world.training import train_tiny

    first = TrainConfig(phases=TINY_PHASES)
    second = TrainConfig(phases=(Phase("D", 2, 2, (2, 3), choices=1.0),), streams=3, vision_weight=0.0)
    both, record = train_tiny((first, second), out=None, progress=False)
    alone, _ = train_tiny(first, out=None, progress=False)
    then, _ = train_tiny(second, out=None, progress=False, start=alone.model)
    for a, b in zip(both.model.parameters(), then.model.parameters()):
        assert torch.equal(a, b)
    assert [s["phases"][0]["phase"] for s in record["stages"]] == ["A", "D"]


def test_multiple_choice_turns_mark_each_options_word_its_letter_and_the_answering_position(trainer):
    """A multiple-choice turn is asked in its benchmark's prompt and answered by its letter; the option heads read
    the last character of each option's word (checked here by decoding the ids up to it, not by the code's
    tokenizing of prefixes) and the position whose logits give the letter."""
    from kvdemo.world.batches import OPTION_WORDS, dialogue
    from kvdemo.world.choices import multiple_choice

    adapter = trainer.adapter
    episode = generate_episode(5, StreamSpec(pairs=(3, 3), objects=(3, 3)))
    rng = np.random.default_rng(1)
    asked = [
        multiple_choice(episode.questions[0], rng, "videomme"),
        episode.questions[1],
        multiple_choice(episode.questions[2], rng, "ovobench"),
    ]
    turns = dialogue(adapter, asked, np.arange(3))
    decode = adapter.tokenizer.decode
    text = decode(turns.ids)
    assert len(turns.options) == 8 and len(turns.choice_answers) == 2
    for item, options, after in ((asked[0], turns.options[:4], "\n"), (asked[2], turns.options[4:], ";")):
        for letter, (position, word, letter_index, right) in enumerate(options):
            assert decode(turns.ids[: position + 1]).endswith(f"{'ABCD'[letter]}. {item.words[letter]}")
            assert decode(turns.ids[position + 1 : position + 2]) == after
            assert OPTION_WORDS[word] == item.words[letter] and letter_index == letter
            assert right == (item.words[letter] == item.question.answer)
    for (position, word), item in zip(turns.choice_answers, (asked[0], asked[2])):
        assert decode(turns.ids[: position + 1]).endswith(item.prompt.strip() + "<|im_end|>\n<|im_start|>assistant\n")
        assert (
            decode(turns.ids[position + 1 : position + 2]) == item.letter and OPTION_WORDS[word] == item.question.answer
        )
    # the bare question in between is answered by its word, as every bare question is
    assert f"{asked[1].text}<|im_end|>\n<|im_start|>assistant\n{asked[1].answer}<|im_end|>" in text


def test_the_pointer_loss_reads_the_attention_from_each_answering_position_to_its_right_options_word(trainer):
    """The pointer loss is -log of one head's attention weight from the position that answers a multiple-choice
    question to the last character of its right option's word; restated here with a loop over the batch's decoded
    text (the right option found by its word, not by the code's verdict targets)."""
    from kvdemo.world.batches import OPTION_WORDS

    batch = build_batch(
        trainer.adapter,
        [generate_episode(s, StreamSpec(pairs=(2, 2))) for s in (3, 4)],
        np.random.default_rng(2),
        choices=1.0,
    )
    rows, length = batch.input_ids.shape
    attention = torch.rand(rows, 4, length, length, generator=torch.Generator().manual_seed(0))
    expected, decode = [], trainer.adapter.tokenizer.decode
    for k in range(batch.choice_at.shape[1]):
        row, at = batch.choice_at[:, k].tolist()
        word = OPTION_WORDS[int(batch.choice_words[k])]
        options = [int(p) for p in batch.option_at[1, 4 * k : 4 * k + 4]]
        target = next(p for p in options if decode(batch.input_ids[row, : p + 1].tolist()).endswith(". " + word))
        expected.append(-np.log(float(attention[row, 2, at, target]) + 1e-6))
    probe = TinyTrainer.__new__(TinyTrainer)
    probe.config = TrainConfig(pointer_head=2)
    stats = type("Stats", (), {})()
    loss = probe._pointer_loss(batch, attention, stats)
    assert len(expected) == batch.choice_at.shape[1] > 0
    assert loss.item() == pytest.approx(float(np.mean(expected)), rel=1e-5)


def test_the_letter_loss_is_the_cross_entropy_of_the_right_options_letter_where_the_question_is_answered(trainer):
    """The letter loss: at each position that answers a multiple-choice question, the cross-entropy of the model's
    next-token logits against the right option's letter; restated with the letter found in the decoded text (the
    option whose word is the answer), not the code's next-token ids."""
    from kvdemo.world.batches import OPTION_WORDS

    batch = build_batch(
        trainer.adapter,
        [generate_episode(s, StreamSpec(pairs=(2, 2))) for s in (5, 6)],
        np.random.default_rng(3),
        choices=1.0,
    )
    rows, length = batch.input_ids.shape
    hidden = torch.randn(
        rows, length, trainer.model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    decode, expected = trainer.adapter.tokenizer.decode, []
    with torch.no_grad():
        for k in range(batch.choice_at.shape[1]):
            row, at = batch.choice_at[:, k].tolist()
            word = OPTION_WORDS[int(batch.choice_words[k])]
            text = decode(batch.input_ids[row, : at + 1].tolist())
            letter = next(c for c in "ABCD" if f"{c}. {word}" in text[text.rindex("A. ") :])
            logits = trainer.model.lm_head(hidden[row, at]).double()
            expected.append(float(torch.logsumexp(logits, 0) - logits[trainer.adapter.tokenize(letter)[0]]))
        loss = trainer._letter_loss(batch, hidden)
    assert len(expected) == batch.choice_at.shape[1] > 0
    assert loss.item() == pytest.approx(float(np.mean(expected)), rel=1e-4)
