"""kvdemo: stream a video into a vision-language model under a hard KV-cache budget and see what survives.

The public names are imported on first use (PEP 562), so ``python -m kvdemo`` can check its arguments
and the video file before torch and transformers load.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BudgetError": ".errors",
    "EngineError": ".stream.engine",
    "FrameStream": ".stream.engine",
    "KVMemory": ".cache.memory",
    "LayerSlice": ".policies",
    "LiveSession": ".stream.live",
    "MemoryCapError": ".stream.engine",
    "OccupancyEvent": ".cache.memory",
    "Policy": ".policies",
    "Selection": ".policies",
    "StreamEngine": ".stream.engine",
    "UserError": ".errors",
    "Video": ".media.video",
    "VideoError": ".media.video",
    "evaluate": ".experiments.evaluation",
    "fidelity": ".analysis.explain",
    "generate_episode": ".world.synthetic",
    "load_model": ".models.loading",
    "load_video": ".media.video",
    "make_policy": ".policies",
    "policy_names": ".policies",
    "stream_video": ".stream.streaming",
    "synthetic_video": ".world.synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvdemo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
