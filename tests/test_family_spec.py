"""A family is one file declaring one spec: the catalog finds every family file's spec, everything reads the spec
(a throwaway family registered here goes through the catalog, loading, the app's banner, streaming and asking
without any other file knowing it), and each spec's declared normalisation is what its processor uses."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvdemo.media.video import load_video, write_video
from kvdemo.models import catalog, qwen2_vl
from kvdemo.models.base import ModelError
from kvdemo.models.loading import load_model
from kvdemo.models.qwen2_vl import build_tiny_model
from kvdemo.models.spec import FamilySpec, OfflineModel
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import stream_video

MODELS = Path(catalog.__file__).parent


def declared_specs() -> set[str]:
    """The modules of kvdemo/models whose source assigns ``SPEC = FamilySpec(...)`` (read, not imported)."""
    out = set()
    for path in MODELS.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and any(getattr(t, "id", "") == "SPEC" for t in node.targets)
                and getattr(getattr(node.value, "func", None), "id", "") == "FamilySpec"
            ):
                out.add(path.stem)
    return out


def test_every_family_file_is_found_by_the_catalog():
    found = {spec.load.__module__.rsplit(".", 1)[-1] for spec in catalog.families().values()}
    assert found == declared_specs() and len(found) >= 4
    for model_type, spec in catalog.families().items():
        assert model_type in spec.model_types
        for offline in spec.offline:
            assert offline.family in spec.model_types and catalog.offline_model(offline.name) is offline


@pytest.mark.parametrize("name", sorted(catalog.OFFLINE_MODELS))
def test_a_specs_normalisation_and_geometry_are_what_its_model_uses(name):
    offline = catalog.OFFLINE_MODELS[name]
    spec = catalog.family_spec(offline.family)
    model = load_model(name)
    assert model.family == offline.family and model.geometry == offline.geometry
    assert tuple(model.processor.image_mean) == spec.pixel_mean and tuple(model.processor.image_std) == spec.pixel_std
    assert spec.geometry(model.hf.config).factor == model.geometry.factor


def test_an_unknown_family_and_a_clash_are_one_line_errors(monkeypatch):
    monkeypatch.setattr(catalog, "_FAMILIES", catalog.families())
    with pytest.raises(ModelError, match="not supported; kvdemo supports the families .*qwen3_vl"):
        catalog.family_spec("no_such_vl")
    with pytest.raises(ModelError, match="clashes"):
        catalog.register_family(dataclasses.replace(qwen2_vl.SPEC, name="copy"))


# --- a throwaway family: one spec, nothing else touched ---------------------------------------------------------


def throwaway_resize(geometry, height: int, width: int) -> tuple[int, int]:
    """The throwaway family's own rule: every frame 56 x 84 (two by three tokens of 28 pixels)."""
    return 56, 84


THROWAWAY_GEOMETRY = dataclasses.replace(qwen2_vl.RANDOM_GEOMETRY, resize=throwaway_resize, min_pixels=56 * 84)


def build_throwaway():
    """A copy of the tiny-random Qwen2.5-VL adapter under the throwaway family's names."""
    model = build_tiny_model()
    model.name, model.family, model.geometry = "tiny-random-throwaway", "throwaway_vl", THROWAWAY_GEOMETRY
    return model


THROWAWAY = FamilySpec(
    name="Throwaway-VL",
    model_types=("throwaway_vl",),
    geometry=lambda config: THROWAWAY_GEOMETRY,
    pixel_mean=qwen2_vl.CLIP_MEAN,
    pixel_std=qwen2_vl.CLIP_STD,
    load=lambda model_id, config, device: build_throwaway(),
    budget=(5000, 4000),
    caveat="Throwaway-VL: exists for one test.",
    verified="one test, CPU",
    checkpoints=("someone/throwaway-vl",),
    offline=(
        OfflineModel("tiny-random-throwaway", "throwaway_vl", THROWAWAY_GEOMETRY, "noise", build_throwaway, (24, 12)),
    ),
)


@pytest.fixture
def throwaway(monkeypatch):
    """The registry with the throwaway family added (restored afterwards)."""
    monkeypatch.setattr(catalog, "_FAMILIES", catalog.families())
    return catalog.register_family(THROWAWAY)


def test_a_family_registered_from_one_spec_goes_through_catalog_load_stream_and_ask(throwaway, tmp_path):
    from kvdemo.app.single_updates import banner_html

    name = "tiny-random-throwaway"
    assert name in catalog.OFFLINE_MODELS and "someone/throwaway-vl" in catalog.REAL_MODELS
    assert catalog.family_of(name) == "throwaway_vl" and catalog.geometry_for(name) is THROWAWAY_GEOMETRY
    assert catalog.default_budget(name) == (24, 12, THROWAWAY_GEOMETRY.max_pixels)
    assert catalog.caveat_for("throwaway_vl") == "Throwaway-VL: exists for one test."
    banner = banner_html(name)
    assert (
        "noise" in banner and "Throwaway-VL" in banner and "one test, CPU" in banner and "exists for one test" in banner
    )

    model = load_model(name)
    assert model.family == "throwaway_vl" and model.geometry is THROWAWAY_GEOMETRY
    frames = np.random.default_rng(0).integers(0, 255, (4, 90, 120, 3), dtype=np.uint8)
    clip = write_video(tmp_path / "clip.mp4", frames, fps=2)
    video = load_video(clip, fps=2, model=model)
    assert video.size == (56, 84)  # the throwaway family's own rule sized the frames
    engines = {
        "uniform": StreamEngine(model, "uniform", budget=24, keep=12, fps=video.fps, max_new_tokens=4),
        "full": StreamEngine(model, "full", fps=video.fps, max_new_tokens=4),
    }
    steps = list(stream_video(model, video, engines))
    assert [step.frames_done for step in steps] == [2, 4]
    assert engines["full"].memory.visual_tokens == 2 * 6  # two grids of 2 x 3 tokens
    answer = engines["uniform"].answer("What happened?")
    assert 1 <= answer.tokens <= 4 and engines["uniform"].memory.visual_tokens <= 24


def test_a_video_opened_for_no_model_keeps_its_size_and_streams_into_any_family(tmp_path):
    """``load_video(path, fps)`` sizes for nothing in particular (the source's size); ``stream_video`` sizes its
    frames for each family's model, so Qwen3-VL's 32-pixel grid and LLaVA-OneVision's 384 x 384 both take it."""
    frames = np.random.default_rng(1).integers(0, 255, (2, 90, 150, 3), dtype=np.uint8)
    video = load_video(write_video(tmp_path / "clip.mp4", frames, fps=2), fps=2)
    assert video.size == (90, 150)
    for name in ("tiny-random-qwen3-vl", "tiny-random-llava-ov"):
        model = load_model(name)
        engine = StreamEngine(model, "full", fps=video.fps)
        steps = list(stream_video(model, video, {"full": engine}))
        size = model.geometry.frame_size(90, 150)
        assert size != (90, 150) and engine.frames_fed == 2
        assert {(step.chunk.rows, step.chunk.cols) for step in steps} == {model.geometry.grid(size)}


def test_the_evaluation_streams_its_generated_frames_into_a_32_pixel_family():
    """Generated streams (112 x 112) are sized for the model on the way in, so Qwen3-VL's grid takes them."""
    from kvdemo.experiments.evaluation import episode_answers, valid_items
    from kvdemo.world.synthetic import sample_episode

    model = load_model("tiny-random-qwen3-vl")
    episode = sample_episode("static")
    items = valid_items(episode, 0, (0,))[:1]
    first = next(episode_answers(model, episode, items, ["full"], None, None))
    assert first[:3] == (0, 0, "full")
