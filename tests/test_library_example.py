"""The README's library example, run verbatim for the offline model of every family: only the model name and the
video path change (a two-second clip written by kvdemo's own writer), so a family whose frames the example sizes
wrongly fails here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvdemo.media.video import write_video
from kvdemo.models.catalog import OFFLINE_MODELS

README = Path(__file__).resolve().parents[1] / "README.md"


def library_example() -> str:
    """The first ```python block after the README's ``## Library`` heading."""
    text = README.read_text()
    section = text[text.index("\n## Library\n") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_example_names_the_model_and_the_clip_once():
    code = library_example()
    assert len(re.findall(r'load_model\("tiny"\)', code)) == 1
    assert code.count('"clip.mp4"') == 1


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """Two seconds at 2 fps (4 frames) of a square moving over a gradient, 96 x 160, written by kvdemo."""
    frames = np.zeros((4, 96, 160, 3), np.uint8)
    frames[..., 0] = np.linspace(0, 255, 160, dtype=np.uint8)
    for i in range(4):
        frames[i, 30:60, 20 + 30 * i : 50 + 30 * i] = (250, 200, 20)
    return write_video(tmp_path_factory.mktemp("clip") / "clip.mp4", frames, fps=2)


@pytest.mark.parametrize("name", sorted(OFFLINE_MODELS))
def test_the_readme_library_example_runs_for_every_family(name, clip, monkeypatch, capsys, tmp_path):
    code = (
        library_example().replace('load_model("tiny")', f"load_model({name!r})").replace('"clip.mp4"', repr(str(clip)))
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, f"README.md ## Library ({name})", "exec"), namespace)
    model, video, engines = namespace["model"], namespace["video"], namespace["engines"]
    assert model.name == name
    # Frames sized the way this model's family sizes them, every frame fed to both engines.
    assert video.size == model.geometry.frame_size(96, 160)
    assert video.num_frames == 4
    assert all(engine.frames_fed == 4 for engine in engines.values())
    assert engines["full"].memory.visual_tokens > 0
    assert namespace["report"]["policy"] == "infinipot-v"
    assert namespace["answer"].attribution is not None
    printed = capsys.readouterr().out
    held = r"^(\d+) frames, visual tokens held: \{'infinipot-v': \d+, 'full': \d+\}$"
    assert re.findall(held, printed, re.M) == ["2", "4"]  # a line a chunk
    assert re.search(r"^answer: .*\n(?=attention shares: )", printed, re.M), "the streamed answer ends its own line"


@pytest.mark.slow
def test_the_readme_library_example_compresses_the_real_clip_and_labels_every_result(
    media, monkeypatch, capsys, tmp_path
):
    """On the real clip (20 frames at 2 fps, 15 tokens a chunk on the trained tiny model) the example's budget, four
    chunks, is exceeded: InfiniPot-V compresses, so what it changed against the full cache is not zero; every result
    is on its own labelled line, and the offline model's answer about a real video comes with its note."""
    code = library_example().replace('"clip.mp4"', repr(str(media / "flipping_a_pancake.mkv")))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md ## Library (real clip)", "exec"), namespace)
    policy, full = namespace["policy"], namespace["engines"]["full"]
    assert (policy.budget.M, policy.budget.C) == (60, 45) and full.memory.held_tokens == 150
    assert policy.stats.compressions > 0 and policy.memory.held_tokens <= 60
    lines = capsys.readouterr().out.splitlines()[10:]  # after the ten chunks' lines
    labels = ["compressions: ", "note: ", "answer: ", "attention shares: ", "attention per frame pair (by its time): "]
    labels += [
        "attention-output error per layer, against the full cache: ",
        "first-token KL divergence from the full cache: ",
    ]
    assert [next(label for label in labels if line.startswith(label)) for line in lines] == labels
    assert lines[1].endswith("Its answers about this video mean little.")
    assert len(namespace["answer"].attribution.frame_mass()) == 10 and lines[4].count(" s': ") == 10  # frame pairs
    errors = namespace["measured"]["layer_error"]
    assert len(errors) == 4 and min(errors) > 0 and namespace["measured"]["first_token_kl"] > 0


def test_the_docs_library_page_example_runs(clip, monkeypatch, capsys, tmp_path):
    """docs/library.md's example (the README's, on a Qwen3-VL model) runs as written but for the clip's path."""
    text = (README.parent / "docs" / "library.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert code.count('"clip.mp4"') == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code.replace('"clip.mp4"', repr(str(clip))), "docs/library.md", "exec"), namespace)
    assert namespace["model"].family == "qwen3_vl" and namespace["engines"]["full"].frames_fed == 4


def live_example() -> str:
    """The README's second ```python block after ``## Library``: a live session."""
    text = README.read_text()
    section = text[text.index("\n## Library\n") :].split("\n## ", 2)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-random-llava-ov"])  # two frames a grid, and one
def test_the_readme_live_example_runs_after_the_first(name, clip, monkeypatch, capsys, tmp_path):
    """The live block runs on what the first block made (the model and the video): the question is asked after the
    first chunk, the second chunk enters while it is answered, and the lag and the drops are printed."""
    first = (
        library_example().replace('load_model("tiny")', f"load_model({name!r})").replace('"clip.mp4"', repr(str(clip)))
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(first, "README.md ## Library", "exec"), namespace)
    capsys.readouterr()
    exec(compile(live_example(), "README.md ## Library (live)", "exec"), namespace)
    live, answer = namespace["live"], namespace["answer"]
    engine = live.engines["infinipot-v"]
    assert engine.frames_fed == 4 and live.dropped == 0 and live.in_flight == []
    assert answer.done and answer.answers["infinipot-v"].visual_tokens < engine.memory.visual_tokens
    printed = capsys.readouterr().out
    assert printed.startswith(answer.texts["infinipot-v"]) and re.search(
        r"\d\.\d\d s behind live, 0 frames dropped", printed
    )
