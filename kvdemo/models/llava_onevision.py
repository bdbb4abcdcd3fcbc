"""LLaVA-OneVision through transformers' own classes (no remote code).

Every frame is resized to the vision tower's square input (384 x 384 with SigLIP), encoded, projected and
bilinearly pooled to 14 x 14 = 196 tokens: one frame per temporal grid, provenance on that 14 x 14 grid. The
language model (Qwen2) uses plain 1-D RoPE: a frame's tokens take the next 196 positions. After the video comes
one learned ``image_newline`` vector (not a token): transformers 5.23's ``get_video_features`` appends one per
call, so each chunk drops it and a question starts with it, once.

Positions grow by 196 per frame and eviction does not give them back: at 32,768 positions the range the model
was trained with ends after ~166 frames. kvdemo stops the stream there with a message (the engine's
``position_limit`` rule) rather than re-rotating kept keys to earlier positions, which would be a model the
authors never trained.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionVideoProcessor

from ..chunk import VisualChunk
from .adapter import TextCursor, TransformersAdapter, load_checkpoint
from .base import FrameGeometry

MODEL_CLASSES: dict[str, Any] = {"llava_onevision": LlavaOnevisionForConditionalGeneration}


def geometry(config: Any) -> FrameGeometry:
    """Frames resized to the vision tower's square input and pooled to ``ceil(side / patch / 2)`` tokens a side."""
    vision = config.vision_config
    side = int(vision.image_size)
    pooled = math.ceil(side // int(vision.patch_size) / 2)
    return FrameGeometry("fixed", side // pooled, 1, side * side, side * side, fixed_size=(side, side),
                         fixed_grid=(pooled, pooled))


def video_processor(config: Any) -> LlavaOnevisionVideoProcessor:
    side = int(config.vision_config.image_size)
    return LlavaOnevisionVideoProcessor(size={"height": side, "width": side})


class LlavaOnevision(TransformersAdapter):
    """A LLaVA-OneVision model behind the :class:`~kvdemo.models.base.VideoLM` protocol."""

    family = "llava_onevision"
    position_axes = 1

    def __init__(self, model: Any, tokenizer: Any, name: str, processor: Any = None, random_weights: bool = False,
                 notice: str | None = None) -> None:
        super().__init__(model, tokenizer, processor or video_processor(model.config), geometry(model.config), name,
                         random_weights, notice)

    def prefix_text(self) -> str:
        """The chat template up to the video (LLaVA-OneVision's has no default system turn)."""
        return "<|im_start|>user\n"

    def question_embeds(self, history: list[tuple[str, str]], question: str) -> torch.Tensor:
        """The learned newline vector that closes the video, then the dialogue and ``question`` as text."""
        newline = self.hf.model.image_newline[None].to(self.device, self.dtype)
        return torch.cat([newline, super().question_embeds(history, question)])

    @torch.inference_mode()
    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk:
        """Vision-encode one chunk of frames ``[T, H, W, 3]`` (already 384 x 384): ``T`` grids of 196 tokens."""
        start = time.perf_counter()
        pixels = self.processor_inputs(frames)["pixel_values_videos"]
        tower = self.hf.model.vision_tower
        config = self.hf.config
        output = self.hf.model.get_video_features(pixels.to(tower.device, tower.dtype),
                                                  vision_feature_layer=config.vision_feature_layer,
                                                  vision_feature_select_strategy=config.vision_feature_select_strategy,
                                                  return_dict=True)
        embeds = output.pooler_output[0, :-1].to(self.device, self.dtype)  # the appended newline is added at question time
        rows, cols = self.geometry.fixed_grid
        count = int(frames.shape[0])
        local = torch.arange(count * rows * cols)
        return VisualChunk(
            embeds=embeds,
            grid=first_grid + local // (rows * cols),
            row=(local % (rows * cols)) // cols,
            col=local % cols,
            first_grid=first_grid,
            num_grids=count,
            rows=rows,
            cols=cols,
            grid_times_s=[float(t) for t in times_s],
            frames=count,
            second_per_grid=1.0 / fps,
            end_time_s=float(times_s[-1]),
            encode_ms=(time.perf_counter() - start) * 1000,
        )

    def chunk_positions(self, chunk: VisualChunk, cursor: TextCursor) -> tuple[torch.Tensor, TextCursor]:
        """1-D: the chunk's tokens take the next positions in order."""
        return self.text_positions(cursor, chunk.num_tokens)


def load(model_id: str, config: Any, device: str | None = None) -> LlavaOnevision:
    """Load a LLaVA-OneVision checkpoint (Hub id or local folder) with transformers' classes."""
    model, tokenizer, processor = load_checkpoint(MODEL_CLASSES[config.model_type], model_id, device)
    return LlavaOnevision(model, tokenizer, name=model_id, processor=processor)
