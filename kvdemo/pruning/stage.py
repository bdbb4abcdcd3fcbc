"""The pruning stage of one engine: between the vision encoding and the prefill, it decides which of a chunk's
visual tokens enter the memory at all (:meth:`Pruning.prune`), and keeps the small record the views and the
report need of what it offered and let in (the pruned tokens never reach the memory, so the memory cannot say).

Only visual tokens are pruned: the text a stream carries (Qwen3-VL's timestamps and delimiters) always enters
with its grid, at its place, as vLLM keeps the prompt's text around a pruned video. The positions are not this
stage's: the engine gives every token of the chunk the position the model gives it in the full video, then keeps
those of the tokens that enter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..cache.chunk import VisualChunk
from .evs import EVS
from .spec import METHODS, PruneSpec, parse_prune
from .vidcom2 import VidCom2

#: Each method's streaming selector, by name (:data:`~kvdemo.pruning.spec.METHODS`).
SELECTORS = {"evs": EVS, "vidcom2": VidCom2}


class Pruning:
    """One engine's pruning before the LLM with ``spec`` (``evs:0.75``...), its selector's state, and the record of
    every grid: tokens offered and entered, and which patches were pruned."""

    def __init__(self, spec: PruneSpec | str) -> None:
        parsed = parse_prune(spec)
        if parsed is None:
            raise ValueError("a pruning stage needs a method (parse_prune returned None)")
        self.spec = parsed
        self.selector = SELECTORS[parsed.method](parsed.rate)
        self.grid_counts: list[tuple[int, int, int]] = []  # (grid, offered, entered)
        self._pruned: list[np.ndarray] = []  # per grid, [rows, cols] bool: pruned before the LLM
        #: After each chunk: (stream time s of its newest frame, visual tokens offered so far, entered so far).
        self.points: list[tuple[float, int, int]] = []
        self.ms = 0.0

    @torch.inference_mode()
    def prune(self, chunk: VisualChunk) -> torch.Tensor:
        """``[n]`` bool over every token of ``chunk``: True for what enters (every stream-text token, the visual tokens
        the method keeps)."""
        text = chunk.text if chunk.text is not None else torch.zeros(chunk.num_tokens, dtype=torch.bool)
        visual = ~text.to(chunk.embeds.device)
        frames = chunk.embeds[visual].view(chunk.num_grids, chunk.tokens_per_grid, -1)
        kept = self.selector.select(frames)  # [T, P]
        keep = torch.ones(chunk.num_tokens, dtype=torch.bool, device=chunk.embeds.device)
        keep[visual] = kept.flatten()
        self._record(chunk, kept)
        return keep

    def _record(self, chunk: VisualChunk, kept: torch.Tensor) -> None:
        held = kept.cpu()
        entered = held.sum(dim=1).tolist()
        for index, count in enumerate(entered):
            self.grid_counts.append((chunk.first_grid + index, chunk.tokens_per_grid, int(count)))
        self._pruned.extend((~held).view(chunk.num_grids, chunk.rows, chunk.cols).numpy())
        self.points.append((chunk.end_time_s, self.offered, self.entered))

    @property
    def offered(self) -> int:
        """Visual tokens offered so far (what the full stream would have put in the memory)."""
        return sum(offered for _, offered, _ in self.grid_counts)

    @property
    def entered(self) -> int:
        """Visual tokens that entered the memory so far."""
        return sum(entered for _, _, entered in self.grid_counts)

    def pruned_map(self) -> np.ndarray:
        """``[grids, rows, cols]`` bool: the patches pruned before the LLM (the views draw them)."""
        return np.stack(self._pruned) if self._pruned else np.zeros((0, 0, 0), dtype=bool)

    def to(self, device: torch.device | str) -> "Pruning":
        """Move the selector's state to ``device`` (the record stays on the host)."""
        self.selector.to(device)
        return self

    def describe(self) -> str:
        """One line: ``evs:0.75 (EVS ...): 1,234 of 4,936 offered visual tokens entered (25%)``."""
        share = f" ({100 * self.entered / self.offered:.0f}%)" if self.offered else ""
        return (
            f"{self.spec.text} ({METHODS[self.spec.method].summary.split(':')[0]}): {self.entered:,} of "
            f"{self.offered:,} offered visual tokens entered{share}"
        )

    def report(self) -> dict[str, Any]:
        """The report's ``pruning`` section: the method, its rate (the fraction pruned, vLLM's ``q``) and its own
        parameter, per temporal grid the tokens offered and entered, and the totals."""
        return {
            "method": self.spec.method,
            "spec": self.spec.text,
            "rate": self.spec.rate,
            "parameter": self.spec.parameter,
            "grids": [{"grid": g, "offered": o, "entered": e} for g, o, e in self.grid_counts],
            "offered": self.offered,
            "entered": self.entered,
            "prune_ms": round(self.ms, 3),
        }
