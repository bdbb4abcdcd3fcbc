"""What every family adapter shares: a transformers model behind :class:`~kvdemo.models.base.VideoLM`.

:class:`TransformersAdapter` owns the text side (tokenizing, the chat template, stop tokens, embedding), the
language model's forward on kvdemo's cache (the model's own text model and head, with kvdemo's attention
function selected at load), which layers hold keys and values, the position limit, and the rotation; a family
subclass adds its vision encoding, the positions of its chunks, and what else its forward needs.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, AutoVideoProcessor

from ..cache.attention import ATTN_IMPLEMENTATION
from ..cache.chunk import VisualChunk
from ..devices.zerogpu import on_zerogpu
from ..dialogue import MAX_DIALOGUE_TOKENS
from .base import FrameGeometry

SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class TextCursor:
    """The next position of a family whose text and visual tokens advance one position counter (Qwen3-VL,
    Qwen3.5, LLaVA-OneVision)."""

    next: int = 0


class Rotation:
    """A language model's rotary embedding as a function of positions, computed by the model's own rotary
    module: ``rotate(x, p) = x cos(p) + rotate_half(x) sin(p)`` on the first ``rotary_dim`` channels (all of them,
    or a share: Qwen3.5 rotates 64 of 256), the rest passed through; ``unrotate`` is its inverse (rotations are
    orthogonal). ``x [..., D]``; ``p [..., 3]`` (for 1-D RoPE the three columns are equal and the first is
    used), broadcastable against ``x``'s leading dimensions (one position for all pseudo-tokens of a prototype
    is ``[..., 1, 3]``)."""

    def __init__(self, rotary_emb: torch.nn.Module, axes: int = 3) -> None:
        self.rotary_emb = rotary_emb
        self.axes = axes

    def cos_sin(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos, sin [..., rotary_dim]`` for positions ``[..., 3]``."""
        flat = position.reshape(-1, 3).t().long()  # [3, N]
        buffer = self.rotary_emb.inv_freq
        ids = flat[:, None, :] if self.axes == 3 else flat[:1]  # [3, 1, N] or [1, N]
        with torch.inference_mode():
            cos, sin = self.rotary_emb(torch.empty(0, dtype=torch.float32, device=buffer.device), ids.to(buffer.device))
        shape = (*position.shape[:-1], cos.shape[-1])
        return cos[0].reshape(shape), sin[0].reshape(shape)

    def _apply(self, x: torch.Tensor, position: torch.Tensor, sign: float) -> torch.Tensor:
        cos, sin = self.cos_sin(position)
        cos, sin = cos.to(x.device), sin.to(x.device)
        rot = cos.shape[-1]
        half = rot // 2
        xf = x.float()
        # x cos + sign * rotate_half(x) sin on the rotary channels, rotate_half(x) = [-x2, x1] added half by half in
        # place (no concatenated copy); cos/sin broadcast, so positions shared along a dimension can stay size 1.
        if rot < x.shape[-1]:
            out = xf.clone()
            out[..., :rot].mul_(cos)
        else:
            out = xf * cos  # one pass (broadcast cos), no product copied into a second buffer
        out[..., :half].addcmul_(xf[..., half:rot], sin[..., :half], value=-sign)
        out[..., half:rot].addcmul_(xf[..., :half], sin[..., half:], value=sign)
        return out.to(x.dtype)

    def rotate(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Keys before RoPE -> rotated at ``position`` (as the model caches them)."""
        return self._apply(x, position, 1.0)

    def unrotate(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Cached keys rotated at ``position`` -> keys before RoPE."""
        return self._apply(x, position, -1.0)

    def unrotating(self, positions: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """A forward's queries ``[H_q, q, D]`` at ``positions [3, q]`` -> before RoPE: what a store that scores
        queries before RoPE reads while answering (``MemoryCache.unrotate``)."""
        return lambda query: self.unrotate(query, positions.t().to(query.device))


class TransformersAdapter(abc.ABC):
    """A transformers vision-language model behind the :class:`~kvdemo.models.base.VideoLM` protocol.

    ``processor`` is the family's own video processor (pixels equal to what the model's processor feeds it);
    ``geometry`` how frames are sized (:class:`~kvdemo.models.base.FrameGeometry`).
    """

    family = ""
    #: 3 for M-RoPE (three position rows), 1 for plain RoPE.
    position_axes = 3

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        processor: Any,
        geometry: FrameGeometry,
        name: str,
        random_weights: bool = False,
        notice: str | None = None,
    ) -> None:
        self.hf = model.eval()
        self.tokenizer = tokenizer
        self.processor = processor
        self.geometry = geometry
        self.name = name
        self.random_weights = random_weights
        #: What its answers are worth, when that needs saying (the offline tiny models); shown by the CLI and UI.
        self.notice = notice
        #: The most tokens of earlier turns replayed before a question (:mod:`kvdemo.dialogue`).
        self.max_dialogue_tokens = MAX_DIALOGUE_TOKENS
        text = self.text_config
        types = getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers)
        attention = [i for i, kind in enumerate(types) if kind != "linear_attention"]
        self.layer_map: list[int | None] = [attention.index(i) if i in attention else None for i in range(len(types))]
        self.num_layers = len(attention)
        self.num_kv_heads = int(text.num_key_value_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        self.position_limit: int | None = (
            int(text.max_position_embeddings) if getattr(text, "max_position_embeddings", None) else None
        )
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        #: Optional additive bias on next-token logits ``[vocab]`` (the random tiny models restrict themselves to
        #: printable text so their answers stay readable).
        self.logit_bias: torch.Tensor | None = None
        self._stop_ids = {
            i for i in (self._special_id("<|im_end|>"), self._special_id("<|endoftext|>")) if i is not None
        }
        #: The language model's rotation (policies that keep keys before RoPE get it through their views).
        self.rotary = Rotation(self.text_model.rotary_emb, self.position_axes)

    # --- what a family says about its model -------------------------------------------------
    @property
    def text_config(self) -> Any:
        return self.hf.config.text_config

    @property
    def text_model(self) -> torch.nn.Module:
        return self.hf.model.language_model

    def layer_devices(self) -> dict[int, torch.device]:
        """Each decoder layer's device ``{model layer: device}`` (where its weights are: several devices under a
        ``device_map`` split), so the memory keeps each layer's keys, values and state beside them."""
        return {i: next(layer.parameters()).device for i, layer in enumerate(self.text_model.layers)}

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
        """The chat template up to where the stream's tokens begin (never evicted)."""
        return f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"

    def question_text(self, history: list[tuple[str, str]], question: str) -> str:
        """After the stream: the dialogue so far replayed as text, then ``question``."""
        parts = []
        for previous_question, previous_answer in history:
            parts.append(f"{previous_question}<|im_end|>\n<|im_start|>assistant\n{previous_answer}<|im_end|>\n")
            parts.append("<|im_start|>user\n")
        parts.append(f"{question}<|im_end|>\n<|im_start|>assistant\n")
        return "".join(parts)

    @torch.inference_mode()
    def embed_text(self, ids: list[int]) -> torch.Tensor:
        """Token ids -> embeddings ``[n, d_model]``."""
        table = self.hf.get_input_embeddings()
        return table(torch.tensor(ids, dtype=torch.long, device=table.weight.device)).to(self.device)

    def prefix_embeds(self) -> torch.Tensor:
        return self.embed_text(self.tokenize(self.prefix_text()))

    def question_embeds(self, history: list[tuple[str, str]], question: str) -> torch.Tensor:
        return self.embed_text(self.tokenize(self.question_text(history, question)))

    # --- positions ------------------------------------------------------------------------
    def new_cursor(self) -> Any:
        return TextCursor(0)

    def text_positions(self, cursor: Any, count: int) -> tuple[torch.Tensor, Any]:
        """Positions ``[3, count]`` of ``count`` text tokens after ``cursor`` (each advances all axes by one)."""
        positions = torch.arange(cursor.next, cursor.next + count).expand(3, -1)
        return positions, dataclasses.replace(cursor, next=cursor.next + count)

    # --- vision ---------------------------------------------------------------------------
    def processor_inputs(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """uint8 frames ``[T, H, W, 3]`` (already resized) -> the family's processor outputs (pixels and grid)."""
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        return self.processor(
            videos=[video], do_resize=False, do_sample_frames=False, return_tensors="pt", **self.processor_options
        )

    #: Extra keyword arguments of the family's processor call.
    processor_options: dict[str, Any] = {}

    @abc.abstractmethod
    def encode(self, frames: np.ndarray, first_grid: int, times_s: np.ndarray, fps: float) -> VisualChunk:
        """Vision-encode one chunk ``[T, H, W, 3]`` sampled at ``fps`` into what it puts in the sequence."""

    @abc.abstractmethod
    def chunk_positions(self, chunk: VisualChunk, cursor: Any) -> tuple[torch.Tensor, Any]:
        """Positions ``[3, n]`` of every token of ``chunk`` after ``cursor``, and the cursor after it."""

    # --- language model -------------------------------------------------------------------
    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """``[3, n]`` -> what the text model takes: ``[3, 1, n]`` for M-RoPE, ``[1, n]`` for plain RoPE."""
        positions = positions.to(self.device)
        return positions[:, None, :] if self.position_axes == 3 else positions[:1]

    def forward_extras(self, chunk: VisualChunk | None, length: int) -> dict[str, Any]:
        """Keyword arguments the family's text model needs for this forward besides the embeddings."""
        return {}

    @torch.inference_mode()
    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, cache: Any, chunk: VisualChunk | None = None
    ) -> torch.Tensor:
        """Run ``embeds [n, d]`` at ``positions [3, n]`` on ``cache`` (a :class:`~kvdemo.cache.attention.MemoryCache`,
        extended in place) through the model's own text model and head; last-token logits ``[vocab]``. The cache
        also reaches kvdemo's attention function (``kvdemo=cache``)."""
        output = self.text_model(
            inputs_embeds=embeds[None].to(self.device, self.dtype),
            position_ids=self.position_ids(positions),
            cache=cache,
            use_cache=True,
            kvdemo=cache,
            **self.forward_extras(chunk, int(embeds.shape[0])),
        )
        return self.hf.lm_head(output.last_hidden_state[:, -1])[0]


def load_checkpoint(model_class: Any, model_id: str, device: str | None = None) -> tuple[Any, Any, Any]:
    """A checkpoint (Hub id or local folder) through transformers' own class: the model (bf16 and
    ``device_map="auto"`` via accelerate on CUDA, float32 on the CPU; kvdemo's attention function in the language
    model, ``sdpa`` in the vision tower), its tokenizer, and its video processor (None if it has none: the
    family's default is used). On a ZeroGPU Space the model is loaded at start-up and moved with
    ``.to("cuda")``, ZeroGPU's own pattern (there is no GPU to map onto until a ``@spaces.GPU`` call runs)."""
    use_cuda = torch.cuda.is_available() and device != "cpu"
    kwargs: dict[str, Any] = {"attn_implementation": ATTN_IMPLEMENTATION, "trust_remote_code": False}
    zerogpu = on_zerogpu()
    if zerogpu:
        kwargs.update(dtype=torch.bfloat16)
    elif use_cuda:
        kwargs.update(dtype=torch.bfloat16, device_map=device or "auto")
    else:
        kwargs.update(dtype=torch.float32)
    model = model_class.from_pretrained(model_id, **kwargs)
    if zerogpu:
        model = model.to("cuda")
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=False)
    try:
        processor = AutoVideoProcessor.from_pretrained(model_id, trust_remote_code=False)
    except (OSError, ValueError):
        processor = None
    return model, tokenizer, processor
