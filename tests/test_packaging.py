"""What the wheel is built from holds together: the requirement files setuptools reads are plain lines, every folder
of kvdemo with code is a package (``packages.find`` with ``namespaces = false`` skips one without ``__init__.py``),
the tiny model's files are package data where the loader reads them, and the entry points name real objects.
.ci/wheel-check builds and installs the wheel itself."""

import importlib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dependencies_and_extras_come_from_requirement_files_of_plain_lines():
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]
    files = {"": dynamic["dependencies"]["file"]}
    files.update({extra: spec["file"] for extra, spec in dynamic["optional-dependencies"].items()})
    assert files == {"": ["requirements.txt"], "dev": ["requirements-dev.txt"], "eval": ["requirements-eval.txt"]}
    for names in files.values():
        for line in (ROOT / names[0]).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                # setuptools drops whole-line comments only: an option (-r) or an inline comment breaks the build
                assert "#" not in line and not line.startswith("-"), f"{names[0]}: {line!r}"
                Requirement(line)


def test_the_torch_floor_is_one_the_pinned_transformers_runs_on():
    """A user whose environment already has an older torch keeps it (pip is satisfied by the floor): the floor must be
    one the transformers kvdemo pins accepts, or transformers turns PyTorch off and nothing loads. The minimum is
    read from the installed transformers' own metadata (its ``torch`` extra)."""
    from importlib.metadata import requires

    from packaging.version import Version

    ours = {
        Requirement(line).name: Requirement(line)
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    theirs = [
        Requirement(r) for r in requires("transformers") or [] if r.startswith("torch>=") or r.startswith("torch >=")
    ]
    assert theirs, "transformers' metadata names no torch minimum"
    needed = max(Version(spec.version) for r in theirs for spec in r.specifier if spec.operator == ">=")
    floor = min(Version(spec.version) for spec in ours["torch"].specifier if spec.operator == ">=")
    assert floor >= needed, f"requirements.txt allows torch {floor}, transformers needs {needed}"


def test_every_folder_of_kvdemo_with_code_is_a_package():
    folders = {path.parent for path in (ROOT / "kvdemo").rglob("*.py")}
    assert ROOT / "kvdemo" / "policies" / "protokv" in folders
    assert [f for f in folders if not (f / "__init__.py").exists()] == []


def test_the_tiny_model_is_package_data_where_the_loader_reads_it():
    from kvdemo.models.tiny import TRAINED_DIR

    assert TRAINED_DIR == ROOT / "kvdemo" / "assets" / "tiny"
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in TRAINED_DIR.iterdir()}
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["kvdemo"]
    assert all(any(p.relative_to(ROOT / "kvdemo").match(g) for g in patterns) for p in TRAINED_DIR.iterdir())


def test_the_console_command_and_the_lmms_eval_entry_point():
    assert PYPROJECT["project"]["scripts"] == {"kvdemo": "kvdemo.cli:main"}
    module, name = PYPROJECT["project"]["scripts"]["kvdemo"].split(":")
    assert callable(getattr(importlib.import_module(module), name))
    # the integration module is optional (lmms-eval extra), so only its name is checked here
    assert PYPROJECT["project"]["entry-points"]["lmms_eval.models"] == {
        "kvdemo": "kvdemo.integrations.lmms_eval:manifest"
    }
