"""What an answer looked at, and what compression changed: two observers of the attention seam
(:class:`~kvdemo.cache.attention.MemoryCache` ``.observers``), off unless asked for.

- :class:`AttributionTally`: while an engine answers (the question's prefill and every generated token), the
  attention mass each memory layer's query heads put on every held slot, summed per KV head; :meth:`result`
  maps it through the memory's provenance to (frame, row, col): an :class:`Attribution` (plain numpy). Mass on
  the prefix, the stream's own text and the dialogue (question, earlier turns, generated tokens) is "text",
  on the summary region "summary" (ProtoKV's pseudo-tokens), on chunks brought back from the offload store
  "retrieved" (HybridKV's dynamic heads). It reads the same query and keys the forward attends with (no second
  pass); the weights are recomputed in float32 from them (:func:`~kvdemo.cache.attention.attention_weights`).
- :func:`fidelity`: teacher-forced per-layer relative error of a policy's attention output against the full
  cache's on the same question: one forward on the full cache, and in every layer the same query (computed from
  the full cache's hidden states) and the question's own keys/values attend over each policy's memory instead;
  plus the KL divergence of the first answer token's distribution (each engine's own forward).

How much of the full cache's attribution lands on the frames that show the asked object
(:func:`evidence_ratio`) is how attribution is validated on generated streams, where the ground truth is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cache.attention import MemoryCache, attention_weights, weighted_values
from ..cache.memory import KVMemory
from ..views import Chart, PatchValues, Series, View

#: Where an answer's attention mass went, besides the held visual tokens (the order of ``Attribution.shares``).
SHARES = ("text", "summary", "visual", "retrieved")


@dataclass
class Attribution:
    """What one answer looked at (:class:`AttributionTally`): ``shares [layers, H_kv, 4]`` of its attention mass
    on text, summary, held visual tokens and retrieved chunks (each (layer, head) sums to 1), and per layer the
    share ``visual[l] [H_kv, n]`` on each visual token it attended, held or retrieved (HybridKV's chunks brought
    back from the offload store are patches of the stream too), with its provenance ``frame/row/col[l] [H_kv, n]``."""

    shares: np.ndarray
    visual: list[np.ndarray]
    frame: list[np.ndarray]
    row: list[np.ndarray]
    col: list[np.ndarray]
    num_grids: int
    grid_shape: tuple[int, int]

    def patch_map(self, layer: int | None = None, head: int | None = None) -> np.ndarray:
        """``[grids, rows, cols]``: the share of the answer's attention on each patch, averaged over the chosen
        layer and KV head (None: all of them); it sums to that selection's visual and retrieved shares."""
        rows, cols = self.grid_shape
        out = np.zeros(self.num_grids * rows * cols, dtype=np.float64)
        layers = range(len(self.visual)) if layer is None else [layer]
        count = 0
        for index in layers:
            picked = slice(None) if head is None else slice(head, head + 1)
            flat = (self.frame[index][picked] * rows + self.row[index][picked]) * cols + self.col[index][picked]
            np.add.at(out, flat.ravel(), self.visual[index][picked].ravel())
            count += self.visual[index][picked].shape[0]
        return (out / max(count, 1)).reshape(self.num_grids, rows, cols)

    def frame_mass(self, layer: int | None = None, head: int | None = None) -> np.ndarray:
        """``[grids]``: the share of the answer's attention on each temporal grid."""
        return self.patch_map(layer, head).sum(axis=(1, 2))

    def share(self, layer: int | None = None, head: int | None = None) -> dict[str, float]:
        """Each share (text, summary, visual, retrieved), averaged over the chosen layer and KV head (None: all)."""
        chosen = self.shares[slice(None) if layer is None else layer, slice(None) if head is None else head]
        return {name: float(chosen[..., k].mean()) for k, name in enumerate(SHARES)}

    def to_dict(self) -> dict[str, Any]:
        """For the JSON report: the mean shares, per (layer, KV head) shares, and per grid the attention share."""
        return {
            "share": self.share(),
            "per_layer_head": {name: np.round(self.shares[..., k], 5).tolist() for k, name in enumerate(SHARES)},
            "frame_share": np.round(self.frame_mass(), 6).tolist(),
        }


class AttributionTally:
    """Observer: per memory layer, the attention mass ``[H_kv, live]`` on the slots committed before the answer
    (summed over each KV head's group of query heads and every answer token), and per layer and head the mass on
    the dialogue's own slots (after the live part) and on retrieved chunks."""

    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory
        self.live = [memory.live_len(layer) for layer in range(len(memory.layers))]
        # Per memory layer, on the layer's device until the answer ends (no host sync per token): the mass on
        # each committed slot [H_kv, live], and [H_kv] on the dialogue's own slots and on retrieved chunks.
        self.held: list[torch.Tensor | None] = [None] * len(self.live)
        self.dialogue: list[torch.Tensor | None] = [None] * len(self.live)
        self.retrieved: list[torch.Tensor | None] = [None] * len(self.live)
        # Per memory layer, every retrieved token's mass [H_kv, R] (device) with its frame/row/col [3, H_kv, R] (host).
        self.fetched: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.live]

    def __call__(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: torch.Tensor | None,
        extra: Any,
        scale: float,
    ) -> None:
        if layer >= len(self.live):
            return
        mass = attention_weights(query, key, bias, scale, extra).sum(dim=1).double()  # [H_kv, kv + R]
        live, kv_len = self.live[layer], key.shape[2]
        parts = (mass[:, :live], mass[:, live:kv_len].sum(dim=-1), mass[:, kv_len:].sum(dim=-1))
        for tally, part in zip((self.held, self.dialogue, self.retrieved), parts):
            tally[layer] = part if tally[layer] is None else tally[layer] + part
        offload = self.memory.layers[layer].offload
        if extra is not None and offload is not None and offload.last_fetched is not None:
            self.fetched[layer].append((mass[:, kv_len:], offload.last_fetched))

    def result(self) -> Attribution:
        """The tally mapped through the memory's provenance (the memory as it was when the answer began)."""
        memory = self.memory
        layers, heads = len(self.live), memory.num_kv_heads
        shares = np.zeros((layers, heads, len(SHARES)))
        visual, frame, row, col = [], [], [], []
        start, summary = memory.visual_start, memory.visual_start - memory.prefix_len
        for layer in range(layers):
            zeros = torch.zeros(heads, dtype=torch.float64)
            held = (
                self.held[layer].cpu()
                if self.held[layer] is not None
                else torch.zeros(heads, self.live[layer], dtype=torch.float64)
            )
            dialogue = self.dialogue[layer].cpu() if self.dialogue[layer] is not None else zeros
            retrieved = self.retrieved[layer].cpu() if self.retrieved[layer] is not None else zeros
            length = memory.layers[layer].visual_len
            total = held.sum(dim=1) + dialogue + retrieved
            total = torch.where(total > 0, total, torch.ones_like(total))
            on_visual = held[:, start : start + length] / total[:, None]
            valid = memory.valid[layer]  # ragged heads: padding slots hold nothing (and no provenance)
            valid = valid.cpu() if valid is not None else torch.ones(on_visual.shape, dtype=torch.bool)
            on_visual = on_visual * valid
            shares[layer, :, 0] = (
                (held[:, : memory.prefix_len].sum(1) + held[:, start + length :].sum(1) + dialogue) / total
            ).numpy()
            shares[layer, :, 1] = (held[:, memory.prefix_len : memory.prefix_len + summary].sum(1) / total).numpy()
            shares[layer, :, 2] = on_visual.sum(1).numpy()
            shares[layer, :, 3] = (retrieved / total).numpy()
            where = [(field[layer].cpu() * valid).long() for field in (memory.frame, memory.row, memory.col)]
            for fetched, fetched_where in self.fetched[layer]:  # retrieved tokens are patches of the stream too
                on_visual = torch.cat([on_visual, fetched.cpu() / total[:, None]], dim=1)
                where = [torch.cat([w, fetched_where[k]], dim=1) for k, w in enumerate(where)]
            visual.append(on_visual.float().numpy())
            for out, field in zip((frame, row, col), where):
                out.append(field.numpy().astype(np.int32))
        return Attribution(shares, visual, frame, row, col, memory.num_grids, memory.grid_shape or (0, 0))


def attribution_views(
    attributions: dict[str, Attribution],
    grid_times_s: list[float],
    grids: list[int],
    layer: int | None = None,
    head: int | None = None,
) -> list[View]:
    """One :class:`~kvdemo.views.PatchValues` per engine over ``grids``: "what this answer looked at", on a scale
    shared by every engine (so they compare), the shares of text, summary and retrieved in the caption."""
    maps = {name: a.patch_map(layer, head) for name, a in attributions.items()}
    top = max((float(m[grids].max()) for m in maps.values() if m.size and len(grids)), default=0.0) or 1.0
    views: list[View] = []
    for name, attribution in attributions.items():
        share = attribution.share(layer, head)
        parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items() if v >= 0.005 or k in ("text", "visual"))
        mass = maps[name].sum(axis=(1, 2))
        views.append(
            PatchValues(
                f"{name}: what the answer looked at",
                f"attention share: {parts} (brightness and outline: relative to the largest patch of any engine, "
                f"{100 * top:.2f}%)",
                list(grids),
                np.clip(maps[name][grids] / top, 0, 1),
                [f"{grid_times_s[g]:.0f} s · {100 * mass[g]:.1f}%" for g in grids],
            )
        )
    return views


def evidence_grids(episode, subject: str, num_grids: int) -> np.ndarray:
    """``[num_grids]`` bool: the temporal grids of a generated stream in which a visual token shows ``subject``
    (a shape name; per-token ground truth, :attr:`~kvdemo.world.synthetic.Episode.shape_labels`)."""
    from ..world.synthetic import SHAPES  # deferred on purpose: the generated world is needed only to validate

    labels = episode.shape_labels[:num_grids]
    return (labels == SHAPES.index(subject)).any(axis=1)


def evidence_ratio(attribution: Attribution, episode, subject: str) -> float:
    """How much more of the answer's visual attention a frame that shows ``subject`` receives than the average frame:
    (share on the evidence grids / their number) over (share on every grid / their number). 1 is no preference, the
    most is grids / evidence grids; ``nan`` when no grid (or every grid) shows it, or nothing visual is attended. It
    compares with the average frame rather than with the other frames so that an engine that holds almost nothing
    outside the evidence does not divide by almost nothing (kvdemo's choice)."""
    mass = attribution.frame_mass()
    shows = evidence_grids(episode, subject, len(mass))
    if not shows.any() or shows.all() or mass.sum() <= 0:
        return float("nan")
    return float(mass[shows].mean() / mass.mean())


def evidence_share(attribution: Attribution, episode, subject: str) -> float:
    """The share of the answer's visual attention (held and retrieved patches) on the grids that show ``subject``;
    ``nan`` when nothing visual is attended. Its chance level is the share of grids that show it."""
    mass = attribution.frame_mass()
    shows = evidence_grids(episode, subject, len(mass))
    return float(mass[shows].sum() / mass.sum()) if mass.sum() > 0 else float("nan")


def object_token_share(
    attribution: Attribution, episode, subject: str, layer: int | None = None
) -> tuple[float, float]:
    """``(share of the visual attention on tokens that show subject, share of the attended tokens that show it)``
    in ``layer`` (None: every layer), each token's label read through its provenance from the stream's per-token
    ground truth (:attr:`~kvdemo.world.synthetic.Episode.shape_labels` ``[grids, rows * cols]``): the first above the
    second is attention on the object itself rather than on its frame. ``nan`` when nothing visual is attended."""
    from ..world.synthetic import SHAPES  # deferred on purpose: the generated world is needed only to validate

    cols = attribution.grid_shape[1]
    on, tokens, mass = 0.0, 0, 0.0
    for index in range(len(attribution.visual)) if layer is None else [layer]:
        shows = episode.shape_labels[attribution.frame[index], attribution.row[index] * cols + attribution.col[index]]
        shows = shows == SHAPES.index(subject)
        attended = attribution.visual[index] > 0
        on += float(attribution.visual[index][shows].sum())
        mass += float(attribution.visual[index].sum())
        tokens += int((shows & attended).sum()) / max(int(attended.sum()), 1)
    layers = len(attribution.visual) if layer is None else 1
    return (on / mass if mass > 0 else float("nan"), tokens / layers)


class FidelityProbe:
    """Observer on the full cache's question forward: in every layer, the same query and the question's own
    keys/values attend over each other memory too; accumulates the squared error of each memory's attention
    output against the full cache's, and the squared norm of the full cache's (both float32, the same
    :func:`~kvdemo.cache.attention.attention_weights`, so the full cache against itself is exactly 0)."""

    def __init__(self, memories: dict[str, KVMemory], unrotate: Any = None) -> None:
        self.memories, self.unrotate = memories, unrotate  # unrotate: as ``MemoryCache.unrotate``
        layers = max((len(m.layers) for m in memories.values()), default=0)
        self.error = {name: np.zeros(layers) for name in memories}
        self.norm = np.zeros(layers)

    def __call__(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: torch.Tensor | None,
        extra: Any,
        scale: float,
    ) -> None:
        q_heads, q_len = query.shape[1], query.shape[2]
        reference = weighted_values(attention_weights(query, key, bias, scale, extra), value, extra, q_heads)
        self.norm[layer] += float(reference.pow(2).sum())
        new_keys, new_values = key[:, :, -q_len:], value[:, :, -q_len:]
        for name, memory in self.memories.items():
            store, live = memory.layers[layer], memory.live_len(layer)
            own_keys = torch.cat([store.keys[:, :, :live].to(query.device), new_keys], dim=2)
            own_values = torch.cat([store.values[:, :, :live].to(query.device), new_values], dim=2)
            own_bias = store.bias[:, :live] if store.bias is not None else None
            own_extra = store.offload.fetch(query[0], scale, self.unrotate) if store.offload is not None else None
            out = weighted_values(
                attention_weights(query, own_keys, own_bias, scale, own_extra), own_values, own_extra, q_heads
            )
            self.error[name][layer] += float((out - reference).pow(2).sum())

    def relative_error(self) -> dict[str, list[float]]:
        """Per memory, per layer: ``||o_policy - o_full|| / ||o_full||`` over the question's tokens and query heads."""
        norm = np.sqrt(np.maximum(self.norm, 1e-30))
        return {name: (np.sqrt(error) / norm).tolist() for name, error in self.error.items()}


def first_token_kl(full_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """``KL(p_full || p_policy)`` in nats of the first answer token's distributions (``[vocab]`` logits)."""
    full = torch.log_softmax(full_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double().to(full.device), dim=-1)
    return float((full.exp() * (full - other)).sum())


@torch.inference_mode()
def fidelity(full, engines: dict[str, Any], question: str) -> dict[str, dict[str, Any]]:
    """What compression changed for ``question`` (kvdemo's protocol: the question alone, no earlier turns, so every
    engine reads the same text): per engine, the per-layer relative error of its attention output against the
    full cache's engine ``full`` (teacher-forced, :class:`FidelityProbe`) and the first answer token's KL
    divergence from the full cache's. Memories are left exactly as they were (writes go to the slack; retrieval
    marks are cleared)."""
    model = full.model
    question = full.check_question(question)
    cursors = {name: engine.memory.cursor.next for name, engine in engines.items()}
    if any(c != full.memory.cursor.next for c in cursors.values()):
        raise ValueError("fidelity compares engines that watched the same stream (their positions differ)")
    embeds = model.question_embeds([], question)
    positions, _ = model.text_positions(full.memory.cursor, int(embeds.shape[0]))
    for engine in engines.values():
        engine.memory.reset_retrieved()
    rotary = getattr(model, "rotary", None)
    unrotate = rotary.unrotating(positions) if rotary is not None else None  # for stores that score before RoPE
    probe = FidelityProbe({name: engine.memory for name, engine in engines.items()}, unrotate)
    cache = MemoryCache(full.memory)
    cache.observers.append(probe)
    full_logits = model.forward(embeds, positions, cache)
    errors = probe.relative_error()
    out = {}
    for name, engine in engines.items():
        engine.memory.reset_retrieved()
        own = MemoryCache(engine.memory)
        own.answering, own.unrotate = True, unrotate
        logits = model.forward(embeds, positions, own)
        out[name] = {
            "layer_error": [round(e, 6) for e in errors[name]],
            "first_token_kl": round(first_token_kl(full_logits, logits), 6),
        }
        engine.memory.reset_retrieved()  # the probe's retrieval marks are not an answer's
    return out


def fidelity_views(question: str, results: dict[str, dict[str, Any]]) -> list[View]:
    """A chart per policy's fidelity: relative attention-output error per layer (every policy on one axis), KL in
    the legend."""
    lines = {f"{name} (first-token KL {r['first_token_kl']:.3f})": r["layer_error"] for name, r in results.items()}
    layers = len(next(iter(results.values()))["layer_error"]) if results else 0
    return [
        Chart(
            f"What compression changed: “{question}”",
            "relative error of each layer's attention output against the full cache's, on the same query "
            "(teacher-forced: the full cache's hidden states feed every memory); KL: first answer token",
            [Series(list(range(layers)), lines, "layer", "relative error", markers=True)],
        )
    ]
