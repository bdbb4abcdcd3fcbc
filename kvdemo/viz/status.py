"""What one head holds beyond its exact tokens: per patch, held exactly, summarised (a policy's summary region
still represents it), offloaded or retrieved (the memory's offload store), or evicted; the strips and gallery
of an engine drawn with those statuses."""

from __future__ import annotations

import numpy as np

from ..analysis.survival import survival_counts
from ..policies.contract import SummaryRegion
from .frames import (
    EVICTED,
    _grid_lines,
    _upsample,
    drawable,
    frame_strip,
    survivor_gallery,
    survivor_strip,
    thumbnail,
    with_pruned,
)

#: Per-patch status codes of :func:`patch_status`.
HELD, SUMMARISED, OFFLOADED, RETRIEVED = 0, 1, 2, 3
STATUS_COLOURS = {HELD: (255, 214, 0), SUMMARISED: (66, 133, 244), OFFLOADED: (171, 71, 188), RETRIEVED: (52, 168, 83)}
STATUS_NAMES = {
    HELD: "held exactly",
    SUMMARISED: "summarised (represented in the policy's summary region)",
    OFFLOADED: "offloaded (host memory)",
    RETRIEVED: "retrieved while answering the last question",
}


def summarised(engine, layer: int, head: int) -> np.ndarray | None:
    """``[grids, rows, cols]`` bool: the patches a policy with a summary region still represents for one
    (layer, KV head) (:meth:`~kvdemo.policies.contract.SummaryRegion.summarised`); None for any other policy."""
    if not isinstance(engine.policy, SummaryRegion):
        return None
    return engine.policy.summarised(engine.view_context(), layer, head)


def patch_status(engine, layer: int, head: int) -> np.ndarray | None:
    """``[grids, rows, cols]`` status of every patch for one (layer, KV head): held exactly, summarised (a
    summary region still represents it), offloaded / retrieved during the last answer (the memory's offload
    store), or ``EVICTED``. None for a policy that only selects (its view is :func:`survivor_strip`)."""
    memory = engine.memory
    store = memory.layers[layer] if memory.layers else None
    summary = summarised(engine, layer, head) if memory.grid_shape is not None else None
    offloads = store is not None and store.offload is not None
    if memory.grid_shape is None or not (summary is not None or offloads):
        return None
    rows, cols = memory.grid_shape
    status = np.full((memory.num_grids, rows, cols), EVICTED, dtype=np.int16)
    if summary is not None:
        status[summary] = SUMMARISED
    if offloads:
        offload = store.offload
        chunks = int(offload.count[head])
        valid = offload.head_chunks("valid", head).numpy()
        retrieved = offload.retrieved[head, :chunks].cpu().numpy()[:, None] & valid
        frame, row, col = (offload.head_chunks(name, head).numpy() for name in ("frame", "row", "col"))
        status[frame[valid], row[valid], col[valid]] = OFFLOADED
        status[frame[retrieved], row[retrieved], col[retrieved]] = RETRIEVED
    frame, row, col = (
        t[head].long().cpu().numpy() for t in (memory.frame[layer], memory.row[layer], memory.col[layer])
    )
    held = (
        memory.valid[layer][head].cpu().numpy() if memory.valid[layer] is not None else np.ones(frame.shape, dtype=bool)
    )
    status[frame[held], row[held], col[held]] = HELD
    return status


def overlay_status(frame: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Colour each patch by its :func:`patch_status` code, darken evicted ones (``codes [rows, cols]``)."""
    height, width = frame.shape[:2]
    palette = np.zeros((len(STATUS_COLOURS) + 1, 3), dtype=np.float32)
    for code, colour in STATUS_COLOURS.items():
        palette[code] = colour
    shown = _upsample((codes != EVICTED).astype(np.float32), (height, width))[..., None]
    colour = palette[_upsample(codes.astype(np.float32), (height, width)).astype(np.int64)]
    image = frame.astype(np.float32) * (0.25 + 0.75 * shown)
    image = image * (1 - 0.4 * shown) + colour * 0.4 * shown
    return _grid_lines(np.clip(image, 0, 255).astype(np.uint8), codes.shape)


def status_legend(codes: np.ndarray) -> str:
    """Markdown legend of the statuses that appear in ``codes``."""
    present = set(np.unique(codes).tolist())
    parts = [
        f"<span style='color:rgb{STATUS_COLOURS[code]}'>■</span> {name}"
        for code, name in STATUS_NAMES.items()
        if code in present
    ]
    return " &nbsp; ".join(parts + ["dark = evicted"])


def possible_statuses(engines) -> np.ndarray:
    """The status codes the strips of ``engines`` can show (held always; summarised for a policy with a summary region,
    offloaded and retrieved for a memory with an offload store), known without drawing: for one legend over them."""
    codes = {HELD}
    for engine in engines:
        if isinstance(engine.policy, SummaryRegion):
            codes.add(SUMMARISED)
        if any(store.offload is not None for store in engine.memory.layers):
            codes.update((OFFLOADED, RETRIEVED))
    return np.array(sorted(codes))


def status_fractions(engine, layer: int | None = None, head: int | None = None) -> np.ndarray | None:
    """``[statuses, grids, rows, cols]``: the share of (layer, KV head) copies of each patch in each
    :func:`patch_status` (held, summarised, offloaded, retrieved), over all layers/heads or the chosen ones;
    None for a policy that only selects. Counted with one ``bincount`` per layer, like the survival map."""
    memory = engine.memory
    if memory.grid_shape is None or not memory.layers:
        return None
    layers = range(memory.num_layers) if layer is None else [layer]
    heads = list(range(memory.num_kv_heads)) if head is None else [head]
    summarises = isinstance(engine.policy, SummaryRegion)
    offloads = any(memory.layers[l].offload is not None for l in layers)
    if not (summarises or offloads):
        return None
    rows, cols = memory.grid_shape
    size = memory.num_grids * rows * cols
    copies = len(layers) * len(heads)
    held = survival_counts(memory, layer, head).numpy().reshape(-1).astype(np.float64)
    out = np.zeros((len(STATUS_COLOURS), size))
    out[HELD] = held
    if summarises:  # represented by the summary and not held exactly
        represented = sum(summarised(engine, l, h).reshape(-1).astype(np.float64) for l in layers for h in heads)
        out[SUMMARISED] = np.maximum(represented - held, 0)
    for l in layers:
        store = memory.layers[l].offload
        if store is None:
            continue
        frame, row, col = (store.by_head(name) for name in ("frame", "row", "col"))
        flat = ((frame * rows + row) * cols + col)[heads]
        valid = store.by_head("valid")[heads]
        retrieved = store.retrieved[heads].cpu()[..., None] & valid
        out[RETRIEVED] += np.bincount(flat[retrieved].numpy(), minlength=size)
        out[OFFLOADED] += np.bincount(flat[valid & ~retrieved].numpy(), minlength=size)
    return (out / copies).reshape(len(STATUS_COLOURS), memory.num_grids, rows, cols)


def overlay_status_fractions(frame: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """Tint each patch by the shares of its statuses (``fractions [statuses, rows, cols]``); dark = evicted."""
    height, width = frame.shape[:2]
    colours = np.array([STATUS_COLOURS[code] for code in STATUS_COLOURS], dtype=np.float32)  # [S, 3]
    shares = np.stack([_upsample(f, (height, width)) for f in fractions], axis=-1)  # [h, w, S]
    shown = shares.sum(-1, keepdims=True).clip(0, 1)
    tint = (shares @ colours) / np.maximum(shown, 1e-6)
    image = frame.astype(np.float32) * (0.25 + 0.75 * shown)
    image = image * (1 - 0.4 * shown) + tint * 0.4 * shown
    return _grid_lines(np.clip(image, 0, 255).astype(np.uint8), fractions.shape[1:])


def _status_caption(fractions: np.ndarray) -> str:
    held, summarised, offloaded, retrieved = (float(f.mean()) for f in fractions)
    parts = [f"{100 * held:.0f}% exact"]
    if summarised:
        parts.append(f"{100 * summarised:.0f}% summarised")
    if offloaded or retrieved:
        parts.append(f"{100 * (offloaded + retrieved):.0f}% offloaded")
    return " · ".join(parts)


def pruned_patches(engine) -> np.ndarray | None:
    """``[grids, rows, cols]`` bool: the patches of ``engine``'s grids pruned before the LLM (None without pruning), as
    many grids as its memory has seen."""
    if getattr(engine, "pruning", None) is None:
        return None
    return engine.pruning.pruned_map()[: engine.memory.num_grids]


def engine_strip(
    engine,
    thumbnails: list[np.ndarray],
    layer: int | None = None,
    head: int | None = None,
    by_reason: bool = False,
    last: int = 4,
) -> np.ndarray:
    """What survives of the newest grids for ``engine``: :func:`survivor_strip`, or, for a policy that
    summarises (ProtoKV) or offloads (HybridKV), each patch tinted by its statuses (:func:`patch_status`)
    over the chosen layer/KV head or all of them, so that a summarised patch never reads as evicted. Patches pruned
    before the LLM are marked in their own colour (:func:`~kvdemo.viz.frames.mark_pruned`)."""
    memory = engine.memory
    pruned = pruned_patches(engine)
    if not by_reason or layer is None or head is None:
        fractions = status_fractions(engine, layer, head)
        if fractions is not None:
            grids = drawable(range(max(0, memory.num_grids - last), memory.num_grids), thumbnails)
            tiles = [overlay_status_fractions(thumbnails[g], fractions[:, g]) for g in grids]
            captions = [f"t={memory.grid_times_s[g]:.1f}s  {_status_caption(fractions[:, g])}" for g in grids]
            return frame_strip(*with_pruned(tiles, captions, grids, pruned))
    return survivor_strip(memory, thumbnails, layer, head, last=last, by_reason=by_reason, pruned=pruned)


def engine_gallery(engine, thumbnails: list[np.ndarray], max_width: int = 160) -> list[tuple[np.ndarray, str]]:
    """Every grid so far with what survives of it (aggregated; statuses for summarising/offloading policies)."""
    fractions = status_fractions(engine)
    pruned = pruned_patches(engine)
    if fractions is None:
        return survivor_gallery(engine.memory, thumbnails, max_width, pruned)
    memory = engine.memory
    grids = drawable(range(memory.num_grids), thumbnails)
    tiles = [overlay_status_fractions(thumbnail(thumbnails[g], max_width), fractions[:, g]) for g in grids]
    captions = [f"t={memory.grid_times_s[g]:.1f}s · {_status_caption(fractions[:, g])}" for g in grids]
    return list(zip(*with_pruned(tiles, captions, grids, pruned))) if grids else []
