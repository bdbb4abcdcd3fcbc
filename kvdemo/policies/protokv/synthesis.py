"""ProtoKV's read side (paper 003, Alg. 3-4): the pseudo-tokens of the prototypes a pass changed (the top-``S`` code
tuples of their PQ histograms by beam search, decoded, added to the centres and rotated at ``tau_k``) and the bias
``log n_k`` of every slot, as the memory's summary updates (:class:`~kvdemo.policies.contract.SummaryUpdate`)."""

from __future__ import annotations

from typing import Any

import torch

from ...tensors import gather_rows
from ..contract import SummaryUpdate
from .bank import ProtoBank
from .pq import beam_search, pq_decode

#: Per sub-quantiser: the top-S codes ``[B, U, S, G]`` and the codebooks with an appended all-zero codeword.
Codes = list[tuple[torch.Tensor, torch.Tensor]]


def synthesize(
    bank: ProtoBank,
    touched: torch.Tensor,
    rotary: Any,
    heads: int,
    pseudo_tokens: int,
    beam: int,
    smoothing: float,
    residuals: bool = True,
    mass_bias: bool = True,
) -> list[SummaryUpdate]:
    """Pseudo-tokens of the ``touched [B, K]`` prototypes (rotated at ``tau_k``) and the bias of every slot (``log n_k``
    in float64, kept float32; ``-inf`` on an empty slot; 0 with ``mass_bias`` off), per layer: ``Selection.summary``.

    It reads back one number, how many prototypes the most touched row has (it sizes the pseudo-tokens). On a CPU the
    pseudo-tokens are decoded, centred and rotated layer by layer (kvdemo's: a layer's ``[H, U, S, D]`` pseudo-tokens
    stay in the processor's cache between those steps, where all rows at once, 100 MB at 7B shape, are fresh memory
    each pass), one update per layer; elsewhere all rows at once, one update covering every layer (the memory writes
    it with one put of rows per tensor), so the launches do not grow with the layers. The same values either way."""
    rows, capacity = bank.mass.shape
    s = pseudo_tokens
    layers = rows // heads
    count = int(touched.sum(dim=1).max()) if rows else 0
    # Touched prototypes per row, padded by repeating the row's first touched one (rewriting a slot with
    # its own value is harmless).
    order = torch.argsort((~touched).to(torch.int8), dim=1, stable=True)[:, : max(count, 1)]
    valid = torch.gather(touched, 1, order)
    order = torch.where(valid, order, order[:, :1])
    codes = residual_codes(bank, order, s, beam or 4 * s, smoothing) if residuals else None  # Alg. 3, every row
    centre_k, centre_v = (
        gather_rows(bank.centre_k, order)[:, :, None],
        gather_rows(bank.centre_v, order)[:, :, None],
    )
    position = gather_rows(bank.tau_pos, order)[:, :, None]  # one position per prototype [B, U, 1, 3]
    slots = (order[:, :, None] * s + torch.arange(s, device=order.device)).flatten(1)  # [B, U*S]
    if not count:
        slots = slots[:, :0]
    mass = bank.mass.double()
    bias = torch.where(mass > 0, mass.clamp_min(1).log() if mass_bias else torch.zeros_like(mass), float("-inf"))
    bias = bias.float().repeat_interleave(s, dim=1)  # [B, K*S]
    dim = bank.centre_k.shape[-1]

    def pseudo_tokens_of(part: slice) -> tuple[torch.Tensor, torch.Tensor]:  # rows ``part``: [rows, U * S, D] each
        width = part.stop - part.start
        residual_k, residual_v = residual_modes(codes, part, (width, order.shape[1], s, dim), order.device)
        keys = rotary.rotate(residual_k.add_(centre_k[part]), position[part]).reshape(width, -1, dim)
        return keys, residual_v.add_(centre_v[part]).reshape(width, -1, dim)

    if bank.mass.device.type != "cpu":
        keys, values = pseudo_tokens_of(slice(0, rows))
        return [SummaryUpdate(keys, values, bias, slots, layers=tuple(range(layers)))] * layers
    updates = []
    for layer in range(layers):
        part = slice(layer * heads, (layer + 1) * heads)
        keys, values = pseudo_tokens_of(part)
        updates.append(SummaryUpdate(keys=keys, values=values, bias=bias[part], slots=slots[part]))
    return updates


def residual_codes(bank: ProtoBank, protos: torch.Tensor, modes: int, beam: int, smoothing: float) -> Codes | None:
    """Alg. 3 for prototypes ``protos [B, U]``: for keys and for values, the top-``modes`` codes ``[B, U, S, G]`` (beam
    ``beam``) and the codebooks with an appended all-zero codeword that a prototype without residuals decodes to in
    every sub-space (so the decode writes its zeros directly); None before the codebooks exist."""
    if bank.codebook_k is None:
        return None
    out = []
    empty = (gather_rows(bank.n_res, protos) == 0)[:, :, None, None]  # [B, U, 1, 1]
    for hist, codebook in ((bank.hist_k, bank.codebook_k), (bank.hist_v, bank.codebook_v)):
        codes = beam_search(gather_rows(hist, protos), modes, beam, smoothing)
        with_zero = torch.cat([codebook, codebook.new_zeros(*codebook.shape[:2], 1, codebook.shape[-1])], dim=2)
        out.append((torch.where(empty, codebook.shape[2], codes), with_zero))
    return out


def residual_modes(
    codes: Codes | None, part: slice, shape: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoded key and value residual modes ``shape = [rows, U, S, D]`` of rows ``part`` (zero without codes),
    fresh tensors."""
    if codes is None:
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    keys, values = (pq_decode(c[part], book[part]) for c, book in codes)
    return keys, values
