"""``python -m kvdemo doctor --full-depth``: random weights at real model configs, every layer, streamed end to end.

The real-shape passes of :mod:`.doctor` time one compression on two layers; this streams a whole model: a
checkpoint folder with seeded random weights and the real config of a released model (every language and vision
layer, hidden sizes, heads, M-RoPE sections, DeepStack), written with the offline models' byte tokenizer and
loaded back through :func:`kvdemo.models.loading.load_model`, the path a user's own checkpoint takes. The vocabulary
is the byte tokenizer's (265 ids instead of ~152k; kvdemo's own choice, so that every id decodes): the embedding
and output rows shrink, nothing that the KV cache, the attention or the compression touch. Each policy (and the
full cache) streams ``seconds`` of the bundled generated sample, looped and upscaled to 1280 x 720 so a grid holds
as many tokens as a real HD clip at the app's pixel range, at the family's default budget; per run: vision
encoding, prefill and compression per chunk, decode per token, peak device memory beside the weights and beside
the budget's bound (``M`` tokens' keys and values), compression as a share of prefill, model work per second of
stream. Answers are noise (random weights). Prints a table, returns rows; asserts nothing about speed.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache.attention import ATTN_IMPLEMENTATION
from ..cache.budget import Budget
from ..devices.timing import Stopwatch
from ..media.video import resize_frames
from ..models.catalog import default_budget, released_configs
from ..models.loading import load_model
from ..models.tiny_random import TEXT_IDS, VOCAB, byte_tokenizer, qwen_ids
from ..policies import make_policy, policy_names
from ..stream.engine import EngineStop, StreamEngine
from ..world.synthetic import sample_episode

SOURCE_SIZE = (720, 1280)
QUESTION = "What happened in the video?"


def write_random_checkpoint(name: str, folder: str | Path, device: str | torch.device = "cpu", seed: int = 0) -> Path:
    """A checkpoint folder of the released config ``name`` (:func:`~kvdemo.models.catalog.released_configs`) with
    seeded random weights (bfloat16 on CUDA, float32 on the CPU; built on ``device``) and the byte tokenizer; what
    ``load_model(folder)`` and the app load."""
    from transformers import AutoConfig, AutoModelForImageTextToText  # deferred: only writing a checkpoint needs them

    spec = released_configs()[name]
    text = dict(spec["text_config"], vocab_size=VOCAB, **TEXT_IDS)
    config = AutoConfig.for_model(
        spec["model_type"],
        text_config=text,
        vision_config=spec["vision_config"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        **qwen_ids(),
        **TEXT_IDS,
    )
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    folder = Path(folder)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    del model
    _release(device)
    return folder


def looped_frames(seconds: float, fps: float = 2.0) -> np.ndarray:
    """``seconds`` of the bundled generated sample at ``fps``, looped, upscaled to :data:`SOURCE_SIZE` ``[T, H, W, 3]``."""
    import torchvision.transforms.v2.functional as tvF  # deferred with torch's vision ops, as in kvdemo.media.video

    frames = sample_episode().video.frames
    count = max(int(round(seconds * fps)), 2)
    # Each distinct frame upscaled once, in uint8, then looped (not every looped copy in float).
    big = tvF.resize(torch.from_numpy(frames).permute(0, 3, 1, 2), list(SOURCE_SIZE), antialias=True)
    return big.permute(0, 2, 3, 1).contiguous().numpy()[np.arange(count) % len(frames)]


def _release(device: str | torch.device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _device_bytes(device: torch.device, peak: bool = False) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)


def stream_run(
    model: Any, policy_name: str, frames: np.ndarray, budget: Budget | None, fps: float, max_new_tokens: int = 16
) -> dict[str, Any]:
    """One engine over ``frames`` (two at a time), one question at the end: timings, memory, whether it stopped."""
    device = model.device
    engine = StreamEngine(model, make_policy(policy_name), budget=budget, fps=fps, max_new_tokens=max_new_tokens)
    before = _device_bytes(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stopped, watch = None, Stopwatch(device)
    try:
        for start in range(0, len(frames), 2):
            engine.feed(frames[start : start + 2])
    except EngineStop as stop:
        stopped = str(stop).splitlines()[0][:80]
    stream_ms = watch.ms()
    answer = engine.answer(QUESTION)
    stats, report = engine.stats, engine.report()
    seconds = engine.last_time_s + 1 / fps if engine.frames_fed else 0.0
    token_bytes = engine.memory.token_bytes()
    peak = _device_bytes(device, peak=True)
    return {
        "policy": policy_name,
        "budget": None if budget is None else f"{budget.M}/{budget.C}",
        "chunks": stats.chunks,
        "tokens_per_grid": engine.tokens_per_grid,
        "compressions": stats.compressions,
        "stopped": stopped,
        "stream_s": round(seconds, 1),
        "encode_ms_per_chunk": stats.encode_ms / max(stats.chunks, 1),
        "prefill_ms_per_chunk": stats.prefill_ms / max(stats.chunks, 1),
        "compress_ms_per_pass": stats.compress_ms / max(stats.compressions, 1),
        "compress_pct_of_prefill": 100.0 * stats.compress_ms / max(stats.prefill_ms, 1e-9),
        "decode_ms_per_token": (answer.ms - answer.ttft_ms) / max(answer.tokens - 1, 1),
        "ttft_ms": answer.ttft_ms,
        "model_s_per_stream_s": (stats.encode_ms + stats.prefill_ms + stats.compress_ms) / 1000 / max(seconds, 1e-9),
        "wall_ms": stream_ms,
        "peak_visual_tokens": report["peak_visual_tokens"],
        "peak_cache_mb": report["peak_cache_bytes"] / 2**20,
        "bound_mb": None if budget is None else budget.M * token_bytes / 2**20,
        "peak_above_weights_mb": None if peak is None else (peak - before) / 2**20,
        "weights_mb": None if before is None else before / 2**20,
        "answer": answer.answer[:40],
    }


def full_depth(
    names: list[str],
    device_name: str,
    seconds: float,
    folder: str | Path,
    fps: float = 2.0,
    keep_folders: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Every policy (and the full cache) streamed through each of ``names`` (released configs,
    :func:`~kvdemo.models.catalog.released_configs`) on ``device_name``; the checkpoints are written under
    ``folder`` and removed after their runs unless named in ``keep_folders``. Rows for :data:`COLUMNS`."""
    device = torch.device(device_name)
    frames = looped_frames(seconds, fps)
    rows = []
    for name in names:
        path = Path(folder) / name
        watch = Stopwatch(device)
        write_random_checkpoint(name, path, device)
        written_s = watch.ms() / 1000
        watch.restart()
        model = load_model(str(path), device=str(device))
        loaded_s = watch.ms() / 1000
        clip = resize_frames(frames, model.geometry)
        M, C, _ = default_budget(str(path))
        print(
            f"\n{name}: {model.num_layers} layers, {model.num_kv_heads} KV heads of {model.head_dim}, {model.dtype} on "
            f"{model.device}; written in {written_s:.0f} s, loaded in {loaded_s:.0f} s; {len(clip)} frames of "
            f"{clip.shape[2]}x{clip.shape[1]}, M = {M}, C = {C}",
            flush=True,
        )
        print(header(), flush=True)
        for policy_name in sorted(policy_names(), key=lambda p: make_policy(p).bounded):
            policy = make_policy(policy_name)
            budget = Budget.resolve(policy, M, C) if policy.bounded else None
            try:
                with torch.inference_mode():
                    row = {"model": name, **stream_run(model, policy_name, clip, budget, fps)}
            except Exception as error:  # noqa: BLE001 (a failing run is a row of the table; the others still run)
                row = {
                    "model": name,
                    "policy": policy_name,
                    "stopped": f"{type(error).__name__}: {error}".splitlines()[0][:120],
                }
            rows.append(row)
            print(_row_text(row), flush=True)
            _release(device)
        del model
        _release(device)
        if name not in keep_folders:
            shutil.rmtree(path, ignore_errors=True)
    return rows


COLUMNS = [
    ("model            ", "model", "<17"),
    ("policy        ", "policy", "<14"),
    ("tok/grid", "tokens_per_grid", "d"),
    ("encode ms", "encode_ms_per_chunk", ".1f"),
    ("prefill ms", "prefill_ms_per_chunk", ".1f"),
    ("pass ms", "compress_ms_per_pass", ".1f"),
    ("pass % prefill", "compress_pct_of_prefill", ".2f"),
    ("decode ms/tok", "decode_ms_per_token", ".1f"),
    ("model s / stream s", "model_s_per_stream_s", ".3f"),
    ("peak tokens", "peak_visual_tokens", "d"),
    ("cache MB", "peak_cache_mb", ".0f"),
    ("bound MB", "bound_mb", ".0f"),
    ("peak-weights MB", "peak_above_weights_mb", ".0f"),
    ("stopped", "stopped", ""),
]


def _row_text(row: dict[str, Any]) -> str:
    return "  ".join(
        format(row[key], fmt).rjust(len(title)) if row.get(key) is not None else "-".rjust(len(title))
        for title, key, fmt in COLUMNS
    )


def header() -> str:
    """The column titles of :func:`_row_text`."""
    return "  ".join(title for title, _, _ in COLUMNS)
