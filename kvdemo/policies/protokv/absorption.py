"""ProtoKV's absorption of a chunk's assigned tokens (paper 003, Alg. 1 lines 8-13): the prototypes' centres, mass,
recency and spatial statistics after their tokens (the sequential EMA in closed form per prototype, :mod:`.ema`), and
each token's residual into its prototype's PQ histograms, or into the warm-up reservoir until the codebooks are trained
(App. A.1, :mod:`.pq`). Which prototype each token goes to is :mod:`.assignment`'s (Eq. 1); the bank is
:class:`~.bank.ProtoBank`, every row of every layer at once."""

from __future__ import annotations

import torch

from ...tensors import flat_nonzero
from .bank import ProtoBank
from .ema import ema_closed_form, running_mean_before
from .pq import pq_encode, train_codebooks


def update(
    bank: ProtoBank,
    keys: torch.Tensor,
    values: torch.Tensor,
    spatial: torch.Tensor,
    position: torch.Tensor,
    choice: torch.Tensor,
    mask: torch.Tensor,
    t: int,
    alpha: float,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alg. 1 lines 8-12 for the tokens ``mask [B, E]`` assigned to ``choice [B, E]`` (``keys/values [B, E, D]``
    before RoPE, ``spatial [B, E, 2]``, ``position [B, E, 3]``, arrival order along ``E``): the sequential EMA
    (centre rate ``alpha`` = beta, spatial rate ``eta``) in closed form per prototype. Returns each token's
    prototype cell ``row * K + k`` and its key/value residuals ``[B, E, D]`` for line 13.

    It reads back one thing: how many tokens are assigned, the most on one prototype, and on how many prototypes
    (they size the tensors that follow)."""
    rows, tokens = choice.shape
    capacity, dim = bank.capacity, keys.shape[-1]
    device = choice.device
    cell = torch.arange(rows, device=device)[:, None] * capacity + choice  # (row, prototype) of every token
    # The group sizes m_k, and the one read of the update.
    count = torch.zeros(rows * capacity, dtype=torch.long, device=device)
    count.index_add_(0, cell.flatten(), mask.flatten().long())
    assigned, most, groups = torch.stack([count.sum(), count.max(), (count > 0).sum()]).tolist()
    picked = flat_nonzero(mask, assigned)  # assigned tokens (row * E + e), row-major then arrival order

    def of_assigned(x: torch.Tensor) -> torch.Tensor:  # x[mask] without a wait: [assigned, ...]
        return x.reshape(rows * tokens, *x.shape[2:])[picked]

    flat = cell.flatten()[picked]
    token_ids = picked % tokens
    # Rank of each token among the tokens on its prototype (arrival order).
    sort = torch.sort(flat * tokens + token_ids).indices
    start = torch.cumsum(count, 0) - count
    rank = torch.empty_like(flat)
    rank[sort] = torch.arange(flat.numel(), device=device) - start[flat[sort]]
    later = count[flat] - 1 - rank  # tokens after this one on the same prototype
    # Chunk-start state of each token's prototype (after this chunk's initialisations).
    c_before_k = torch.gather(bank.centre_k, 1, choice[..., None].expand(-1, -1, dim))
    c_before_v = torch.gather(bank.centre_v, 1, choice[..., None].expand(-1, -1, dim))
    mu_before = torch.gather(bank.mu, 1, choice[..., None].expand(-1, -1, 2))  # chunk-start means
    # Alg. 1 line 12 reads the mean right after the token's own update: s - mu_r = (1 - eta)(s - mu_{r-1}),
    # with mu_{r-1} the running mean before it (a prefix over earlier tokens on the same prototype).
    spatial_of = of_assigned(spatial)
    before = running_mean_before(spatial_of, of_assigned(mu_before), flat, rank, count, eta, most, groups)
    deviation = (1 - eta) * (spatial_of - before)
    bank.sigma = ema_closed_form(bank.sigma, deviation[:, :, None] * deviation[:, None, :], flat, count, later, eta)
    bank.mu = ema_closed_form(bank.mu, spatial_of, flat, count, later, eta)
    bank.centre_k = ema_closed_form(bank.centre_k, of_assigned(keys), flat, count, later, alpha)
    bank.centre_v = ema_closed_form(bank.centre_v, of_assigned(values), flat, count, later, alpha)
    bank.mass.view(-1).index_add_(0, flat, torch.ones_like(flat))
    hit = (count > 0).view(rows, capacity)
    bank.tau_time = torch.where(hit, t, bank.tau_time)
    newest = torch.zeros(rows * capacity, dtype=torch.long, device=device)
    newest.scatter_reduce_(0, flat, token_ids, reduce="amax", include_self=False)
    owner = torch.arange(rows * capacity, device=device) // capacity
    bank.tau_pos = torch.where(hit[..., None], position[owner, newest].view(rows, capacity, 3), bank.tau_pos)
    # Residuals against the centre right after the token's update: x - c_after = (1 - a)(x - c_before).
    return cell, (1 - alpha) * (keys - c_before_k), (1 - alpha) * (values - c_before_v)


def record_residuals(
    bank: ProtoBank, cell: torch.Tensor, mask: torch.Tensor, residual_k: torch.Tensor, residual_v: torch.Tensor
) -> None:
    """Alg. 1 line 13 for the tokens ``mask [B, E]`` (prototype ``cell = row * K + k``), residuals
    ``[B, E, D]``: PQ-encode them into their prototype's histograms, or fill the warm-up reservoir until
    the codebooks can be trained (App. A.1), then train them. Every token is encoded and counts ``mask``'s 1 or
    0 (no wait for which ones count); the warm-up reads how many residuals every row can give."""
    groups, codewords = bank.hist_k.shape[-2:]
    if bank.codebook_k is None:
        # Take each row's first assigned tokens (arrival order), as many as every row has. A residual that is
        # exactly zero (the token equals its prototype's centre) says nothing about the spread the codebooks
        # must cover, and would pull several codewords onto zero: it stays out of the reservoir.
        usable = mask & (residual_k != 0).any(dim=-1) & (residual_v != 0).any(dim=-1)
        warmup = bank.reservoir_k.shape[1]
        take = min(int(usable.sum(dim=1).min()), warmup - bank.reservoir_len)
        if take > 0:
            first = torch.argsort((~usable).to(torch.int8), dim=1, stable=True)[:, :take]
            dest = slice(bank.reservoir_len, bank.reservoir_len + take)
            dim = residual_k.shape[-1]
            bank.reservoir_k[:, dest] = torch.gather(residual_k, 1, first[..., None].expand(-1, -1, dim))
            bank.reservoir_v[:, dest] = torch.gather(residual_v, 1, first[..., None].expand(-1, -1, dim))
            bank.reservoir_len += take
        if bank.reservoir_len >= warmup:
            bank.codebook_k = train_codebooks(bank.reservoir_k, groups, codewords)
            bank.codebook_v = train_codebooks(bank.reservoir_v, groups, codewords)
            bank.reservoir_k = bank.reservoir_k[:, :0]
            bank.reservoir_v = bank.reservoir_v[:, :0]
        return
    group_ids = torch.arange(groups, device=cell.device)
    counts = mask[..., None].expand(-1, -1, groups).flatten().to(bank.hist_k.dtype)
    for residual, codebook, hist in (
        (residual_k, bank.codebook_k, bank.hist_k),
        (residual_v, bank.codebook_v, bank.hist_v),
    ):
        codes = pq_encode(residual, codebook)  # [B, E, G]
        hist.view(-1).index_add_(0, ((cell[..., None] * groups + group_ids) * codewords + codes).flatten(), counts)
    bank.n_res.view(-1).index_add_(0, cell.flatten(), mask.flatten().to(bank.n_res.dtype))
