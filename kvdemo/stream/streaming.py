"""The engines watching one stream: one :class:`~kvdemo.stream.engine.FrameStream` (one vision encoding per chunk)
feeds every engine that has not stopped (:class:`EngineGroup`); :func:`stream_video` streams a video file
through one, its frames sized for the model. The CLI, the app, the evaluation and the benchmarks all stream this way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..cache.chunk import VisualChunk
from ..cache.memory import OccupancyEvent
from ..media.video import Video, VideoFile, frames_for
from ..models.base import VideoLM
from .engine import EngineStop, FrameStream, StreamEngine


@dataclass
class StreamStep:
    """What one chunk did to a group of engines (see :class:`EngineGroup`)."""

    chunk: VisualChunk
    frames_done: int
    frames_total: int | None
    events: dict[str, list[OccupancyEvent]]
    stopped: dict[str, str] = field(default_factory=dict)  # engine name -> why it stopped (all so far)


class EngineGroup:
    """The engines watching one stream: one :class:`FrameStream` (one vision encoding per chunk) feeds every
    engine that has not stopped. An engine stops when the next chunk would take it past its memory cap
    (:class:`MemoryCapError`) or the device runs out of memory; the others go on, and :attr:`stopped` says
    why. The CLI, the app, the evaluation and the benchmarks all stream through one of these."""

    def __init__(self, model: VideoLM, engines: dict[str, StreamEngine], fps: float) -> None:
        self.engines = engines
        self.stream = FrameStream(model, fps)
        self.stopped: dict[str, str] = {}

    @property
    def frames_seen(self) -> int:
        return self.stream.frames_seen

    def attach(self, model: VideoLM) -> "EngineGroup":
        """Attach ``model`` to the stream and every engine after unpickling (the memory stays where it is)."""
        self.stream.model = model
        for engine in self.engines.values():
            engine.attach(model)
        return self

    def push(
        self, frames: np.ndarray, times_s: np.ndarray | None = None, flush: bool = False, total: int | None = None
    ) -> list[StreamStep]:
        """Add frames ``[T, H, W, 3]``; feed every chunk they complete (and, with ``flush``, a last odd frame
        paired with a copy of itself) to every running engine, one step per chunk. ``total`` (frames the
        stream will have) goes into the steps."""
        chunks = [self.stream.push(frames, times_s) if len(frames) else None]
        if flush:
            chunks.append(self.stream.flush())
        return [self.feed_chunk(chunk, total) for chunk in chunks if chunk is not None]

    def feed_chunk(self, chunk: VisualChunk, total: int | None = None) -> StreamStep:
        events = {}
        for name, engine in self.engines.items():
            if name in self.stopped:
                continue
            try:
                events[name] = engine.feed_chunk(chunk)
            except EngineStop as exc:
                self.stopped[name] = str(exc)
            except RuntimeError as exc:
                if "out of memory" not in str(exc).lower():
                    raise
                self.stopped[name] = f"stopped: out of memory at {engine.frames_fed} frames"
        return StreamStep(chunk, self.stream.frames_seen, total, events, dict(self.stopped))


def stream_video(
    model: VideoLM,
    video: Video | VideoFile,
    engines: dict[str, StreamEngine],
    frames_per_chunk: int = 2,
) -> Iterator[StreamStep]:
    """Stream ``video`` into every engine through one :class:`EngineGroup`; yields after each chunk. Frames not on
    ``model``'s grid (a video opened for no model, or for another family) are resized as its family does
    (:func:`~kvdemo.media.video.frames_for`); frames already on it pass unchanged."""
    group = EngineGroup(model, engines, video.fps)
    parts = video.chunks(frames_per_chunk)
    current = next(parts, None)
    while current is not None:
        following = next(parts, None)  # decoded ahead by one part, so the last one flushes an odd frame
        _, frames, times = current
        yield from group.push(
            frames_for(frames, model.geometry), times, flush=following is None, total=video.num_frames
        )
        current = following
