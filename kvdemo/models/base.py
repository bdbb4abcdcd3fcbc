"""The small protocol every model family implements, and the M-RoPE position rule.

Models know nothing of policies: they turn frames into visual embeddings, text into ids, and run
the language model on a given cache with given positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class ModelError(ValueError):
    """A model could not be loaded or used; the message says which and why."""


@dataclass
class VisualChunk:
    """The vision encoding of one chunk of frames, shared by every engine watching the stream.

    embeds: ``[n, d_model]`` visual token embeddings, grid-major then row-major.
    grid/row/col: ``[n]`` temporal-grid index in the stream and merged-patch row/col of each token.
    grid_times_s: stream time (s) of the first frame of each temporal grid in this chunk.
    frames: real sampled frames in the chunk (a padded copy of an odd last frame is not counted).
    second_per_grid: temporal_patch_size / sampling fps (seconds one temporal grid spans).
    end_time_s: stream time (s) of the newest real frame in the chunk.
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

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def tokens_per_grid(self) -> int:
        return self.rows * self.cols


def mrope_positions(
    grid: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    start: int,
    second_per_grid: float,
    tokens_per_second: float | None,
) -> torch.Tensor:
    """3-D M-RoPE positions ``[3, n]`` of visual tokens whose region starts at position ``start``.

    Qwen2.5-VL (``tokens_per_second`` set): ``(s + floor(g * second_per_grid * tokens_per_second), s + row, s + col)``,
    computed in float and floored at the end. Qwen2-VL (``tokens_per_second=None``): ``(s + g, s + row, s + col)``.
    """
    if tokens_per_second is None:
        temporal = grid.long()
    else:
        temporal = torch.floor(grid.double() * float(second_per_grid) * float(tokens_per_second)).long()
    return torch.stack([temporal + start, row.long() + start, col.long() + start])


class VideoLM(Protocol):
    """What the engine needs from a model (see ``qwen_vl.QwenVL``)."""

    name: str
    random_weights: bool
    notice: str | None  # what its answers are worth, when that needs saying (offline tiny models)
    min_pixels: int  # the pixel range frames are resized into for this model
    max_pixels: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    temporal_patch_size: int
    tokens_per_second: float | None
    device: torch.device
    dtype: torch.dtype
    #: The language model's M-RoPE rotation (``rotate(x, position)`` / ``unrotate``), see ``qwen_vl.MRopeRotation``.
    rotary: object

    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk: ...

    def embed_text(self, ids: list[int]) -> torch.Tensor: ...

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def prefix_text(self) -> str: ...

    def question_text(self, history: list[tuple[str, str]], question: str) -> str: ...

    @property
    def stop_ids(self) -> set[int]: ...
