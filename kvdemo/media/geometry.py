"""How a model family sizes frames and groups them into temporal grids of tokens (:class:`FrameGeometry`), known
before any model loads. No torch here: the CLI opens and checks a video file before torch loads. The resize rule
itself is the family's (its file in :mod:`kvdemo.models` gives it); this module knows no family."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

#: A family's resize rule: ``(geometry, height, width) -> (new_height, new_width)``, sides multiples of
#: ``geometry.factor`` and the pixel count within ``[geometry.min_pixels, geometry.max_pixels]``.
ResizeRule = Callable[["FrameGeometry", int, int], tuple[int, int]]


@dataclass(frozen=True)
class FrameGeometry:
    """How one family sizes frames and groups them into temporal grids of tokens, known before the model loads.

    ``factor``: pixels per token side (patch x merge); ``frames_per_grid``: frames one temporal grid takes;
    ``[min_pixels, max_pixels]``: a frame's pixel range. ``resize`` is the family's own rule (e.g. its processor's
    ``smart_resize``, declared in the family's file); a family whose frames all take one size gives ``fixed_size``
    instead (LLaVA-OneVision's 384 x 384, pooled to ``fixed_grid`` tokens). ``text_per_grid`` bounds the
    stream-text tokens a grid carries (timestamps and delimiters), which count against the budget.
    """

    factor: int
    frames_per_grid: int
    min_pixels: int
    max_pixels: int
    resize: ResizeRule | None = None
    fixed_size: tuple[int, int] | None = None
    fixed_grid: tuple[int, int] | None = None
    text_per_grid: int = 0

    def __post_init__(self) -> None:
        if self.resize is None and self.fixed_size is None:
            raise ValueError("a frame geometry needs its family's resize rule or a fixed frame size")

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> "FrameGeometry":
        """This geometry with the user's pixel range (a fixed-size family ignores it)."""
        max_pixels = self.max_pixels if max_pixels is None else int(max_pixels)
        min_pixels = self.min_pixels if min_pixels is None else int(min_pixels)
        return dataclasses.replace(self, min_pixels=min(min_pixels, max_pixels), max_pixels=max_pixels)

    def describe(self) -> str:
        """How frames are resized, in a phrase (the app's pixel field says it)."""
        if self.fixed_size:
            return (
                f"every frame is resized to {self.fixed_size[0]} x {self.fixed_size[1]} "
                f"({self.fixed_grid[0] * self.fixed_grid[1] if self.fixed_grid else '?'} tokens); this field does not apply"
            )
        return f"frames are resized like the family's processor: sides multiples of {self.factor}"

    @property
    def smallest_frame(self) -> int:
        """The fewest pixels a frame may be given (one token)."""
        return self.factor * self.factor

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` a source frame is resized to, by the family's own rule."""
        if height <= 0 or width <= 0:
            raise ValueError(f"frame size must be positive, got {height}x{width}")
        if self.fixed_size is not None:
            return self.fixed_size
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio must be below 200, got {height}x{width}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        return self.resize(self, height, width)

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """``(rows, cols)`` of visual tokens per temporal grid for frames of ``size`` (already resized)."""
        if self.fixed_grid is not None:
            return self.fixed_grid
        return size[0] // self.factor, size[1] // self.factor

    def check_size(self, size: tuple[int, int]) -> None:
        """Raise ``ValueError`` unless frames of ``size`` are already on this family's grid."""
        if self.fixed_size is not None and tuple(size) != tuple(self.fixed_size):
            raise ValueError(
                f"frames must be {self.fixed_size[1]}x{self.fixed_size[0]} for this model (size frames for it: "
                f"load_video(..., model=model) or stream_video), got {size[1]}x{size[0]}"
            )
        if self.fixed_size is None and (size[0] % self.factor or size[1] % self.factor):
            raise ValueError(
                f"frame sides must be multiples of {self.factor} (size frames for the model: "
                f"load_video(..., model=model) or stream_video), got {size}"
            )

    def chunk_tokens(self, size: tuple[int, int] | None, frames: int) -> tuple[int, str]:
        """Tokens one chunk of ``frames`` frames of ``size`` puts in the memory (visual tokens and, at most, the
        stream text of its grids), and its shape in words; with ``size`` unknown, the most ``max_pixels`` allows."""
        grids = -(-frames // self.frames_per_grid)
        if size is not None:
            rows, cols = self.grid(size)
            shape = f"{grids} temporal grid(s) of {rows}x{cols} tokens"
            visual = rows * cols
        else:
            visual = math.prod(self.fixed_grid) if self.fixed_grid else self.max_pixels // self.factor**2
            shape = f"{frames} frames at max pixels"
        if self.text_per_grid:
            shape += f" + up to {self.text_per_grid} text tokens each"
        return grids * (visual + self.text_per_grid), shape
