"""The attention seam: kvdemo's attention function and the transformers ``Cache`` over a :class:`KVMemory`.

The function is registered with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME` and
selected for the language model when a model loads (``attn_implementation={"text_config": "kvdemo", ...}``;
the vision tower keeps ``sdpa``); no global monkey-patching. The model's forward receives the cache as
the keyword argument ``kvdemo=cache``, which transformers hands to the attention function of every layer.

transformers builds no mask for an implementation it does not know, so the function builds its own:
every cached slot is visible, the new tokens attend causally among themselves (they always sit after the
cache, see :mod:`kvdemo.cache.memory`). On top of that it applies what the memory supplies per layer:

- an additive key bias ``[H_kv, L]`` (ProtoKV's ``log n_k`` on pseudo-tokens, ``-inf`` on the padding of
  ragged heads), broadcast to each KV head's group of query heads (GQA), on prefill chunks and on every
  decode step; it reaches the softmax in float32 on every device (:func:`mask_dtype`, :func:`bias_needs_float32`);
- while a question is answered, chunks retrieved from the memory's offload store (HybridKV's dynamic heads):
  the forward's queries score each head's chunk mean keys, the top chunks within the head's budget come
  back from host memory and are attended together with the cache under one softmax.

With nothing supplied it is SDPA with that causal mask, equal to transformers' ``sdpa`` path. On CUDA kvdemo's
calls leave cuDNN's SDPA backend out (:func:`sdpa_backends`): it builds a plan for every new key length, and a
streaming cache has a new one at every chunk and every decoded token. Observers
(``MemoryCache.observers``, off unless asked for: :mod:`kvdemo.analysis.explain`'s answer attribution and fidelity probe)
see every layer's query, keys, values, bias and retrieved chunks in the same forward, and read the attention
weights with :func:`attention_weights`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from .memory import KVMemory

ATTENTION_NAME = "kvdemo"
#: ``attn_implementation`` for ``from_pretrained``/``_from_config``: our function in the language model.
ATTN_IMPLEMENTATION = {"text_config": ATTENTION_NAME, "vision_config": "sdpa", "": "sdpa"}


def mask_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype of the additive mask kvdemo hands SDPA with ``query``: at least float32 on the CPU, whose kernels take a
    float32 mask with bfloat16/float16 queries (so ProtoKV's ``log n_k`` and the ``-inf`` padding reach the softmax
    unrounded); the query's own dtype elsewhere, because CUDA's memory-efficient kernel rejects any other ("invalid
    dtype for bias - should match query's dtype"). Where that dtype would round a bias (:func:`bias_needs_float32`),
    the attention does not go through SDPA at all but through the float32 softmax of :func:`attention_weights`."""
    if query.device.type == "cpu":
        return torch.promote_types(query.dtype, torch.float32)
    return query.dtype


def bias_needs_float32(query: torch.Tensor, cache: "MemoryCache") -> bool:
    """Whether SDPA would round ``cache``'s key bias for ``query``: the mask it takes there is narrower than float32
    (:func:`mask_dtype`: bfloat16/float16 queries off the CPU) and the memory holds a summary region (ProtoKV's
    ``log n_k``, a count's log that bfloat16 rounds by up to 2^-8 of itself: a prototype's weight off by up to
    1.6%). Other biases hold only 0 and ``-inf`` (ragged padding), which every dtype holds exactly. Decided from
    the memory's layout, never from the bias's values (no device sync per layer)."""
    return torch.finfo(mask_dtype(query)).bits < 32 and cache.memory.summary_open and cache.memory.summary_slots > 0


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[q, kv]`` bool: query ``i`` (the ``i``-th of the last ``q`` slots) sees slots ``<= kv - q + i``."""
    past = kv_len - q_len
    return torch.arange(kv_len, device=device)[None] <= (past + torch.arange(q_len, device=device))[:, None]


def kvdemo_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    kvdemo: "MemoryCache | None" = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query [1, H_q, q, D]``, ``key/value [1, H_kv, kv, D]`` (the last ``q`` slots are the new tokens)
    -> ``([1, q, H_q, D], None)`` as transformers' attention functions return."""
    if query.shape[0] != 1:
        raise ValueError("kvdemo's attention runs one stream at a time (batch 1)")
    _, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    past = kv_len - q_len
    scale = scaling if scaling is not None else dim**-0.5
    bias = extra = None
    if kvdemo is not None:  # a forward over a kvdemo memory (without one: plain causal SDPA)
        layer = kvdemo.memory.layer_map[module.layer_idx]  # the memory's layer
        if kvdemo.capture is not None:
            kvdemo.capture[layer] = query[0].detach().clone()
        bias = kvdemo.key_bias(layer, past)
        extra = kvdemo.retrieval(layer, query[0], scale)
        for observer in kvdemo.observers:
            observer(layer, query, key, value, bias, extra, scale)
    if extra is not None or (bias is not None and bias_needs_float32(query, kvdemo)):
        return float32_attention(query, key, value, bias, extra, scale), None
    if bias is None:
        mask = causal_mask(q_len, kv_len, query.device) if q_len > 1 else None
    else:
        mask = torch.zeros(kv_heads, q_len, kv_len, dtype=mask_dtype(query), device=query.device)
        mask[:, :, :past] = bias[:, None, :].to(mask.dtype)
        if q_len > 1:
            mask[:, :, past:].masked_fill_(~causal_mask(q_len, q_len, query.device), float("-inf"))
    out = grouped_sdpa(query, key, value, mask, scale, expand_kv=fused_needs_expanded_kv(query))
    return out.transpose(1, 2).contiguous(), None


def fused_needs_expanded_kv(query: torch.Tensor) -> bool:
    """Whether :func:`grouped_sdpa` expands the KV heads for ``query``'s device: on CUDA, where SDPA with a mask
    and ``enable_gqa`` falls back to its math kernel (it materialises the ``[H_q, q, kv]`` scores; transformers'
    own sdpa path avoids the combination the same way), so the memory-efficient kernel runs instead. Elsewhere
    the grouped call is the faster one. kvdemo's choice; on an H200 (torch 2.11) the memory-efficient kernel took the
    expanded call and refused the grouped one (docs/devices.md)."""
    return query.device.type == "cuda"


#: kvdemo's own switching of SDPA's backend flags, one thread at a time: the flags are process-wide and
#: ``sdpa_kernel`` restores what it found, so two threads interleaving would restore each other's state.
_BACKEND_SWITCH = threading.Lock()


def sdpa_backends(device: torch.device) -> list[SDPBackend] | None:
    """The SDPA backends kvdemo's calls on ``device`` choose from, or None to leave SDPA's own choice.

    On CUDA (kvdemo's choice): every backend the caller has enabled except cuDNN's. PyTorch builds a cuDNN plan
    for every new combination of sizes (its plan cache is keyed on exact sizes, the key length included, and is
    per thread), and PyTorch 2.10+ puts cuDNN first on Hopper and Blackwell when the bundled cuDNN is 9.15 or
    newer; a streaming cache meets a new key length at every chunk and every decoded token, so each would pay a plan
    build where the memory-efficient or flash kernel runs at once (docs/devices.md). A caller that enabled cuDNN
    alone keeps it (the doctor times each backend alone that way); None where cuDNN is already off, or off CUDA."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    enabled = {
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled(),
    }
    return [backend for backend, on in enabled.items() if on] or None


@contextlib.contextmanager
def sdpa_scope(device: torch.device) -> Iterator[None]:
    """SDPA's backends limited to :func:`sdpa_backends` for the calls inside (nothing changes where it is None);
    the flags are restored on exit."""
    backends = sdpa_backends(device)
    if backends is None:
        yield
        return
    with _BACKEND_SWITCH, sdpa_kernel(backends):
        yield


def grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    expand_kv: bool = False,
) -> torch.Tensor:
    """SDPA of ``query [1, H_q, q, D]`` over ``key/value [1, H_kv, kv, D]`` (``H_q`` a multiple of ``H_kv``) with
    ``mask`` None, ``[q, kv]`` (bool, shared by every head) or ``[H_kv, q, kv]`` (additive, per KV head, shared
    by its group of query heads) -> ``[1, H_q, q, D]``.

    ``expand_kv=False``: each KV head's group of query heads is one batch entry and SDPA's GQA shares the keys
    (no copy of keys, values or mask). ``expand_kv=True``, the input every fused kernel takes (no GQA): with a
    mask, each KV head one batch entry whose keys and values are expanded to its query heads without a copy and
    whose mask (a per-KV-head one in the query's dtype) broadcasts over them; without one, keys and values
    repeated to ``H_q`` heads. Either way a decode step
    (``q = 1``) gives SDPA each KV head's group of query heads as its query rows (no repeat, no GQA). All are the
    same attention (tests compare them with a hand softmax)."""
    with sdpa_scope(query.device):
        return _grouped_sdpa(query, key, value, mask, scale, expand_kv)


def _grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    expand_kv: bool,
) -> torch.Tensor:
    _, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    if q_len == 1 and group > 1:
        # A decode step: each KV head's group of query heads as that head's query rows (one token has no causal
        # block), so SDPA reads each KV head's keys and values once, with as many query as key heads (no GQA, no
        # copy of the cache on CUDA); kvdemo's, measured on a CPU in docs/performance.md ("Decode steps"). The mask
        # [H_kv, 1, kv] or [1, kv] broadcasts over the rows.
        rows_mask = mask.reshape(1, kv_heads, 1, kv_len) if mask is not None and mask.dim() == 3 else mask
        if expand_kv and rows_mask is not None and rows_mask.is_floating_point():
            rows_mask = rows_mask.to(query.dtype)  # what CUDA's fused kernels take
        out = F.scaled_dot_product_attention(
            query.reshape(1, kv_heads, group, dim), key, value, attn_mask=rows_mask, scale=scale
        )
        return out.reshape(1, q_heads, 1, dim)
    if expand_kv and mask is not None:
        # KV heads as the batch: keys and values expanded to the group's query heads without a copy (stride 0), the
        # mask broadcast over the group ([H_kv, 1, q, kv] per KV head, or the shared [q, kv]). Copying the mask to
        # [1, H_q, q, kv] held a chunk's [H_q, q, kv] in memory, and repeating keys and values to the query heads a
        # copy of the cache per call. On an H200 the memory-efficient kernel took both forms, with the same bits
        # (docs/devices.md).
        shape = (kv_heads, group, kv_len, dim)
        shared = mask.to(query.dtype)[:, None] if mask.dim() == 3 else mask
        out = F.scaled_dot_product_attention(
            query.reshape(kv_heads, group, q_len, dim),
            key[0][:, None].expand(shape),
            value[0][:, None].expand(shape),
            attn_mask=shared,
            scale=scale,
        )
        return out.reshape(1, q_heads, q_len, dim)
    if expand_kv:
        if group > 1:  # no mask: keys and values repeated to the query heads (flash's input; unmeasured stride 0)
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=None, scale=scale)
    if mask is None or mask.dim() == 2:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    # The query heads of each KV head as one batch entry, so the mask [H_kv, q, kv] broadcasts over the group:
    # query [H_kv, group, q, D] against key/value [H_kv, 1, kv, D], mask [H_kv, 1, q, kv].
    out = F.scaled_dot_product_attention(
        query.reshape(kv_heads, group, q_len, dim),
        key[0].unsqueeze(1),
        value[0].unsqueeze(1),
        attn_mask=mask.unsqueeze(1),
        scale=scale,
        enable_gqa=True,
    )
    return out.reshape(1, q_heads, q_len, dim)


#: The most float32 logits one block of query tokens holds in :func:`float32_attention` (bytes; kvdemo's choice).
SCORE_BLOCK_BYTES = 64 * 2**20


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The softmax weights (float32; float64 for float64 queries) of ``query [1, H_q, q, D]`` over the cache ``key [1, H_kv, kv, D]`` (the last
    ``q`` slots are these tokens, causal among themselves; ``bias [H_kv, kv - q]`` or None on the earlier slots)
    and, with ``extra`` (retrieved keys/values ``[H_kv, R, D]`` and their bias ``[H_kv, R]``), the retrieved keys,
    under one softmax -> ``[H_kv, group * q, kv + R]``, rows ordered (query head within the group, token)."""
    _, q_heads, q_len, dim = query.shape
    kv_heads, past = key.shape[1], key.shape[2] - q_len
    wide = torch.promote_types(query.dtype, torch.float32)  # never narrower than the model's own dtype
    grouped = query.reshape(kv_heads, q_heads // kv_heads * q_len, dim).to(wide)  # [H_kv, group * q, D]
    logits = torch.matmul(grouped, key[0].to(wide).transpose(1, 2)).mul_(scale)  # [H_kv, group * q, kv]
    if bias is not None:
        logits[:, :, :past] += bias[:, None, :].to(logits.device, wide)
    if q_len > 1:
        hidden = ~causal_mask(q_len, q_len, query.device).repeat(q_heads // kv_heads, 1)  # rows: (group, q)
        logits[:, :, past:].masked_fill_(hidden, float("-inf"))
    if extra is not None:
        extra_keys, _, extra_bias = extra
        fetched = grouped @ extra_keys.to(wide).transpose(1, 2) * scale + extra_bias[:, None, :].to(wide)
        logits = torch.cat([logits, fetched], dim=-1)
    return torch.softmax(logits, dim=-1)


def weighted_values(weights: torch.Tensor, value: torch.Tensor, extra: tuple | None, q_heads: int) -> torch.Tensor:
    """``weights [H_kv, group * q, kv (+ R)]`` (:func:`attention_weights`) applied to ``value [1, H_kv, kv, D]``
    (and ``extra``'s retrieved values) -> ``[1, q, H_q, D]`` in the weights' dtype, as transformers' functions return."""
    kv_heads, kv_len, dim = value.shape[1], value.shape[2], value.shape[3]
    out = weights[..., :kv_len] @ value[0].to(weights.dtype)
    if extra is not None:
        out = out + weights[..., kv_len:] @ extra[1].to(weights.dtype)
    q_len = weights.shape[1] * kv_heads // q_heads
    return out.reshape(1, q_heads, q_len, dim).transpose(1, 2)


def float32_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    scale: float,
    block_bytes: int | None = None,
) -> torch.Tensor:
    """Attention with the logits, the bias and the softmax in float32 (:func:`attention_weights`), over the cache
    plus, with ``extra``, retrieved chunks without concatenating them (one softmax over both). ``query [1, H_q, q,
    D]`` (the last ``q`` cache slots are these tokens, causal among themselves), cache ``[1, H_kv, kv, D]`` with
    ``bias [H_kv, kv - q]`` (or None), ``extra`` keys/values ``[H_kv, R, D]`` and their bias ``[H_kv, R]`` (or None)
    -> ``[1, q, H_q, D]`` in the query's dtype. Used for HybridKV's retrieval, and for a bias SDPA would round
    (:func:`bias_needs_float32`).

    The float32 logits and weights of a whole chunk are ``[H_q, q, kv]`` each (hundreds of MB at a real model's
    chunk; measured on a GPU in docs/devices.md), so the query tokens go in blocks of at most ``block_bytes`` of
    logits (default :data:`SCORE_BLOCK_BYTES`, kvdemo's choice). A block sees the keys up to its last token, the
    chunk's earlier tokens unbiased."""
    _, q_heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    width = kv_len + (extra[0].shape[1] if extra is not None else 0)
    step = max(1, (SCORE_BLOCK_BYTES if block_bytes is None else block_bytes) // (4 * q_heads * width))
    if step >= q_len:
        weights = attention_weights(query, key, bias, scale, extra)
        return weighted_values(weights, value, extra, q_heads).to(query.dtype).contiguous()
    past = kv_len - q_len
    out = torch.empty(1, q_len, q_heads, dim, dtype=query.dtype, device=query.device)
    key, value = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (key, value))  # once, not per block
    padded = None if bias is None else torch.cat([bias, bias.new_zeros(bias.shape[0], q_len)], dim=1)
    for start in range(0, q_len, step):
        stop = min(start + step, q_len)
        seen = past + stop  # the block's last token sees slots < seen
        block_bias = None if padded is None else padded[:, : past + start]
        weights = attention_weights(query[:, :, start:stop], key[:, :, :seen], block_bias, scale, extra)
        out[:, start:stop] = weighted_values(weights, value[:, :, :seen], extra, q_heads)
    return out


def register() -> None:
    """Make :data:`ATTENTION_NAME` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvdemo_attention)


register()


class MemoryLayer(CacheLayerMixin):
    """One layer of :class:`MemoryCache`: writes new keys/values into the memory's slack in place and returns
    views of everything written so far (the memory's live part, then this forward's tokens)."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, memory: KVMemory, layer: int) -> None:
        # CacheLayerMixin.__init__ is not called: all it does is assign ``keys``/``values`` (here read-only views of
        # the memory) and ``is_initialized``.
        self.memory, self.layer = memory, layer
        self.end = memory.live_len(layer) if layer < len(memory.layers) else 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.memory.ensure_layer(self.layer, key_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.memory.ensure_layer(self.layer, key_states)
        n = key_states.shape[-2]
        self.memory.reserve(self.layer, self.end + n)
        store = self.memory.layers[self.layer]
        store.keys[:, :, self.end : self.end + n] = key_states
        store.values[:, :, self.end : self.end + n] = value_states
        self.end += n
        return store.keys[:, :, : self.end], store.values[:, :, : self.end]

    def _store(self):
        return self.memory.layers[self.layer] if self.layer < len(self.memory.layers) else None

    # transformers reads ``layer.keys`` (lengths, devices).
    @property
    def keys(self) -> torch.Tensor | None:
        store = self._store()
        return None if store is None else store.keys[:, :, : self.end]

    @property
    def values(self) -> torch.Tensor | None:
        store = self._store()
        return None if store is None else store.values[:, :, : self.end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.end + query_length, 0

    def get_seq_length(self) -> int:
        return self.end

    def get_max_length(self) -> int:
        return -1


class LinearStateLayer(LinearAttentionLayer):
    """A layer without keys and values (Qwen3.5's Gated DeltaNet) on a copy-on-write fork of the memory's committed
    state: the forward reads the committed recurrent state and rebinds its own result instead of writing into it;
    only the convolution state, which the one-token decode kernel updates in place, is cloned (a few hundred KB).
    A chunk's prefill commits the new state (:meth:`MemoryCache.commit_linear_state`); a question never does, so
    the memory's state after it is the same tensors, bit for bit."""

    def __init__(self, memory: KVMemory, model_layer: int) -> None:
        super().__init__()
        self.model_layer = model_layer
        committed = memory.linear_state.get(model_layer)
        if committed is not None:
            conv, recurrent = committed["conv"], committed["recurrent"]
            self.conv_states[0], self.recurrent_states[0] = conv.clone(), recurrent
            self.conv_kernel_size[0] = int(conv.shape[-1])
            self.dtype, self.device = conv.dtype, conv.device
            self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
            self.has_previous_state[0] = True

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent_states[state_idx] = recurrent_states
        self.is_recurrent_states_initialized[state_idx] = True
        return recurrent_states


class MemoryCache(Cache):
    """A transformers ``Cache`` over a :class:`KVMemory`'s live part, one layer per model layer: a
    :class:`MemoryLayer` over the memory's layer for an attention layer, a :class:`LinearStateLayer` for a layer
    without keys and values (``memory.layer_map``).

    ``answering`` (set by the engine while it answers a question: the question's prefill and every decode
    step) turns on retrieval from the memory's offload stores; ``capture`` (a dict) makes the attention
    function record each memory layer's queries ``[H_q, q, D]`` (post-RoPE), which is how a probe text is read;
    ``observers`` are called in every layer's attention with ``(memory layer, query, key, value, bias, retrieved,
    scale)`` (:mod:`kvdemo.analysis.explain`).
    """

    def __init__(self, memory: KVMemory) -> None:
        layers = [
            MemoryLayer(memory, layer) if layer is not None else LinearStateLayer(memory, index)
            for index, layer in enumerate(memory.layer_map)
        ]
        super().__init__(layers=layers)
        self.memory = memory
        self.answering = False
        self.capture: dict[int, torch.Tensor] | None = None
        self.observers: list = []
        self.unrotate = None  # query [H_q, q, D] -> before RoPE, at this forward's positions (set while answering)

    def commit_linear_state(self) -> None:
        """Make the state this forward left in the layers without keys and values the memory's committed state."""
        for layer in self.layers:
            if isinstance(layer, LinearStateLayer) and layer.has_previous_state[0]:
                self.memory.commit_linear(layer.model_layer, layer.conv_states[0], layer.recurrent_states[0])

    def retrieval(self, layer: int, query: torch.Tensor, scale: float):
        """Keys/values/bias the forward of ``query [H_q, q, D]`` brings back from memory layer ``layer``'s offload
        store, or None (not answering, or nothing offloaded)."""
        if not self.answering or layer >= len(self.memory.layers):
            return None
        store = self.memory.layers[layer].offload
        return None if store is None else store.fetch(query, scale, self.unrotate)

    def key_bias(self, layer: int, past: int) -> torch.Tensor | None:
        """The memory's additive key bias ``[H_kv, past]`` over the first ``past`` slots of ``layer``, or None."""
        if layer >= len(self.memory.layers):
            return None
        bias = self.memory.layers[layer].bias
        return None if bias is None else bias[:, :past]
