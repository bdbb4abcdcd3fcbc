"""How a model family sizes frames and groups them into temporal grids of tokens (:class:`FrameGeometry`), known
before any model loads. No torch here: the CLI opens and checks a video file before torch loads."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FrameGeometry:
    """How one family sizes frames and groups them into temporal grids of tokens, known before the model loads.

    ``rule`` names the family's own resize rule: ``"qwen2-vl"`` (transformers' ``Qwen2VLImageProcessor``
    ``smart_resize``: sides multiples of ``factor`` = patch x merge, pixel count in ``[min_pixels,
    max_pixels]``), ``"qwen3-vl"`` (``Qwen3VLVideoProcessor``'s ``smart_resize`` for one temporal grid, the same
    bounds per frame: a stream fixes its frame size up front, where the processor spreads ``max_pixels`` over a
    whole clip) or ``"fixed"`` (every frame resized to ``fixed_size``: LLaVA-OneVision's 384 x 384, pooled to
    ``fixed_grid`` tokens). ``text_per_grid`` bounds the stream-text tokens a grid carries (Qwen3-VL's
    ``<t seconds><|vision_start|>`` and ``<|vision_end|>``), which count against the budget.
    """

    rule: str
    factor: int
    frames_per_grid: int
    min_pixels: int
    max_pixels: int
    fixed_size: tuple[int, int] | None = None
    fixed_grid: tuple[int, int] | None = None
    text_per_grid: int = 0

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> "FrameGeometry":
        """This geometry with the user's pixel range (a fixed-size family ignores it)."""
        max_pixels = self.max_pixels if max_pixels is None else int(max_pixels)
        min_pixels = self.min_pixels if min_pixels is None else int(min_pixels)
        return dataclasses.replace(self, min_pixels=min(min_pixels, max_pixels), max_pixels=max_pixels)

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
        if self.rule == "qwen3-vl":
            # The library's own resize rules, imported when a frame size is asked (deferred on purpose: this module is
            # imported by the memory and the CLI's fast checks, and importing them loads much of transformers).
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_resize  # deferred

            grid = self.frames_per_grid
            return qwen3_resize(grid, height, width, temporal_factor=grid, factor=self.factor,
                                min_pixels=grid * self.min_pixels, max_pixels=grid * self.max_pixels)
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # deferred, as above

        return smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """``(rows, cols)`` of visual tokens per temporal grid for frames of ``size`` (already resized)."""
        if self.fixed_grid is not None:
            return self.fixed_grid
        return size[0] // self.factor, size[1] // self.factor

    def check_size(self, size: tuple[int, int]) -> None:
        """Raise ``ValueError`` unless frames of ``size`` are already on this family's grid."""
        if self.fixed_size is not None and tuple(size) != tuple(self.fixed_size):
            raise ValueError(f"frames must be {self.fixed_size[1]}x{self.fixed_size[0]} for this model, got {size[1]}x{size[0]}")
        if self.fixed_size is None and (size[0] % self.factor or size[1] % self.factor):
            raise ValueError(f"frame sides must be multiples of {self.factor} (resize with the model's geometry), got {size}")

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


#: Qwen2-VL / Qwen2.5-VL's video defaults per frame (128 to 768 merged tokens of 28 x 28 pixels): the geometry of
#: a video opened without naming a model.
QWEN2_GEOMETRY = FrameGeometry("qwen2-vl", 28, 2, 128 * 28 * 28, 768 * 28 * 28)
