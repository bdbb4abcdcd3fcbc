"""kvdemo: stream a video into a vision-language model under a hard KV-cache budget and see what survives."""

from .engine import EngineError, FrameStream, MemoryCapError, StreamEngine, stream_video
from .memory import KVMemory, OccupancyEvent
from .models.qwen_vl import load_model
from .policies import BudgetError, LayerView, Policy, Selection, make_policy, policy_names
from .video import Video, VideoError, load_video, synthetic_video

__all__ = [
    "BudgetError",
    "EngineError",
    "FrameStream",
    "KVMemory",
    "LayerView",
    "MemoryCapError",
    "OccupancyEvent",
    "Policy",
    "Selection",
    "StreamEngine",
    "Video",
    "VideoError",
    "load_model",
    "load_video",
    "make_policy",
    "policy_names",
    "stream_video",
    "synthetic_video",
]
