"""``cords``: CoRDS (paper 002): KV-cache compression as coreset selection in joint key/value space.

Per anchor layer and KV head:

1. The recent tail (the newest ``r = max(1, round(recent_ratio * f))`` frames, the same rule as
   InfiniPot-V's recent window) is always kept (Sec. 3).
2. The old part is reduced to the remaining budget as a coreset whose elements are frames: each old
   frame is represented by the centroid of its tokens' keys and of their values (Sec. 3, "we work at
   frame level").
3. Greedy farthest-first with the D2 rule: repeatedly add the candidate frame ``i`` maximising

       norm(min_j [beta d_K(i, j) + (1 - beta) d_V(i, j)]) + bonus * norm(o_i),
       o_i = gamma (1 - max_j cos(K_i, K_j)) + (1 - gamma) (1 - max_j cos(V_i, V_j)),

   over the selected set ``j`` (Eq. 4-10). ``d`` is the squared Euclidean distance between centroids
   and ``norm`` is min-max over the remaining candidates with ``eps`` (Eq. 10).
4. Chosen frames expand back to their tokens in pick order.

kvdemo's own rules (the paper does not state them, or its values were lost in extraction):

- keys and values are each scaled per head to unit mean squared norm before any distance, so ``beta``
  weighs comparable scales (raw concatenation lets the larger of the two decide);
- seeding with the recent tail: it counts as already selected (it is retained), so the first pick is
  the old frame the recent frames cover worst (ties to the older frame);
- ``o`` is ``1 - max cos``, our reading of the paper's "max-cosine redundancy surrogate" of the
  orthogonal residual (an anti-parallel direction counts as new; the exact span residual of a unit
  vector against one direction would be ``1 - cos^2``);
- the partial-frame fill: when the budget is not a whole number of frames, the next frame in pick order
  contributes the tokens farthest (same bicriteria distance, token level) from everything selected;
- ``recent_ratio = 0.125`` and ``eps = 1e-6`` (the paper's values were lost in extraction);
- which layer ``layers=single`` uses (``single_depth``, default the middle layer as in the paper's
  single-layer run, Table 13) and what layers outside the active set do (``above``, below).

Layer schedule (App. B.1, B.7, B.8): selection is *active* on ``layers`` (``bottom25``: the bottom 25%
of layers; ``all``; ``single``: layer ``floor(single_depth * num_layers)``). Layers are counted over the
memory's layers, the ones that hold keys and values: every decoder layer of Qwen2/2.5/3-VL and
LLaVA-OneVision, but only the full-attention layers of Qwen3.5 (its linear-attention layers hold no
tokens), so ``bottom25`` of a 24-layer Qwen3.5 with 6 attention layers is its first two attention layers
(model layers 3 and 7), kvdemo's reading where the paper, written for all-attention models, is silent. With ``followers=True`` only
every other active layer is an anchor (the last active layer of an odd count follows too, e.g. anchors
0, 2, 4 of 28 layers) and followers reuse their anchor's indices. The paper says both "reuse the most
recent active-layer selection" (App. B.1) and "leave the remaining layers uncompressed" (Sec. 3, B.7), so
both are offered: ``above=reuse`` (default) makes every layer outside the active set (for ``single``,
the layers below it too) reuse the last active selection, so every layer keeps exactly ``C`` tokens;
``above=keep`` leaves them uncompressed: their indices are all their tokens
(``Selection.info["uncompressed_layers"]`` lists them), which breaks the hard budget ``M`` on those
layers (the cache keeps growing there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import PolicyParameterError
from .contract import LayerSlice, Selection, layer_rows
from .grid import recent_window
from .registry import BenchDeclaration, PolicyCard, param, register
from .topk import Ranking, ScoredPolicy, minmax

REASON_RECENT, REASON_COVERAGE, REASON_FILL, REASON_UNCOMPRESSED = 0, 1, 2, 3
REASON_NAMES = {
    REASON_RECENT: "recent",
    REASON_COVERAGE: "coreset frame",
    REASON_FILL: "partial frame",
    REASON_UNCOMPRESSED: "uncompressed layer",
}
SCHEDULES = ("bottom25", "all", "single")
#: What layers outside the active set do: reuse the last active selection, or keep every token.
OUTSIDE_ACTIVE = ("reuse", "keep")


def active_layers(num_layers: int, layers: str, single_depth: float = 0.5) -> list[int]:
    """The layers where selection is active, ascending."""
    if layers == "all":
        return list(range(num_layers))
    if layers == "bottom25":
        return list(range(max(1, round(0.25 * num_layers))))
    if layers == "single":
        return [min(num_layers - 1, int(single_depth * num_layers))]
    raise PolicyParameterError(f"layers must be one of {', '.join(SCHEDULES)}, got {layers!r}")


def layer_schedule(
    num_layers: int, layers: str, followers: bool, single_depth: float = 0.5, above: str = "reuse"
) -> list[int | None]:
    """For every layer, the anchor whose selection it uses (an anchor uses its own); ``None`` for a
    layer left uncompressed (outside the active set with ``above="keep"``)."""
    active = active_layers(num_layers, layers, single_depth)
    if followers:
        odd_tail = len(active) % 2 and len(active) > 1
        anchors = [a for i, a in enumerate(active) if i % 2 == 0 and not (odd_tail and i == len(active) - 1)]
    else:
        anchors = active
    source_of = {layer: max(a for a in anchors if a <= layer) for layer in active}
    outside = None if above == "keep" else source_of[active[-1]]
    return [source_of.get(layer, outside) for layer in range(num_layers)]


#: Tokens per block of :meth:`CoRDS._scaled`'s squared norms on a CPU (a block of one head group stays in cache).
SCALE_BLOCK = 1024


def _pairwise_sq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared distances ``[H, N, M]`` between ``x [H, N, D]`` and ``y [H, M, D]``."""
    return (x.square().sum(-1)[..., None] - 2 * x @ y.transpose(1, 2) + y.square().sum(-1)[:, None]).clamp_min(0)


CARD = PolicyCard(
    "Coreset selection: old frames chosen farthest-first in joint key/value space, with a diversity bonus.",
    reasons=REASON_NAMES,
    # its pass is also timed without the cross-layer followers (every active layer selecting)
    bench=BenchDeclaration(variants={"followers=False": {"followers": False}}),
)


@register(CARD)
@dataclass
class CoRDS(ScoredPolicy):
    """Coreset of old frames in joint K/V space (D2 farthest-first + orthogonal bonus), recent tail kept."""

    name = "cords"

    beta: float = param(
        0.25, "key weight in the bicriteria distance beta*d_K + (1-beta)*d_V (0.25: value-favouring)", within="[0, 1]"
    )
    gamma: float = param(0.25, "key weight in the orthogonal anti-redundancy bonus", within="[0, 1]")
    bonus: float = param(0.25, "weight of the orthogonal bonus (0 = bicriteria coverage only)", within="[0, inf)")
    eps: float = param(1e-6, "epsilon of the min-max normalisation", within="(0, inf)")
    recent_ratio: float = param(
        0.125, "recent tail r = ratio x frames held (at least one frame), always kept", within="(0, 1]"
    )
    layers: str = param(
        "bottom25",
        "where selection is active, counted over the attention layers (the memory's): "
        "bottom25 (paper), all, single (one layer, see single_depth)",
        choices=SCHEDULES,
    )
    followers: bool = param(True, "only every other active layer selects; the others reuse their anchor's indices")
    above: str = param(
        "reuse",
        "layers outside the active set: reuse the last active selection, or keep them "
        "uncompressed (keep breaks the budget M on those layers)",
        choices=OUTSIDE_ACTIVE,
    )
    single_depth: float = param(
        0.5,
        "layers=single: the attention layer at this relative depth, floor(depth x "
        "attention layers) (0.5 = the middle layer, as the paper's single-layer run; 0 = "
        "layer 0)",
        within="[0, 1]",
    )

    def rank(self, slices: list[LayerSlice], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        source = layer_schedule(len(slices), self.layers, self.followers, self.single_depth, self.above)
        anchors = tuple(sorted({a for a in source if a is not None}))
        for layer, anchor in enumerate(source):
            if anchor is not None and slices[layer].length != slices[anchor].length:
                raise ValueError(
                    f"layer {layer} holds {slices[layer].length} tokens but its anchor {anchor} holds "
                    f"{slices[anchor].length}"
                )
        # Every anchor selects at once: their heads are the rows of one batch (followers reuse their anchor's).
        heads = slices[anchors[0]].num_heads
        selected, picks = self.select(
            layer_rows(slices, anchors, "frame"),
            layer_rows(slices, anchors, "keys"),
            layer_rows(slices, anchors, "values"),
            slices[anchors[0]].tokens_per_frame,
            keep,
        )
        selected.layers = anchors
        selected.followers = {layer: anchor for layer, anchor in enumerate(source) if anchor not in (None, layer)}
        rankings = [selected]
        uncompressed = tuple(layer for layer, anchor in enumerate(source) if anchor is None)
        for layer in uncompressed:  # above="keep": every token of these layers stays
            frame = slices[layer].frame
            whole = torch.full((frame.shape[0],), frame.shape[1], dtype=torch.long, device=frame.device)
            reason = torch.full(frame.shape, REASON_UNCOMPRESSED, dtype=torch.int8, device=frame.device)
            rankings.append(
                Ranking(
                    torch.zeros(frame.shape, dtype=torch.float64, device=frame.device), reason, (layer,), keep=whole
                )
            )
        info = {
            "source_layer": source,
            "anchors": list(anchors),
            "uncompressed_layers": list(uncompressed),
            "pick_order": {anchor: picks[i * heads : (i + 1) * heads] for i, anchor in enumerate(anchors)},
        }
        return rankings, info

    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        selection = super().compress(slices, keep)
        selection.uncompressed = tuple(selection.info["uncompressed_layers"])
        return selection

    def select(
        self, frame: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tokens_per_frame: int, keep: int
    ) -> tuple[Ranking, torch.Tensor]:
        """Rows of anchor heads (``frame [R, L]``, ``keys``/``values [R, L, D]``): their ranking (recent tail, then
        whole coreset frames, then the partial frame's tokens by distance; its ``layers`` are the caller's to set)
        and the frames picked ``[R, picks]`` (ranks, in pick order)."""
        heads, length = frame.shape
        recent, rank, held, _ = recent_window(frame, tokens_per_frame, keep, self.recent_ratio)
        keys, values = self._scaled(keys, values)
        device = keys.device
        frames = int(held.max())
        # Frame centroids [H, F, D] and token counts [H, F]; rank is the dense frame index per head.
        dim = keys.shape[-1]
        slot = (torch.arange(heads, device=device)[:, None] * frames + rank).flatten()  # (head, frame) row
        counts = torch.bincount(slot, minlength=heads * frames).to(keys.dtype).view(heads, frames)
        key_c = torch.zeros(heads * frames, dim, dtype=keys.dtype, device=device).index_add_(
            0, slot, keys.reshape(-1, dim)
        )
        value_c = torch.zeros(heads * frames, dim, dtype=keys.dtype, device=device).index_add_(
            0, slot, values.reshape(-1, dim)
        )
        key_c = key_c.view(heads, frames, dim) / counts.clamp_min(1)[..., None]
        value_c = value_c.view(heads, frames, dim) / counts.clamp_min(1)[..., None]
        is_recent_frame = torch.zeros(heads, frames, dtype=torch.bool, device=device).scatter_(1, rank, recent)
        candidate = (counts > 0) & ~is_recent_frame
        budget = keep - recent.sum(dim=1)  # [H] old-part token budget

        picks = self._greedy(key_c, value_c, candidate, is_recent_frame, counts, budget)
        # Expand frames back to tokens in pick order: whole frames while they fit, then a partial one.
        picked_counts = torch.gather(counts, 1, picks.clamp_min(0)) * (picks >= 0)
        before = torch.cumsum(picked_counts, dim=1) - picked_counts
        whole = (before + picked_counts <= budget[:, None]) & (picks >= 0)
        partial = (before < budget[:, None]) & ~whole & (picks >= 0)
        frame_whole = torch.zeros(heads, frames + 1, dtype=torch.bool, device=device)
        frame_whole.scatter_(1, torch.where(whole, picks, frames), True)
        frame_partial = torch.zeros(heads, frames + 1, dtype=torch.bool, device=device)
        frame_partial.scatter_(1, torch.where(partial, picks, frames), True)
        token_whole = torch.gather(frame_whole[:, :frames], 1, rank)
        token_partial = torch.gather(frame_partial[:, :frames], 1, rank)

        priority = recent.double() * 4 + token_whole.double() * 2
        if bool(token_partial.any()):
            selected = frame_whole[:, :frames] | is_recent_frame
            fill = self._token_distance(keys, values, key_c, value_c, selected)
            scaled = fill / fill.max(dim=1, keepdim=True).values.clamp_min(1e-12)
            priority = priority + token_partial.double() * (1 + scaled.double())
        # Codes by arithmetic on the masks (a boolean index would make a GPU wait for its count).
        reason = REASON_FILL + (REASON_COVERAGE - REASON_FILL) * token_whole.to(torch.int8)
        reason += (REASON_RECENT - reason) * recent.to(torch.int8)
        return Ranking(priority, reason, ()), picks

    @staticmethod
    def _scaled(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[H, L, D]`` in float32, each scaled per head to unit mean squared norm.

        The squared norms are taken :data:`SCALE_BLOCK` tokens at a time on a CPU (a block's float32 square stays in
        cache), and a half-precision cache's widened copy is divided in place: one cache-sized float32 tensor per
        input where widening, squaring and dividing allocated three. The same numbers."""
        out = []
        for x in (keys, values):
            heads, length, _ = x.shape
            step = max(1, length if x.device.type == "cuda" else SCALE_BLOCK)
            norms = torch.empty(heads, length, dtype=torch.float32, device=x.device)
            for start in range(0, length, step):
                norms[:, start : start + step] = x[:, start : start + step].float().square().sum(-1)
            scale = norms.mean(-1).clamp_min(1e-12).sqrt()[:, None, None]
            wide = x.float()  # a float32 cache comes back as is: divide it into a new tensor, never in place
            out.append(x / scale if wide is x else wide.div_(scale))
        return out[0], out[1]

    def _greedy(
        self,
        key_c: torch.Tensor,
        value_c: torch.Tensor,
        candidate: torch.Tensor,
        selected: torch.Tensor,
        counts: torch.Tensor,
        budget: torch.Tensor,
    ) -> torch.Tensor:
        """D2 farthest-first over frame centroids with the orthogonal bonus; returns picks ``[H, steps]``
        (frame ranks in pick order, -1 once a head's budget is met or its candidates run out).

        ``selected [H, F]`` seeds the selected set (the recent tail); the loop runs over picks only.
        """
        heads, frames, _ = key_c.shape
        device = key_c.device
        big = torch.tensor(torch.finfo(key_c.dtype).max, device=device)
        # Distance and max-cosine of every frame to the seed set.
        dist_k, dist_v = _pairwise_sq(key_c, key_c), _pairwise_sq(value_c, value_c)
        bicriteria = self.beta * dist_k + (1 - self.beta) * dist_v  # [H, F, F]
        unit_k, unit_v = F.normalize(key_c, dim=-1), F.normalize(value_c, dim=-1)
        cos_k, cos_v = unit_k @ unit_k.transpose(1, 2), unit_v @ unit_v.transpose(1, 2)
        seed = selected[:, None, :]
        min_dist = torch.where(seed, bicriteria, big).min(dim=-1).values  # [H, F]
        max_cos_k = torch.where(seed, cos_k, -1.0).max(dim=-1).values
        max_cos_v = torch.where(seed, cos_v, -1.0).max(dim=-1).values
        no_seed = ~selected.any(dim=1, keepdim=True)
        # Without a seed (cannot happen with a recent tail) every candidate is equally uncovered.
        min_dist = torch.where(no_seed, bicriteria.mean(-1), min_dist)

        remaining = candidate.clone()
        taken = torch.zeros(heads, dtype=counts.dtype, device=device)
        steps = int(candidate.sum(dim=1).max())
        picks = torch.full((heads, steps), -1, dtype=torch.long, device=device)
        rows = torch.arange(heads, device=device)
        # Every step runs (no read of whether any head is still active: a GPU would wait once per step); a head
        # that stopped stays stopped (its candidates only shrink, its count only grows), so the steps that picked
        # anything are a prefix, read once at the end.
        for step in range(steps):
            active = remaining.any(dim=1) & (taken < budget)
            orth = self.gamma * (1 - max_cos_k) + (1 - self.gamma) * (1 - max_cos_v)
            score = minmax(min_dist, remaining, self.eps) + self.bonus * minmax(orth, remaining, self.eps)
            score = torch.where(remaining, score, -big)
            pick = score.argmax(dim=1)  # first index on ties: the oldest frame, deterministic
            picks[:, step] = torch.where(active, pick, -1)
            remaining[rows, pick] &= ~active  # an inactive head's pick stays as it was (no boolean index: no wait)
            taken = taken + torch.where(active, counts[rows, pick], 0)
            min_dist = torch.minimum(min_dist, bicriteria[rows, :, pick])
            max_cos_k = torch.maximum(max_cos_k, cos_k[rows, :, pick])
            max_cos_v = torch.maximum(max_cos_v, cos_v[rows, :, pick])
        return picks[:, : int((picks >= 0).any(dim=0).sum())]

    def _token_distance(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_c: torch.Tensor,
        value_c: torch.Tensor,
        selected: torch.Tensor,
    ) -> torch.Tensor:
        """Bicriteria distance ``[H, L]`` of every token to the nearest selected frame centroid."""
        big = torch.finfo(keys.dtype).max
        distance = self.beta * _pairwise_sq(keys, key_c) + (1 - self.beta) * _pairwise_sq(values, value_c)
        return torch.where(selected[:, None, :], distance, big).min(dim=-1).values
