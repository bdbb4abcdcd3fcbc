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


#: Beam-search scores are fixed point: each log-probability is rounded to a multiple of 1 / SCORE_SCALE and tuples
#: are scored by exact int64 sums (kvdemo's; see :func:`beam_search`).
SCORE_SCALE = 2**32


def beam_search(hist: torch.Tensor, modes: int, beam: int, smoothing: float) -> torch.Tensor:
    """Alg. 3: the top-``modes`` code tuples of the factorised distribution of ``hist [..., G, C]``
    (Eq. 3 smoothing), by beam search over sub-quantisers -> codes ``[..., modes, G]``, best first.

    **The order (kvdemo's, the paper gives none for ties).** A tuple's score is ``sum_g round(2^32 log P(g, z_g))``,
    summed exactly in int64 (log-probabilities closer than 2^-32 count as equal); higher scores come first, and equal
    scores go to the lexicographically smaller tuple (the lower codeword in the first sub-quantiser where they
    differ). Ties are common: codewords with equal counts have equal probabilities.

    Each sub-quantiser contributes only its ``modes`` best codewords under that order (a tuple with a lower-ranked
    code cannot be among the top ``modes``: swapping that code for any of the ``modes`` better ones gives ``modes``
    better tuples), which shrinks every step's candidates without changing the result. For the same reason the
    beam never needs to be wider than ``modes``: a prefix outside the best ``modes`` prefixes has ``modes`` better
    ones, each of which completes with the same suffix to a better tuple (integer sums are exact, and a tie between
    prefixes is decided by the prefixes, whatever follows). So ``beam`` (the paper's B = 4S) is honoured as an upper
    bound and the search runs ``min(beam, modes)`` wide, returning exactly the top ``modes`` tuples of the order.
    """
    *lead, groups, codewords = hist.shape
    counts = hist.double()
    logp = torch.log((counts + smoothing) / (counts.sum(-1, keepdim=True) + codewords * smoothing))
    score = torch.round(logp * SCORE_SCALE).long()  # [..., G, C]
    code = torch.arange(codewords, device=hist.device)
    top = min(modes, codewords)
    width_max = min(beam, modes)
    if (int(score.abs().max()) * groups + 1) * max(width_max, 1) * codewords >= 2**62:
        raise ValueError("beam search scores would overflow int64: fewer pseudo-tokens or codewords")
    # Per sub-quantiser, its best codewords (score first, then the lower codeword): one unique int64 key each.
    code_ids = torch.topk(score * codewords + (codewords - 1 - code), top, dim=-1).indices  # [..., G, top], best first
    code_score = torch.gather(score, -1, code_ids)
    scores = torch.zeros(*lead, 1, dtype=torch.long, device=hist.device)
    lex = torch.zeros_like(scores)  # each beam's rank in lexicographic order of its prefix
    parents, picked = [], []  # per sub-quantiser: each beam's parent beam and its codeword [..., width]
    for g in range(groups):
        candidates = (scores[..., :, None] + code_score[..., None, g, :]).flatten(-2)  # [..., width * top]
        order = (lex[..., :, None] * codewords + code_ids[..., None, g, :]).flatten(-2)  # lexicographic rank of prefix+code
        span = scores.shape[-1] * codewords  # order < span
        width = min(beam, modes, candidates.shape[-1])
        pick = torch.topk(candidates * span + (span - 1 - order), width, dim=-1).indices  # unique keys, best first
        scores = torch.gather(candidates, -1, pick)
        lex = torch.argsort(torch.argsort(torch.gather(order, -1, pick), dim=-1), dim=-1)
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
