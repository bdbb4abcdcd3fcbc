"""ProtoKV's running statistics (paper 003, Alg. 1 lines 8-12): exponential moving averages in closed form over
a chunk of tokens, the running mean each token's own update reads, and the spatial Mahalanobis distance of
Eq. 1."""

from __future__ import annotations

import torch

#: Regularisation added to a prototype's spatial covariance before inverting it (kvdemo's).
SIGMA_FLOOR = 1e-4


def ema_closed_form(
    state: torch.Tensor, update: torch.Tensor, cell: torch.Tensor, count: torch.Tensor, later: torch.Tensor, rate: float
) -> torch.Tensor:
    """The sequential EMA ``x <- (1 - a) x + a u`` of every prototype over its tokens of one chunk, at once:
    ``(1-a)^m state + sum_j a (1-a)^(later_j) u_j`` per prototype.

    ``state [B, K, ...]``; ``update [N, ...]`` one per assigned token; ``cell [N]`` its prototype ``row * K + k``;
    ``count [B * K]`` tokens per prototype (``m``); ``later [N]`` tokens after this one on the same prototype.
    Returns a new ``[B, K, ...]`` tensor in ``state``'s dtype.
    """
    rows, capacity = state.shape[:2]
    inner = state.shape[2:]
    out = state.reshape(rows * capacity, -1) * ((1 - rate) ** count.double()).to(state.dtype)[:, None]
    weight = (rate * (1 - rate) ** later.double()).to(state.dtype)[:, None]
    return out.index_add_(0, cell, update.reshape(cell.numel(), out.shape[1]) * weight).view(rows, capacity, *inner)


def running_mean_before(
    values: torch.Tensor,
    start: torch.Tensor,
    group: torch.Tensor,
    rank: torch.Tensor,
    count: torch.Tensor,
    rate: float,
    width: int | None = None,
    groups: int | None = None,
) -> torch.Tensor:
    """For each token, the EMA ``mu <- (1 - rate) mu + rate x`` of its group just before the token's own update.

    ``values [N, F]`` in arrival order within groups, ``start [N, F]`` the group's state before the chunk,
    ``group [N]`` group ids, ``rank [N]`` position within the group, ``count`` group sizes (indexed by group id).
    Closed form on a padded ``[groups, max_m]`` layout (a group never mixes with another in the prefix sum):
    ``mu_r = (1-a)^(r+1) mu_0 + a (1-a)^r sum_{i<=r} (1-a)^-i x_i``, all in float64. ``width`` (the largest group)
    and ``groups`` (how many are not empty), when the caller knows them, spare reading them from ``count``.
    """
    if values.numel() == 0:
        return values
    present = count > 0
    compact = torch.cumsum(present.long(), 0) - 1
    gid = compact[group]
    width = int(count.max()) if width is None else width
    groups = int(present.sum()) if groups is None else groups
    dense = torch.zeros(groups, width, values.shape[1], dtype=torch.float64, device=values.device)
    steps = torch.arange(width, device=values.device, dtype=torch.float64)
    dense[gid, rank] = values.double() * (1 - rate) ** (-steps[rank])[:, None]
    prefix = torch.cumsum(dense, dim=1)  # sum_{i<=r} (1-a)^-i x_i
    previous = rank - 1  # mu_{r-1}: the mean after the previous token of the group (mu_0 for the first)
    r = previous.clamp_min(0).double()[:, None]
    after_previous = (1 - rate) ** (r + 1) * start.double() + rate * (1 - rate) ** r * prefix[
        gid, previous.clamp_min(0)
    ]
    return torch.where((rank > 0)[:, None], after_previous, start.double()).to(values.dtype)


def mahalanobis(spatial: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``d_Mah(s; mu_k, Sigma_k) = sqrt((s - mu)^T Sigma^-1 (s - mu))`` for ``s [B, E, 2]``, ``mu [B, K, 2]``,
    ``sigma [B, K, 2, 2]`` -> ``[B, E, K]``, as one small matmul of quadratic features (no ``[B, E, K, 2]``
    temporary). ``Sigma + 1e-4 I`` keeps a prototype fed from one place invertible (kvdemo's floor)."""
    return quadratic_distance(spatial, mahalanobis_form(mu, sigma))


def mahalanobis_form(mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The coefficients ``[B, 6, K]`` (float64) of each prototype's quadratic form in the features ``(x^2, xy, y^2, x,
    y, 1)`` of a position (see :func:`mahalanobis`), computed once for every token that is measured against it."""
    a, b, d = sigma[..., 0, 0] + SIGMA_FLOOR, sigma[..., 0, 1], sigma[..., 1, 1] + SIGMA_FLOOR
    det = (a * d - b * b).clamp_min(1e-12)
    ia, ib, id_ = d / det, -b / det, a / det  # inverse [[ia, ib], [ib, id]]
    mx, my = mu[..., 0], mu[..., 1]
    # (s-mu)^T A (s-mu) = ia x^2 + 2 ib x y + id y^2 - 2 x (ia mx + ib my) - 2 y (ib mx + id my) + mu^T A mu
    coef = torch.stack(
        [
            ia,
            2 * ib,
            id_,
            -2 * (ia * mx + ib * my),
            -2 * (ib * mx + id_ * my),
            ia * mx * mx + 2 * ib * mx * my + id_ * my * my,
        ],
        dim=-1,
    )  # [B, K, 6]
    return coef.double().transpose(1, 2)


def quadratic_distance(spatial: torch.Tensor, form: torch.Tensor) -> torch.Tensor:
    """:func:`mahalanobis` from its form (:func:`mahalanobis_form`): ``spatial [B, E, 2]`` -> ``[B, E, K]`` float32."""
    x, y = spatial[..., 0], spatial[..., 1]
    features = torch.stack([x * x, x * y, y * y, x, y, torch.ones_like(x)], dim=-1)  # [B, E, 6]
    # The quadratic form in float64 (its expanded terms cancel), its square root in float32 (as precise as needed:
    # the distance is returned in float32 either way, and a float64 square root of [B, E, K] costs more than the form).
    return (features.double() @ form).clamp_min_(0).float().sqrt_()
