"""What the engine needs of a model family, and nothing it must know about one.

A family is one file (:mod:`.qwen2_vl`, :mod:`.qwen3_vl`, :mod:`.qwen3_5`, :mod:`.llava_onevision`): its spec
(:mod:`.spec`: what the rest of kvdemo knows of it) and its adapter behind :class:`VideoLM`. The adapter turns
frames into a chunk (the tokens a temporal grid puts in the sequence: visual tokens, and the text the stream
itself carries around them; :class:`~kvdemo.cache.chunk.VisualChunk`), gives every token its position through a
cursor (:class:`Cursor`, pickled with the memory), embeds the prefix and a question, runs the language model
on a given cache, and rotates keys (for policies that keep keys before RoPE). How frames are sized is a
:class:`FrameGeometry`, known before any weight loads. Models know nothing of policies.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from ..cache.chunk import VisualChunk
from ..errors import UserError
from ..media.geometry import FrameGeometry


class ModelError(UserError):
    """A model could not be loaded or used; the message says which and why."""


class Cursor(Protocol):
    """Where the next token goes (a family's own small, picklable state; see each adapter)."""

    next: int


class VideoLM(Protocol):
    """What the engine needs from a model family (the adapters implement it; see :mod:`.adapter`)."""

    name: str
    family: str
    random_weights: bool
    notice: str | None  # what its answers are worth, when that needs saying (offline tiny models)
    geometry: FrameGeometry
    num_layers: int  # layers that hold keys and values (the memory's layers)
    num_kv_heads: int
    head_dim: int
    layer_map: list[int | None]  # model layer -> memory layer (None: no keys and values, e.g. linear attention)
    position_limit: int | None  # the positions the model was trained with end here (None: no limit)
    device: torch.device
    dtype: torch.dtype
    #: The language model's rotation (``rotate(x, position)`` / ``unrotate``) of positions ``[..., 3]``.
    rotary: Any
    logit_bias: torch.Tensor | None
    max_dialogue_tokens: int  # earlier turns replayed before a question, at most (kvdemo.dialogue)

    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk: ...

    def new_cursor(self) -> Cursor: ...

    def chunk_positions(self, chunk: VisualChunk, cursor: Cursor) -> tuple[torch.Tensor, Cursor]: ...

    def text_positions(self, cursor: Cursor, count: int) -> tuple[torch.Tensor, Cursor]: ...

    def prefix_embeds(self) -> torch.Tensor: ...

    def question_embeds(self, history: list[tuple[str, str]], question: str) -> torch.Tensor: ...

    def embed_text(self, ids: list[int]) -> torch.Tensor: ...

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, cache: Any, chunk: VisualChunk | None = None
    ) -> torch.Tensor: ...

    def tokenize(self, text: str) -> list[int]: ...

    def layer_devices(self) -> dict[int, torch.device]: ...  # {model layer: device of its weights}

    def detokenize(self, ids: list[int]) -> str: ...

    @property
    def stop_ids(self) -> set[int]: ...
