"""``python -m kvdemo doctor``: the device checklist, one command on any machine.

For every offline model of each family and every policy, on the chosen device (bfloat16 on CUDA, float32 on the
CPU): stream the bundled sample twice at ``M`` = half of what the full cache holds after it (``C`` = 3/4 ``M``),
ask twice, and check that each bounded policy stays under ``M``, that asking leaves the memory bit-identical, and
whether the answers and the memory are identical across the two runs (the table says where they are not). Then the
placement checks: every policy's compression with the memory's layers split across two devices (``cpu`` and
``cuda:0``; without a GPU, the CPU and :mod:`kvdemo.devices.emulated_device`), the attention backend SDPA takes for
kvdemo's masked calls (on CUDA, with what a new key length costs each backend and what each attention call holds at
real head shapes: :mod:`.attention_checks`), and timings per policy (prefill per chunk, compression pass, decode
per token, compression as % of prefill) on the tiny model and, with ``--real-shapes``, one compression pass on two
layers at Qwen2.5-VL-3B/-7B's per-layer cache shapes; with ``--full-depth``, whole models at released configs with
random weights, streamed per policy (:mod:`.fulldepth`); last, kvdemo's decode per token against transformers' own
``generate`` on the same weights and device (:mod:`.decode_check`). Prints tables, writes JSON; asserts nothing about
speed.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..cache.budget import DEFAULT_KEEP_RATIO, Budget
from ..devices.emulated_device import DEVICE as EMULATED
from ..devices.emulated_device import EmulatedDevice
from ..devices.timing import Stopwatch, synchronize
from ..models.catalog import OFFLINE_MODELS, families, released_configs
from ..models.loading import load_model
from ..policies import make_policy, policy_names
from ..stream.engine import StreamEngine
from ..stream.lineup import Contender, make_engines
from ..testing import QWEN3B_SHAPE, QWEN7B_SHAPE, qwen7b_rotation, synthetic_memory, synthetic_probe
from ..usage import UsageError
from ..world.synthetic import sample_episode
from . import fulldepth, write_json
from .attention_checks import attention_backend, attention_memory, key_length_cost
from .decode_check import decode_against_generate, decode_line
from .passes import time_pass

QUESTION = "What colour was the circle?"
#: The shortest clip the model matrix takes: at M = half the full cache and C = 3/4 M, M - C is an eighth of the
#: clip's tokens, so the clip needs eight chunks of two frames for M - C to hold one (the budget's own rule).
MIN_FRAMES = 16


def quick_models() -> list[str]:
    """The CI's small matrix: the first offline model of every family (the trained tiny model for its own)."""
    return [spec.offline[0].name for spec in dict.fromkeys(families().values()) if spec.offline]


def _digest(engine: StreamEngine) -> str:
    """A hash of what answering must not change: live keys and values, provenance, biases, linear state."""
    h = hashlib.sha256()
    memory = engine.memory
    for t in (*memory.keys, *memory.values):
        h.update(t.float().cpu().numpy().tobytes())
    for layer, store in enumerate(memory.layers):
        h.update(store.packed[:, : store.visual_len + store.text_len].cpu().numpy().tobytes())
        if store.bias is not None:
            h.update(store.bias[:, : memory.live_len(layer)].cpu().numpy().tobytes())
    for state in memory.linear_state.values():
        for t in state.values():
            h.update(t.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _one_run(model: Any, policy: str, frames: Any, budget: Budget | None, device: torch.device) -> dict[str, Any]:
    """Stream ``frames`` one temporal grid (two frames) at a time, ask twice; what the checklist records of one run."""
    engine = make_engines(model, [Contender(policy, budget=budget)], fps=2.0, max_new_tokens=8)[policy]
    for start in range(0, len(frames), 2):
        engine.feed(frames[start : start + 2])
    before = _digest(engine)
    synchronize(device)
    answers = [engine.answer(QUESTION) for _ in range(2)]
    unchanged = _digest(engine) == before
    stats = engine.stats
    decode = answers[0].ms - answers[0].ttft_ms
    return {
        "answer": answers[0].answer,
        "asked_twice_same": answers[0].answer == answers[1].answer,
        "memory_unchanged_by_asking": unchanged,
        "memory_digest": before,
        "peak_visual_tokens": max(e.visual_tokens for e in engine.memory.timeline),
        "chunks": stats.chunks,
        "compressions": stats.compressions,
        "prefill_ms_per_chunk": stats.prefill_ms / max(stats.chunks, 1),
        "compress_ms_per_pass": stats.compress_ms / max(stats.compressions, 1),
        "compress_pct_of_prefill": 100.0 * stats.compress_ms / max(stats.prefill_ms, 1e-9),
        "decode_ms_per_token": decode / max(answers[0].tokens - 1, 1),
    }


def step(text: str, start: float | None = None) -> None:
    """A progress line on stderr (the tables go to stdout): the checklist takes minutes on a CPU. ``start``: the
    checklist's ``time.monotonic()`` at its start, for the seconds so far."""
    elapsed = f"[{time.monotonic() - start:4.0f} s] " if start is not None else ""
    print(f"doctor: {elapsed}{text}", file=sys.stderr, flush=True)


def model_matrix(
    models: list[str], device: torch.device, frames: int, start: float | None = None
) -> list[dict[str, Any]]:
    """Every policy x ``models``, each run twice on ``device`` (a progress line per run, :func:`step`)."""
    rows = []
    episode = sample_episode()
    total = len(models) * len(policy_names())
    for name in models:
        model = load_model(name)
        if device.type == "cuda":
            model.hf.to(device=device, dtype=torch.bfloat16)
            model.device, model.dtype = device, torch.bfloat16
            if model.logit_bias is not None:
                model.logit_bias = model.logit_bias.to(device)
        video = episode.video.resized(OFFLINE_MODELS[name].geometry if name in OFFLINE_MODELS else model.geometry)
        clip = video.frames[:frames]
        # M: half of what the full cache holds after the clip (so every bounded policy compresses), C = 3/4 M.
        names = sorted(policy_names(), key=lambda p: make_policy(p).bounded)  # the full cache first
        M = None
        for policy_name in names:
            step(f"{name} x {policy_name}, streamed twice ({len(rows) + 1}/{total})", start)
            policy = make_policy(policy_name)
            budget = Budget.resolve(policy, M, None, default_ratio=DEFAULT_KEEP_RATIO) if policy.bounded else None
            with torch.inference_mode():
                first = _one_run(model, policy_name, clip, budget, device)
                second = _one_run(model, policy_name, clip, budget, device)
            if budget is None:
                M = max(first["peak_visual_tokens"] // 2, 1)
            rows.append(
                {
                    "model": name,
                    "policy": policy_name,
                    "budget": None if budget is None else budget.describe(),
                    "under_M": budget is None or first["peak_visual_tokens"] <= budget.M,
                    "same_across_runs": first["answer"] == second["answer"]
                    and first["memory_digest"] == second["memory_digest"],
                    **first,
                }
            )
    return rows


def split_matrix(device: torch.device) -> list[dict[str, Any]]:
    """Every bounded policy's compression on a memory whose layer 0 is on the host and the others on ``device``
    (on a CPU-only machine the emulated device), against the same compression on one device: same tokens?"""
    second = device if device.type == "cuda" else EMULATED
    rows = []
    for name in [p for p in policy_names() if make_policy(p).bounded]:
        outcome = []
        for placement in ("one device", "split"):
            policy = make_policy(name)
            budget = Budget.resolve(policy, 64, None, default_ratio=0.625)
            summary, keep = budget.summary, budget.keep_for(0)
            memory = synthetic_memory(3, 2, 16, 64, (2, 4), torch.float32, visual_tokens=64, summary_slots=summary)
            probe = synthetic_probe(3, 4, 16, torch.float32)
            mode = EmulatedDevice() if second == EMULATED and placement == "split" else contextlib.nullcontext()
            try:
                with mode, torch.inference_mode():
                    if placement == "split":
                        memory.to({0: "cpu", 1: second, 2: second})
                    slices = memory.slices(
                        rotary=qwen7b_rotation(16), probe=[p.to(d) for p, d in zip(probe, memory.devices)]
                    )
                    memory.apply(policy.compress(slices, keep))
                    memory.to("cpu")
                outcome.append(torch.cat([t.flatten() for s in memory.layers for t in (s.keys, s.values)]))
            except Exception as error:  # noqa: BLE001 (the checklist reports any failure as a row)
                outcome.append(f"{type(error).__name__}: {error}"[:160])
        ok = all(isinstance(o, torch.Tensor) for o in outcome) and torch.equal(outcome[0], outcome[1])
        rows.append(
            {
                "policy": name,
                "devices": f"cpu + {'emulated' if second == EMULATED else second}",
                "same_tokens": ok,
                "error": next((o for o in outcome if isinstance(o, str)), None),
            }
        )
    return rows


def real_shape_passes(
    device: torch.device,
    repeats: int,
    shapes: tuple[tuple[str, dict[str, Any]], ...] = (("3B", QWEN3B_SHAPE), ("7B", QWEN7B_SHAPE)),
) -> list[dict[str, Any]]:
    """One compression pass per bounded policy on two layers at each of ``shapes`` (label, per-layer shape;
    default Qwen2.5-VL-3B's and -7B's), with the M-RoPE rotation a policy that keeps keys before RoPE needs."""
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for label, shape in shapes:
        for name in [p for p in policy_names() if make_policy(p).bounded]:
            policy = make_policy(name)
            budget = Budget.resolve(policy, shape["budget"], None, default_ratio=shape["keep"] / shape["budget"])
            summary, keep = budget.summary, budget.keep_for(0)
            memory = synthetic_memory(
                2,
                shape["num_kv_heads"],
                shape["head_dim"],
                shape["budget"],
                shape["grid"],
                dtype,
                summary_slots=summary,
            ).to(device)
            rotary = qwen7b_rotation(shape["head_dim"])  # on the host: it moves its cos and sin to the keys
            rows.append({"shape": label, "policy": name, **time_pass(policy, memory, keep, repeats, rotary=rotary)})
    return rows


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    lines = ["  ".join(f"{title:>{len(title)}}" for title, _, _ in columns)]
    for row in rows:
        lines.append(
            "  ".join(
                format(row.get(key), fmt).rjust(len(title)) if row.get(key) is not None else "-".rjust(len(title))
                for title, key, fmt in columns
            )
        )
    return "\n".join(lines)


MATRIX_COLUMNS = [
    ("model               ", "model", "<20"),
    ("policy        ", "policy", "<14"),
    ("under M", "under_M", ""),
    ("ask keeps memory", "memory_unchanged_by_asking", ""),
    ("same 2 runs", "same_across_runs", ""),
    ("prefill ms/chunk", "prefill_ms_per_chunk", ".1f"),
    ("pass ms", "compress_ms_per_pass", ".2f"),
    ("pass % prefill", "compress_pct_of_prefill", ".1f"),
    ("decode ms/tok", "decode_ms_per_token", ".1f"),
]


def doctor_command(args) -> int:
    """``python -m kvdemo doctor`` with its parsed arguments: the checklist's exit status (0: every check passed)."""
    models = [m.strip() for m in args.models.split(",")] if args.models else None
    full = [m.strip() for m in args.full_depth.split(",")] if args.full_depth else []
    report = doctor(
        args.device,
        models,
        args.frames,
        args.real_shapes,
        json_path=args.json,
        full_depth=full,
        seconds=args.seconds,
        checkpoints=args.checkpoints,
        keep_checkpoints=args.keep_checkpoints,
    )
    return 0 if report["ok"] else 1


def doctor(
    device_name: str = "auto",
    models: list[str] | None = None,
    frames: int = 24,
    real_shapes: bool = False,
    repeats: int = 3,
    json_path: str | None = None,
    full_depth: list[str] | None = None,
    seconds: float = 60.0,
    checkpoints: str = "full-depth-checkpoints",
    keep_checkpoints: bool = False,
) -> dict[str, Any]:
    """Run the checklist (see the module docstring); print its tables; return (and optionally write) the JSON."""
    if frames < MIN_FRAMES:
        raise UsageError(
            f"--frames {frames} is too short for the checklist: give at least {MIN_FRAMES} (M is half of "
            f"what the full cache holds after the clip and C = 3/4 M, so M - C holds one two-frame chunk "
            f"from {MIN_FRAMES} frames on)"
        )
    if full_depth and not seconds > 0:
        raise UsageError(f"--seconds must be positive (seconds of stream per full-depth run), got {seconds:g}")
    device = torch.device(
        "cuda:0"
        if device_name == "auto" and torch.cuda.is_available()
        else "cpu"
        if device_name == "auto"
        else device_name
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no GPU (torch.cuda.is_available() is False)")
    unknown = sorted(set(full_depth or ()) - set(released_configs()))
    if unknown:
        raise SystemExit(f"error: --full-depth knows {', '.join(released_configs())}; not {', '.join(unknown)}")
    watch, start = Stopwatch(device), time.monotonic()
    report: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": str(device),
            "threads": torch.get_num_threads(),
        }
    }
    step(f"the attention backend on {device}", start)
    report["attention"] = attention_backend(device)
    print(f"attention on {device}: " + ", ".join(f"{k}={v}" for k, v in report["attention"].items()))
    report["key_lengths"] = key_length_cost(device)
    if report["key_lengths"]:
        print(
            "\nkvdemo's masked SDPA call when each call meets a new key length (a stream) or a repeated one, median ms:"
        )
        print(
            _table(
                report["key_lengths"],
                [
                    ("backend         ", "backend", "<16"),
                    ("queries", "queries", "d"),
                    ("keys from", "keys", "d"),
                    ("new length ms", "new_length_ms", ".2f"),
                    ("same length ms", "same_length_ms", ".2f"),
                    ("error", "error", ""),
                ],
            )
        )
    if device.type == "cuda":
        report["attention_memory"] = attention_memory(device)
        print("\nkvdemo's attention for a 720-token chunk over 6144 cached keys, bfloat16 (MB above what was held):")
        print(
            _table(
                report["attention_memory"],
                [
                    ("shape", "shape", "<5"),
                    ("call                      ", "call", "<26"),
                    ("peak MB", "peak_mb", ".1f"),
                    ("ms", "ms", ".2f"),
                    ("same as one block", "same_as_one_block", ""),
                    ("error", "error", ""),
                ],
            )
        )
    step("every policy with the memory's layers split across two devices", start)
    report["split"] = split_matrix(device)
    print("\nlayers split across two devices (layer 0 on the host):")
    print(
        _table(
            report["split"],
            [
                ("policy        ", "policy", "<14"),
                ("devices        ", "devices", "<15"),
                ("same tokens", "same_tokens", ""),
                ("error", "error", ""),
            ],
        )
    )
    report["models"] = model_matrix(list(models or quick_models()), device, frames, start)
    print(
        f"\nevery policy x model on {device}, {frames} frames of the bundled sample, M = half the full cache's tokens:"
    )
    print(_table(report["models"], MATRIX_COLUMNS))
    if real_shapes:
        step("one compression pass per policy at Qwen2.5-VL-3B/-7B layer shapes", start)
        report["real_shapes"] = real_shape_passes(device, repeats)
        print("\none compression pass, two layers at Qwen2.5-VL per-layer cache shapes (median ms):")
        print(
            _table(
                report["real_shapes"],
                [
                    ("shape", "shape", "<5"),
                    ("policy        ", "policy", "<14"),
                    ("select ms", "select_ms", ".1f"),
                    ("apply ms", "apply_ms", ".1f"),
                    ("total ms", "total_ms", ".1f"),
                ],
            )
        )
    if full_depth:
        _write(report, json_path)  # what is measured so far survives a stream that runs out of time
        print(f"\nrandom weights at real configs, every layer, {seconds:g} s of stream per policy:")
        report["full_depth"] = fulldepth.full_depth(
            full_depth, str(device), seconds, checkpoints, keep_folders=tuple(full_depth) if keep_checkpoints else ()
        )
        _write(report, json_path)
    step("kvdemo's decode beside transformers' generate", start)
    report["decode"] = decode_check(device, full_depth, checkpoints)
    print("\n" + decode_line(report["decode"]))
    failed = [r for r in report["models"] if not (r["under_M"] and r["memory_unchanged_by_asking"])]
    failed += [r for r in report["split"] if not r["same_tokens"]]
    report["ok"] = not failed
    report["seconds"] = watch.ms() / 1000
    print(f"\n{'all checks passed' if not failed else f'{len(failed)} check(s) FAILED'} in {report['seconds']:.0f} s")
    _write(report, json_path)
    return report


def decode_check(device: torch.device, full_depth: list[str] | None, checkpoints: str) -> dict[str, Any]:
    """kvdemo's decode per token against transformers' ``generate`` (:mod:`.decode_check`): on the first full-depth
    checkpoint when the doctor streams some (written again, then removed), else on the trained tiny model."""
    if not full_depth:
        return decode_against_generate(device)
    folder = Path(checkpoints) / f"decode-{full_depth[0]}"
    try:
        fulldepth.write_random_checkpoint(full_depth[0], folder, device)
        return decode_against_generate(device, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write(report: dict[str, Any], json_path: str | None) -> None:
    if json_path:
        write_json(json_path, report)
