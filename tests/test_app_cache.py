"""Files the app serves are deleted once they are older than the cache's age (an hour by default): uploads, every
heatmap JPEG, reports and charts, including those of components updated with gr.update, which Gradio's own
delete_cache never registers. The sweeper's clock and sleep are injected, so nothing here waits real seconds."""

import logging
import os
import re
import urllib.request

import pytest
from gradio_client import Client, handle_file

from conftest import launch_app
from kvdemo.app.sessions import CacheSweeper

AGE_S = 3600.0


class FakeTime:
    """A clock that moves only when slept on."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_sweeper_deletes_what_is_older_than_its_age_each_round(tmp_path, caplog):
    old, new = tmp_path / "a" / "old.jpeg", tmp_path / "b" / "new.html"
    for path in (old, new):
        path.parent.mkdir()
        path.write_text("x")
    os.utime(old, (1_000.0, 1_000.0))
    os.utime(new, (1_000.0 + 0.25 * AGE_S, 1_000.0 + 0.25 * AGE_S))
    clock = FakeTime(1_000.0 + AGE_S - 1)
    sweeper = CacheSweeper(tmp_path, AGE_S, clock=clock, sleep=clock.sleep)
    assert sweeper.every_s == 600.0  # AGE_S / 6, at most 10 minutes
    with caplog.at_level(logging.INFO, logger="kvdemo"):
        sweeper.run(rounds=1)  # now 1000 + AGE_S + 599: old is past the age, new (1000 + 900) 301 s short of it
        assert not old.exists() and not old.parent.exists() and new.exists()
        sweeper.run(rounds=1)  # 600 s later: new is past it too
        assert not new.exists() and list(tmp_path.iterdir()) == []
    assert [r.getMessage().split(" from ")[0] for r in caplog.records] == [
        f"deleted 1 served file(s) older than {AGE_S:g} s"
    ] * 2


@pytest.mark.slow
def test_every_file_the_app_serves_is_swept_and_the_app_keeps_serving(tmp_path_factory, media):
    """The real app's served files (its cache folder), aged by the sweeper's clock rather than by waiting."""
    folder = tmp_path_factory.mktemp("short-cache-app")
    for app in launch_app(folder):
        client = Client(app.url, download_files=False, verbose=False)
        client.predict(handle_file(str(media / "flipping_a_pancake.mkv")), "tiny", "protokv", 96, api_name="/run")
        client.predict("What is cooking?", api_name="/ask")
        chart = client.predict(api_name="/export_chart")
        served = [p for p in app.cache.rglob("*") if p.is_file()]
        kinds = {p.suffix for p in served}
        assert {".jpeg", ".json", ".html", ".mkv"} <= kinds, (
            kinds
        )  # heatmaps and panels, reports, the chart, the upload
        # The exported chart references the app's one plotly.js, which lies outside the swept cache folder.
        with urllib.request.urlopen(chart["url"], timeout=30) as response:
            page = response.read().decode()
        script = re.search(r'<script charset="utf-8" src="([^"]+plotly[^"]+\.js)"', page).group(1)
        assert not script.startswith(str(app.cache)) and str(app.cache) not in script
        clock = FakeTime(max(p.stat().st_mtime for p in served) + 3600 + 1)
        assert CacheSweeper(app.cache, 3600, clock=clock).sweep() >= len(served)
        left = [p for p in served if p.exists()]
        assert left == [], f"{len(left)} of {len(served)} served files are still there: {left[:5]}"
        with urllib.request.urlopen(script, timeout=30) as response:
            assert len(response.read()) > 1_000_000, "plotly.js is still served"
        final = client.predict(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run")
        assert "20/20 frames" in final[0], "the app keeps serving"
