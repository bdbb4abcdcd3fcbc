"""A stream of random keys and values at a model's cache shape, managed by a policy exactly as the engine manages its
memory, with no model: what the bench's per-policy measurements stream (:mod:`.policies`, :mod:`.host_store`,
:mod:`.passes`)."""

from __future__ import annotations

from typing import Any

import torch

from ..cache.attention import MemoryCache
from ..cache.budget import DEFAULT_KEEP_RATIO, Budget
from ..cache.memory import KVMemory
from ..devices.timing import Stopwatch
from ..policies import Policy, Probed
from ..stream.engine import must_compress
from ..testing import PREFIX_TOKENS, QWEN7B_SHAPE, append_random, qwen7b_rotation, synthetic_chunk, synthetic_probe


def simulated_stream(
    policy: Policy,
    grids: int,
    shape: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[KVMemory, list[dict[str, Any]]]:
    """Stream ``grids`` temporal grids of random keys/values into a memory on ``device`` managed by ``policy``
    exactly as the engine does (compress when the engine's trigger, :func:`kvdemo.stream.engine.must_compress`, says
    the next grid would overflow ``M``, then append), with no model. The values are drawn on the host, so every
    device streams the same ones.

    Returns the memory and one record per compression: grid, selection ms (and the policy's own phase
    split when it reports one), apply ms, and the bytes in the memory's offload stores after it (host memory).
    """
    shape = shape or QWEN7B_SHAPE
    per_grid = shape["grid"][0] * shape["grid"][1]
    # sized for grids of this size, as the engine sizes it at its first chunk (Budget.sized)
    budget = Budget.resolve(policy, shape["budget"], shape["keep"], default_ratio=DEFAULT_KEEP_RATIO)
    budget = budget.sized(policy, per_grid)
    generator = torch.Generator().manual_seed(seed)
    memory = KVMemory(shape["num_layers"], shape["num_kv_heads"], budget)
    cache = MemoryCache(memory)
    for layer in cache.layers:
        prefix = torch.randn(1, shape["num_kv_heads"], PREFIX_TOKENS, shape["head_dim"], generator=generator)
        prefix = prefix.to(device=device, dtype=dtype)
        layer.update(prefix, prefix)
    memory.commit_prefix(PREFIX_TOKENS)
    rotary = qwen7b_rotation(shape["head_dim"])
    heads = shape.get("num_heads", shape["num_kv_heads"])
    passes = []
    uncompressed: tuple[int, ...] = ()
    with torch.inference_mode():
        for grid in range(grids):
            if must_compress(budget, memory, uncompressed, per_grid):  # the engine's own trigger
                probe = None
                if isinstance(policy, Probed):
                    drawn = synthetic_probe(shape["num_layers"], heads, shape["head_dim"], dtype, grid)
                    probe = [p.to(device) for p in drawn]
                held_frames = frames_held(memory)
                watch = Stopwatch(memory.devices)
                selection = policy.compress(memory.slices(rotary, probe), budget.keep_for(per_grid))
                middle = watch.ms()
                memory.apply(selection)
                end = watch.ms()
                uncompressed = tuple(selection.uncompressed)
                record = {
                    "grid": grid,
                    "length": selection.indices[0].shape[1],
                    "select_ms": middle,
                    "apply_ms": end - middle,
                    "frames_held": held_frames,
                    "offloaded_bytes": memory.offloaded_bytes,
                }
                phases = selection.info.get("phase_ms")
                if phases:
                    record["phases_ms"] = dict(phases)
                passes.append(record)
            append_random(memory, synthetic_chunk(grid, 1, shape["grid"]), generator)
    return memory, passes


def frames_held(memory: KVMemory) -> int:
    """The most frames (temporal grids) any KV head of the memory's first layer holds tokens of (padding left out)."""
    frame = memory.frame[0].long()
    if frame.numel() == 0:
        return 0
    valid = memory.valid[0]
    span = int(frame.max()) + 1
    keyed = frame + torch.arange(frame.shape[0], device=frame.device)[:, None] * span  # (head, frame) pairs
    pairs = torch.unique(keyed if valid is None else keyed[valid])
    return int(torch.bincount(torch.div(pairs, span, rounding_mode="floor")).max())
