"""The README's set-up section is what the project runs: two commands, the test one is what CI runs, and a
CPU-only install (no CUDA build of torch) is spelt out before the command that would download the CUDA build."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Set up and run", 1)[1].split("\n## ", 1)[0]


def test_two_setup_commands_install_and_run_the_app_then_the_tests():
    blocks = re.findall(r"```bash\n(.*?)```", setup_section(), flags=re.DOTALL)
    assert len(blocks) == 2, blocks
    app, tests = (block.strip() for block in blocks)
    assert app == "pip install -r requirements.txt && python app.py"
    assert tests == 'pip install -e ".[dev]" && python -m pytest -q'
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    # The dev dependencies, installed from the package's extra or from the file that extra reads.
    install = next(
        i for i, line in enumerate(ci) if "pip install" in line and (".[dev" in line or "requirements-dev.txt" in line)
    )
    assert ci.index("python -m pytest -q") > install, ".ci/run runs the README's test command"


def test_a_cpu_only_install_is_explained_with_pytorchs_cpu_index_before_the_install():
    section = setup_section()
    text = " ".join(section.split())
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "without an NVIDIA GPU" in text
    first_install = section.index("```bash")
    assert section.index("PIP_EXTRA_INDEX_URL") < first_install, "advice first, then the command that downloads CUDA"


def test_the_stated_test_time_is_in_minutes_on_two_cores():
    assert re.search(r"about \d+ minutes on 2 cores", " ".join(setup_section().split()))


def test_retraining_is_described_with_its_time_and_where_it_writes():
    """A newcomer reads how long ``train-tiny`` runs and that it leaves the bundled weights alone before running it."""
    readme = (ROOT / "README.md").read_text()
    sentence = next(s for s in " ".join(readme.split()).split(". ") if "kvdemo train-tiny" in s)
    assert re.search(r"about \d+ minutes on 2 cores", sentence), sentence
    assert "never over the bundled weights" in sentence, sentence
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL)
    assert len(blocks) >= 3, "the set-up commands and the quick start"
    assert not any("train-tiny" in block for block in blocks), "no quick-start line starts a training"
