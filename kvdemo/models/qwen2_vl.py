"""Qwen2-VL and Qwen2.5-VL through transformers' own classes (no remote code).

The stream is one video region: the prefix ends with ``<|vision_start|>``, every temporal grid's tokens follow
with nothing between them, and a question opens with ``<|vision_end|>``. Positions are 3-D M-RoPE computed
here (:func:`mrope_positions`), the original rule the models were trained with: the g-th temporal grid of a
region starting at ``s`` is at ``(s + floor(g * second_per_grid * tokens_per_second), s + row, s + col)``
(Qwen2.5-VL; Qwen2-VL: ``(s + g, s + row, s + col)``), text after the region at the largest position + 1.
transformers 5.23's ``get_rope_index`` advances only by ``max(h, w)`` after a video (tests show both).
Pixels: :func:`pixel_values` computes what the family's video processor (``Qwen2VLVideoProcessor``) computes
(rescale, CLIP normalisation, merge-block patch order; equal to float rounding, a test compares them) in the
order the offline tiny model was trained with, so its training stays reproducible bit for bit. Frames are sized
by the processor's ``smart_resize`` (:class:`~kvdemo.geometry.FrameGeometry`, rule ``"qwen2-vl"``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen2VLVideoProcessor

from ..chunk import VisualChunk
from .adapter import SYSTEM_PROMPT, TransformersAdapter, load_checkpoint
from .base import FrameGeometry

#: ``config.model_type`` of the checkpoints this adapter loads, and their classes.
MODEL_CLASSES = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration}
#: Qwen's video defaults per frame: 128 to 768 merged tokens of 28 x 28 pixels.
MIN_PIXELS, MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28


def geometry(config: Any, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> FrameGeometry:
    """How a Qwen2-VL / Qwen2.5-VL ``config`` sizes frames (patch x merge pixels per token side)."""
    vision = config.vision_config
    return FrameGeometry("qwen2-vl", int(vision.patch_size) * int(vision.spatial_merge_size), int(vision.temporal_patch_size),
                         min_pixels, max_pixels)


def video_processor(config: Any) -> Qwen2VLVideoProcessor:
    """The family's video processor for ``config`` (Qwen's normalisation; kvdemo resizes before it)."""
    vision = config.vision_config
    return Qwen2VLVideoProcessor(patch_size=int(vision.patch_size), merge_size=int(vision.spatial_merge_size),
                                 temporal_patch_size=int(vision.temporal_patch_size))


#: OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, Qwen's pixel normalisation.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def pixel_values(
    frames: np.ndarray, patch_size: int = 14, merge_size: int = 2, temporal_patch_size: int = 2
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 frames ``[T, H, W, 3]`` (already resized) -> flattened patches ``[t*h*w, 3*tp*p*p]`` and grid (t, h, w).

    Mirrors ``Qwen2VLVideoProcessor``: rescale 1/255, normalise with CLIP mean/std, pad an odd tail with
    the last frame, and lay patches out merge-block by merge-block.
    """
    # Normalise channels-last (a broadcast over the contiguous last dim is ~7x faster than over dim 1).
    video = torch.from_numpy(np.ascontiguousarray(frames)).float()  # [T, H, W, 3]
    mean, std = torch.tensor(CLIP_MEAN), torch.tensor(CLIP_STD)
    video = video.mul_(1.0 / 255.0).sub_(mean).div_(std).permute(0, 3, 1, 2)  # [T, 3, H, W]
    if pad := -video.shape[0] % temporal_patch_size:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)], dim=0)
    num_frames, channels, height, width = video.shape
    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    patches = video.reshape(
        grid_t,
        temporal_patch_size,
        channels,
        grid_h // merge_size,
        merge_size,
        patch_size,
        grid_w // merge_size,
        merge_size,
        patch_size,
    )
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)
    return flat, (grid_t, grid_h, grid_w)


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


@dataclass(frozen=True)
class RegionCursor:
    """The next text position (the largest so far + 1) and where the one video region starts (-1: not yet)."""

    next: int = 0
    start: int = -1


class Qwen2VL(TransformersAdapter):
    """A Qwen2-VL / Qwen2.5-VL model behind the :class:`~kvdemo.models.base.VideoLM` protocol."""


    def __init__(self, model: Any, tokenizer: Any, name: str, processor: Any = None, geometry_: FrameGeometry | None = None,
                 random_weights: bool = False, notice: str | None = None) -> None:
        config = model.config
        super().__init__(model, tokenizer, processor or video_processor(config), geometry_ or geometry(config), name,
                         random_weights, notice)
        vision = config.vision_config
        self.family = config.model_type  # "qwen2_5_vl" or "qwen2_vl"
        self.patch_size = int(vision.patch_size)
        self.merge_size = int(vision.spatial_merge_size)
        self.temporal_patch_size = int(vision.temporal_patch_size)
        self.tokens_per_second = float(vision.tokens_per_second) if self.family == "qwen2_5_vl" else None

    # --- text -----------------------------------------------------------------------------
    def prefix_text(self) -> str:
        """Chat template up to the opening of the video region (never evicted)."""
        return f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|vision_start|>"

    def question_text(self, history: list[tuple[str, str]], question: str) -> str:
        """Closes the video region, replays the dialogue so far as text, asks ``question``."""
        return "<|vision_end|>" + super().question_text(history, question)

    # --- positions ------------------------------------------------------------------------
    def new_cursor(self) -> RegionCursor:
        return RegionCursor()

    def chunk_positions(self, chunk: VisualChunk, cursor: RegionCursor) -> tuple[torch.Tensor, RegionCursor]:
        start = cursor.next if cursor.start < 0 else cursor.start
        positions = mrope_positions(chunk.grid, chunk.row, chunk.col, start, chunk.second_per_grid, self.tokens_per_second)
        return positions, RegionCursor(max(cursor.next, int(positions.max()) + 1), start)

    # --- vision ---------------------------------------------------------------------------
    def pixel_values(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Flattened patches and grid (t, h, w) of frames already resized (:func:`pixel_values`: the family's
        video processor's numbers, in the order the offline model was trained with)."""
        return pixel_values(frames, self.patch_size, self.merge_size, self.temporal_patch_size)

    @torch.inference_mode()
    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk:
        """Vision-encode one chunk ``[T, H, W, 3]`` sampled at ``fps`` (an odd tail is paired with a copy of itself)."""
        start = time.perf_counter()
        flat, (grid_t, grid_h, grid_w) = self.pixel_values(frames)
        visual = self.hf.model.visual
        grid_thw = torch.tensor([[grid_t, grid_h, grid_w]], device=visual.device)
        output = self.hf.model.get_video_features(flat.to(visual.device, visual.dtype), grid_thw, return_dict=True)
        embeds = torch.cat(list(output.pooler_output), dim=0).to(self.device, self.dtype)
        rows, cols = grid_h // self.merge_size, grid_w // self.merge_size
        per_grid = rows * cols
        local = torch.arange(grid_t * per_grid)
        grid_times = [float(times_s[min(k * self.temporal_patch_size, len(times_s) - 1)]) for k in range(grid_t)]
        return VisualChunk(
            embeds=embeds,
            grid=first_grid + local // per_grid,
            row=(local % per_grid) // cols,
            col=local % cols,
            first_grid=first_grid,
            num_grids=grid_t,
            rows=rows,
            cols=cols,
            grid_times_s=grid_times,
            frames=int(frames.shape[0]),
            second_per_grid=self.temporal_patch_size / fps,
            end_time_s=float(times_s[-1]),
            encode_ms=(time.perf_counter() - start) * 1000,
        )


def load(model_id: str, config: Any, device: str | None = None) -> Qwen2VL:
    """Load a Qwen2-VL / Qwen2.5-VL checkpoint (Hub id or local folder) with transformers' classes."""
    model, tokenizer, processor = load_checkpoint(MODEL_CLASSES[config.model_type], model_id, device)
    return Qwen2VL(model, tokenizer, name=model_id, processor=processor)
