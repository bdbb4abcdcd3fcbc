"""``streamingvlm``: StreamingVLM (ICLR 2026, ``mit-han-lab/streaming-vlm``): attention sinks, a window of recent
text and a window of recent vision, at contiguous positions.

What the authors' code keeps (``streaming_vlm/inference/inference.py``, ``process_past_kv``; the cache itself,
``streaming_cache.py``, is transformers' ``DynamicCache`` plus each layer's position ids): the system prompt; of the
"previous text" (the narration of rounds that left the recent window) its first ``text_sink`` = 512 tokens (the
sinks) and its last ``text_sliding_window`` = 512 (the text window); the narration of the last ``text_round`` = 16
one-second rounds; and the video of the last ``window_size`` = 16 seconds (the vision window). Everything else
leaves, every layer and head alike. With ``pos_mode="shrink"`` (the default, the one the released checkpoint was
trained for) the positions of the whole kept sequence are recomputed every round as if the evicted tokens had
never been there, so the gaps close (keys are cached before RoPE and rotated at attention time).

kvdemo's setting differs, and these are kvdemo's own choices:

- kvdemo's memory holds the system prompt (always kept, as the sinks' first part) and video; there is no per-round
  narration (answers are asked on a fork; the dialogue is replayed with each question). The code's cut is therefore
  made on the stream itself, as positions: of the stream after the prompt, the first ``text_sink`` tokens are the
  attention sinks (StreamingLLM's first tokens), the ``text_sliding_window`` tokens just before the vision window
  are the text window, and the grids of the last ``window_size`` seconds are the vision window. ``text_round`` has
  no counterpart and is not a parameter.
- The vision window is measured from the newest grid held, when a compression runs: grid ``g`` is in it when
  ``t_newest - t_g < window_size`` (16 grids of 1 s, the newest included, as the code's 16 rounds).
- kvdemo compresses when the budget ``M`` is reached, as for every policy; a pass keeps the windows, at most ``C``
  tokens (vision window first, newest first; then the sinks, oldest first; then the text window, newest first),
  never a token outside them. Between passes the memory may hold older tokens, up to ``M``.
- ``positions=contiguous``: the gap each evicted temporal grid leaves closes. A grid's span is how far the next
  held grid's positions start after its own (on the temporal axis: Qwen2.5-VL's ``floor(g * second_per_grid *
  tokens_per_second)`` steps, one cursor step per grid for the 1-D families); every held token after an evicted
  grid, and every later token (the next chunks, a question), moves back by the spans evicted before it, on all
  three axes alike, its key re-rotated once (:class:`~.contract.PositionShift`). That is what the code's recompute
  does for its layout, where each one-second chunk is a video region of its own whose three axes start at the
  running position: removing a round moves every later token back by the round's span on every axis. In kvdemo's
  single video region (Qwen2-VL/2.5-VL: rows and columns from the region's start) the rows and columns of the kept
  window move back with it, relative to the prompt; relative to each other and to a question nothing changes. A
  grid partly kept keeps its span (its evicted tokens leave gaps inside it).
- ``positions=kept``: kvdemo's kept positions (every other policy's): keys keep the positions they were rotated at.

The released checkpoint (StreamingVLM's Qwen2.5-VL-7B fine-tune) was trained with contiguous positions; an
untrained model (Qwen2.5-VL-Instruct, kvdemo's default) was not, and sees a prompt followed, without a gap, by video
from long ago. Each re-rotation rounds a key once to the cache's dtype (computed in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BudgetError
from .contract import LayerSlice, PositionShift, Selection, SliceStack, slice_stacks
from .registry import BenchDeclaration, PolicyCard, param, register
from .topk import Ranking, ScoredPolicy, select_ranked

REASON_SINK = 0
REASON_TEXT_WINDOW = 1
REASON_VISION_WINDOW = 2
#: Priority classes (higher is kept first); within a class the arrival order decides.
_CLASS = {REASON_VISION_WINDOW: 3.0, REASON_SINK: 2.0, REASON_TEXT_WINDOW: 1.0}
_CLASS_STEP = 2.0**33  # above any arrival number (int32)

CARD = PolicyCard(
    "StreamingVLM: attention sinks, a text window and a vision window of the last seconds, at contiguous positions.",
    reasons={
        REASON_SINK: "attention sink",
        REASON_TEXT_WINDOW: "text window",
        REASON_VISION_WINDOW: "vision window",
    },
    bench=BenchDeclaration(host_reads=8),
)


@register(CARD)
@dataclass
class StreamingVLM(ScoredPolicy):
    """Sinks, text window and vision window (module docstring); every layer and head keeps the same tokens.

    Per pass: a token's class from its arrival number ``order`` and its grid ``frame`` (``[G * H, L]`` rows of a
    stack, every layer at once), its priority ``class * 2^33 +/- order``, at most ``min(C, tokens in the
    windows)`` kept (the shared top-k); with ``positions=contiguous`` the shift of every grid
    (:func:`grid_shifts`) goes to the memory with the selection.
    """

    name = "streamingvlm"
    window_size: float = param(
        16.0, "vision window: seconds of the newest video kept (the paper's 16 s)", within="(0, inf)"
    )
    text_sink: int = param(
        512, "attention sinks: the first tokens of the stream after the prompt, kept for good", within="[0, inf)"
    )
    text_sliding_window: int = param(
        512, "text window: the tokens just before the vision window (the code's 512)", within="[0, inf)"
    )
    positions: str = param(
        "contiguous",
        "contiguous: kept keys re-rotated to close the gaps (as the checkpoint was trained); kept: as rotated",
        choices=("contiguous", "kept"),
    )

    def check_stream(self, chunk_seconds: float) -> None:
        if self.window_size < chunk_seconds:
            raise BudgetError(
                f"streamingvlm's vision window window_size={self.window_size:g} s is shorter than one chunk "
                f"({chunk_seconds:g} s of video); raise window_size to at least {chunk_seconds:g}"
            )

    def rank(self, slices: list[LayerSlice], keep: int) -> tuple[list[Ranking], dict[str, Any]]:
        rankings = []
        for stack in slice_stacks(slices):
            reason, in_window = window_reasons(stack, self.window_size, self.text_sink, self.text_sliding_window)
            order = stack.rows("order").double()
            klass = torch.zeros_like(order)
            for code, value in _CLASS.items():
                klass = torch.where(reason == code, value, klass)
            sign = torch.where(reason == REASON_SINK, -1.0, 1.0).to(order.dtype)  # sinks: oldest first
            priority = torch.where(in_window, klass * _CLASS_STEP + sign * order, -_CLASS_STEP)
            wanted = in_window.sum(dim=1).clamp(max=int(keep))  # never a token outside the windows
            rankings.append(Ranking(priority, reason.to(torch.int8), stack.layers, keep=wanted))
        return rankings, {}

    def compress(self, slices: list[LayerSlice], keep: int) -> Selection:
        rankings, info = self.rank(slices, keep)
        selection, masks = select_ranked(slices, rankings, keep, info)
        if self.positions == "contiguous" and slices:
            first = slices[0]
            if first.rotary is None:
                raise ValueError("positions=contiguous re-rotates keys: the slices carry no rotation (rotary)")
            if first.position is None:
                raise ValueError("positions=contiguous needs each key's position (the slices carry none)")
            grids = max(len(first.grid_times_s), first.newest_frame + 1)
            shift = grid_shifts(first.frame[0], first.position[0], masks[0][0], grids)
            selection.shift = PositionShift(shift, first.rotary)
        return selection


def window_reasons(
    stack: SliceStack, window_size: float, text_sink: int, text_sliding_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's window, as rows ``[G * H, L]`` of ``stack``: the reason code (vision window before sink before
    text window where they overlap) and whether it lies in any window.

    Vision window: grids ``g >= first`` with ``first`` the oldest grid within ``window_size`` s of the newest
    (from ``grid_times_s``, on the host: no read of a tensor; without times, one grid per second). Sinks: arrival
    number ``order < text_sink``. Text window: ``o_w - text_sliding_window <= order < o_w``, ``o_w`` the first
    arrival number of the vision window in that row (a min over the row, on the device).
    """
    frame, order = stack.rows("frame").long(), stack.rows("order").long()
    first = first_window_grid(stack.first.grid_times_s, stack.first.newest_frame, window_size)
    vision = frame >= first
    big = torch.iinfo(torch.int64).max
    window_start = torch.where(vision, order, big).min(dim=1, keepdim=True).values
    sink = order < text_sink
    text = (order < window_start) & (order >= window_start - text_sliding_window)
    reason = torch.where(vision, REASON_VISION_WINDOW, torch.where(sink, REASON_SINK, REASON_TEXT_WINDOW))
    return reason, vision | sink | text


def first_window_grid(grid_times_s: list[float], newest: int, window_size: float) -> int:
    """The oldest grid whose time is within ``window_size`` seconds of grid ``newest`` (``t_newest - t_g <
    window_size``); with no times given, grids are taken one second apart."""
    if not grid_times_s:
        return max(0, newest - math.ceil(window_size) + 1)
    newest_time = grid_times_s[newest]
    first = newest
    while first > 0 and newest_time - grid_times_s[first - 1] < window_size:
        first -= 1
    return first


def grid_shifts(frame: torch.Tensor, position: torch.Tensor, kept: torch.Tensor, grids: int) -> torch.Tensor:
    """``[grids]`` int64: how far every grid's tokens move back when the grids ``kept`` keeps none of close their
    gaps (``positions=contiguous``).

    ``frame [L]``, ``position [L, 3]`` and ``kept [L]`` bool of one head (every head and layer keeps the same tokens).
    A held grid's span is the distance on the temporal axis from its first position to the next held grid's; the
    shift of grid ``g`` is the sum of the spans of the grids evicted now before it (exclusive prefix sum), and the
    last entry, the newest grid's, is what every later token moves back by.
    """
    device = frame.device
    frame = frame.long()
    big = torch.iinfo(torch.int64).max
    start = torch.full((grids,), big, dtype=torch.long, device=device)
    start = start.scatter_reduce(0, frame, position[:, 0].long(), reduce="amin")  # first position of each held grid
    held = start < big
    kept_grid = torch.zeros(grids, dtype=torch.bool, device=device).scatter_(0, frame[kept], True)
    # the next held grid's start: a suffix minimum (positions grow with the grid), shifted by one
    suffix = torch.flip(torch.cummin(torch.flip(start, [0]), 0).values, [0])
    following = torch.cat([suffix[1:], suffix.new_full((1,), big)])
    span = torch.where(held & (following < big), following - start, 0)
    evicted_span = torch.where(held & ~kept_grid, span, 0)
    return torch.cumsum(evicted_span, 0) - evicted_span
