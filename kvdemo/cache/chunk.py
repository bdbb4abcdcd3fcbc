"""What one chunk of frames puts in the sequence (:class:`VisualChunk`): made by a model family's adapter, kept by
the memory, so it sits below both (the memory knows no model)."""

from __future__ import annotations

import dataclasses
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
    per_visual_token: the names of ``extras`` whose tensors (or lists of tensors) hold one row per visual token, in
    sequence order, so that :meth:`subset` keeps their rows with the visual tokens it keeps.
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
    per_visual_token: tuple[str, ...] = ()

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

    def subset(self, keep: torch.Tensor) -> "VisualChunk":
        """The chunk with only the tokens ``keep [n]`` (bool) marks, in their order: what pruning before the LLM lets
        in. Its grids, times and frames stay (they were seen); the :attr:`per_visual_token` extras keep the rows of
        the visual tokens kept."""
        text = self.text if self.text is not None else torch.zeros(self.num_tokens, dtype=torch.bool)
        visual_keep = keep.cpu()[~text.cpu()]
        extras = dict(self.extras)
        for name in self.per_visual_token:
            value = extras[name]
            extras[name] = (
                [rows[visual_keep.to(rows.device)] for rows in value]
                if isinstance(value, (list, tuple))
                else value[visual_keep.to(value.device)]
            )

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            return tensor[keep.to(tensor.device)]

        return dataclasses.replace(
            self,
            embeds=rows(self.embeds),
            grid=rows(self.grid),
            row=rows(self.row),
            col=rows(self.col),
            text=None if self.text is None else rows(self.text),
            extras=extras,
        )
