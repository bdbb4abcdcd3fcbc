"""``python -m kvdemo train-tiny``: train the offline tiny model from scratch on generated streams.

The model is transformers' own ``Qwen2_5_VLForConditionalGeneration`` built from
:func:`~kvdemo.models.tiny.tiny_config` (initializer range 0.02). Each training sequence is exactly what
the engine feeds at inference: the chat prefix, the stream's visual tokens at the project's M-RoPE
positions (2 fps), then every question of the stream as a multi-turn dialogue in random order, in the
adapter's own template. Every batch mixes the two stream kinds of :mod:`kvdemo.world.synthetic` (stream ``i``
is static when ``i`` is even, moving when odd), so one model answers on both. Losses:

- cross-entropy on the answer tokens (answer word + ``<|im_end|>``);
- per-token colour and shape heads on the vision merger's output (weight 1 each), each token labelled
  with the item covering most of it (:mod:`kvdemo.world.synthetic`): they teach the two-block vision encoder
  shape and colour before the language model can use them;
- a question head on the language model's hidden state after layer 2, at the question's "?" and the
  template tokens up to the answer, predicting what is asked (the shape, or "which came first"; weight
  0.5): it makes the model read the question (three shape names end in "e", so the answer position
  alone cannot tell them apart).

The curriculum (its stages, their phases and hyperparameters) is :mod:`.curriculum`. AdamW, weight decay on
matrices, gradient clipping. Reproducible: every step draws its streams from
``numpy.random.default_rng((seed, streams, phase, step, item))``, deterministic algorithms, a fixed thread count.
The heads are training aids and are not saved; the weights, config and tokenizer go to the output folder
(``--out``; the bundled weights are in ``kvdemo/assets/tiny``).
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import Qwen2_5_VLForConditionalGeneration

from ..models.catalog import TINY_NAME
from ..models.qwen2_vl import Qwen2VL
from ..models.tiny import ByteTokenizer, save_tokenizer_spec, tiny_config
from .batches import OPTION_WORDS, QUESTION_CLASSES, Batch, build_batch
from .choices import LETTERS
from .curriculum import RECIPE, TrainConfig
from .synthetic import COLOURS, SHAPES, StreamSpec, generate_episode


@dataclass
class StepStats:
    loss: float
    colour_acc: float
    shape_acc: float
    answer_acc: float = float("nan")
    first_acc: float = float("nan")
    question_acc: float = float("nan")
    moving_shape_acc: float = float("nan")
    moving_answer_acc: float = float("nan")
    choice_acc: float = float("nan")
    option_acc: float = float("nan")
    pointer_mass: float = float("nan")


class Heads(torch.nn.Module):
    """The training-only heads (not saved): colour and shape per visual token, what the question asks, and for
    multiple-choice questions the steps of the option lookup (kvdemo's own aids, in the spirit of the question head):
    at the last character of each option's word, its word and its letter (after ``option_layer``) and whether it
    is the right one (after ``verdict_layer``); at the position that answers, the right word (after
    ``verdict_layer``), so the last layer only has to match that word to an option and copy its letter."""

    def __init__(self, vision_dim: int, text_dim: int) -> None:
        super().__init__()
        self.colour = torch.nn.Linear(vision_dim, len(COLOURS) + 1)
        self.shape = torch.nn.Linear(vision_dim, len(SHAPES) + 2)
        self.question = torch.nn.Linear(text_dim, len(QUESTION_CLASSES))
        self.option_word = torch.nn.Linear(text_dim, len(OPTION_WORDS))
        self.option_letter = torch.nn.Linear(text_dim, len(LETTERS))
        self.option_right = torch.nn.Linear(text_dim, 2)
        self.answer_word = torch.nn.Linear(text_dim, len(OPTION_WORDS))


class TinyTrainer:
    """Builds the model and its heads from ``config.seed`` and runs the curriculum step by step."""

    def __init__(self, config: TrainConfig = TrainConfig(), start: Path | torch.nn.Module | None = None) -> None:
        """``start``: weights to continue from (a ``save_pretrained`` folder or a model); else from scratch."""
        self.config = config
        model_config = tiny_config(initializer_range=0.02)
        model_config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            if start is None:
                model = Qwen2_5_VLForConditionalGeneration(model_config).float()
            elif isinstance(start, torch.nn.Module):
                model, model_config = start, start.config
            else:
                model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                    start, dtype=torch.float32, attn_implementation="sdpa"
                )
                model_config = model.config
            self.heads = Heads(model_config.vision_config.out_hidden_size, model_config.text_config.hidden_size)
        if config.pointer_weight > 0:
            model.set_attn_implementation("eager")  # the pointer loss reads the attention weights
        self.adapter = Qwen2VL(model, ByteTokenizer(), name=TINY_NAME)
        self.model = model.train()
        parameters = [p for p in (*model.parameters(), *self.heads.parameters())]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": config.weight_decay},
                {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=config.lr,
            betas=config.betas,
        )
        self.parameters = parameters
        self.steps_done = 0

    # --- schedule -------------------------------------------------------------------------------
    def learning_rate(self, phase_index: int, step: int) -> float:
        """Vision-only phases: linear warm-up to ``vision_lr`` then constant. The other phases share one
        schedule: linear warm-up to ``lr``, cosine decay to ``final_lr`` over their steps together."""
        config = self.config
        if config.phases[phase_index].vision_only:
            return config.vision_lr * min(1.0, (step + 1) / config.vision_warmup)
        joint = [p for p in config.phases if not p.vision_only]
        done = sum(p.steps for i, p in enumerate(config.phases[:phase_index]) if not p.vision_only) + step
        total = sum(p.steps for p in joint)
        if done < config.warmup:
            return config.lr * (done + 1) / config.warmup
        progress = (done - config.warmup) / max(1, total - config.warmup)
        return config.final_lr + (config.lr - config.final_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    # --- data -----------------------------------------------------------------------------------
    def batch(self, phase_index: int, step: int) -> Batch:
        """The streams of one step, a pure function of ``(seed, phase, step)``."""
        phase = self.config.phases[phase_index]
        streams = self.config.streams
        step_rng = np.random.default_rng((self.config.seed, streams, phase_index, step))
        pairs = int(step_rng.integers(phase.pairs[0], phase.pairs[1] + 1))
        specs = [StreamSpec(pairs=(pairs, pairs), objects=phase.objects, kind=kind) for kind in phase.kinds]
        episodes = [
            generate_episode((self.config.seed, streams, phase_index, step, item), specs[item % len(specs)])
            for item in range(phase.batch)
        ]
        return build_batch(self.adapter, episodes, step_rng, with_text=not phase.vision_only, choices=phase.choices)

    # --- losses ---------------------------------------------------------------------------------
    def losses(self, batch: Batch, vision_only: bool) -> tuple[torch.Tensor, StepStats]:
        """The weighted training loss of ``batch`` and its accuracies."""
        hf = self.model
        merged = torch.cat(
            list(hf.model.get_video_features(batch.pixels, batch.grid_thw, return_dict=True).pooler_output)
        )
        colour_logits, shape_logits = self.heads.colour(merged), self.heads.shape(merged)
        loss = self.config.vision_weight * (
            F.cross_entropy(colour_logits, batch.colour_labels) + F.cross_entropy(shape_logits, batch.shape_labels)
        )
        shape_right = shape_logits.argmax(-1) == batch.shape_labels
        stats = StepStats(
            0.0,
            (colour_logits.argmax(-1) == batch.colour_labels).float().mean().item(),
            shape_right.float().mean().item(),
        )
        if batch.moving_tokens is not None and batch.moving_tokens.any():
            stats.moving_shape_acc = shape_right[batch.moving_tokens].float().mean().item()
        if not vision_only:
            embeds = hf.get_input_embeddings()(batch.input_ids)
            rows = batch.input_ids.shape[0]
            embeds = torch.cat(
                [
                    embeds[:, : batch.visual.start],
                    merged.view(rows, -1, merged.shape[-1]),
                    embeds[:, batch.visual.stop :],
                ],
                dim=1,
            )
            pointing = (
                self.config.pointer_weight > 0 and batch.choice_kind is not None and bool(batch.choice_kind.any())
            )
            output = hf.model.language_model(
                inputs_embeds=embeds,
                position_ids=batch.positions,
                use_cache=False,
                output_hidden_states=True,
                output_attentions=pointing,
            )
            logits = hf.lm_head(output.last_hidden_state[batch.answer_at[0], batch.answer_at[1]])
            loss = loss + F.cross_entropy(logits, batch.answer_targets)
            question_hidden = output.hidden_states[self.config.question_layer][
                batch.question_at[0], batch.question_at[1]
            ]
            question_logits = self.heads.question(question_hidden)
            loss = loss + self.config.question_weight * F.cross_entropy(question_logits, batch.question_targets)
            right = (logits.argmax(-1) == batch.answer_targets).float()
            wrong_per_question = torch.zeros(batch.questions).index_add_(0, batch.answer_of, 1 - right)
            right_per_question = wrong_per_question == 0
            stats.answer_acc = right_per_question.float().mean().item()
            if batch.first_kind.any():
                stats.first_acc = right_per_question[batch.first_kind].float().mean().item()
            if batch.moving_questions is not None and batch.moving_questions.any():
                stats.moving_answer_acc = right_per_question[batch.moving_questions].float().mean().item()
            stats.question_acc = (question_logits.argmax(-1) == batch.question_targets).float().mean().item()
            if batch.choice_kind is not None and batch.choice_kind.any():
                stats.choice_acc = right_per_question[batch.choice_kind].float().mean().item()
                loss = loss + self._option_loss(batch, output.hidden_states, stats)
                if pointing:
                    loss = loss + self.config.pointer_weight * self._pointer_loss(batch, output.attentions[-1], stats)
                if self.config.letter_weight > 0:
                    loss = loss + self.config.letter_weight * self._letter_loss(batch, output.last_hidden_state)
        stats.loss = loss.item()
        return loss, stats

    def _option_loss(self, batch: Batch, hidden: tuple[torch.Tensor, ...], stats: StepStats) -> torch.Tensor:
        """The option heads' losses (:class:`Heads`), each weighted ``option_weight``; ``stats.option_acc``: how
        often the verdict head picks the right option of a question (argmax over its options)."""
        config, heads = self.config, self.heads
        at, targets = batch.option_at, batch.option_targets
        said = hidden[config.option_layer][at[0], at[1]]
        judged = hidden[config.verdict_layer][at[0], at[1]]
        answering = hidden[config.verdict_layer][batch.choice_at[0], batch.choice_at[1]]
        verdict = heads.option_right(judged)
        loss = (
            F.cross_entropy(heads.option_word(said), targets[0])
            + F.cross_entropy(heads.option_letter(said), targets[1])
            + F.cross_entropy(verdict, targets[2])
            + F.cross_entropy(heads.answer_word(answering), batch.choice_words)
        )
        margin = (verdict[:, 1] - verdict[:, 0]).view(-1, len(LETTERS))
        stats.option_acc = (margin.argmax(-1) == targets[2].view(-1, len(LETTERS)).argmax(-1)).float().mean().item()
        return config.option_weight * loss

    def _pointer_loss(self, batch: Batch, attention: torch.Tensor, stats: StepStats) -> torch.Tensor:
        """``-log`` of the last layer's ``pointer_head`` attention weight (``attention``: ``[B, heads, L, L]``) from each
        multiple-choice answering position to its right option's word; ``stats.pointer_mass``: that weight's mean."""
        rows, at = batch.choice_at
        right = batch.option_targets[2].view(-1, len(LETTERS)).argmax(-1)  # options come in fours, one per question
        option_positions = batch.option_at[1].view(-1, len(LETTERS))
        target = option_positions[torch.arange(len(right)), right]
        weight = attention[rows, self.config.pointer_head, at, target]
        stats.pointer_mass = weight.mean().item()
        return -torch.log(weight + 1e-6).mean()

    def _letter_loss(self, batch: Batch, last_hidden: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the letter each multiple-choice question is answered with, at the position that answers it
        (``last_hidden``: the language model's last hidden state ``[B, L, hidden]``), mean over the questions."""
        rows, at = batch.choice_at
        return F.cross_entropy(self.model.lm_head(last_hidden[rows, at]), batch.input_ids[rows, at + 1])

    def step(self, phase_index: int, step: int, batch: Batch | None = None) -> StepStats:
        """One optimiser step on the streams of ``(phase_index, step)`` (``batch``: those, made in advance)."""
        batch = batch if batch is not None else self.batch(phase_index, step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(phase_index, step)
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats = self.losses(batch, self.config.phases[phase_index].vision_only)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters, self.config.clip)
        self.optimizer.step()
        self.steps_done += 1
        return stats

    def run(self, progress: bool = True) -> list[dict[str, Any]]:
        """Every phase of the curriculum; returns per-phase summaries (mean stats over the last 50 steps).

        The next step's streams are generated on a second thread while this step trains (numpy and torch
        release the GIL), so data generation uses the other core; each batch is a pure function of its
        step, so this changes nothing in the result.
        """
        plan = [(index, step) for index, phase in enumerate(self.config.phases) for step in range(phase.steps)]
        bar = tqdm(total=len(plan), unit="step", desc="train-tiny", disable=not progress, dynamic_ncols=True)
        summaries, recent = [], []
        start = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                upcoming = pool.submit(self.batch, *plan[0]) if plan else None
                for position, (index, step) in enumerate(plan):
                    batch = upcoming.result()
                    if position + 1 < len(plan):
                        upcoming = pool.submit(self.batch, *plan[position + 1])
                    recent = (recent + [self.step(index, step, batch)])[-50:]
                    phase = self.config.phases[index]
                    bar.update(1)
                    bar.set_postfix_str(_postfix(phase.name, recent), refresh=False)
                    if step == phase.steps - 1:
                        summaries.append(
                            {
                                "phase": phase.name,
                                "steps": phase.steps,
                                "seconds": time.perf_counter() - start,
                                **_mean(recent),
                            }
                        )
                        start, recent = time.perf_counter(), []
        finally:
            bar.close()
        return summaries

    def adapter_for_inference(self) -> Qwen2VL:
        self.model.eval()
        return self.adapter

    def save(self, folder: Path, record: dict[str, Any]) -> Path:
        """Weights (safetensors) and config through transformers' ``save_pretrained``, the tokenizer spec,
        and ``training.json`` (the configuration and what the run measured)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder, safe_serialization=True)
        save_tokenizer_spec(folder)
        (folder / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        return folder


def _mean(stats: list[StepStats]) -> dict[str, float]:
    values = {key: [getattr(s, key) for s in stats if not math.isnan(getattr(s, key))] for key in asdict(stats[0])}
    return {key: float(np.mean(v)) for key, v in values.items() if v}


def _postfix(phase: str, recent: list[StepStats]) -> str:
    mean = _mean(recent)
    nan = float("nan")
    text = f"{phase} loss {mean['loss']:.3f} colour {mean['colour_acc']:.2f} shape {mean['shape_acc']:.2f}"
    text += f" (moving {mean.get('moving_shape_acc', nan):.2f})"
    if "answer_acc" in mean:
        text += (
            f" answers {mean['answer_acc']:.2f} (first {mean.get('first_acc', nan):.2f}, moving "
            f"{mean.get('moving_answer_acc', nan):.2f}) question {mean['question_acc']:.2f}"
        )
    if "choice_acc" in mean:
        text += f" choices {mean['choice_acc']:.2f} (options {mean.get('option_acc', nan):.2f}, pointer {mean.get('pointer_mass', nan):.2f})"
    return text


def train_tiny(
    stages: TrainConfig | tuple[TrainConfig, ...] = RECIPE,
    out: Path | None = None,
    progress: bool = True,
    start: Path | torch.nn.Module | None = None,
) -> tuple[TinyTrainer, dict[str, Any]]:
    """Run ``stages`` one after the other (each continues from the previous one's weights with fresh heads and
    optimiser; the first from ``start``'s weights, or from scratch) under deterministic algorithms and each
    stage's thread count; save to ``out`` (unless ``None``). Global torch settings are restored afterwards.

    The record holds each stage's configuration and summaries, and the total wall and CPU seconds."""
    stages = (stages,) if isinstance(stages, TrainConfig) else tuple(stages)
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    begin, cpu_begin = time.perf_counter(), time.process_time()
    records, weights = [], start
    try:
        for config in stages:
            torch.set_num_threads(config.threads)
            began, cpu_began = time.perf_counter(), time.process_time()
            trainer = TinyTrainer(config, start=weights)
            phases = trainer.run(progress)
            records.append(
                {
                    "config": asdict(config),
                    "phases": phases,
                    "train_seconds": time.perf_counter() - began,
                    "train_cpu_seconds": time.process_time() - cpu_began,
                }
            )
            weights = trainer.model
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
    record = {
        "start": None if start is None else str(start),
        "stages": records,
        "train_seconds": time.perf_counter() - begin,
        "train_cpu_seconds": time.process_time() - cpu_begin,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }
    trainer.adapter_for_inference()
    if out is not None:
        trainer.save(out, record)
    return trainer, record
