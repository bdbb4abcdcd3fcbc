"""LLaVA-OneVision through transformers' own classes (no remote code).

Every frame is resized to the vision tower's square input (384 x 384 with SigLIP), encoded, projected and
bilinearly pooled to 14 x 14 = 196 tokens: one frame per temporal grid, provenance on that 14 x 14 grid. The
language model (Qwen2) uses plain 1-D RoPE: a frame's tokens take the next 196 positions. After the video comes
one learned ``image_newline`` vector (not a token): transformers 5.23's ``get_video_features`` appends one per
call, so each chunk drops it and a question starts with it, once.

Positions grow by 196 per frame and eviction does not give them back: at 32,768 positions the range the model
was trained with ends after ~166 frames. kvdemo stops the stream there with a message (the engine's
``position_limit`` rule) rather than re-rotating kept keys to earlier positions, which would be a model the
authors never trained. :data:`SPEC` is what the rest of kvdemo knows of the family.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionVideoProcessor

from ..cache.chunk import VisualChunk
from ..devices.timing import Stopwatch
from ..media.geometry import FrameGeometry
from .adapter import TextCursor, TransformersAdapter, load_checkpoint
from .spec import RANDOM_WEIGHTS_NOTICE, FamilySpec, OfflineModel
from .tiny_random import TEXT_IDS, TOKEN_ID, VOCAB, build_hf_model, byte_tokenizer, printable_answers

MODEL_CLASSES: dict[str, Any] = {"llava_onevision": LlavaOnevisionForConditionalGeneration}


def config_geometry(config: Any) -> FrameGeometry:
    """Frames resized to the vision tower's square input and pooled to ``ceil(side / patch / 2)`` tokens a side."""
    vision = config.vision_config
    side = int(vision.image_size)
    pooled = math.ceil(side // int(vision.patch_size) / 2)
    return FrameGeometry(
        side // pooled, 1, side * side, side * side, fixed_size=(side, side), fixed_grid=(pooled, pooled)
    )


#: SigLIP's normalisation (the LLaVA-OneVision checkpoints' preprocessor configs: mean = std = 0.5), where the
#: processor class defaults to CLIP's.
PIXEL_MEAN = PIXEL_STD = (0.5, 0.5, 0.5)


def video_processor(config: Any) -> LlavaOnevisionVideoProcessor:
    """The family's video processor for a checkpoint that ships none (and the offline model): its square input
    size and SigLIP's normalisation."""
    side = int(config.vision_config.image_size)
    return LlavaOnevisionVideoProcessor(
        size={"height": side, "width": side}, image_mean=list(PIXEL_MEAN), image_std=list(PIXEL_STD)
    )


class LlavaOnevision(TransformersAdapter):
    """A LLaVA-OneVision model behind the :class:`~kvdemo.models.base.VideoLM` protocol."""

    family = "llava_onevision"
    position_axes = 1

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        processor: Any = None,
        random_weights: bool = False,
        notice: str | None = None,
    ) -> None:
        super().__init__(
            model,
            tokenizer,
            processor or video_processor(model.config),
            config_geometry(model.config),
            name,
            random_weights,
            notice,
        )

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
        watch = Stopwatch(self.device)  # synchronised: on CUDA the vision tower runs asynchronously
        pixels = self.processor_inputs(frames)["pixel_values_videos"]
        tower = self.hf.model.vision_tower
        config = self.hf.config
        output = self.hf.model.get_video_features(
            pixels.to(tower.device, tower.dtype),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        )
        embeds = output.pooler_output[0, :-1].to(
            self.device, self.dtype
        )  # the appended newline is added at question time
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
            encode_ms=watch.ms(),
        )

    def chunk_positions(self, chunk: VisualChunk, cursor: TextCursor) -> tuple[torch.Tensor, TextCursor]:
        """1-D: the chunk's tokens take the next positions in order."""
        return self.text_positions(cursor, chunk.num_tokens)


def load(model_id: str, config: Any, device: str | None = None) -> LlavaOnevision:
    """Load a LLaVA-OneVision checkpoint (Hub id or local folder) with transformers' classes."""
    model, tokenizer, processor = load_checkpoint(MODEL_CLASSES[config.model_type], model_id, device)
    return LlavaOnevision(model, tokenizer, name=model_id, processor=processor)


# --- the offline model and the spec -------------------------------------------------------------------------


def tiny_random_config() -> LlavaOnevisionConfig:
    """LLaVA-OneVision: a 2-block SigLIP at 384 px (patch 14: 27 x 27 patches pooled to 14 x 14) and a 4-layer
    Qwen2 (4 heads / 2 KV heads of 16)."""
    return LlavaOnevisionConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=384,
            patch_size=14,
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            initializer_range=0.1,
            **TEXT_IDS,
        ),
        image_token_index=TOKEN_ID["<image>"],
        video_token_index=TOKEN_ID["<video>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=False,
    )


def build_tiny_random() -> LlavaOnevision:
    """``tiny-random-llava-ov``: :func:`tiny_random_config` with seeded random weights and the byte tokenizer."""
    model = build_hf_model(tiny_random_config, LlavaOnevisionForConditionalGeneration)
    adapter = LlavaOnevision(
        model, byte_tokenizer(), "tiny-random-llava-ov", random_weights=True, notice=RANDOM_WEIGHTS_NOTICE
    )
    return printable_answers(adapter, VOCAB)


SPEC = FamilySpec(
    name="LLaVA-OneVision",
    model_types=tuple(MODEL_CLASSES),
    geometry=config_geometry,
    pixel_mean=PIXEL_MEAN,
    pixel_std=PIXEL_STD,
    load=load,
    menu_order=3,
    budget=(6272, 4704),  # 32 / 24 frames of 196 tokens
    caveat="LLaVA-OneVision: positions grow by 196 a frame and eviction does not give them back, so the stream stops "
    "with a message where the model's trained positions end (about 166 frames with a 32K range; kvdemo's "
    "rule: kept keys are never re-rotated).",
    verified="random weights, CPU: pooled provenance, newline once, chunked prefill = forward; real clip",
    checkpoints=("llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf"),
    offline=(
        OfflineModel(
            "tiny-random-llava-ov",
            "llava_onevision",
            config_geometry(tiny_random_config()),
            RANDOM_WEIGHTS_NOTICE,
            build_tiny_random,
            (1568, 1176),
        ),
    ),
)
