"""Qwen3-VL through transformers' own classes (no remote code).

Every temporal grid is ``<{t:.1f} seconds><|vision_start|>`` + its visual tokens + ``<|vision_end|>``, ``t`` the
mean time of the grid's two frames: the stream carries that text, which lives in the memory's stream-text
region (it counts against ``M`` and leaves with the grid's last visual token; :mod:`kvdemo.cache.memory`).

kvdemo follows the layout the model was trained with: the per-grid wrappers replace the chat template's video
placeholder whole, as Qwen's own pipeline (qwen-vl-utils) and transformers' Qwen3-VL processor did at the
model's release. transformers >= 5.10's processor replaces only ``<|video_pad|>``, so the template's outer
``<|vision_start|>``/``<|vision_end|>`` stay around the per-grid wrappers (two extra tokens, every later
position shifted by one); a test shows the two layouts side by side.

Positions (interleaved M-RoPE, ``mrope_section`` e.g. [24, 20, 20]): text advances one position on every axis;
a grid starting at ``s`` puts its tokens at ``(s, s + row, s + col)`` (temporal index 0: time lives in the
text) and the next token at ``s + max(rows, cols)``, which equals transformers' ``get_rope_index``. DeepStack:
the vision tower's intermediate features are added to the language model's hidden states at visual positions
after its first layers, so each chunk passes its own (``forward_extras``). Frames are sized by the family's
video processor's ``smart_resize`` for one temporal grid (factor 32, :func:`resize`); pixels come from that
processor (mean = std = 0.5). :data:`SPEC` is what the rest of kvdemo knows of the family.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

from ..cache.chunk import VisualChunk
from ..devices.timing import Stopwatch
from ..media.geometry import FrameGeometry
from .adapter import TextCursor, TransformersAdapter, load_checkpoint
from .spec import RANDOM_WEIGHTS_NOTICE, FamilySpec, OfflineModel
from .tiny_random import TEXT_IDS, VOCAB, build_hf_model, byte_tokenizer, printable_answers, qwen_ids

MODEL_CLASSES: dict[str, Any] = {"qwen3_vl": Qwen3VLForConditionalGeneration}
#: qwen-vl-utils' per-frame video bounds for Qwen3-VL: 128 to 768 merged tokens of 32 x 32 pixels.
MIN_PIXELS, MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32
#: A stream longer than a day is not expected: its timestamps stay within this many characters.
LONGEST_TIMESTAMP = "<99999.9 seconds>"


def timestamp(seconds: float) -> str:
    """The text before a grid: ``<{t:.1f} seconds><|vision_start|>`` (Qwen3-VL's processor format)."""
    return f"<{seconds:.1f} seconds><|vision_start|>"


#: The offline random-weight models use small frames (16 to 64 tokens a frame), so a CPU streams the real clip
#: through them in seconds.
SMALL_MIN_PIXELS, SMALL_MAX_PIXELS = 16 * 32 * 32, 64 * 32 * 32
#: Qwen3-VL's normalisation (its video processor's image_mean / image_std).
PIXEL_MEAN = PIXEL_STD = (0.5, 0.5, 0.5)


def resize(geometry: FrameGeometry, height: int, width: int) -> tuple[int, int]:
    """The family's resize rule: ``Qwen3VLVideoProcessor``'s ``smart_resize`` for one temporal grid, the same
    bounds per frame (a stream fixes its frame size up front, where the processor spreads ``max_pixels`` over a
    whole clip)."""
    grid = geometry.frames_per_grid
    return smart_resize(
        grid,
        height,
        width,
        temporal_factor=grid,
        factor=geometry.factor,
        min_pixels=grid * geometry.min_pixels,
        max_pixels=grid * geometry.max_pixels,
    )


def config_geometry(
    config: Any, text_per_grid: int = 0, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> FrameGeometry:
    """How a Qwen3-VL / Qwen3.5 ``config`` sizes frames (patch x merge = 32 pixels per token side)."""
    vision = config.vision_config
    return FrameGeometry(
        int(vision.patch_size) * int(vision.spatial_merge_size),
        int(vision.temporal_patch_size),
        min_pixels,
        max_pixels,
        resize=resize,
        text_per_grid=text_per_grid,
    )


def video_processor(config: Any) -> Qwen3VLVideoProcessor:
    """The family's video processor for ``config`` (kvdemo resizes before it)."""
    vision = config.vision_config
    return Qwen3VLVideoProcessor(
        patch_size=int(vision.patch_size),
        merge_size=int(vision.spatial_merge_size),
        temporal_patch_size=int(vision.temporal_patch_size),
        image_mean=list(PIXEL_MEAN),
        image_std=list(PIXEL_STD),
    )


class Qwen3VL(TransformersAdapter):
    """A Qwen3-VL model behind the :class:`~kvdemo.models.base.VideoLM` protocol (Qwen3.5 subclasses it)."""

    processor_options = {"cap_pixels_per_frame": False}  # kvdemo sizes frames itself (the geometry)

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        processor: Any = None,
        random_weights: bool = False,
        notice: str | None = None,
        min_pixels: int = MIN_PIXELS,
        max_pixels: int = MAX_PIXELS,
    ) -> None:
        config = model.config
        text_per_grid = len(tokenizer.encode(timestamp(99999.9) + "<|vision_end|>", add_special_tokens=False))
        super().__init__(
            model,
            tokenizer,
            processor or video_processor(config),
            config_geometry(config, text_per_grid, min_pixels, max_pixels),
            name,
            random_weights,
            notice,
        )
        vision = config.vision_config
        self.family = config.model_type
        self.merge_size = int(vision.spatial_merge_size)
        self.temporal_patch_size = int(vision.temporal_patch_size)

    def prefix_text(self) -> str:
        """The chat template up to the first grid's timestamp (Qwen3's template has no default system turn)."""
        return "<|im_start|>user\n"

    # --- vision ---------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk:
        """Vision-encode one chunk ``[T, H, W, 3]``: each grid's timestamp and delimiters around its visual
        tokens, and the DeepStack features of the visual tokens (an odd tail is paired with a copy of itself)."""
        watch = Stopwatch(self.device)  # synchronised: on CUDA the vision tower runs asynchronously
        inputs = self.processor_inputs(frames)
        grid_thw = inputs["video_grid_thw"]
        visual = self.hf.model.visual
        output = self.hf.model.get_video_features(
            inputs["pixel_values_videos"].to(visual.device, visual.dtype), grid_thw.to(visual.device), return_dict=True
        )
        embeds = torch.cat(list(output.pooler_output), dim=0).to(self.device, self.dtype)
        grid_t, grid_h, grid_w = (int(x) for x in grid_thw[0])
        rows, cols = grid_h // self.merge_size, grid_w // self.merge_size
        per_grid = rows * cols
        pad = len(times_s) - 1
        times = [
            (float(times_s[min(k * 2, pad)]) + float(times_s[min(k * 2 + self.temporal_patch_size - 1, pad)])) / 2
            for k in range(grid_t)
        ]
        parts, text, grid, row, col = [], [], [], [], []
        after = self.tokenize("<|vision_end|>")
        local = torch.arange(per_grid)
        for k in range(grid_t):  # a chunk holds one or two grids
            before = self.tokenize(timestamp(times[k]))
            parts += [self.embed_text(before), embeds[k * per_grid : (k + 1) * per_grid], self.embed_text(after)]
            text += [
                torch.ones(len(before), dtype=torch.bool),
                torch.zeros(per_grid, dtype=torch.bool),
                torch.ones(len(after), dtype=torch.bool),
            ]
            count = len(before) + per_grid + len(after)
            grid.append(torch.full((count,), first_grid + k))
            none_before, none_after = torch.full((len(before),), -1), torch.full((len(after),), -1)
            row.append(torch.cat([none_before, local // cols, none_after]))
            col.append(torch.cat([none_before, local % cols, none_after]))
        extras = {}
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack:
            extras["deepstack"] = [torch.cat(list(feature), dim=0).to(self.device, self.dtype) for feature in deepstack]
        return VisualChunk(
            embeds=torch.cat(parts),
            grid=torch.cat(grid),
            row=torch.cat(row),
            col=torch.cat(col),
            first_grid=first_grid,
            num_grids=grid_t,
            rows=rows,
            cols=cols,
            grid_times_s=[float(times_s[min(k * self.temporal_patch_size, pad)]) for k in range(grid_t)],
            frames=int(frames.shape[0]),
            second_per_grid=self.temporal_patch_size / fps,
            end_time_s=float(times_s[-1]),
            encode_ms=watch.ms(),
            text=torch.cat(text),
            extras=extras,
            per_visual_token=tuple(extras),
        )

    # --- positions ------------------------------------------------------------------------
    def chunk_positions(self, chunk: VisualChunk, cursor: TextCursor) -> tuple[torch.Tensor, TextCursor]:
        """Text one position apart on all axes; a grid at ``(s, s + row, s + col)``, the token after it at
        ``s + max(rows, cols)`` (see the module docstring)."""
        text = chunk.text if chunk.text is not None else torch.zeros(chunk.num_tokens, dtype=torch.bool)
        positions = torch.empty(3, chunk.num_tokens, dtype=torch.long)
        # Each text token and each grid is one step: how far the step advances, and where it starts.
        first_visual = ~text & torch.cat(
            [torch.ones(1, dtype=torch.bool), text[:-1] | (chunk.grid[1:] != chunk.grid[:-1])]
        )
        advance = torch.where(text, 1, 0) + first_visual.long() * max(chunk.rows, chunk.cols)
        start = cursor.next + torch.cumsum(advance, 0) - advance  # position where each step begins
        visual_start = torch.cummax(torch.where(first_visual, start, -1), 0).values  # its grid's s, for visual tokens
        positions[:, text] = start[text].expand(3, -1)
        s = visual_start[~text]
        positions[0, ~text] = s
        positions[1, ~text] = s + chunk.row[~text].long()
        positions[2, ~text] = s + chunk.col[~text].long()
        return positions, TextCursor(cursor.next + int(advance.sum()))

    # --- language model -------------------------------------------------------------------
    def forward_extras(self, chunk: VisualChunk | None, length: int) -> dict[str, Any]:
        """DeepStack: a chunk's visual positions and its features for the first decoder layers."""
        if chunk is None or "deepstack" not in chunk.extras:
            return {}
        return {
            "visual_pos_masks": (~chunk.text)[None].to(self.device),
            "deepstack_visual_embeds": chunk.extras["deepstack"],
        }


def load(model_id: str, config: Any, device: str | None = None) -> Qwen3VL:
    """Load a Qwen3-VL checkpoint (Hub id or local folder) with transformers' classes."""
    model, tokenizer, processor = load_checkpoint(MODEL_CLASSES[config.model_type], model_id, device)
    return Qwen3VL(model, tokenizer, name=model_id, processor=processor)


# --- the offline model and the spec -------------------------------------------------------------------------


def tiny_random_config() -> Qwen3VLConfig:
    """Qwen3-VL: 4 layers, 4 heads / 2 KV heads of 16, interleaved M-RoPE sections 2/3/3; vision patch 16, merge 2,
    DeepStack from all three vision blocks."""
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=32768,
            initializer_range=0.1,
            **TEXT_IDS,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1, 2],
            initializer_range=0.1,
        ),
        **qwen_ids(),
        tie_word_embeddings=False,
    )


#: At most this many tokens of stream text per grid with the byte tokenizer (``<99999.9 seconds>``, 17 bytes,
#: plus ``<|vision_start|>`` and ``<|vision_end|>``); real tokenizers need fewer.
BYTE_TEXT_PER_GRID = 19
SMALL_GEOMETRY = FrameGeometry(
    32, 2, SMALL_MIN_PIXELS, SMALL_MAX_PIXELS, resize=resize, text_per_grid=BYTE_TEXT_PER_GRID
)


def build_tiny_random() -> Qwen3VL:
    """``tiny-random-qwen3-vl``: :func:`tiny_random_config` with seeded random weights and the byte tokenizer."""
    model = build_hf_model(tiny_random_config, Qwen3VLForConditionalGeneration)
    adapter = Qwen3VL(
        model,
        byte_tokenizer(),
        "tiny-random-qwen3-vl",
        random_weights=True,
        notice=RANDOM_WEIGHTS_NOTICE,
        min_pixels=SMALL_MIN_PIXELS,
        max_pixels=SMALL_MAX_PIXELS,
    )
    return printable_answers(adapter, VOCAB)


#: Released Qwen3-VL configs (the fields that shape the computation, from the checkpoint's ``config.json``).
RELEASED = {
    "qwen3-vl-8b": dict(
        model_type="qwen3_vl",
        tie_word_embeddings=False,
        text_config=dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=4096,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
            hidden_act="gelu_pytorch_tanh",
        ),
    ),
}


SPEC = FamilySpec(
    name="Qwen3-VL",
    model_types=tuple(MODEL_CLASSES),
    geometry=config_geometry,
    pixel_mean=PIXEL_MEAN,
    pixel_std=PIXEL_STD,
    load=load,
    menu_order=1,
    budget=(6144, 4608),
    verified="random weights, CPU: positions = get_rope_index, pixels, DeepStack, chunked prefill = forward; real clip",
    checkpoints=("Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"),
    offline=(
        OfflineModel(
            "tiny-random-qwen3-vl", "qwen3_vl", SMALL_GEOMETRY, RANDOM_WEIGHTS_NOTICE, build_tiny_random, (320, 224)
        ),
    ),
    released=RELEASED,
)
