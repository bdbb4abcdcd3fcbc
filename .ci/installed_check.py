"""Checks of .ci/wheel-check, one per mode:

- ``wheel WHEEL SRC``: the wheel holds every module of ``SRC/kvdemo`` and the tiny model's files, and declares
  exactly requirements.txt (and the extras' files) as its dependencies; every third-party module kvdemo's source
  imports belongs to a declared distribution (the venv below sees the system's site-packages, which could hide an
  undeclared one; a transitive import check would flag what libraries import only because it is there).
- ``library README VENV CHECKOUT`` (run by the venv's python, from the folder outside the checkout where
  ``kvdemo run`` wrote ``run.json``): that report is the tiny model's on 4 frames; kvdemo is imported from the
  venv; the README's library example (the first python block after ``## Library``) runs on a
  short clip written from the bundled sample.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

#: Modules kvdemo imports that no requirements file declares, and why.
OPTIONAL_MODULES = {"spaces": "Hugging Face's ZeroGPU package, preinstalled on a ZeroGPU Space; imported only there"}


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a requirements file (comments and blank lines dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def check_wheel(wheel: Path, src: Path) -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {str(p.relative_to(src)) for p in (src / "kvdemo").rglob("*.py")}
    wanted |= {str(p.relative_to(src)) for p in (src / "kvdemo" / "assets" / "tiny").iterdir()}
    missing = sorted(wanted - names)
    assert not missing, f"the wheel lacks {missing}"
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    declared: dict[str, set[str]] = {}
    for line in re.findall(r"^Requires-Dist: (.+)$", text, flags=re.M):
        requirement = Requirement(line)
        extra = re.search(r'extra == "([^"]+)"', str(requirement.marker or ""))
        requirement.marker = None
        declared.setdefault(extra.group(1) if extra else "", set()).add(str(requirement))
    files = {"": "requirements.txt", "dev": "requirements-dev.txt", "eval": "requirements-eval.txt"}
    for extra, file in files.items():
        expected = {str(Requirement(line)) for line in requirement_lines(src / file)}
        assert declared.get(extra, set()) == expected, f"{file} != the wheel's {extra or 'runtime'} requirements"
    check_imports(src, {canonicalize_name(Requirement(r).name) for group in declared.values() for r in group})
    print(
        f"wheel-check: {wheel.name}: {len(names)} files, every module and the tiny model; requires "
        f"{len(declared[''])} (+ dev {len(declared['dev'])}, eval {len(declared['eval'])}) as requirements*.txt"
    )


def write_clip(path: Path, frames: int = 8) -> None:
    """The first ``frames`` frames of the bundled sample as an mp4 (the example opens ``clip.mp4``)."""
    from kvdemo.media.video import write_video
    from kvdemo.world.synthetic import sample_episode

    video = sample_episode().video
    write_video(path, video.frames[:frames], video.fps)


def imported_modules(package: Path) -> dict[str, str]:
    """Third-party top-level modules imported anywhere in ``package``'s source -> one file importing it."""
    import ast

    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != package.name:
                    found.setdefault(top, str(path.relative_to(package.parent)))
    return found


def check_imports(src: Path, declared: set[str]) -> None:
    """Every third-party module kvdemo imports comes from a declared distribution (canonical names)."""
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    owners = packages_distributions()
    for module, path in imported_modules(src / "kvdemo").items():
        if module in OPTIONAL_MODULES:
            continue
        dists = {canonicalize_name(d) for d in owners.get(module, [])}
        assert dists, f"{path} imports {module}, which no installed distribution provides"
        assert dists & declared, (
            f"{path} imports {module} ({', '.join(sorted(dists))}), which no requirements file declares"
        )


def check_library(readme: Path, venv: Path, checkout: Path) -> None:
    import kvdemo

    where = Path(kvdemo.__file__).resolve()
    assert venv.resolve() in where.parents and checkout.resolve() not in where.parents, f"kvdemo from {where}"
    report = json.loads(Path("run.json").read_text())  # what `kvdemo run --model tiny --max-frames 4` wrote here
    assert (report["model"], report["frames"]) == ("tiny", 4), (report["model"], report["frames"])
    section = readme.read_text().split("\n## Library\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    write_clip(Path("clip.mp4"))
    exec(compile(code, "README.md (## Library)", "exec"), {"__name__": "__readme__"})
    print(f"\nwheel-check: the README's library example ran with kvdemo from {where.parent}")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "wheel":
        check_wheel(Path(args[0]), Path(args[1]))
    else:
        check_library(*map(Path, args))
