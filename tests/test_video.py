import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvdemo.media.video import (
    Video,
    VideoError,
    load_video,
    open_video,
    resize_frames,
    sample_count,
    write_video,
)
from kvdemo.models.catalog import geometry_for
from kvdemo.world.synthetic import synthetic_video

#: Qwen2-VL / Qwen2.5-VL's video defaults per frame (128 to 768 merged tokens of 28 x 28 pixels), as the random tiny
#: model declares them.
QWEN2_GEOMETRY = geometry_for("tiny-random")


@pytest.mark.parametrize(
    "size, expected",
    [
        ((240, 426), (252, 420)),  # the real clip: rounded to multiples of 28
        ((280, 392), (280, 392)),  # already on the grid and within bounds
        ((224, 336), (280, 392)),  # below min_pixels (128*28*28): scaled up
        ((4320, 7680), (560, 1008)),  # 8K: scaled down under max_pixels (768*28*28)
    ],
)
def test_frames_are_sized_by_the_familys_own_rule(size, expected):
    """Frames for a Qwen2-VL / Qwen2.5-VL model are sized as its video processor sizes them."""
    assert QWEN2_GEOMETRY.frame_size(*size) == expected


def test_impossible_shapes_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="aspect ratio"):
        QWEN2_GEOMETRY.frame_size(10, 5000)
    with pytest.raises(ValueError, match="min_pixels"):
        dataclasses.replace(QWEN2_GEOMETRY, min_pixels=10_000, max_pixels=100).frame_size(100, 100)
    with pytest.raises(VideoError, match="aspect ratio"):
        resize_frames(np.zeros((1, 2, 500, 3), np.uint8), QWEN2_GEOMETRY)


def test_sample_count_follows_duration():
    assert sample_count(10.381, 2.0) == 20  # the real clip: times 0, 0.5, ..., 9.5
    assert sample_count(10.381, 2.0, max_frames=3) == 3
    assert sample_count(0.2, 2.0) == 1  # at least the first frame
    assert sample_count(None, 2.0) is None and sample_count(None, 2.0, max_frames=5) == 5


@pytest.mark.parametrize("fps", [0, -2, float("nan"), float("inf"), "fast", None])
def test_a_sampling_rate_is_checked_by_one_rule_wherever_it_comes_in(fps, tmp_path):
    """Files, in-memory videos, frame streams and the app's settings give the same one-line error for a bad rate."""
    from kvdemo.app.sessions import RunSettings
    from kvdemo.app.settings import settings_lineup
    from kvdemo.errors import StreamSettingError
    from kvdemo.stream.engine import FrameStream

    video = Video(np.zeros((4, 28, 28, 3), np.uint8), np.arange(4) / 2.0, 2.0, "four black frames")
    settings = RunSettings("tiny-random", "uniform", {}, 96, 72, fps, 200704, False, 0.0)
    for call in (
        lambda: open_video(tmp_path / "missing.mp4", fps=fps),
        lambda: video.sampled(fps),
        lambda: FrameStream(None, fps),
        lambda: settings_lineup(settings),
    ):
        with pytest.raises(StreamSettingError) as error:
            call()
        assert str(error.value) == f"sampling fps must be positive, got {fps}"


def test_real_clip_decodes_at_fps(pancake):
    assert pancake.num_frames == 20  # 10.3 s at 2 fps
    assert pancake.size == (252, 420)
    assert pancake.frames.dtype == np.uint8
    np.testing.assert_allclose(pancake.times_s[:3], [0.0, 0.5, 1.0])
    assert pancake.lost_frames == 0
    assert pancake.frames.std() > 10  # real picture content, not a blank decode


def test_damaged_file_decodes_what_it_can(media):
    video = load_video(media / "corrupted.mp4", fps=2.0)
    assert video.num_frames > 0
    assert video.lost_frames > 0
    assert "damaged" in video.describe()


def test_non_video_and_missing_files_raise_one_clear_error(tmp_path):
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 50)
    with pytest.raises(VideoError, match="notes.mp4: not a readable video"):
        load_video(text)
    with pytest.raises(VideoError, match="no such file"):
        load_video(tmp_path / "missing.mp4")
    empty = tmp_path / "empty.mkv"
    empty.write_bytes(b"")
    with pytest.raises(VideoError, match="empty"):
        load_video(empty)


def test_written_video_round_trips_through_decord(tmp_path):
    clip = synthetic_video(10, 112, 168, fps=5.0, seed=2)
    path = write_video(tmp_path / "clip.mp4", clip.frames, fps=5.0)
    decoded = load_video(path, fps=5.0, geometry=QWEN2_GEOMETRY.with_pixels(min_pixels=56 * 56))
    assert decoded.num_frames == 10
    assert decoded.size == (112, 168)
    assert np.abs(decoded.frames.astype(int) - clip.frames.astype(int)).mean() < 12  # lossy codec


def test_odd_tail_is_paired_with_itself():
    from kvdemo.models.qwen2_vl import pixel_values

    frames = np.random.default_rng(0).integers(0, 255, (3, 56, 56, 3), dtype=np.uint8)
    odd, grid = pixel_values(frames)
    padded, _ = pixel_values(frames[[0, 1, 2, 2]])
    assert grid == (2, 4, 4)
    assert torch.equal(odd, padded)


def native_frames(path, indices):
    """Frames by index, decoded independently of kvdemo with decord."""
    import decord

    return decord.VideoReader(str(path)).get_batch(list(indices)).asnumpy()


def test_decoded_frames_equal_decords(media, pancake):
    """The sampled frames are exactly decord's frames at the same indices (then resized)."""
    from kvdemo.media.video import resize_frames

    expected = resize_frames(native_frames(media / "flipping_a_pancake.mkv", range(0, 300, 15)), QWEN2_GEOMETRY)
    np.testing.assert_array_equal(pancake.frames, expected)


def test_pixel_values_match_transformers_video_processor(pancake, media):
    """Our decode + resize + normalise + patchify equals Qwen2VLVideoProcessor on the native frames."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from kvdemo.models.qwen2_vl import pixel_values

    native = native_frames(media / "flipping_a_pancake.mkv", [0, 15, 30, 45])  # the frames our 2 fps sampler picks
    processor = Qwen2VLVideoProcessor()
    expected = processor(
        videos=[torch.from_numpy(native).permute(0, 3, 1, 2)], return_tensors="pt", cap_pixels_per_frame=False
    )
    ours, grid = pixel_values(pancake.frames[:4])
    assert tuple(expected["video_grid_thw"][0].tolist()) == grid
    torch.testing.assert_close(ours, expected["pixel_values_videos"], atol=1e-5, rtol=1e-5)


def test_streamed_decoding_matches_loading_and_counts_damage(media):
    from kvdemo.media.video import open_video

    source = open_video(media / "flipping_a_pancake.mkv", fps=2.0, geometry=QWEN2_GEOMETRY)
    assert source.num_frames == 20 and source.size == (252, 420)
    parts = list(source.chunks(frames_per_chunk=3, batch=4))
    assert [len(f) for _, f, _ in parts] == [3] * 6 + [2]
    whole = load_video(media / "flipping_a_pancake.mkv", fps=2.0, geometry=QWEN2_GEOMETRY)
    np.testing.assert_array_equal(np.concatenate([f for _, f, _ in parts]), whole.frames)
    np.testing.assert_allclose(np.concatenate([t for _, _, t in parts]), whole.times_s)
    damaged = open_video(media / "corrupted.mp4", fps=2.0)
    assert damaged.lost_frames == 0  # not known before decoding
    frames = sum(len(f) for _, f, _ in damaged.chunks(2))
    assert damaged.lost_frames > 0 and frames + damaged.lost_frames == damaged.num_frames
    assert "damaged" in damaged.describe()


@pytest.mark.parametrize("container", ["mkv", "mp4"])
def test_every_sampled_frame_is_delivered_at_any_rate(tmp_path, container):
    """A healthy 30 fps clip whose frames show their own index (in binary, one 8-px block per bit): at every rate each target time
    ``k / fps`` gets the frame shown then (source index ``floor(k * 30 / fps)``) and nothing counts as damaged.
    Matroska stores milliseconds, so a target half-way between two frames (0.25 s at 30 fps, met at 4 and 8 fps)
    sits at the rounding edge, and is delivered all the same."""
    source_fps, count = 30, 93
    bits = (np.arange(count)[:, None] >> np.arange(7)) & 1  # [count, 7]
    frames = np.kron(bits[:, None, :], np.ones((56, 8), dtype=np.int64))[..., None].repeat(3, axis=-1) * 255
    path = write_video(tmp_path / f"index.{container}", frames.astype(np.uint8), fps=source_fps)
    for fps in (1, 2, 3, 4, 5, 6, 7.5, 8, 10, 12, 30):
        video = load_video(path, fps=fps, geometry=QWEN2_GEOMETRY.with_pixels(min_pixels=56 * 56))
        expected = np.floor(np.arange(sample_count(count / source_fps, fps)) * source_fps / fps + 1e-9).astype(int)
        blocks = video.frames[:, :, :, 0].reshape(video.num_frames, 56, 7, 8).mean(axis=(1, 3)) > 127  # [n, 7]
        shown = (blocks * (1 << np.arange(7))).sum(axis=1)
        assert video.lost_frames == 0 and "damaged" not in video.describe(), fps
        np.testing.assert_array_equal(shown, np.minimum(expected, count - 1), err_msg=f"{fps} fps")


def test_the_real_clip_loses_no_frame_at_the_apps_rates(media):
    from kvdemo.media.video import open_video

    for fps in (0.5, 1, 2, 4, 6, 8):
        source = open_video(media / "flipping_a_pancake.mkv", fps=fps)
        delivered = sum(len(f) for _, f, _ in source.chunks(2))
        assert delivered == source.num_frames and source.lost_frames == 0, (fps, source.describe())


@pytest.mark.slow
def test_a_clone_without_the_shared_media_skips_their_tests_with_a_reason(tmp_path):
    """Outside CI a newcomer's clone has no ../shared/media: the tests that need it are skipped, saying where
    the media are expected, instead of erroring."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"KVDEMO_MEDIA": str(tmp_path / "absent")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/test_video.py::test_real_clip_decodes_at_fps",
            "tests/test_video.py::test_sample_count_follows_duration",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    assert "1 passed, 1 skipped" in done.stdout
    assert f"the real test media are not at {tmp_path / 'absent'} (../shared/media beside the checkout" in done.stdout


@pytest.mark.slow
def test_pyav_is_imported_only_where_a_file_is_opened():
    """The CLI, the doctor, the app and the bundled sample run without importing PyAV (a GPU host that only
    streams the sample or a random checkpoint needs no FFmpeg); writing or opening a file imports it."""
    code = (
        "import sys, tempfile, numpy as np, kvdemo.cli, kvdemo.bench.doctor, kvdemo.app, kvdemo.world.synthetic as s\n"
        "s.sample_episode()\n"
        "assert 'av' not in sys.modules, 'imported before any file'\n"
        "from kvdemo.media.video import write_video\n"
        "write_video(tempfile.mkdtemp() + '/clip.mp4', np.zeros((2, 32, 32, 3), np.uint8), 2.0)\n"
        "print('ok' if 'av' in sys.modules else 'not imported')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
