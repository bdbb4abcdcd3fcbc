"""The app in a real headless Chromium (Debian's, driven by Playwright): the sample run, a question to
both engines, screenshots inspected for the chart and the heatmaps, and the webcam with a fake camera."""

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]
FAKE_CAMERA = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError("CI must install Debian's chromium (see .ci/run)")
    pytest.skip("Debian's chromium is not installed (apt-get install chromium)", allow_module_level=True)


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS + FAKE_CAMERA)
        yield browser
        browser.close()


@pytest.fixture
def artifacts(tmp_path):
    folder = Path(os.environ.get("KVDEMO_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def element_pixels(page, selector) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(page.locator(selector).screenshot())).convert("RGB")).astype(int)


def test_sample_run_and_question_in_chromium(browser, app_url, artifacts):
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.goto(app_url)
    page.wait_for_selector("#sample-button", timeout=60_000)
    assert "trained on synthetic streams" in page.content()
    page.click("#sample-button")
    page.wait_for_function("document.querySelector('#status').innerText.includes('80/80 frames')", timeout=240_000)
    page.wait_for_selector("#occupancy .js-plotly-plot", timeout=30_000)
    page.wait_for_function("document.querySelector('#heatmap img') && document.querySelector('#heatmap img').naturalWidth > 0")
    example = page.locator("#examples button").first
    asked = example.inner_text().strip()
    example.click()  # one click asks both engines
    for chat in ("#policy-chat", "#full-chat"):
        page.wait_for_function(f"document.querySelector('{chat}').innerText.includes('first token')", timeout=120_000)
    assert "ground truth" in page.locator("#full-chat").inner_text(), "answers on the sample are graded"
    assert "matches the ground truth" in page.locator("#full-chat").inner_text(), "the full cache answers the sample right"
    page.screenshot(path=str(artifacts / "app.png"), full_page=True)

    chart = element_pixels(page, "#occupancy")
    red = ((chart[..., 0] > 180) & (chart[..., 1] < 90) & (chart[..., 2] < 90)).sum()
    blue = ((chart[..., 2] > 150) & (chart[..., 0] < 80)).sum()
    assert red > 200 and blue > 200, "the chart draws the policy (red) and the full cache (blue)"
    heatmap = element_pixels(page, "#heatmap img")
    assert heatmap.shape[0] > 50 and heatmap.std() > 20, "the heatmap shows frames, not a blank image"
    assert (Path(artifacts) / "app.png").stat().st_size > 50_000
    for chat in ("#policy-chat", "#full-chat"):
        assert asked in page.locator(chat).inner_text()
    assert page.input_value("#question textarea") == asked


def test_webcam_with_a_fake_camera(browser, app_url, artifacts):
    context = browser.new_context(viewport={"width": 1400, "height": 1400}, permissions=["camera"])
    page = context.new_page()
    page.goto(app_url)
    page.wait_for_selector("#sample-button", timeout=60_000)
    page.get_by_role("tab", name="Webcam").click()
    page.get_by_text("Click to Access Webcam").click()
    page.locator("#webcam button", has_text="Record").click()
    page.wait_for_function("document.querySelector('#status').innerText.includes('webcam (live)')", timeout=90_000)
    frames_fed = "(() => { const m = document.querySelector('#status').innerText.match(/(\\d+) frames/); return m ? +m[1] : 0; })()"
    page.wait_for_function(f"{frames_fed} >= 6", timeout=90_000)
    page.screenshot(path=str(artifacts / "webcam.png"), full_page=True)
    frames = page.evaluate(frames_fed)
    assert frames >= 6 and frames % 2 == 0, "frames are fed in pairs (one temporal grid per model call)"
    heatmap = element_pixels(page, "#heatmap img")
    assert heatmap.std() > 10
    context.close()
