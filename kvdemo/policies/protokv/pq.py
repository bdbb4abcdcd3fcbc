"""ProtoKV's residual statistics as product quantisation (paper 003, App. A.1 and A.3): codebooks trained by
k-means on a warm-up reservoir, residuals encoded to one codeword per sub-space, code tuples decoded back to
residuals, and Alg. 3's beam search for the most likely code tuples of a prototype's histograms.

Shapes: ``B`` bank rows (layer x KV head), ``G`` sub-quantisers of ``C`` codewords over ``D / G`` dimensions.
"""

from __future__ import annotations

import math

import torch

from ...tensors import take_rows
from ..topk import arg_min, top_k_values


def train_codebooks(reservoir: torch.Tensor, groups: int, codewords: int, iterations: int = 20) -> torch.Tensor:
    """k-means per row and sub-space on the warm-up reservoir ``[B, R, D]`` -> codebooks ``[B, G, C, D/G]``.

    Deterministic: the initial codewords are reservoir points at evenly spaced indices; Lloyd iterations
    on the whole reservoir (one mini-batch); an emptied cluster keeps its codeword.
    """
    rows, count, dim = reservoir.shape
    points = (
        reservoir.view(rows, count, groups, dim // groups).transpose(1, 2).reshape(rows * groups, count, dim // groups)
    )
    start = torch.linspace(0, count - 1, codewords, device=reservoir.device).round().long()
    centres = points[:, start].clone()
    for _ in range(iterations):
        nearest = arg_min(torch.cdist(points, centres))  # [BG, R]
        sums = torch.zeros_like(centres).scatter_add_(1, nearest[..., None].expand_as(points), points)
        counts = torch.zeros(centres.shape[:2], device=points.device).scatter_add_(
            1, nearest, torch.ones_like(nearest, dtype=torch.float32)
        )
        centres = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centres)
    return centres.view(rows, groups, codewords, dim // groups)


def pq_encode(residual: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest codeword per sub-space: ``residual [B, E, D]``, per-row ``codebook [B, G, C, D/G]`` -> codes
    ``[B, E, G]`` (one batched distance per row and sub-space)."""
    rows, tokens, dim = residual.shape
    groups, codewords, sub = codebook.shape[1:]
    parts = residual.view(rows, tokens, groups, sub).transpose(1, 2).reshape(rows * groups, tokens, sub)
    distance = torch.cdist(parts, codebook.reshape(rows * groups, codewords, sub))  # [B*G, E, C]
    return arg_min(distance).view(rows, groups, tokens).transpose(1, 2)


def pq_decode(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``codes [B, U, S, G]`` with per-row ``codebook [B, G, C, D/G]`` -> residuals ``[B, U, S, D]``."""
    rows, protos, modes, groups = codes.shape
    codewords, sub = codebook.shape[-2:]
    row_ids = torch.arange(rows, device=codes.device)[:, None, None, None]
    flat = ((row_ids * groups + torch.arange(groups, device=codes.device)) * codewords + codes).reshape(-1)
    picked = take_rows(codebook.reshape(-1, sub).contiguous(), flat)  # one gather of codeword rows
    return picked.view(rows, protos, modes, groups * sub)


#: Beam-search scores are fixed point: each log-probability is rounded to a multiple of 1 / SCORE_SCALE and tuples
#: are scored by exact int64 sums (kvdemo's; see :func:`beam_search`).
SCORE_SCALE = 2**32


def _floor_divmod(x: torch.Tensor, divisor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x // divisor, x mod divisor)`` of int64 ``x`` (floor division, non-negative remainder), by a shift and a mask
    when ``divisor`` is a power of two (exact for negative ``x`` in two's complement; CPU int64 division is not
    vectorised)."""
    if divisor & (divisor - 1) == 0:
        return x >> (divisor.bit_length() - 1), x & (divisor - 1)
    return torch.div(x, divisor, rounding_mode="floor"), x % divisor


def _dominance_pairs(beams: int, codes: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (beam ``i``, code ``j``) pairs of one beam-search step that can be among its ``width`` best: ``(i+1)(j+1) <=
    width``, as two index tensors ``[P]``. Beams and codes both come best first under the search's order, and a
    candidate's order is monotone in each (a better prefix or a better code gives a better tuple, ties included), so
    ``(i, j)`` is beaten by every ``(i', j') <= (i, j)``: ``(i+1)(j+1) - 1`` candidates."""
    pairs = [(i, j) for i in range(beams) for j in range(codes) if (i + 1) * (j + 1) <= width]
    index = torch.tensor(pairs, dtype=torch.long, device=device)
    return index[:, 0], index[:, 1]


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
    Within a step only the candidates :func:`_dominance_pairs` leaves can be among its ``width`` best (20 of 64 at
    ``S = 8``: kvdemo's), so the others are never formed; a sorted key carries its codeword and prefix in its low
    digits, so the search sorts values (:func:`~kvdemo.policies.topk.top_k_values`) and takes no indices.
    """
    *lead, groups, codewords = hist.shape
    code = torch.arange(codewords, device=hist.device)
    top = min(modes, codewords)
    width_max = min(beam, modes)
    counts = hist.long()
    total = counts.sum(-1, keepdim=True).double().add_(codewords * smoothing)  # [..., G, 1]
    fullest = float(total.max()) if total.numel() else 0.0  # the search's one read back to the host
    # |score| is largest for an empty codeword of the fullest histogram: log(smoothing / total) * SCORE_SCALE.
    largest = math.log(fullest / smoothing) * SCORE_SCALE + 1 if total.numel() else 0.0
    if (largest * groups + 1) * max(width_max, 1) * codewords >= 2**62:
        raise ValueError("beam search scores would overflow int64: fewer pseudo-tokens or codewords")
    if fullest >= 2**31:
        raise ValueError(
            "beam search needs histograms of fewer than 2^31 residuals (their codewords are ranked by count)"
        )
    # Per sub-quantiser, its best codewords (score first, then the lower codeword). A score grows strictly with its
    # count (two counts below 2^31 differ by more than 2^-32 in log-probability), so they are the codewords with the
    # most counts: integer keys that carry their codeword in the low digit, sorted, then scored (``top`` of ``C``).
    best = top_k_values(counts * codewords + (codewords - 1 - code), top)  # [..., G, top], best first
    best_count, low = _floor_divmod(best, codewords)  # low: codewords - 1 - the codeword
    logp = best_count.double().add_(smoothing).div_(total).log_()
    best = (
        torch.round(logp.mul_(SCORE_SCALE)).long().mul_(codewords).add_(low).movedim(-2, 0).contiguous()
    )  # [G, ..., top]
    code_score = _floor_divmod(best, codewords)[0]
    scores = torch.zeros(*lead, 1, dtype=torch.long, device=hist.device)
    lex = torch.zeros_like(scores)  # each beam's rank in lexicographic order of its prefix
    parents, picked = [], []  # per sub-quantiser: each beam's parent beam and its codeword [..., width]
    for g in range(groups):
        beams = scores.shape[-1]
        width = min(beam, modes, beams * top)
        beam_of, code_of = (index.expand(*lead, -1) for index in _dominance_pairs(beams, top, width, hist.device))
        # A candidate's key (score, then its prefix + code in lexicographic order, both in one int64 whose low digit
        # is span - 1 - order) splits into a beam's part and a code's part: [..., beams] + [..., top], then one sum
        # per candidate pair.
        span = beams * codewords
        beam_key = scores * span - lex * codewords + (span - codewords)
        code_key = code_score[g] * (span - codewords) + best[g]
        kept = top_k_values(
            torch.gather(beam_key, -1, beam_of) + torch.gather(code_key, -1, code_of), width
        )  # best first
        scores, low = _floor_divmod(kept, span)
        order = span - 1 - low  # the prefix's lexicographic rank * codewords + the code
        prefix, code_of_beam = _floor_divmod(order, codewords)
        beam_with_lex = torch.empty_like(lex).scatter_(-1, lex, torch.arange(beams, device=lex.device).expand_as(lex))
        parents.append(torch.gather(beam_with_lex, -1, prefix))
        picked.append(code_of_beam)
        # The kept prefixes' ranks among themselves: sort their (unique) orders with each one's position in the low digit.
        position = torch.arange(width, device=order.device)
        largest_first = _floor_divmod(top_k_values(order * width + position, width), width)[1]
        lex = torch.empty_like(order).scatter_(-1, largest_first, position.flip(0).expand_as(order))
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
