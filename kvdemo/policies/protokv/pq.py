"""ProtoKV's residual statistics as product quantisation (paper 003, App. A.1 and A.3): codebooks trained by
k-means on a warm-up reservoir, residuals encoded to one codeword per sub-space, code tuples decoded back to
residuals, and Alg. 3's beam search for the most likely code tuples of a prototype's histograms.

Shapes: ``B`` bank rows (layer x KV head), ``G`` sub-quantisers of ``C`` codewords over ``D / G`` dimensions.
"""

from __future__ import annotations

import torch

from ...tensors import as_words


def train_codebooks(reservoir: torch.Tensor, groups: int, codewords: int, iterations: int = 20) -> torch.Tensor:
    """k-means per row and sub-space on the warm-up reservoir ``[B, R, D]`` -> codebooks ``[B, G, C, D/G]``.

    Deterministic: the initial codewords are reservoir points at evenly spaced indices; Lloyd iterations
    on the whole reservoir (one mini-batch); an emptied cluster keeps its codeword.
    """
    rows, count, dim = reservoir.shape
    points = reservoir.view(rows, count, groups, dim // groups).transpose(1, 2).reshape(rows * groups, count, dim // groups)
    start = torch.linspace(0, count - 1, codewords, device=reservoir.device).round().long()
    centres = points[:, start].clone()
    for _ in range(iterations):
        nearest = torch.cdist(points, centres).argmin(dim=-1)  # [BG, R]
        sums = torch.zeros_like(centres).scatter_add_(1, nearest[..., None].expand_as(points), points)
        counts = torch.zeros(centres.shape[:2], device=points.device).scatter_add_(1, nearest, torch.ones_like(nearest, dtype=torch.float32))
        centres = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centres)
    return centres.view(rows, groups, codewords, dim // groups)


def pq_encode(residual: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest codeword per sub-space: ``residual [B, E, D]``, per-row ``codebook [B, G, C, D/G]`` -> codes
    ``[B, E, G]`` (one batched distance per row and sub-space)."""
    rows, tokens, dim = residual.shape
    groups, codewords, sub = codebook.shape[1:]
    parts = residual.view(rows, tokens, groups, sub).transpose(1, 2).reshape(rows * groups, tokens, sub)
    distance = torch.cdist(parts, codebook.reshape(rows * groups, codewords, sub))  # [B*G, E, C]
    return distance.argmin(dim=-1).view(rows, groups, tokens).transpose(1, 2)


def pq_decode(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``codes [B, U, S, G]`` with per-row ``codebook [B, G, C, D/G]`` -> residuals ``[B, U, S, D]``."""
    rows, protos, modes, groups = codes.shape
    codewords, sub = codebook.shape[-2:]
    row_ids = torch.arange(rows, device=codes.device)[:, None, None, None]
    flat = ((row_ids * groups + torch.arange(groups, device=codes.device)) * codewords + codes).reshape(-1)
    # One index_select of codeword rows (as int64 words when they are whole words: see as_words).
    picked = as_words(codebook.reshape(-1, sub).contiguous()).index_select(0, flat).view(codebook.dtype)
    return picked.view(rows, protos, modes, groups * sub)


def beam_search(hist: torch.Tensor, modes: int, beam: int, smoothing: float) -> torch.Tensor:
    """Alg. 3: the top-``modes`` code tuples of the factorised distribution of ``hist [..., G, C]``
    (Eq. 3 smoothing), by beam search over sub-quantisers -> codes ``[..., modes, G]``.

    Each sub-quantiser contributes only its ``modes`` most likely codewords (a tuple with a lower-ranked
    code cannot be among the top ``modes``: swapping that code for any of the ``modes`` better ones gives
    ``modes`` better tuples), which shrinks every step's candidates without changing the result. For the same
    reason the beam never needs to be wider than ``modes``: a prefix outside the best ``modes`` prefixes has
    ``modes`` better ones, each of which completes with the same suffix to a better tuple. So ``beam`` (the
    paper's B = 4S) is honoured as an upper bound and the search runs ``min(beam, modes)`` wide, with the
    same tuples as a ``beam``-wide search. Ties go
    to lower codewords (a ramp far below the log-probability resolution), so the search is deterministic.
    """
    *lead, groups, codewords = hist.shape
    counts = hist.float()
    logp = torch.log((counts + smoothing) / (counts.sum(-1, keepdim=True) + codewords * smoothing))
    logp = logp - torch.arange(codewords, device=hist.device, dtype=torch.float32) * 1e-6
    top = min(modes, codewords)
    logp, code_ids = torch.topk(logp, top, dim=-1)  # [..., G, top], best first
    scores = torch.zeros(*lead, 1, device=hist.device)
    parents, picked = [], []  # per sub-quantiser: each beam's parent beam and its codeword [..., width]
    for g in range(groups):
        candidates = (scores[..., :, None] + logp[..., None, g, :]).flatten(-2)  # [..., width * top]
        width = min(beam, modes, candidates.shape[-1])
        scores, pick = torch.topk(candidates, width, dim=-1)  # sorted, best first
        parents.append(torch.div(pick, top, rounding_mode="floor"))
        picked.append(torch.gather(code_ids[..., g, :], -1, pick % top))
    # Backtrack the best beams through their parents (instead of copying every beam's tuple at every step).
    beams = torch.arange(min(modes, width), device=hist.device).expand(*lead, -1).contiguous()
    tuple_codes = []
    for g in reversed(range(groups)):
        tuple_codes.append(torch.gather(picked[g], -1, beams))
        beams = torch.gather(parents[g], -1, beams)
    codes = torch.stack(tuple_codes[::-1], dim=-1)  # [..., n, G]
    if codes.shape[-2] < modes:  # fewer distinct tuples than modes (tiny codebooks): repeat the best
        codes = torch.cat([codes, codes[..., :1, :].expand(*codes.shape[:-2], modes - codes.shape[-2], groups)], dim=-2)
    return codes[..., :modes, :]
