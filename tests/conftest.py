"""Shared fixtures: the offline tiny model (built once) and the real media in ../shared/media."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

MEDIA = Path(__file__).resolve().parents[2] / "shared" / "media"
PANCAKE = MEDIA / "flipping_a_pancake.mkv"
CORRUPTED = MEDIA / "corrupted.mp4"


@pytest.fixture(scope="session")
def media() -> Path:
    assert PANCAKE.exists(), f"the real test clip is expected at {PANCAKE} (../shared beside the checkout)"
    return MEDIA


@pytest.fixture(scope="session")
def tiny():
    from kvdemo.models.tiny import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def pancake(media):
    from kvdemo.video import load_video

    return load_video(media / "flipping_a_pancake.mkv", fps=2.0)


@pytest.fixture
def small_video():
    from kvdemo.video import synthetic_video

    return synthetic_video(num_frames=12, height=112, width=168, fps=2.0, seed=3)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)
