"""Shared fixtures: the offline tiny model (built once) and the real media in ../shared/media."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

#: Real media nobody here made (see docs/testing.md): ``../shared/media`` beside the checkout, or
#: ``KVDEMO_MEDIA``.
MEDIA = Path(os.environ.get("KVDEMO_MEDIA") or Path(__file__).resolve().parents[2] / "shared" / "media")
PANCAKE = MEDIA / "flipping_a_pancake.mkv"
CORRUPTED = MEDIA / "corrupted.mp4"


@pytest.fixture(scope="session")
def media() -> Path:
    """The real media folder; the tests that need it are skipped with a one-line reason outside CI when it is
    absent (in CI it must be there)."""
    if not PANCAKE.exists():
        reason = f"the real test media are not at {MEDIA} (../shared/media beside the checkout; see docs/testing.md)"
        if os.environ.get("CI"):
            raise RuntimeError(reason)
        pytest.skip(reason)
    return MEDIA


@pytest.fixture(scope="session")
def tiny_random():
    from kvdemo.models.qwen2_vl import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def pancake(media, tiny_random):
    """The real clip at 2 fps, frames sized for the random tiny model (Qwen's video defaults: 252 x 420)."""
    from kvdemo.media.video import load_video

    return load_video(media / "flipping_a_pancake.mkv", fps=2.0, model=tiny_random)


@pytest.fixture
def small_video():
    from kvdemo.world.synthetic import synthetic_video

    return synthetic_video(num_frames=12, height=112, width=168, fps=2.0, seed=3)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


#: Sessions whose engines the test app keeps (``KVDEMO_MAX_SESSIONS``): small, so that a test can see the
#: least recently used session freed.
APP_MAX_SESSIONS = 3


@dataclass
class LaunchedApp:
    url: str
    log: Path  # everything the process printed
    cache: Path  # Gradio's cache folder (GRADIO_TEMP_DIR): uploads and every file the app served


def launch_app(folder: Path, **env_extra: str):
    """The real app (``python app.py``) on a free local port with the tiny model; yields a :class:`LaunchedApp`
    and stops it afterwards."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log, cache = folder / "app.log", folder / "gradio-cache"
    root = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        GRADIO_ANALYTICS_ENABLED="False",
        HF_HUB_OFFLINE="1",
        GRADIO_TEMP_DIR=str(cache),
        KVDEMO_MAX_SESSIONS=str(APP_MAX_SESSIONS),
        **env_extra,
    )
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(port), "--model", "tiny"],
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the app did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
    yield LaunchedApp(url, log, cache)
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="session")
def app(tmp_path_factory) -> LaunchedApp:
    yield from launch_app(tmp_path_factory.mktemp("app"))


@pytest.fixture(scope="session")
def emulated_app(tmp_path_factory) -> LaunchedApp:
    """The app with every GPU call in a forked child with pickled arguments and results, as on ZeroGPU."""
    yield from launch_app(tmp_path_factory.mktemp("emulated-app"), KVDEMO_ZEROGPU_EMULATE="1")


@pytest.fixture(scope="session")
def app_url(app) -> str:
    return app.url


@pytest.fixture(scope="session")
def emulated_app_url(emulated_app) -> str:
    return emulated_app.url


#: Fixtures that start the real app in a process of its own: every test that uses one (directly or through another
#: fixture) is in the slow tier.
LAUNCHING_FIXTURES = {"app", "emulated_app"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``slow`` on every test that launches the app (:data:`LAUNCHING_FIXTURES`): the day-to-day tier
    (``-m "not slow"``, docs/testing.md) starts no server."""
    for item in items:
        if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
