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
by the processor's ``smart_resize`` (:func:`resize`). :data:`SPEC` is what the rest of kvdemo knows of the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLVideoProcessor,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from ..cache.attention import ATTN_IMPLEMENTATION
from ..cache.chunk import VisualChunk
from ..devices.timing import Stopwatch
from ..media.geometry import FrameGeometry
from .adapter import SYSTEM_PROMPT, TransformersAdapter, load_checkpoint
from .base import ModelError
from .spec import RANDOM_WEIGHTS_NOTICE, TINY_NAME, TINY_RANDOM_NAME, TRAINED_NOTICE, FamilySpec, OfflineModel
from .tiny import TRAINED_DIALOGUE_TOKENS, TRAINED_DIR, ByteTokenizer, tiny_config
from .tiny_random import TEXT_IDS, VOCAB, build_hf_model, byte_tokenizer, printable_answers, qwen_ids

#: ``config.model_type`` of the checkpoints this adapter loads, and their classes.
MODEL_CLASSES = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration}
#: Qwen's video defaults per frame: 128 to 768 merged tokens of 28 x 28 pixels.
MIN_PIXELS, MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28


#: The trained tiny model's pixel range: 112 x 112 frames stay as they are (16 tokens per pair); other aspect
#: ratios resize to about as many pixels (e.g. 16:9 and 4:3 -> 84 x 140, 15 tokens).
TRAINED_MIN_PIXELS, TRAINED_MAX_PIXELS = 112 * 112, 20 * 28 * 28


def resize(geometry: FrameGeometry, height: int, width: int) -> tuple[int, int]:
    """The family's resize rule: transformers' ``Qwen2VLImageProcessor`` ``smart_resize`` (sides multiples of the
    factor, pixel count within the geometry's range)."""
    return smart_resize(
        height, width, factor=geometry.factor, min_pixels=geometry.min_pixels, max_pixels=geometry.max_pixels
    )


def config_geometry(config: Any, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> FrameGeometry:
    """How a Qwen2-VL / Qwen2.5-VL ``config`` sizes frames (patch x merge pixels per token side)."""
    vision = config.vision_config
    return FrameGeometry(
        int(vision.patch_size) * int(vision.spatial_merge_size),
        int(vision.temporal_patch_size),
        min_pixels,
        max_pixels,
        resize=resize,
    )


def video_processor(config: Any) -> Qwen2VLVideoProcessor:
    """The family's video processor for ``config`` (Qwen's normalisation; kvdemo resizes before it)."""
    vision = config.vision_config
    return Qwen2VLVideoProcessor(
        patch_size=int(vision.patch_size),
        merge_size=int(vision.spatial_merge_size),
        temporal_patch_size=int(vision.temporal_patch_size),
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )


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
    mean, std = torch.tensor(CLIP_MEAN), torch.tensor(CLIP_STD)  # SPEC.pixel_mean / pixel_std
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

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        processor: Any = None,
        geometry: FrameGeometry | None = None,
        random_weights: bool = False,
        notice: str | None = None,
    ) -> None:
        config = model.config
        super().__init__(
            model,
            tokenizer,
            processor or video_processor(config),
            geometry or config_geometry(config),
            name,
            random_weights,
            notice,
        )
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
        positions = mrope_positions(
            chunk.grid, chunk.row, chunk.col, start, chunk.second_per_grid, self.tokens_per_second
        )
        return positions, RegionCursor(max(cursor.next, int(positions.max()) + 1), start)

    # --- vision ---------------------------------------------------------------------------
    def pixel_values(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Flattened patches and grid (t, h, w) of frames already resized (:func:`pixel_values`: the family's
        video processor's numbers, in the order the offline model was trained with)."""
        return pixel_values(frames, self.patch_size, self.merge_size, self.temporal_patch_size)

    @torch.inference_mode()
    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk:
        """Vision-encode one chunk ``[T, H, W, 3]`` sampled at ``fps`` (an odd tail is paired with a copy of itself)."""
        watch = Stopwatch(self.device)  # synchronised: on CUDA the vision tower runs asynchronously
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
            encode_ms=watch.ms(),
        )


def load(model_id: str, config: Any, device: str | None = None) -> Qwen2VL:
    """Load a Qwen2-VL / Qwen2.5-VL checkpoint (Hub id or local folder) with transformers' classes."""
    model, tokenizer, processor = load_checkpoint(MODEL_CLASSES[config.model_type], model_id, device)
    return Qwen2VL(model, tokenizer, name=model_id, processor=processor)


# --- offline models and the spec ----------------------------------------------------------------------------


def tiny_random_config() -> Qwen2VLConfig:
    """Qwen2-VL: 4 layers, 4 heads / 2 KV heads of 32, M-RoPE sections 4/6/6; vision patch 14, merge 2."""
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            initializer_range=0.1,
            **TEXT_IDS,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        ),
        vision_config=dict(
            depth=2,
            embed_dim=64,
            hidden_size=128,
            mlp_ratio=2,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=0.1,
        ),
        **qwen_ids(),
        tie_word_embeddings=False,
    )


RANDOM_GEOMETRY = FrameGeometry(28, 2, MIN_PIXELS, MAX_PIXELS, resize=resize)
TRAINED_GEOMETRY = FrameGeometry(28, 2, TRAINED_MIN_PIXELS, TRAINED_MAX_PIXELS, resize=resize)


def build_tiny_random_qwen2_vl() -> Qwen2VL:
    """``tiny-random-qwen2-vl``: :func:`tiny_random_config` with seeded random weights and the byte tokenizer."""
    model = build_hf_model(tiny_random_config, Qwen2VLForConditionalGeneration)
    adapter = Qwen2VL(
        model,
        byte_tokenizer(),
        "tiny-random-qwen2-vl",
        random_weights=True,
        notice=RANDOM_WEIGHTS_NOTICE,
        geometry=RANDOM_GEOMETRY,
    )
    return printable_answers(adapter, VOCAB)


def build_tiny_model(seed: int = 0) -> Qwen2VL:
    """``tiny-random``: :func:`~kvdemo.models.tiny.tiny_config` with seeded random weights (identical for a given
    ``seed``) and the byte tokenizer, on the CPU in float32."""
    model = build_hf_model(tiny_config, Qwen2_5_VLForConditionalGeneration, seed)
    adapter = Qwen2VL(
        model,
        ByteTokenizer(),
        name=TINY_RANDOM_NAME,
        random_weights=True,
        notice=RANDOM_WEIGHTS_NOTICE,
        geometry=RANDOM_GEOMETRY,
    )
    return printable_answers(adapter, model.config.text_config.vocab_size)


def load_trained_tiny(folder: str | Path = TRAINED_DIR) -> Qwen2VL:
    """The trained tiny model from ``folder`` (``kvdemo/assets/tiny``) through transformers' ``from_pretrained``."""
    folder = Path(folder)
    if not (folder / "model.safetensors").exists():
        raise ModelError(
            f"no trained tiny model in {folder}: run `python -m kvdemo train-tiny` (or use --model tiny-random)"
        )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    adapter = Qwen2VL(
        model.eval(),
        ByteTokenizer.from_spec(folder / "tokenizer.json"),
        name=TINY_NAME,
        notice=TRAINED_NOTICE,
        geometry=TRAINED_GEOMETRY,
    )
    adapter.max_dialogue_tokens = TRAINED_DIALOGUE_TOKENS
    return adapter


def synthetic_positions(chunk: VisualChunk, start: int) -> torch.Tensor:
    """A chunk's positions ``[3, n]`` after ``start`` tokens at Qwen2.5-VL's ``tokens_per_second`` = 2 (no model)."""
    return mrope_positions(chunk.grid, chunk.row, chunk.col, start, chunk.second_per_grid, 2.0)


#: Released Qwen2.5-VL configs (the fields that shape the computation, from each checkpoint's ``config.json``), and a
#: CPU-sized stand-in with the 3B's structure (two layers, small widths) for the tests of the full-depth path.
_QWEN25_TEXT = dict(
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
)
_QWEN25_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    hidden_act="silu",
)
RELEASED = {
    "qwen2.5-vl-3b": dict(
        model_type="qwen2_5_vl",
        tie_word_embeddings=True,
        text_config=dict(
            _QWEN25_TEXT,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
        ),
        vision_config=dict(_QWEN25_VISION, out_hidden_size=2048),
    ),
    "qwen2.5-vl-7b": dict(
        model_type="qwen2_5_vl",
        tie_word_embeddings=False,
        text_config=dict(
            _QWEN25_TEXT,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
        ),
        vision_config=dict(_QWEN25_VISION, out_hidden_size=3584),
    ),
    "shrunk-qwen2.5-vl": dict(
        model_type="qwen2_5_vl",
        tie_word_embeddings=True,
        text_config=dict(
            _QWEN25_TEXT,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        ),
        vision_config=dict(
            _QWEN25_VISION,
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=128,
            fullatt_block_indexes=[1],
        ),
    ),
}


SPEC = FamilySpec(
    name="Qwen2-VL / Qwen2.5-VL",
    model_types=tuple(MODEL_CLASSES),
    geometry=config_geometry,
    pixel_mean=CLIP_MEAN,
    pixel_std=CLIP_STD,
    load=load,
    menu_order=0,
    budget=(6144, 4608),  # InfiniPot-V's M / C
    verified="Qwen2.5-VL: the trained tiny model and random weights, CPU: chunked prefill = transformers' forward; "
    "Qwen2-VL: random weights, CPU: positions, pixels, chunked prefill = transformers' forward; real clip",
    checkpoints=("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct"),
    offline=(
        # M = 96 holds 12 s of the 40 s sample (16 tokens per frame pair); M - C = 24 holds a chunk at its max pixels.
        OfflineModel(TINY_NAME, "qwen2_5_vl", TRAINED_GEOMETRY, TRAINED_NOTICE, load_trained_tiny, (96, 72)),
        OfflineModel(TINY_RANDOM_NAME, "qwen2_5_vl", RANDOM_GEOMETRY, RANDOM_WEIGHTS_NOTICE, build_tiny_model),
        OfflineModel(
            "tiny-random-qwen2-vl", "qwen2_vl", RANDOM_GEOMETRY, RANDOM_WEIGHTS_NOTICE, build_tiny_random_qwen2_vl
        ),
    ),
    synthetic_positions=synthetic_positions,
    released=RELEASED,
)
