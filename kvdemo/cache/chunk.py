"""What one chunk of frames puts in the sequence (:class:`VisualChunk`): made by a model family's adapter, kept by
the memory, so it sits below both (the memory knows no model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class VisualChunk:
    """What one chunk of frames puts in the sequence, encoded once and shared by every engine watching the stream.

    embeds: ``[n, d_model]`` every token of the chunk in sequence order: visual token embeddings (grid-major,
    then row-major) and, for a family whose stream carries text (Qwen3-VL's timestamps and delimiters), the
    embeddings of that text around each grid.
    text: ``[n]`` bool, True for stream-text tokens (None: all visual).
    grid/row/col: ``[n]`` temporal-grid index in the stream and merged-patch row/col of each token (text: -1).
    grid_times_s: stream time (s) of the first frame of each temporal grid in this chunk.
    frames: real sampled frames in the chunk (a padded copy of an odd last frame is not counted).
    second_per_grid: frames per grid / sampling fps (seconds one temporal grid spans).
    end_time_s: stream time (s) of the newest real frame in the chunk.
    extras: what the family's forward needs besides the embeddings (Qwen3-VL's DeepStack features).
    """

    embeds: torch.Tensor
    grid: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    first_grid: int
    num_grids: int
    rows: int
    cols: int
    grid_times_s: list[float]
    frames: int
    second_per_grid: float
    end_time_s: float = 0.0
    encode_ms: float = 0.0
    text: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Every token of the chunk (visual and stream text): what it adds to the memory."""
        return int(self.embeds.shape[0])

    @property
    def visual_tokens(self) -> int:
        return self.num_tokens - (int(self.text.sum()) if self.text is not None else 0)

    @property
    def tokens_per_grid(self) -> int:
        return self.rows * self.cols
