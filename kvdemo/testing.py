"""Fixtures shared by the tests and the benchmarks: memories and chunks of random keys and values at real
per-layer shapes, written the way a model writes them (through :class:`~kvdemo.cache.attention.MemoryCache`), with
no model; the M-RoPE rotation of a Qwen2.5-VL-shaped language model; random probe queries."""

from __future__ import annotations

import torch

from .cache.attention import MemoryCache
from .cache.budget import Budget
from .cache.chunk import VisualChunk
from .cache.memory import KVMemory
from .models.catalog import DEFAULT_REAL_MODEL, families

#: Qwen2.5-VL-7B's language model cache geometry, and InfiniPot-V's budget.
QWEN7B_SHAPE = dict(num_layers=28, num_kv_heads=4, num_heads=28, head_dim=128, budget=6144, keep=4608, grid=(16, 16))
#: Qwen2.5-VL-3B's language model cache geometry (the default real model) and the app's defaults for it.
QWEN3B_SHAPE = dict(num_layers=36, num_kv_heads=2, head_dim=128, budget=6144, keep=4608, grid=(24, 32))
#: Qwen2.5-VL's rope_theta; its M-RoPE sections split a head's D/2 frequencies 2 : 3 : 3 ([16, 24, 24] at D = 128).
QWEN_ROPE_THETA = 1_000_000.0
PROBE_TOKENS = 12
PREFIX_TOKENS = 20


def qwen7b_rotation(head_dim: int = 128):
    """The M-RoPE rotation of a Qwen2.5-VL-shaped language model with ``head_dim`` (no weights needed)."""
    from transformers import Qwen2_5_VLTextConfig  # deferred: only the rotation needs transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    from .models.adapter import Rotation  # deferred with it (the model adapters import transformers)

    config = Qwen2_5_VLTextConfig(
        hidden_size=head_dim * 28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": QWEN_ROPE_THETA,
            "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16],
        },
    )
    return Rotation(Qwen2_5_VLRotaryEmbedding(config))


def synthetic_probe(
    num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> list[torch.Tensor]:
    """Random probe queries ``[H_q, T, D]`` per layer (what the engine reads a probe text with)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_heads, PROBE_TOKENS, head_dim, generator=generator).to(dtype) for _ in range(num_layers)]


def synthetic_memory(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    budget: int,
    grid: tuple[int, int],
    dtype: torch.dtype,
    seed: int = 0,
    visual_tokens: int | None = None,
    summary_slots: int = 0,
) -> KVMemory:
    """A :class:`KVMemory` holding ``visual_tokens`` (default ``budget``) random visual tokens laid out as
    whole frames of ``grid`` after a short prefix, written the way a model writes them (through the
    memory's cache), with room for ``budget``."""
    generator = torch.Generator().manual_seed(seed)
    memory = KVMemory(num_layers, num_kv_heads, Budget(budget + summary_slots, summary=summary_slots))

    def random_kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, num_kv_heads, n, head_dim)
        return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)

    cache = MemoryCache(memory)
    for layer in cache.layers:
        layer.update(*random_kv(PREFIX_TOKENS))
    memory.commit_prefix(PREFIX_TOKENS)
    tokens = budget if visual_tokens is None else visual_tokens
    append_random(memory, synthetic_chunk(0, tokens // (grid[0] * grid[1]), grid), generator)
    return memory


def append_random(memory: KVMemory, chunk: VisualChunk, generator: torch.Generator) -> None:
    """Append ``chunk``'s tokens with random keys/values through the memory's cache (as a model would)."""
    cache = MemoryCache(memory)
    for layer in cache.layers:
        store = memory.layers[layer.layer]
        shape = (1, store.keys.shape[1], chunk.num_tokens, store.keys.shape[-1])
        like = {"device": store.keys.device, "dtype": store.keys.dtype}  # drawn on the host: the same values anywhere
        keys, values = (torch.randn(shape, generator=generator).to(**like) for _ in range(2))
        layer.update(keys, values)
    memory.commit_append(chunk, synthetic_positions(chunk, PREFIX_TOKENS))


def synthetic_positions(chunk: VisualChunk, start: int) -> torch.Tensor:
    """Positions ``[3, n]`` of ``chunk``'s tokens after ``start`` tokens, as the default real model's family puts
    them (its spec's ``synthetic_positions``: no model needed)."""
    spec = next(spec for spec in families().values() if DEFAULT_REAL_MODEL in spec.checkpoints)
    return spec.synthetic_positions(chunk, start)


def synthetic_chunk(first_grid: int, grids: int, grid: tuple[int, int]) -> VisualChunk:
    """Provenance of ``grids`` whole temporal grids (no embeddings: the memory only needs provenance)."""
    per_grid = grid[0] * grid[1]
    local = torch.arange(grids * per_grid)
    return VisualChunk(
        embeds=torch.empty(grids * per_grid, 0),
        grid=first_grid + local // per_grid,
        row=(local % per_grid) // grid[1],
        col=local % grid[1],
        first_grid=first_grid,
        num_grids=grids,
        rows=grid[0],
        cols=grid[1],
        grid_times_s=[float(first_grid + g) for g in range(grids)],
        frames=2 * grids,
        second_per_grid=1.0,
    )
