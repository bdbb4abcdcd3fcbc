"""How ProtoKV reads the memory's slices (paper 003, Sec. 3.3): the tokens that leave the near window, as the bank's
rows, keys un-rotated to before RoPE."""

from __future__ import annotations

import torch

from ..contract import LayerSlice
from .bank import Tokens


def gather_tokens(slices: list[LayerSlice], index: torch.Tensor) -> Tokens:
    """Tokens ``index [layers, H, E]`` of every row (:class:`~.bank.Tokens`, ``[B, E, ...]``) on ``index``'s device
    (the bank's: a layer on another device gathers there and moves only the gathered tokens). Keys are
    un-rotated in float32 (a bfloat16 cache's keys are widened first, so the key before RoPE is not rounded
    back to bfloat16: Sec. 3.3 keeps centres before RoPE, and their EMA is float32)."""
    keys, values, position, frame, row, col, order = [], [], [], [], [], [], []
    home = index.device
    for layer_slice, idx in zip(slices, index):
        idx = idx.to(layer_slice.keys.device)
        expand = idx[..., None].expand(-1, -1, layer_slice.keys.shape[-1])
        keys.append(torch.gather(layer_slice.keys, 1, expand).to(home))
        values.append(torch.gather(layer_slice.values, 1, expand).to(home))
        position.append(torch.gather(layer_slice.position, 1, idx[..., None].expand(-1, -1, 3)).to(home))
        frame.append(torch.gather(layer_slice.frame, 1, idx).to(home))
        row.append(torch.gather(layer_slice.row, 1, idx).to(home))
        col.append(torch.gather(layer_slice.col, 1, idx).to(home))
        order.append(torch.gather(layer_slice.order, 1, idx).to(home))
    position = torch.cat(position).long()
    keys = torch.cat(keys)
    rotary = slices[0].rotary
    if rotary is None:
        raise ValueError("ProtoKV needs the model's rotation to keep keys before RoPE (slices without rotary)")
    keys = rotary.unrotate(keys.float(), position)
    rows, cols = slices[0].grid
    row, col = torch.cat(row).float(), torch.cat(col).float()
    spatial = torch.stack([(row + 0.5) / rows, (col + 0.5) / cols], dim=-1)
    return Tokens(
        keys,
        torch.cat(values).float(),
        spatial,
        position,
        torch.cat(frame).long(),
        row.long(),
        col.long(),
        torch.cat(order).long(),
    )
