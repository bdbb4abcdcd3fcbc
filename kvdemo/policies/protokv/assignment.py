"""ProtoKV's assignment (paper 003, Eq. 1): the cost of giving an evicted token to each prototype, and the cheapest
open prototype per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..topk import arg_min
from .bank import ProtoBank
from .ema import mahalanobis_form, quadratic_distance

#: Tokens per block of costs on a CPU (:func:`assign`).
ASSIGNMENT_BLOCK = 32


def assign(
    bank: ProtoBank,
    keys: torch.Tensor,
    spatial: torch.Tensor,
    t: int,
    lambda_sp: float,
    lambda_idle: float,
    t_idle: int,
) -> torch.Tensor:
    """Eq. 1's choice for tokens ``keys [B, E, D]`` at ``spatial [B, E, 2]``: the prototype of least
    :func:`assignment_cost`, ``[B, E]``. On a CPU the costs are formed and reduced ``ASSIGNMENT_BLOCK`` tokens at a time
    (kvdemo's: a block's ``[B, E_b, K]`` costs, and the float64 quadratic form under them, stay in the processor's
    cache; all of ``[B, E, K]`` at once, 66 MB in float32 at 7B shape and twice that in float64, would be fresh
    memory, and its page faults, every pass); elsewhere (a GPU) all at once. The same costs, so the same choices."""
    unit_centres = F.normalize(bank.centre_k, dim=-1).transpose(1, 2)  # [B, D, K]
    # Per-prototype terms in one [B, 1, K] row: the idle penalty, and +inf on slots that are not open.
    per_prototype = torch.zeros(bank.mass.shape, dtype=unit_centres.dtype, device=keys.device)
    if lambda_idle:
        per_prototype += lambda_idle * ((t - bank.tau_time) > t_idle).to(per_prototype.dtype)
    per_prototype.masked_fill_(~bank.open, float("inf"))
    form = mahalanobis_form(bank.mu, bank.sigma) if lambda_sp else None
    step = keys.shape[1] if keys.device.type != "cpu" else ASSIGNMENT_BLOCK
    return torch.cat(
        [
            arg_min(
                assignment_cost(
                    keys[:, i : i + step], spatial[:, i : i + step], unit_centres, per_prototype, form, lambda_sp
                )
            )
            for i in range(0, keys.shape[1], step)
        ],
        dim=1,
    )


def assignment_cost(
    keys: torch.Tensor,
    spatial: torch.Tensor,
    unit_centres: torch.Tensor,
    per_prototype: torch.Tensor,
    form: torch.Tensor | None,
    lambda_sp: float,
) -> torch.Tensor:
    """Eq. 1 for every token and prototype, ``[B, E, K]``: ``-cos(K, c_k) + lambda_sp d_Mah(s; mu_k, Sigma_k) +
    lambda_idle 1(t - tau_k > T_idle)``, given the bank's unit centres ``[B, D, K]``, its per-prototype terms ``[B, K]``
    (the idle penalty; ``+inf`` on slots that are not :attr:`ProtoBank.open`) and its Mahalanobis form
    (:func:`.ema.mahalanobis_form`; None when ``lambda_sp`` is 0)."""
    unit_keys = F.normalize(keys, dim=-1)
    if form is not None:
        cost = quadratic_distance(spatial, form).mul_(lambda_sp)
        cost.baddbmm_(unit_keys, unit_centres, alpha=-1.0)  # - cos, fused into the sum
    else:
        cost = -(unit_keys @ unit_centres)
    return cost.add_(per_prototype[:, None, :])  # written in place (no [B, E, K] temporaries)
