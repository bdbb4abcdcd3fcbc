"""How ProtoKV reads the memory's slices (paper 003, Sec. 3.3): which tokens the near window keeps and which leave it,
and those tokens as the bank's rows, keys un-rotated to before RoPE.

Every layer of a stack at once (:class:`~kvdemo.policies.contract.SliceStack`: consecutive layers of one device and
visual length, views of the memory's buffers, a field ``[G * H, L, ...]`` as rows): bank row ``layer * H + head`` is
the row of that layer and head in its stack, so a pass launches per stack (one per device, as a rule), not per layer.
"""

from __future__ import annotations

import torch

from ..contract import SliceStack
from ..topk import select_with_text
from .bank import Tokens


def window_with_text(stacks: list[SliceStack], keep: int) -> int:
    """The newest tokens every row of every layer can keep within ``keep`` once their grids' stream text (Qwen3-VL's
    timestamps) is charged (:func:`~kvdemo.policies.topk.select_with_text`, which decides row by row, so a stack's
    rows go in one call); ``keep`` where the stream carries no text of its own. One read for all layers."""
    fewest = []
    for stack in stacks:
        if stack.grid_text is None:
            continue
        order = stack.rows("order")
        text = stack.grid_text.expand(len(stack.layers), -1, -1).reshape(order.shape[0], -1)  # one per row
        kept = select_with_text(order.double(), keep, order, stack.rows("frame"), text)
        fewest.append(kept.sum(dim=1).min().to(stacks[0].keys.device))
    return min(keep, int(torch.stack(fewest).min())) if fewest else keep


def near_window(
    stacks: list[SliceStack], layers: int, keep: int, device: torch.device, reason: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The near window of a pass that keeps the newest ``keep`` tokens of every row of ``layers`` layers (``stacks``):
    per layer, the kept tokens' sorted indices ``[H, keep]`` and their reason code ``reason`` (int8), views of one
    tensor per stack; and for every bank row, on ``device`` (the bank's), the tokens that leave, oldest first,
    ``[B, E]``, and those kept, newest first, ``[B, keep]`` (indices into the slices)."""
    indices: list[torch.Tensor] = [None] * layers  # type: ignore[list-item]
    reasons: list[torch.Tensor] = [None] * layers  # type: ignore[list-item]
    evicted, newest = [], []
    for stack in stacks:
        heads = stack.num_heads
        ranked = torch.argsort(stack.rows("order"), dim=1)  # oldest first (arrival numbers are unique in a row)
        cut = stack.length - keep
        kept = ranked[:, cut:].sort(dim=1).values
        codes = torch.full_like(kept, reason, dtype=torch.int8)
        for position, layer in enumerate(stack.layers):
            rows = slice(position * heads, (position + 1) * heads)
            indices[layer], reasons[layer] = kept[rows], codes[rows]
        evicted.append(ranked[:, :cut].to(device))
        newest.append(ranked[:, cut:].flip(1).to(device))
    return indices, reasons, in_layer_order(evicted, stacks), in_layer_order(newest, stacks)


def gather_tokens(stacks: list[SliceStack], index: torch.Tensor) -> Tokens:
    """Tokens ``index [B, E]`` (indices into the slices, bank rows in layer order) as :class:`~.bank.Tokens`
    ``[B, E, ...]`` on ``index``'s device (the bank's: a stack on another device gathers there and moves only the
    gathered tokens), one gather per field and stack. Keys are un-rotated in float32 (a bfloat16 cache's keys are
    widened first, so the key before RoPE is not rounded back to bfloat16: Sec. 3.3 keeps centres before RoPE, and
    their EMA is float32)."""
    home = index.device
    names = ("keys", "values", "position", "frame", "row", "col", "order")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for stack in stacks:
        idx = _rows_of(index, stack).to(stack.keys.device)
        for name in names:
            source = stack.rows(name)
            if source is None:
                raise ValueError(f"ProtoKV needs the slices' {name} (hand-made slices without it)")
            wide = idx if source.dim() == 2 else idx[..., None].expand(-1, -1, source.shape[-1])
            parts[name].append(torch.gather(source, 1, wide).to(home))
    keys, values, position, frame, row, col, order = (in_layer_order(parts[name], stacks) for name in names)
    first = stacks[0].first
    if first.rotary is None:
        raise ValueError("ProtoKV needs the model's rotation to keep keys before RoPE (slices without rotary)")
    position = position.long()
    keys = first.rotary.unrotate(keys.float(), position)
    rows, cols = first.grid
    row, col = row.float(), col.float()
    spatial = torch.stack([(row + 0.5) / rows, (col + 0.5) / cols], dim=-1)
    return Tokens(keys, values.float(), spatial, position, frame.long(), row.long(), col.long(), order.long())


def in_layer_order(parts: list[torch.Tensor], stacks: list[SliceStack]) -> torch.Tensor:
    """Per-stack rows ``parts`` (``[G * H, ...]`` each, one device) as the bank's rows ``[B, ...]``, layer by layer:
    the stacks' rows one after another (no copy for one stack) when their layers come in order, else reordered."""
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    order = [layer for stack in stacks for layer in stack.layers]
    if order == sorted(order):
        return out
    heads = stacks[0].num_heads
    position = {layer: i for i, layer in enumerate(order)}
    index = [position[layer] * heads + head for layer in sorted(order) for head in range(heads)]
    return out.index_select(0, torch.tensor(index, device=out.device))


def _rows_of(x: torch.Tensor, stack: SliceStack) -> torch.Tensor:
    """The bank rows ``[G * H, ...]`` of ``stack``'s layers among ``x [B, ...]`` (a view when they are consecutive)."""
    heads, layers = stack.num_heads, stack.layers
    if layers == tuple(range(layers[0], layers[0] + len(layers))):
        return x[layers[0] * heads : (layers[-1] + 1) * heads]
    index = torch.tensor(layers, device=x.device)[:, None] * heads + torch.arange(heads, device=x.device)
    return x.index_select(0, index.flatten())
