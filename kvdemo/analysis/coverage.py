"""Coverage diagnostic (CoRDS paper, Sec. 4.6): how well a compressed cache represents the full one.

For every token of the full cache (per layer and KV head), the cosine distance to its nearest retained
token, in three spaces: joint (keys and values each unit-normalised, so joint cosine is the mean of the
two), keys only and values only. Retained tokens are identified by provenance and looked up in the full
cache, so policies are compared on the same features (a curve further left covers better).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..cache.memory import KVMemory

SPACES = ("joint", "key", "value")
THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5)


@torch.inference_mode()
def nearest_retained_cosine(
    keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, block: int = 4096
) -> dict[str, torch.Tensor]:
    """Cosine distance of every token to its nearest retained token, per KV head: ``{space: [H * N]}``.

    ``keys``/``values [H, N, D]`` are the full cache's tokens; ``kept [H, K]`` the ids (into ``N``) of the
    tokens one head retained. ``joint`` is ``1 - max_j (cos_K + cos_V) / 2`` (one nearest token for both),
    ``key``/``value`` take the nearest token in their own space.
    """
    keys, values = F.normalize(keys.float(), dim=-1), F.normalize(values.float(), dim=-1)
    kept = kept.long().to(keys.device)[..., None]
    kept_keys = torch.gather(keys, 1, kept.expand(-1, -1, keys.shape[-1]))
    kept_values = torch.gather(values, 1, kept.expand(-1, -1, values.shape[-1]))
    out: dict[str, list[torch.Tensor]] = {space: [] for space in SPACES}
    for start in range(0, keys.shape[1], block):
        cos_k = keys[:, start : start + block] @ kept_keys.transpose(1, 2)
        cos_v = values[:, start : start + block] @ kept_values.transpose(1, 2)
        out["key"].append(1 - cos_k.max(dim=-1).values)
        out["value"].append(1 - cos_v.max(dim=-1).values)
        out["joint"].append(1 - ((cos_k + cos_v) / 2).max(dim=-1).values)
    return {space: torch.cat(parts, dim=1).flatten().clamp_min(0) for space, parts in out.items()}


@torch.inference_mode()
def nearest_retained_distances(full: KVMemory, kept: KVMemory, block: int = 4096) -> dict[str, torch.Tensor]:
    """Cosine distance of every full-cache token to its nearest retained token: ``{space: [N]}``.

    ``full`` must hold every visual token of the stream (the ``full`` policy) and ``kept`` must have
    watched the same stream; N = layers x KV heads x full visual tokens.
    """
    if full.grid_shape is None or kept.grid_shape != full.grid_shape or kept.num_grids != full.num_grids:
        raise ValueError("coverage needs two memories that watched the same stream")
    rows, cols = full.grid_shape
    expected = full.num_grids * rows * cols
    out: dict[str, list[torch.Tensor]] = {space: [] for space in SPACES}
    p = full.prefix_len
    for layer in range(full.num_layers):
        if full.frame[layer].shape[1] != expected:
            raise ValueError("the reference memory is compressed; coverage needs the full cache")
        # token id in the full cache = (grid * rows + row) * cols + col
        ids = (kept.frame[layer].long() * rows + kept.row[layer].long()) * cols + kept.col[layer].long()
        layer_distances = nearest_retained_cosine(full.keys[layer][0, :, p:], full.values[layer][0, :, p:], ids, block)
        for space, d in layer_distances.items():
            out[space].append(d)
    return {space: torch.cat(parts).cpu() for space, parts in out.items()}


def coverage_summary(distances: dict[str, torch.Tensor], points: int = 51) -> dict[str, Any]:
    """Per space: mean, median, p90, the CDF at a few distances, and the CDF curve (quantiles)."""
    summary = {}
    for space, d in distances.items():
        d = d.double()
        quantiles = torch.linspace(0, 1, points, dtype=torch.float64)
        summary[space] = {
            "mean": float(d.mean()),
            "median": float(d.median()),
            "p90": float(torch.quantile(d, 0.9)),
            "cdf_at": {f"{t:g}": float((d <= t).double().mean()) for t in THRESHOLDS},
            "curve": {"fraction": quantiles.tolist(), "distance": torch.quantile(d, quantiles).tolist()},
        }
    return summary


def coverage(full: KVMemory, kept: KVMemory) -> dict[str, Any]:
    """:func:`nearest_retained_distances` summarised (the report's ``coverage`` entry)."""
    return coverage_summary(nearest_retained_distances(full, kept))


def coverage_table(summaries: dict[str, dict[str, Any]]) -> str:
    """A text table: one row per (policy, space)."""
    head = f"{'policy':<16} {'space':<6} {'mean':>7} {'median':>7} {'p90':>7} " + " ".join(
        f"{'<=' + format(t, 'g'):>7}" for t in THRESHOLDS
    )
    lines = [head]
    for name, summary in summaries.items():
        for space in SPACES:
            s = summary[space]
            cdf = " ".join(f"{s['cdf_at'][format(t, 'g')]:>7.3f}" for t in THRESHOLDS)
            lines.append(f"{name:<16} {space:<6} {s['mean']:>7.3f} {s['median']:>7.3f} {s['p90']:>7.3f} {cdf}")
    return "\n".join(lines)
