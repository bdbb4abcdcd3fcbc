"""Qwen2-VL and Qwen2.5-VL through transformers' own classes (no remote code).

The adapter owns pixel preprocessing (the same rescale, normalise and patchify as transformers'
``Qwen2VLVideoProcessor``; resizing happened in ``video.py``), vision encoding of one chunk, and the
language-model forward on a given cache with positions we computed (``base.mrope_positions``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ..attention import ATTN_IMPLEMENTATION
from ..video import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from ..zerogpu import on_zerogpu
from .base import ModelError, VisualChunk

#: OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, Qwen's pixel normalisation.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SYSTEM_PROMPT = "You are a helpful assistant."


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


class MRopeRotation:
    """The language model's M-RoPE rotation as a function of 3-D positions, computed by the model's own
    rotary module: ``rotate(x, p) = x cos(p) + rotate_half(x) sin(p)`` and its inverse (rotations are
    orthogonal, so ``unrotate(rotate(x, p), p) == x`` up to rounding). ``x [..., D]``, ``p [..., 3]`` (broadcastable
    against ``x``'s leading dimensions: one position for all pseudo-tokens of a prototype is ``[..., 1, 3]``)."""

    def __init__(self, rotary_emb: torch.nn.Module) -> None:
        self.rotary_emb = rotary_emb

    def cos_sin(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos, sin [..., D]`` for positions ``[..., 3]`` (temporal, height, width)."""
        flat = position.reshape(-1, 3).t().long()  # [3, N]
        buffer = self.rotary_emb.inv_freq
        with torch.inference_mode():
            cos, sin = self.rotary_emb(torch.empty(0, dtype=torch.float32, device=buffer.device), flat[:, None, :].to(buffer.device))
        shape = (*position.shape[:-1], cos.shape[-1])
        return cos[0].reshape(shape), sin[0].reshape(shape)

    def _apply(self, x: torch.Tensor, position: torch.Tensor, sign: float) -> torch.Tensor:
        cos, sin = self.cos_sin(position)
        cos, sin = cos.to(x.device), sin.to(x.device)
        half = x.shape[-1] // 2
        xf = x.float()
        # x cos + sign * rotate_half(x) sin, with rotate_half(x) = [-x2, x1] added half by half in place
        # (no concatenated copy); cos/sin broadcast, so positions shared along a dimension can stay size 1.
        out = xf * cos
        out[..., :half].addcmul_(xf[..., half:], sin[..., :half], value=-sign)
        out[..., half:].addcmul_(xf[..., :half], sin[..., half:], value=sign)
        return out.to(x.dtype)

    def rotate(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Keys before RoPE -> rotated at ``position`` (as the model caches them)."""
        return self._apply(x, position, 1.0)

    def unrotate(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Cached keys rotated at ``position`` -> keys before RoPE."""
        return self._apply(x, position, -1.0)


class QwenVL:
    """A Qwen2-VL / Qwen2.5-VL model behind the :class:`~kvdemo.models.base.VideoLM` protocol."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        random_weights: bool = False,
        notice: str | None = None,
        pixel_range: tuple[int, int] = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS),
    ) -> None:
        self.hf = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.random_weights = random_weights
        #: What its answers are worth, when that needs saying (the offline tiny models); shown by the CLI and UI.
        self.notice = notice
        #: The pixel range frames are resized into for this model (Qwen's defaults; the trained tiny model's own).
        self.min_pixels, self.max_pixels = pixel_range
        config = model.config
        text, vision = config.text_config, config.vision_config
        self.family = config.model_type  # "qwen2_5_vl" or "qwen2_vl"
        self.num_layers = int(text.num_hidden_layers)
        self.num_kv_heads = int(text.num_key_value_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        self.patch_size = int(vision.patch_size)
        self.merge_size = int(vision.spatial_merge_size)
        self.temporal_patch_size = int(vision.temporal_patch_size)
        self.tokens_per_second = float(vision.tokens_per_second) if self.family == "qwen2_5_vl" else None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        #: Optional additive bias on next-token logits ``[vocab]`` (the tiny model restricts itself to
        #: printable text so its random answers stay readable).
        self.logit_bias: torch.Tensor | None = None
        self._stop_ids = {
            i for i in (self._special_id("<|im_end|>"), self._special_id("<|endoftext|>")) if i is not None
        }
        #: The language model's rotation (policies that keep keys before RoPE get it through their views).
        self.rotary = MRopeRotation(model.model.language_model.rotary_emb)

    # --- text -----------------------------------------------------------------------------
    def _special_id(self, token: str) -> int | None:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def stop_ids(self) -> set[int]:
        return self._stop_ids

    def prefix_text(self) -> str:
        """Chat template up to the opening of the video region (never evicted)."""
        return f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|vision_start|>"

    def question_text(self, history: list[tuple[str, str]], question: str) -> str:
        """Closes the video region, replays the dialogue so far as text, asks ``question``."""
        parts = ["<|vision_end|>"]
        for previous_question, previous_answer in history:
            parts.append(f"{previous_question}<|im_end|>\n<|im_start|>assistant\n{previous_answer}<|im_end|>\n")
            parts.append("<|im_start|>user\n")
        parts.append(f"{question}<|im_end|>\n<|im_start|>assistant\n")
        return "".join(parts)

    # --- vision ---------------------------------------------------------------------------
    def pixel_values(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        return pixel_values(frames, self.patch_size, self.merge_size, self.temporal_patch_size)

    @torch.inference_mode()
    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk:
        """Vision-encode one chunk ``[T, H, W, 3]`` sampled at ``fps`` (an odd tail is paired with a copy of itself)."""
        start = time.perf_counter()
        flat, (grid_t, grid_h, grid_w) = self.pixel_values(frames)
        visual = self.hf.model.visual
        grid_thw = torch.tensor([[grid_t, grid_h, grid_w]], device=visual.device)
        output = self.hf.model.get_video_features(
            flat.to(visual.device, visual.dtype), grid_thw, return_dict=True
        )
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

    # --- language model -------------------------------------------------------------------
    @torch.inference_mode()
    def embed_text(self, ids: list[int]) -> torch.Tensor:
        """Token ids -> embeddings ``[n, d_model]``."""
        table = self.hf.get_input_embeddings()
        return table(torch.tensor(ids, dtype=torch.long, device=table.weight.device)).to(self.device)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Run ``embeds [n, d]`` at ``positions [3, n]`` on ``cache`` (a :class:`~kvdemo.attention.MemoryCache`,
        extended in place); last-token logits ``[vocab]``. The cache also reaches kvdemo's attention
        function (``kvdemo=cache``), which applies what the memory supplies per layer."""
        output = self.hf(
            inputs_embeds=embeds[None].to(self.device, self.dtype),
            position_ids=positions[:, None, :].to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            kvdemo=cache,
        )
        return output.logits[0, -1]


def load_qwen(model_id: str, device: str | None = None) -> QwenVL:
    """Load a Qwen2-VL / Qwen2.5-VL checkpoint from the Hub or a local folder with transformers' classes.

    bf16 and ``device_map="auto"`` (accelerate) on CUDA, float32 on the CPU; kvdemo's attention function
    (SDPA plus what the memory supplies, :mod:`kvdemo.attention`) in the language model, ``sdpa`` in the vision tower.
    On a ZeroGPU Space the model is loaded at start-up and moved with ``.to("cuda")`` (ZeroGPU's own pattern:
    there is no GPU to map onto until a ``@spaces.GPU`` call runs).
    """
    from transformers import (  # deferred: the CLI checks its arguments before transformers loads
        AutoConfig,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    try:
        config = AutoConfig.from_pretrained(model_id, trust_remote_code=False)
    except Exception as exc:
        raise ModelError(f"cannot load model {model_id!r}: {str(exc).splitlines()[0][:200]}") from None
    classes = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration}
    if config.model_type not in classes:
        raise ModelError(f"{model_id!r} is a {config.model_type!r} model; kvdemo supports Qwen2-VL and Qwen2.5-VL")
    use_cuda = torch.cuda.is_available() and device != "cpu"
    kwargs: dict[str, Any] = {"attn_implementation": ATTN_IMPLEMENTATION, "trust_remote_code": False}
    zerogpu = on_zerogpu()
    if zerogpu:
        kwargs.update(dtype=torch.bfloat16)
    elif use_cuda:
        kwargs.update(dtype=torch.bfloat16, device_map=device or "auto")
    else:
        kwargs.update(dtype=torch.float32)
    model = classes[config.model_type].from_pretrained(model_id, **kwargs)
    if zerogpu:
        model = model.to("cuda")
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=False)
    return QwenVL(model, tokenizer, name=model_id)
