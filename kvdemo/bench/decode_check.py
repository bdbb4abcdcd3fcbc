"""The doctor's decode check: kvdemo's decode per token against transformers' own ``generate`` on the same weights and
device, in one process, as a ratio.

kvdemo decodes an answer with its own greedy loop over its memory (the attention seam, the memory's slack, explicit
positions: :meth:`kvdemo.stream.engine.StreamEngine.ask`); transformers decodes with ``generate`` over its
``DynamicCache`` and its own SDPA attention. Both load one checkpoint folder (on a CPU the trained tiny model written
as an ordinary transformers folder, :func:`kvdemo.models.tiny.export_transformers_folder`; on a GPU the doctor's
full-depth checkpoint), and both decode exactly ``new_tokens`` tokens greedily after a context of the same length:
kvdemo's memory after the bundled sample and the question, transformers' that many text tokens (the cost of a
decode step depends on the context's length, not on what it holds). Per token is the time after the first token
(which includes the prefill) divided by the tokens after it; the runs alternate, medians of ``repeats``. Prints
nothing and asserts nothing about speed: the doctor prints the row.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..devices.timing import Stopwatch
from ..models.loading import load_model
from ..stream.engine import StreamEngine
from ..world.synthetic import sample_episode

QUESTION = "What colour was the circle?"
#: What kvdemo's decode per token may cost at most, as a share of transformers' ``generate``'s.
DECODE_TARGET = 1.0


def tiny_export(folder: str | Path) -> Path:
    """The trained tiny model written as an ordinary transformers Qwen2.5-VL folder under ``folder``."""
    from ..models.tiny import TRAINED_DIR, export_transformers_folder  # deferred: writes a checkpoint

    return export_transformers_folder(TRAINED_DIR, Path(folder) / "tiny-hf")


def _kvdemo_run(engine: StreamEngine, new_tokens: int) -> float:
    """ms per token of kvdemo's decode after the first token (the question's prefill and first token left out)."""
    answer = engine.answer(QUESTION, max_new_tokens=new_tokens, ignore_stop=True)
    engine.reset_dialogue()
    return (answer.ms - answer.ttft_ms) / max(answer.tokens - 1, 1)


def _generate_run(model: Any, ids: torch.Tensor, new_tokens: int, device: torch.device) -> float:
    """ms per token of transformers' ``generate`` after the first token: the time of ``new_tokens`` tokens less that
    of one (its prefill and first token), over the ``new_tokens - 1`` after it."""
    times = []
    for count in (1, new_tokens):
        watch = Stopwatch(device)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=count,
                min_new_tokens=count,
                do_sample=False,
                pad_token_id=0,
            )
        times.append(watch.ms())
    return (times[1] - times[0]) / max(new_tokens - 1, 1)


def decode_against_generate(
    device: torch.device, folder: str | Path | None = None, new_tokens: int = 32, repeats: int = 3, frames: int = 16
) -> dict[str, Any]:
    """kvdemo's decode per token and transformers' ``generate``'s on the checkpoint ``folder`` (default: the tiny model
    exported to a temporary folder), after ``frames`` frames of the bundled sample: ``{"folder", "context_tokens",
    "new_tokens", "kvdemo_ms", "generate_ms", "ratio", "target"}`` (medians over ``repeats`` alternating runs)."""
    from transformers import AutoModelForImageTextToText  # deferred: the doctor's only use of transformers' own model

    with tempfile.TemporaryDirectory(prefix="kvdemo-decode-") as scratch:
        path = Path(folder) if folder is not None else tiny_export(scratch)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        theirs = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        theirs = theirs.to(device).eval()
        ours = load_model(str(path), device=str(device))
        engine = StreamEngine(ours, "full", fps=2.0)
        video = sample_episode().video.sampled(2.0).head(frames).resized(ours.geometry)
        engine.feed(video.frames)
        engine.flush()
        context = engine.memory.live_len(0) + int(ours.question_embeds([], QUESTION).shape[0])
        ids = torch.randint(3, 200, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
        kvdemo, generate = [], []
        _kvdemo_run(engine, 2)  # warm-up: the first call of each pays for lazy set-up
        _generate_run(theirs, ids, 2, device)
        for _ in range(repeats):
            kvdemo.append(_kvdemo_run(engine, new_tokens))
            generate.append(_generate_run(theirs, ids, new_tokens, device))
    ours_ms, theirs_ms = statistics.median(kvdemo), statistics.median(generate)
    return {
        "folder": "the trained tiny model, exported" if folder is None else str(folder),
        "context_tokens": int(context),
        "new_tokens": new_tokens,
        "kvdemo_ms": ours_ms,
        "generate_ms": theirs_ms,
        "ratio": ours_ms / theirs_ms if theirs_ms > 0 else None,
        "target": DECODE_TARGET,
    }


def decode_line(result: dict[str, Any]) -> str:
    """The doctor's line for :func:`decode_against_generate`'s result."""
    ratio = result["ratio"]
    verdict = "n/a" if ratio is None else ("PASS" if ratio <= result["target"] else "FAIL")
    return (
        f"decode per token ({result['folder']}, {result['context_tokens']} tokens of context, "
        f"{result['new_tokens']} new): kvdemo {result['kvdemo_ms']:.2f} ms, transformers' generate "
        f"{result['generate_ms']:.2f} ms, ratio {ratio:.2f} (target <= {result['target']:g}: {verdict})"
    )
