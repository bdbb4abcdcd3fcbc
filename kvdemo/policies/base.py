"""The policy interface: a pure ``compress(views, keep) -> Selection`` over per-layer views of the
visual part of the KV cache, and a registry by name.

Policies know nothing of models or of the UI; they see keys, values and provenance, and return, per
layer and KV head, the sorted indices of the tokens to keep.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class LayerView:
    """What a policy sees of one layer's visual tokens.

    keys, values: ``[H_kv, L, D]`` post-RoPE, exactly as cached.
    frame, row, col: ``[H_kv, L]`` provenance of each token: the temporal grid it came from (a pair of
    sampled frames; called "frame" as in the papers) and its merged-patch row and column.
    """

    layer: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    frame: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    grid: tuple[int, int]
    newest_frame: int

    @property
    def num_heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[0] * self.grid[1]


@dataclass
class Selection:
    """Per layer, ``LongTensor [H_kv, keep]`` of sorted indices into that layer's view."""

    indices: list[torch.Tensor]
    #: Optional per-layer extras a policy reports for explanation (e.g. why each kept token was kept).
    info: dict[str, Any] = field(default_factory=dict)


class BudgetError(ValueError):
    """An impossible budget (the message says which numbers and why)."""


@dataclass
class Policy(abc.ABC):
    """Base of every policy: a dataclass of its paper's parameters, registered by ``name``."""

    name: ClassVar[str] = ""
    #: False for ``full``: the engine never compresses.
    bounded: ClassVar[bool] = True
    #: One line for CLI and UI help.
    summary: ClassVar[str] = ""
    #: Per-parameter help texts (field name -> text) for the CLI and UI.
    help: ClassVar[dict[str, str]] = {}

    @abc.abstractmethod
    def compress(self, views: list[LayerView], keep: int) -> Selection:
        """Choose ``keep`` tokens per layer and KV head from ``views`` (one per layer)."""

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available by ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return list(REGISTRY)


def make_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy with its defaults overridden by ``params``."""
    if name not in REGISTRY:
        raise BudgetError(f"unknown policy {name!r}; choose one of: {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(params) - known
    if unknown:
        raise BudgetError(
            f"policy {name!r} has no parameter(s) {', '.join(sorted(unknown))}"
            + (f"; it takes: {', '.join(sorted(known))}" if known else "; it takes none")
        )
    return cls(**params)


# --- shared helpers for policies ---------------------------------------------------------


def top_k_sorted(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices ``[H, keep]`` of the ``keep`` highest ``scores [H, L]`` per row, in ascending order.

    Ties break towards the newer token (higher index) so results are deterministic.
    """
    length = scores.shape[-1]
    if keep >= length:
        return torch.arange(length, device=scores.device).expand(scores.shape[0], -1).clone()
    # A vanishing ramp by position breaks ties deterministically towards newer tokens.
    ramp = torch.arange(length, device=scores.device, dtype=torch.float64) / (length * 1e9)
    chosen = torch.topk(scores.double() + ramp, keep, dim=-1).indices
    return chosen.sort(dim=-1).values


def frame_rank(frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ranks of frame ids ``[H, L]`` per head: ``(rank [H, L], frames_held [H])``; rank 0 is the oldest.

    Works for heads that hold different frames: each head is ranked among its own frames.
    """
    heads, length = frame.shape
    order = frame.long()
    offset = (order.max() + 1) if length else torch.tensor(1)
    keyed = order + torch.arange(heads, device=frame.device)[:, None] * offset
    unique, inverse = torch.unique(keyed, return_inverse=True)
    head_of_unique = torch.div(unique, offset, rounding_mode="floor")
    counts = torch.bincount(head_of_unique, minlength=heads)
    starts = torch.cumsum(counts, 0) - counts
    rank = inverse - starts[torch.arange(heads, device=frame.device)[:, None].expand(heads, length)]
    return rank, counts
