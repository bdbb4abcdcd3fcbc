"""Pruning before the LLM in the app, its handlers called as the app calls them: the single page's pruning in front
of its policy, the comparison page's pruning per column, and the views that show it (a colour and legend entry of its
own in the survivor strips and the gallery, offered against entered in the occupancy chart, the report's section)."""

import json

import numpy as np
import pytest

from kvdemo import viz
from kvdemo.app import handlers
from kvdemo.app.comparing import CompareUpdates
from kvdemo.app.layout import build_demo
from kvdemo.app.sessions import AppServices, CompareSettings, RunSettings
from kvdemo.app.single_updates import DisplayChoice, SingleUpdates

pytestmark = pytest.mark.slow  # streams through the app's handlers and builds its Blocks (minutes on a busy CPU)


@pytest.fixture(scope="module")
def services():
    return AppServices.create("tiny")


def single(**overrides) -> RunSettings:
    base = dict(
        model="tiny",
        policy="infinipot-v",
        params={},
        budget=64,
        keep=48,
        fps=2.0,
        max_pixels=112 * 112,
        baseline=True,
        cap_mb=2048,
        prune="evs:0.5",
    )
    return RunSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def pruned_run(services):
    updates = list(handlers.run_stream(services, None, None, single(), SingleUpdates(DisplayChoice("0", "0", True))))
    return updates, updates[-1]["session"]


def test_the_single_page_prunes_in_front_of_its_policy_and_shows_it(pruned_run):
    updates, session = pruned_run
    engine = session.engine
    assert list(session.engines) == ["evs:0.5+infinipot-v", "full"] and session.full.pruning is None
    report = engine.report()["pruning"]
    assert 0 < report["entered"] < report["offered"] == session.full.memory.tokens_seen
    assert max(e.visual_tokens for e in engine.memory.timeline) <= 64
    final = updates[-1]
    names = [trace.name for trace in final["plot"].data]
    assert any(name.endswith("offered so far (pruning before the LLM)") for name in names)
    assert any(name.endswith("entered so far (pruning before the LLM)") for name in names)
    offered = next(t for t in final["plot"].data if "offered so far" in t.name)
    assert offered.y[-1] == report["offered"]
    assert viz.PRUNED_NAME in final["legend"]
    saved = json.loads(open(final["report"]).read())
    assert saved["pruning"]["entered"] == report["entered"] and "pruning" not in saved["baseline"]


def test_pruned_patches_are_drawn_in_their_own_colour(pruned_run):
    """A grid's pruned patches are painted (striped, in the pruned colour), its kept ones are not, in the strip and
    the gallery, and the caption says how much was pruned."""
    _, session = pruned_run
    engine = session.engine
    pruned = viz.pruned_patches(engine)
    assert pruned.shape[0] == engine.memory.num_grids and pruned.any() and not pruned.all()
    grid = int(np.flatnonzero(pruned.reshape(len(pruned), -1).any(axis=1))[-1])
    thumbnail = session.thumbnails[grid]
    plain = viz.overlay_fraction(thumbnail, np.zeros(pruned.shape[1:]))
    marked = viz.mark_pruned(plain, pruned[grid])
    rows, cols = pruned.shape[1:]
    height, width = thumbnail.shape[:2]
    for r in range(rows):
        for c in range(cols):
            cell = (
                slice(r * height // rows + 2, (r + 1) * height // rows - 1),
                slice(c * width // cols + 2, (c + 1) * width // cols - 1),
            )
            changed = not np.array_equal(marked[cell], plain[cell])
            assert changed == bool(pruned[grid, r, c]), (r, c)
            if pruned[grid, r, c]:  # pink: red and blue over green
                pixel = marked[cell].reshape(-1, 3).astype(int).mean(axis=0)
                assert pixel[0] > pixel[1] and pixel[2] > pixel[1]
    gallery = viz.engine_gallery(engine, session.thumbnails)
    assert "% pruned" in gallery[grid][1]
    strip = viz.engine_strip(engine, session.thumbnails, 0, 0, by_reason=True)
    assert strip.shape[0] > 0
    assert viz.PRUNED_NAME in viz.legend_text({0: "kept"}, pruned=True)


def test_the_comparison_prunes_per_column(services):
    settings = CompareSettings(
        model="tiny",
        policies=["infinipot-v", "cords"],
        overrides="",
        budget=64,
        keep=48,
        fps=2.0,
        max_pixels=112 * 112,
        cap_mb=2048,
        prunes=["none", "vidcom2:0.5", "evs:0.75", ""],
    )
    updates = list(handlers.run_stream(services, None, None, settings, CompareUpdates()))
    session = updates[-1]["session"]
    assert list(session.engines) == ["infinipot-v", "vidcom2:0.5+cords", "full"]
    assert session.engines["vidcom2:0.5+cords"].pruning.spec.text == "vidcom2:0.5"
    final = {k: v for update in updates for k, v in update.items()}
    assert viz.PRUNED_NAME in final["strips_legend"]
    assert any("vidcom2:0.5+cords: entered so far" in trace.name for trace in final["plot"].data)
    assert "vidcom2:0.5+cords" in final["title:1"]
    bad = CompareSettings(**{**settings.__dict__, "prunes": ["evs:3"]})
    (message,) = [u for u in handlers.run_stream(services, None, None, bad, CompareUpdates())]
    assert "between 0 and 1" in message["status"]


def test_both_tabs_have_pruning_choices_wired_to_their_runs(services):
    demo = build_demo(services)
    ids = {getattr(block, "elem_id", None) for block in demo.blocks.values()}
    assert {"prune", "compare-prune-0", "compare-prune-3"} <= ids
    inputs = {
        fn.api_name: {getattr(block, "elem_id", None) for block in fn.inputs}
        for fn in demo.fns.values()
        if fn.api_name in ("run_sample", "compare_sample")
    }
    assert "prune" in inputs["run_sample"] and "compare-prune-2" in inputs["compare_sample"]
