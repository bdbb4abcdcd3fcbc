"""The package's shape, checked by parsing it: no import circles, imports at the top of files unless deferred on
purpose (and saying so), files a newcomer reads in one sitting, and no policy named outside ``kvdemo/policies``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvdemo"
#: Lines a module may have; longer ones must be one algorithm read top to bottom (listed, with why).
MAX_LINES = 560
LONG_MODULES: dict[str, str] = {}
#: Modules outside kvdemo/policies that may name a policy, and why.
NAMES_A_POLICY = {
    "bench/reference.py": "it compares kvdemo's InfiniPot-V with the authors' own InfiniPot-V code: that policy by definition",
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports anywhere in its file, each with the packages
    above it (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                inside = name.startswith(prefix + ".")  # a module's own package is already being imported
                if prefix in known and prefix != name and not (inside and prefix != target):
                    found.add(prefix)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, found by depth-first search (each reported once, from its smallest member)."""
    found, seen = [], set()

    def visit(node: str, trail: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in trail:
                circle = trail[trail.index(nxt):]
                start = circle.index(min(circle))
                key = tuple(circle[start:] + circle[:start])
                if key not in seen:
                    seen.add(key)
                    found.append(list(key) + [key[0]])
            elif len(trail) < 40:
                visit(nxt, trail + [nxt])

    for node in sorted(graph):
        visit(node, [node])
    return found


def test_the_package_has_no_import_circles():
    known = modules()
    graph = {name: imported(name, path, set(known)) for name, path in known.items()}
    # Packages import their own modules (kvdemo.policies -> kvdemo.policies.cords); that is not a circle unless
    # one of those modules imports something that comes back to the package, which the search still finds.
    assert cycles(graph) == []


def test_the_cycle_search_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_at_the_top_unless_deferred_on_purpose():
    hidden = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().split("\n")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        said = " ".join(lines[max(0, inner.lineno - 2) : inner.end_lineno])
                        if "deferred" not in said:
                            hidden.append(f"{path.relative_to(PACKAGE)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}")
    assert hidden == [], "an import inside a function must say why it is deferred"


def test_modules_are_read_in_one_sitting():
    long = {str(path.relative_to(PACKAGE)): len(path.read_text().split("\n")) for path in PACKAGE.rglob("*.py")}
    too_long = {name: n for name, n in long.items() if n > MAX_LINES and name not in LONG_MODULES}
    assert too_long == {}


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are documentation: docstrings, and the usage examples a command's
    help prints (module-level ``*_EXAMPLES``)."""
    out = set()
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "").endswith("_EXAMPLES") for t in node.targets):
            out.update(id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


@pytest.mark.parametrize("scope", ["app", "viz", "bench", "models", "stream/engine.py", "cache/memory.py", "cache/attention.py", "cli.py",
                                   "experiments/evaluation.py", "cache/budget.py", "cache/offload.py", "views.py", "analysis/survival.py", "testing.py",
                                   "experiments/compare.py", "analysis/explain.py"])
def test_nothing_outside_the_policies_names_a_policy(scope):
    """Outside ``kvdemo/policies`` code never names a policy (the full cache, the baseline every tool shows, is
    the one exception): what a policy does is reached through its class's declarations and protocols."""
    from kvdemo.policies import REGISTRY

    names = [name for name in REGISTRY if name != "full"]
    root = PACKAGE / scope
    offenders = []
    for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        if relative in NAMES_A_POLICY:
            continue
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                offenders += [f"{relative}:{node.lineno}: {name!r}" for name in names if name in node.value]
    assert offenders == []


#: Modules below the model families (the cache core, and the chunk a family makes for it): none of them imports
#: ``kvdemo.models``, even through another module, so no arrow runs back up from the memory to the models.
BELOW_THE_MODELS = ("kvdemo.cache.chunk", "kvdemo.media.geometry", "kvdemo.cache.memory", "kvdemo.cache.layer", "kvdemo.cache.attention",
                    "kvdemo.cache.offload", "kvdemo.cache.budget")


def test_the_cache_core_sits_below_the_models():
    known = modules()
    graph = {name: imported(name, path, set(known)) for name, path in known.items()}
    upward = {}
    for start in BELOW_THE_MODELS:
        reached, frontier = set(), [start]
        while frontier:
            for nxt in graph[frontier.pop()] - reached:
                reached.add(nxt)
                frontier.append(nxt)
        upward[start] = sorted(name for name in reached if name == "kvdemo.models" or name.startswith("kvdemo.models."))
    assert upward == {name: [] for name in BELOW_THE_MODELS}


#: Modules outside kvdemo/models that may name a model family, and why.
NAMES_A_FAMILY = {
    "world/training.py": "it trains the offline tiny model, a Qwen2.5-VL: that family by definition",
}


def test_nothing_outside_the_models_names_a_family():
    """Outside ``kvdemo/models`` code neither imports a family's file nor names a family's model type or offline
    model: what a family is reaches the rest through its spec (``kvdemo.models.catalog``)."""
    from kvdemo.models.catalog import families

    specs = set(families().values())
    files = {spec.load.__module__ for spec in specs}
    names = {t for spec in specs for t in spec.model_types} | {m.name for spec in specs for m in spec.offline
                                                                 if m.name.startswith("tiny-random-")}
    known = modules()
    offenders = []
    for module, path in sorted(known.items()):
        relative = str(path.relative_to(PACKAGE))
        if relative.startswith("models/") or relative in NAMES_A_FAMILY:
            continue
        offenders += [f"{relative}: imports {target}" for target in sorted(imported(module, path, set(known)) & files)]
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                offenders += [f"{relative}:{node.lineno}: {name!r}" for name in sorted(names) if name in node.value]
    assert offenders == []
