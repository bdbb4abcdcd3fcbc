"""``python -m kvdemo bench``: a long synthetic stream through ``full`` and a bounded policy on the tiny model
(per-chunk prefill/compression time, visual tokens, cache bytes), and measurements at Qwen2.5-VL-7B's cache
shape (28 layers, 4 KV heads, head dim 128, M=6144 -> C=4608) with random keys and values and no model: one
compression pass (selection + the memory's compaction) against the memory-bound floor (alternating, in one
process; where the time goes by the policy's phases; compiled and eager kernels side by side, compilation
reported apart, :mod:`kvdemo.policies.fused`), the append cost,
what the policy declares worth measuring about itself (:mod:`.policies`), what a ZeroGPU call pickles
(:mod:`.zerogpu`) and, with ``--reference``, kvdemo's InfiniPot-V pass against the authors' own code
(:mod:`.reference`). The command is :mod:`.command`.

Prints tables and writes JSON; it asserts nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any) -> None:
    """Write a command's results to ``path`` as indented JSON (its folder made if missing; values JSON does not know,
    such as a device or a dtype, written as their text)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")
