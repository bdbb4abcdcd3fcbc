"""Video in: decoding, fps sampling, resizing as the model's family does (its :class:`~kvdemo.media.geometry.FrameGeometry`),
chunking; writing a clip (tests, examples).

Frames are sized by the model that will watch them: ``load_video(path, fps, model=model)`` (or ``geometry=`` for
a pixel range of one's own) gives uint8 arrays ``[T, H, W, 3]`` already on that model's grid, so every engine and
every view shares one exact pixel grid. Opened for no model, frames keep the source's size (right for nothing in
particular: :func:`kvdemo.stream.streaming.stream_video` sizes them for the model it streams into). No family's size is
ever assumed here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StreamSettingError, UserError
from ..views import counted
from .geometry import FrameGeometry

if TYPE_CHECKING:
    import av  # imported where a file is opened or written: the bundled sample, the CLI's checks and the app need no PyAV

#: Largest decoded frame we accept before resizing (a 16K frame costs ~0.8 GB per frame to decode).
MAX_SOURCE_PIXELS = 8192 * 8192


class VideoError(UserError):
    """A video could not be used; the message names the file and says why."""


def sampling_fps(fps: Any) -> float:
    """``fps`` as a sampling rate: the one check of it, made where a rate comes in (the CLI's and the app's settings,
    :class:`VideoFile`, :meth:`Video.sampled`, :class:`~kvdemo.stream.engine.FrameStream`);
    :class:`~kvdemo.errors.StreamSettingError` unless it is a positive, finite number."""
    try:
        rate = float(fps)
    except (TypeError, ValueError):
        rate = math.nan
    if not 0 < rate < math.inf:  # also nan
        raise StreamSettingError(f"sampling fps must be positive, got {fps}")
    return rate


def resize_frames(frames: np.ndarray, geometry: FrameGeometry) -> np.ndarray:
    """Resize uint8 frames ``[T, H, W, 3]`` to the size ``geometry`` gives them (its family's own rule), bicubic
    and antialiased as the families' video processors resize."""
    import torch  # deferred on purpose: opening and checking a file stays quick (the CLI fails fast)
    import torchvision.transforms.v2.functional as tvF  # deferred with torch

    height, width = frames.shape[1:3]
    try:
        new_h, new_w = geometry.frame_size(height, width)
    except ValueError as exc:
        raise VideoError(str(exc)) from None
    if (new_h, new_w) == (height, width):
        return np.ascontiguousarray(frames)
    tensor = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    resized = tvF.resize(tensor, [new_h, new_w], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    return resized.permute(0, 2, 3, 1).contiguous().numpy()


def frames_for(frames: np.ndarray, geometry: FrameGeometry) -> np.ndarray:
    """``frames [T, H, W, 3]`` as a model of ``geometry`` takes them: unchanged when already on its grid (whatever
    pixel range they were sized with, e.g. a user's own), else resized by its family's rule."""
    try:
        geometry.check_size((int(frames.shape[1]), int(frames.shape[2])))
        return frames
    except ValueError:
        return resize_frames(frames, geometry)


@dataclass
class Video:
    """Sampled, resized frames of one stream.

    frames: uint8 ``[N, H, W, 3]`` (sized for the model it was opened for, or the source's size when opened for
    none); times_s: ``[N]`` stream time of each frame.
    """

    frames: np.ndarray
    times_s: np.ndarray
    fps: float
    source: str
    source_fps: float = 0.0
    source_frames: int = 0
    source_size: tuple[int, int] = (0, 0)
    lost_frames: int = 0

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) after resizing."""
        return int(self.frames.shape[1]), int(self.frames.shape[2])

    def describe(self) -> str:
        return _describe(
            Path(self.source).name,
            self.num_frames,
            self.fps,
            self.size,
            self.source_size,
            self.source_fps,
            self.lost_frames,
        )

    def head(self, max_frames: int | None) -> "Video":
        """The first ``max_frames`` frames (all of them when ``None``)."""
        if max_frames is None or max_frames >= self.num_frames:
            return self
        if max_frames <= 0:
            raise VideoError(f"max_frames must be positive, got {max_frames}")
        return dataclasses.replace(self, frames=self.frames[:max_frames], times_s=self.times_s[:max_frames])

    def sampled(self, fps: float) -> "Video":
        """The frames shown at times ``k / fps`` (``fps`` below the video's own rate); at or above it the
        video as it is (it streams at its own rate, as a file does)."""
        fps = sampling_fps(fps)
        if fps >= self.fps:
            return self
        count = sample_count(self.num_frames / self.fps, fps)
        index = np.minimum(np.floor(np.arange(count) / fps * self.fps + 1e-9).astype(int), self.num_frames - 1)
        return dataclasses.replace(self, frames=self.frames[index], times_s=self.times_s[index], fps=float(fps))

    def resized(self, geometry: FrameGeometry) -> "Video":
        """The frames resized as ``geometry`` sizes them (itself when already there)."""
        frames = resize_frames(self.frames, geometry)
        return self if frames is self.frames else dataclasses.replace(self, frames=frames)

    def chunks(self, frames_per_chunk: int = 2) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield ``(first_frame_index, frames [T, H, W, 3], times_s [T])`` chunks of at most ``frames_per_chunk``."""
        if frames_per_chunk <= 0:
            raise VideoError(f"frames per chunk must be positive, got {frames_per_chunk}")
        for start in range(0, self.num_frames, frames_per_chunk):
            stop = min(start + frames_per_chunk, self.num_frames)
            yield start, self.frames[start:stop], self.times_s[start:stop]


def _describe(name: str, frames: int, fps: float, size, source_size, source_fps: float, lost: int) -> str:
    text = (
        f"{name}: {frames} frames at {fps:g} fps, {size[1]}x{size[0]} "
        f"(source {source_size[1]}x{source_size[0]} @ {source_fps:.3g} fps)"
    )
    if lost:
        text += f"; {counted(lost, 'damaged frame')} could not be decoded and {'was' if lost == 1 else 'were'} skipped"
    return text


def sample_count(duration_s: float | None, fps: float, max_frames: int | None = None) -> int | None:
    """How many frames sampling at ``fps`` takes from ``duration_s`` seconds (times k / fps, k = 0, 1, ...);
    ``None`` when the duration is unknown (sample until the end). ``fps`` is already checked (:func:`sampling_fps`)."""
    if max_frames is not None and max_frames <= 0:
        raise VideoError(f"max_frames must be positive, got {max_frames}")
    count = None if duration_s is None else max(1, int(math.floor(duration_s * fps + 1e-9)))
    if max_frames is not None:
        count = max_frames if count is None else min(count, max_frames)
    return count


class VideoFile:
    """A video file opened lazily: metadata at once, frames decoded, sampled and resized as they stream.

    Decoding is sequential with PyAV (FFmpeg), so memory stays at a few full-resolution frames however
    long the video is. (decord's threaded decoder keeps decoding ahead of a slow consumer without bound:
    measured here at ~350 MB/s on 1080p while the model works, so a long video ran out of memory.)

    Sampling takes, for each time ``k / fps``, the frame shown then (within half a source frame); a
    target whose frame cannot be decoded counts in ``lost_frames``. Sampling faster than the source
    takes every frame (``fps`` becomes the source rate). Frames are resized as ``geometry`` says (a model's), or
    kept at the source's size without one. A file that is not a readable video raises :class:`VideoError` naming it.
    """

    def __init__(
        self,
        path: str | Path,
        fps: float = 2.0,
        max_frames: int | None = None,
        geometry: FrameGeometry | None = None,
    ) -> None:
        fps = sampling_fps(fps)
        path = Path(path)
        try:
            found, folder, size = path.exists(), path.is_dir(), path.stat().st_size if path.is_file() else None
        except OSError as exc:  # e.g. a name too long for the file system
            raise VideoError(f"{path}: cannot be opened ({exc.strerror or type(exc).__name__})") from None
        if not found:
            raise VideoError(f"{path}: no such file")
        if folder:
            raise VideoError(f"{path}: is a directory, not a video file")
        if size == 0:
            raise VideoError(f"{path.name}: the file is empty")
        self.path, self.geometry = path, geometry
        with self._open() as container:
            stream = container.streams.video[0]
            self.source_fps = float(stream.average_rate or stream.guessed_rate or 0.0)
            duration = None
            if stream.duration:
                duration = float(stream.duration * stream.time_base)
            elif container.duration:
                duration = container.duration / 1_000_000  # AV_TIME_BASE
            self.duration_s = duration
            self.source_frames = int(stream.frames or (round(duration * self.source_fps) if duration else 0))
            height, width = stream.codec_context.height, stream.codec_context.width
        if not height or not width:
            raise VideoError(f"{path.name}: the video stream has no frame size")
        self.source_size = (int(height), int(width))
        if height * width > MAX_SOURCE_PIXELS:
            raise VideoError(f"{path.name}: frames of {width}x{height} are too large (limit {MAX_SOURCE_PIXELS} px)")
        try:
            self.size = geometry.frame_size(height, width) if geometry is not None else self.source_size
        except ValueError as exc:
            raise VideoError(f"{path.name}: {exc}") from None
        self.fps = float(min(fps, self.source_fps) if self.source_fps > 0 else fps)
        self.planned = sample_count(duration, self.fps, max_frames)
        self.max_frames = max_frames
        self.lost_frames = 0
        self.decoded_frames = 0

    def _open(self):
        import av  # deferred on purpose (see the imports)

        try:
            container = av.open(str(self.path))
        except Exception as exc:  # av.error.* (InvalidDataError...), or undecodable metadata
            raise VideoError(f"{self.path.name}: not a readable video file ({_first_line(exc, self.path)})") from None
        if not container.streams.video:
            container.close()
            raise VideoError(f"{self.path.name}: has no video stream")
        return container

    @property
    def num_frames(self) -> int:
        """Frames the sampling plans (known from the duration; decoded so far when it is unknown)."""
        return int(self.planned if self.planned is not None else self.decoded_frames)

    @property
    def source(self) -> str:
        return str(self.path)

    def chunks(self, frames_per_chunk: int = 2, batch: int = 4) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield ``(first_frame_index, frames [T, H, W, 3], times_s [T])``; frames are resized ``batch`` at a time."""
        if frames_per_chunk <= 0:
            raise VideoError(f"frames per chunk must be positive, got {frames_per_chunk}")
        self.lost_frames = self.decoded_frames = 0
        native: list[tuple[np.ndarray, float]] = []
        ready: list[tuple[np.ndarray, float]] = []
        produced = 0
        for frame, time_s in self._sampled_frames():
            native.append((frame, time_s))
            if len(native) >= batch:
                ready.extend(self._resized(native))
                native = []
            while len(ready) >= frames_per_chunk:
                part, ready = ready[:frames_per_chunk], ready[frames_per_chunk:]
                yield produced, np.stack([f for f, _ in part]), np.array([t for _, t in part])
                produced += len(part)
        ready.extend(self._resized(native))
        for start in range(0, len(ready), frames_per_chunk):
            part = ready[start : start + frames_per_chunk]
            yield produced, np.stack([f for f, _ in part]), np.array([t for _, t in part])
            produced += len(part)
        if produced == 0:
            raise VideoError(f"{self.path.name}: none of the sampled frames could be decoded (damaged file)")

    def _resized(self, frames: list[tuple[np.ndarray, float]]) -> list[tuple[np.ndarray, float]]:
        if not frames or self.geometry is None:
            return frames
        resized = resize_frames(np.stack([f for f, _ in frames]), self.geometry)
        return list(zip(resized, (t for _, t in frames)))

    def _sampled_frames(self) -> Iterator[tuple[np.ndarray, float]]:
        """Decode sequentially; yield the RGB frame (``[H, W, 3]`` uint8) shown at each target time ``k / fps``.

        The frame shown at ``T`` is the newest decoded frame that starts at or before ``T`` (1 ms of slack, at
        most a quarter of a source frame, absorbs rounded timestamps: Matroska stores milliseconds), so it is
        only known once the next frame arrives. A target is lost only where frames could not be decoded: it falls in a
        gap between decoded frames after the decoder reported damage, or after the last frame of a stream
        that ended early. A gap without damage (variable frame rate) shows the frame before it.
        """
        period = 1.0 / (self.source_fps if self.source_fps > 0 else self.fps)
        slack = min(0.25 * period, 1e-3)
        target, damage = 0, 0
        previous: tuple[av.VideoFrame, float] | None = None

        def due() -> bool:
            return self.planned is None or target < self.planned

        for frame, time_s, errors in self._decoded(period):
            damage += errors
            # Targets before this frame: shown by the previous frame, unless they fall in a damaged gap.
            gap = previous is not None and time_s - previous[1] > 1.5 * period
            while due() and target / self.fps < time_s - slack:
                covered = previous is not None and target / self.fps < previous[1] + period - slack
                if previous is None and not damage:
                    shown = frame  # the stream starts a little after 0: its first frame is what shows
                elif covered or (previous is not None and not (gap and damage)):
                    shown = previous[0]
                else:
                    shown = None
                target += 1
                if shown is None:
                    self.lost_frames += 1
                else:
                    self.decoded_frames += 1
                    yield shown.to_ndarray(format="rgb24"), time_s if shown is frame else previous[1]
            if gap or previous is None:
                damage = 0  # a damaged gap (or start) accounted for
            previous = (frame, time_s)
            if not due():
                return
        # After the last decoded frame: it shows until one source frame later; past that the stream ended early.
        while due() and previous is not None and target / self.fps < previous[1] + 1.5 * period:
            target += 1
            self.decoded_frames += 1
            yield previous[0].to_ndarray(format="rgb24"), previous[1]
        if self.planned is not None and target < self.planned:
            self.lost_frames += self.planned - target  # the stream ended early (truncated file)

    def _decoded(self, period: float) -> Iterator[tuple[av.VideoFrame, float, int]]:
        """Every frame the decoder delivers, with its time (s) and the decode errors reported since the
        previous one (a damaged packet is skipped; its frames never come)."""
        import av  # deferred on purpose (see the imports)

        errors, index = 0, 0
        with self._open() as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            packets = container.demux(stream)
            while True:
                try:
                    packet = next(packets)
                    frames = packet.decode()
                except StopIteration:
                    return
                except av.error.FFmpegError:
                    errors += 1
                    continue
                for frame in frames:
                    time_s = float(frame.time) if frame.time is not None else index * period
                    index += 1
                    yield frame, time_s, errors
                    errors = 0

    def describe(self) -> str:
        frames = self.decoded_frames or self.num_frames
        return _describe(
            self.path.name, frames, self.fps, self.size, self.source_size, self.source_fps, self.lost_frames
        )

    def load(self) -> Video:
        """Decode every sampled frame into memory."""
        parts = list(self.chunks(frames_per_chunk=64))
        return Video(
            frames=np.concatenate([f for _, f, _ in parts]),
            times_s=np.concatenate([t for _, _, t in parts]).astype(np.float64),
            fps=self.fps,
            source=str(self.path),
            source_fps=self.source_fps,
            source_frames=self.source_frames,
            source_size=self.source_size,
            lost_frames=self.lost_frames,
        )


def open_video(
    path: str | Path,
    fps: float = 2.0,
    max_frames: int | None = None,
    model: Any = None,
    geometry: FrameGeometry | None = None,
) -> VideoFile:
    """Open ``path`` for streaming (see :class:`VideoFile`): frames sized as ``model`` (a loaded model: its
    ``geometry``) sizes them, or as an explicit ``geometry`` says (e.g. ``model.geometry.with_pixels(...)``); with
    neither, at the source's size."""
    return VideoFile(path, fps, max_frames, frame_geometry(model, geometry))


def load_video(
    path: str | Path,
    fps: float = 2.0,
    max_frames: int | None = None,
    model: Any = None,
    geometry: FrameGeometry | None = None,
) -> Video:
    """Decode ``path``, sample at ``fps``, size frames for ``model`` (or ``geometry``; see :func:`open_video`), all
    in memory."""
    return open_video(path, fps, max_frames, model, geometry).load()


def frame_geometry(model: Any = None, geometry: FrameGeometry | None = None) -> FrameGeometry | None:
    """The geometry frames are sized with: ``geometry`` if given, else ``model.geometry``, else None (source size)."""
    if geometry is not None and not isinstance(geometry, FrameGeometry):
        raise TypeError(f"geometry must be a FrameGeometry (a model's .geometry), got {type(geometry).__name__}")
    if geometry is not None and model is not None:
        raise ValueError(
            "size frames by the model or by a geometry, not both (model.geometry.with_pixels(...) "
            "gives the model's geometry with a pixel range of your own)"
        )
    if geometry is None and model is not None:
        geometry = getattr(model, "geometry", None)
        if not isinstance(geometry, FrameGeometry):
            raise TypeError(f"model must be a loaded model (load_model(...)), got {type(model).__name__}")
    return geometry


def _first_line(exc: Exception, path: Path | None = None) -> str:
    """The gist of a library's error message; ``path`` is shown by its name only (the folder may be a
    server's upload folder, which says nothing to the user)."""
    text = str(exc).strip().splitlines()
    line = text[-1] if text else type(exc).__name__
    if path is not None:
        line = line.replace(str(path), path.name)
    return line.split("] ")[-1][:160]


def write_video(path: str | Path, frames: np.ndarray, fps: float) -> Path:
    """Encode uint8 frames ``[T, H, W, 3]`` to an H.264 mp4 with PyAV."""
    import av  # deferred on purpose (see the imports)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "23", "preset": "medium"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
