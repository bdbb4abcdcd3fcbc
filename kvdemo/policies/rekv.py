"""``rekv``: ReKV (ICLR 2025, ``Becomebright/ReKV``): a sliding window on the device, every block that leaves it kept in
host memory, and at each question each layer retrieves the blocks whose representative keys best match the question.

What kvdemo takes from the code (``kv_cache_manager.py``, ``rekv_attention.py``) and where it differs:

- **Blocks.** ReKV's ``block_size`` is the tokens of one video frame (``n_frame_tokens``): a block is one frame.
  kvdemo's visual time unit is the temporal grid (the model's own frame, two sampled frames for Qwen's temporal
  patch), so ``block_size=0`` (the default) makes a block one temporal grid; a positive ``block_size`` makes blocks
  runs of that many tokens in arrival order, as the code's (kvdemo's choice of unit, the paper's rule).
- **Initial tokens.** ReKV keeps ``n_init`` initial tokens, by default the prompt before the video
  (``len(init_prompt_ids)``): kvdemo's prefix, which the memory always keeps. ``n_init`` here counts visual tokens
  kept besides it (default 0, the paper's).
- **Local window.** The newest ``n_local`` tokens (the paper's 15,000 for LLaVA-OV-7B) stay on the device, in whole
  blocks; what leaves goes to the store (:class:`~kvdemo.cache.offload.OffloadStore`) as whole blocks.
- **Representative key and scoring.** A block's representative key is the mean of its keys before RoPE; at a
  question, the question's queries before RoPE, averaged over its tokens, score every stored block, the dot products
  summed over the layer's query heads (the code concatenates all heads into one vector per block and one per query:
  one ranking per layer, every head retrieving the same blocks). The top ``topk`` blocks (the paper's 64 frames) are
  chosen at the question's prefill and kept for every decode step, then released
  (:class:`~kvdemo.policies.contract.RetrievalRule`: shared, per question, unrotated). ReKV's ``chunk_size`` (1 in
  every released script) is not offered.
- **Memory bound (kvdemo's).** ReKV bounds the device by its window and buffer sizes; kvdemo bounds what a question
  attends to by ``M``: the retrieved blocks count toward the budget (``OffloadUpdate.counted``), so a compression to
  ``C`` keeps ``C`` less the retrieval reserve, and resident + retrieved never pass ``M``. The reserve is ``topk``
  blocks, at most half of ``C`` (kvdemo's, so the window keeps at least half; the report notes a clamp), and the
  window is ``min(n_local, C - reserve - n_init)`` rounded down to whole blocks.
- **Positions.** ReKV re-positions the retrieved blocks contiguously after the initial tokens (InfLLM's scheme);
  kvdemo attends to them at their stream positions, as cached (its keys keep their RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import BudgetError
from ..views import CellGrid, Chart, Series, View, ViewContext
from .contract import LayerSlice, OffloadUpdate, Policy, RetrievalRule, Selection, SliceStack, slice_stacks
from .registry import BenchDeclaration, PolicyCard, param, register
from .topk import Ranking, select_ranked

REASON_INIT, REASON_LOCAL = 0, 1
REASON_NAMES = {REASON_INIT: "initial tokens (n_init)", REASON_LOCAL: "local window (n_local)"}
#: The largest share of ``C`` the retrieval reserve may take (kvdemo's: the local window keeps the rest).
RESERVE_SHARE = 0.5

CARD = PolicyCard(
    "A local window on the device; every block that leaves it is kept in host memory and each layer retrieves the "
    "blocks that best match the question.",
    reasons=REASON_NAMES,
    view_titles=("Retrieved blocks", "Host store"),
    bench=BenchDeclaration(benchmarks=("store",)),
)


@register(CARD)
@dataclass
class ReKV(Policy):
    """The newest ``n_local`` tokens resident; the rest offloaded in blocks and retrieved per question per layer."""

    name = "rekv"

    n_init: int = param(
        0, "visual tokens kept from the stream's start besides the prefix (ReKV's prompt)", within="[0, inf)"
    )
    n_local: int = param(15000, "local window: the newest visual tokens kept on the device", within="[1, inf)")
    topk: int = param(64, "blocks each layer retrieves for a question", within="[1, inf)")
    block_size: int = param(0, "tokens per block (0: one temporal grid, the paper's frame)", within="[0, inf)")
    _last: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _evicted_blocks: int = field(default=0, init=False, repr=False, compare=False)

    def check_window(self, keep: int | None, chunk_tokens: int) -> None:
        """A local window shorter than one chunk cannot hold the chunk being prefilled: refused (before a model
        loads) with a one-line reason. The window is at least ``min(n_local, C - C // 2 - n_init)``."""
        shortest = self.n_local if keep is None else min(self.n_local, keep - int(keep * RESERVE_SHARE) - self.n_init)
        if shortest < chunk_tokens:
            smallest_keep = chunk_tokens + self.n_init
            while smallest_keep - int(smallest_keep * RESERVE_SHARE) - self.n_init < chunk_tokens:
                smallest_keep += 1
            advice = [f"n_local to at least {chunk_tokens}"] if self.n_local < chunk_tokens else []
            if keep is not None and keep < smallest_keep:
                advice.append(f"C to at least {smallest_keep}")
            raise BudgetError(
                f"rekv's local window ({shortest} tokens: n_local={self.n_local}"
                + (f", C={keep} less the retrieval reserve and n_init={self.n_init}" if keep is not None else "")
                + f") is shorter than one chunk ({chunk_tokens} visual tokens); raise {' and '.join(advice)}"
            )

    def split(self, keep: int, block: int) -> tuple[int, int, int]:
        """``(initial, window, reserve)`` tokens of a pass keeping ``keep`` with blocks of ``block`` tokens (see the
        module docstring): the reserve ``topk`` blocks, at most half of ``keep``; the window whole blocks."""
        reserve = min(self.topk, int(keep * RESERVE_SHARE) // block) * block
        initial = min(self.n_init, keep - reserve)
        window = min(self.n_local, keep - reserve - initial) // block * block
        return initial, window, reserve

    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        """Every layer at once: keep the initial and the newest tokens, move the rest to the store as blocks."""
        first = slices[0]
        grid_tokens = max(first.grid[0] * first.grid[1], 1)
        block = self.block_size or grid_tokens
        initial, window, reserve = self.split(keep, block)
        rankings = [self.rank_stack(stack, initial) for stack in slice_stacks(slices)]
        selection, kept = select_ranked(slices, rankings, initial + window)
        selection.offload = [
            self.offload(stack, mask, reserve, block) for stack, mask in zip(slice_stacks(slices), kept)
        ]
        stored = self._last.get("stored_blocks", 0) + self._evicted_blocks
        self._last = {
            "initial": initial,
            "window": window,
            "reserve_blocks": reserve // block,
            "block_tokens": block,
            "topk_clamped": reserve // block < self.topk,
            "keep": keep,
            "stored_blocks": stored,
        }
        return selection

    def rank_stack(self, stack: SliceStack, initial: int) -> Ranking:
        """Rows ``[G * H, L]``: the first ``initial`` tokens of the stream first, then the newest."""
        order = stack.rows("order").double()
        first = order < initial
        priority = torch.where(first, order.new_tensor(float("inf")), order)
        reason = torch.where(first, REASON_INIT, REASON_LOCAL).to(torch.int8)
        return Ranking(priority, reason, stack.layers)

    def offload(self, stack: SliceStack, kept: torch.Tensor, reserve: int, block: int) -> OffloadUpdate:
        """What ``stack``'s layers evict (``kept [G * H, L]``), in arrival order, as blocks (one temporal grid each,
        or runs of ``block_size``) with their representative keys before RoPE; every head retrieves ``reserve``
        tokens (whole blocks) while answering, counted toward ``M``."""
        layers, heads, length = stack.frame.shape
        device = stack.keys.device
        valid = stack.rows("valid")
        held = torch.ones(layers * heads, length, dtype=torch.bool, device=device) if valid is None else valid
        evicted = held & ~kept
        count = evicted.sum(dim=1)
        arrival = torch.where(evicted, stack.rows("order").long(), torch.iinfo(torch.int64).max)
        width = int(count.max()) if count.numel() else 0  # one read for the stack
        self._evicted_blocks = -(-width // block)  # whole blocks leave (a pruned grid may leave fewer tokens)
        tokens = torch.argsort(arrival, dim=1)[:, :width]
        token_valid = torch.arange(width, device=device)[None] < count[:, None]
        blocks = None if self.block_size else torch.gather(stack.rows("frame").long(), 1, tokens)
        index_keys, rule = None, RetrievalRule(shared=True, per_question=True)
        rotary = stack.first.rotary
        if rotary is not None and stack.position is not None:
            dim = stack.keys.shape[-1]
            picked = tokens.view(layers, heads, width)
            gathered = torch.gather(stack.keys, 2, picked[..., None].expand(-1, -1, -1, dim))
            position = torch.gather(stack.position, 2, picked[..., None].expand(-1, -1, -1, 3))
            index_keys = rotary.unrotate(gathered.float(), position.long())
            rule = RetrievalRule(shared=True, per_question=True, unrotated=True)
        return OffloadUpdate(
            layers=stack.layers,
            tokens=tokens.view(layers, heads, width),
            valid=token_valid.view(layers, heads, width),
            retrieve=torch.full((layers, heads), reserve, dtype=torch.long, device=device),
            chunk=block,
            counted=True,
            block=None if blocks is None else blocks.view(layers, heads, width),
            index_keys=index_keys,
            rule=rule,
        )

    # --- what it shows ----------------------------------------------------------------------
    def views(self, context: ViewContext, layer: int, head: int) -> list[View]:
        """The layers x frames map of the blocks each layer retrieved for the last question, and the host store's
        size over the stream."""
        views: list[View] = []
        retrieved = context.retrieved_frames
        if retrieved is not None and retrieved.shape[1]:
            stored, fetched = retrieved[0], retrieved[1]  # [layers, grids] tokens
            classes = np.where(fetched > 0, 2, np.where(stored > 0, 1, 0))
            times = context.grid_times_s
            hover = [
                [
                    f"layer {l}, frame {f}"
                    + (f" ({times[f]:.1f} s)" if f < len(times) else "")
                    + f": {int(fetched[l, f])} of {int(stored[l, f])} stored tokens retrieved"
                    for f in range(classes.shape[1])
                ]
                for l in range(classes.shape[0])
            ]
            grid = CellGrid(
                classes=classes,
                class_names={0: "on the device (not stored)", 1: "stored, not retrieved", 2: "retrieved"},
                numbers=fetched,
                hover=hover,
                row_names=[f"L{l}" for l in range(classes.shape[0])],
                col_names=[f"f{f}" for f in range(classes.shape[1])],
            )
            caption = (
                "Which blocks each layer brought back from host memory for the last question (numbers: tokens "
                "retrieved per frame); every layer chooses its own blocks."
            )
            views.append(Chart("Retrieved blocks", caption, [grid]))
        events = [event for event in context.timeline if event.event == "compress"]
        if events:
            series = Series(
                x=[event.time_s for event in events],
                lines={"host store (MB)": [event.offloaded_bytes / 2**20 for event in events]},
                x_title="stream time (s)",
                y_title="MB in host memory",
            )
            caption = "The keys and values of every block that left the local window, kept in host memory."
            views.append(Chart("Host store", caption, [series]))
        return views

    def report(self) -> dict[str, Any]:
        if not self._last:
            return {"offloading": False}
        last = self._last
        notes = []
        if last["topk_clamped"]:
            notes.append(
                f"topk={self.topk} clamped to {last['reserve_blocks']} blocks: at most half of C={last['keep']} "
                f"is kept for retrieval ({last['block_tokens']} tokens per block)"
            )
        if self.topk > last["stored_blocks"]:
            notes.append(
                f"topk={self.topk} is more than the {last['stored_blocks']} blocks stored: a question retrieves at "
                f"most {min(last['reserve_blocks'], last['stored_blocks'])}"
            )
        return {
            "offloading": True,
            "stored_blocks": last["stored_blocks"],
            "initial_tokens": last["initial"],
            "local_window": last["window"],
            "retrieved_blocks": last["reserve_blocks"],
            "block_tokens": last["block_tokens"],
            "notes": notes,
        }
