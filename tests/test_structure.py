"""The package's shape, checked by parsing it: no import circles, every module on a floor that imports only its own
floor and those below (data flows down), imports at the top of files unless deferred on purpose (and saying so),
files a newcomer reads in one sitting (or that say why not), and no policy named outside ``kvdemo/policies``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvdemo"
#: Lines a module may have before it must say why it is longer: a comment line starting with LONG_REASON in its
#: head (before its first definition), giving the reason, e.g. one algorithm or one unit a reader needs whole.
MAX_LINES = 450
LONG_REASON = "# Long on purpose:"
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
                circle = trail[trail.index(nxt) :]
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
                            hidden.append(
                                f"{path.relative_to(PACKAGE)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}"
                            )
    assert hidden == [], "an import inside a function must say why it is deferred"


def reason_for_length(text: str) -> str:
    """The reason a module gives for its length: the text after LONG_REASON on a comment line of its head (before
    its first function or class); '' when it gives none."""
    tree = ast.parse(text)
    head_end = min(
        (node.lineno for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))),
        default=None,
    )
    lines = text.splitlines()[: head_end - 1 if head_end else None]
    said = [line.strip()[len(LONG_REASON) :].strip() for line in lines if line.strip().startswith(LONG_REASON)]
    return said[0] if said else ""


def test_modules_are_read_in_one_sitting_or_say_why_not():
    long = {str(path.relative_to(PACKAGE)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    unexplained = {
        name: len(text.splitlines())
        for name, text in long.items()
        if len(text.splitlines()) > MAX_LINES and len(reason_for_length(text).split()) < 4
    }
    assert unexplained == {}, f"over {MAX_LINES} lines with no '{LONG_REASON} <why>' comment in the module's head"


def test_the_reason_for_length_is_read_from_the_head_only():
    said = f'"""Doc."""\n\n{LONG_REASON} one algorithm, read top to bottom.\nimport os\n\n\ndef f():\n    pass\n'
    assert reason_for_length(said) == "one algorithm, read top to bottom."
    late = f'"""Doc."""\n\n\ndef f():\n    pass\n\n{LONG_REASON} too late: a reader meets it at the end.\n'
    assert reason_for_length(late) == ""


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


@pytest.mark.parametrize(
    "scope",
    [
        "app",
        "viz",
        "bench",
        "models",
        "cache",
        "stream",
        "analysis",
        "experiments",
        "media",
        "devices",
        "world",
        "cli.py",
        "live_run.py",
        "usage.py",
        "subcommands.py",
        "tool_commands.py",
        "views.py",
        "testing.py",
    ],
)
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


#: The floors of the house, ground first. A module imports only modules on its own floor or below, so data flows
#: down and no arrow runs back up (the memory knows no model family, the families no engine, the engine no app).
#: A package's modules are on its floor; every module of kvdemo is on one (a new root module is placed here).
FLOORS: list[tuple[str, list[str]]] = [
    (
        "the vocabulary every floor shares",
        ["kvdemo.tensors", "kvdemo.views", "kvdemo.dialogue", "kvdemo.errors", "kvdemo.devices"],
    ),
    ("what a policy decides; frames in", ["kvdemo.policies", "kvdemo.media"]),
    ("the memory under a budget", ["kvdemo.cache"]),
    ("what enters the memory: pruning before the LLM", ["kvdemo.pruning"]),
    ("the model families", ["kvdemo.models"]),
    ("the generated world", ["kvdemo.world"]),
    ("reading a memory and an answer", ["kvdemo.analysis"]),
    ("the engine", ["kvdemo.stream"]),
    ("drawing", ["kvdemo.viz"]),
    ("policies measured on streams", ["kvdemo.experiments"]),
    (
        "the faces: app, command line, benchmarks, integrations, test fixtures",
        [
            "kvdemo.app",
            "kvdemo.cli",
            "kvdemo.live_run",
            "kvdemo.usage",
            "kvdemo.subcommands",
            "kvdemo.tool_commands",
            "kvdemo.bench",
            "kvdemo.integrations",
            "kvdemo.testing",
            "kvdemo.__main__",
            "kvdemo",
        ],
    ),
]


def floor_of(module: str) -> int | None:
    """The floor (index into FLOORS) of a dotted module name: its longest listed prefix's; None if unplaced."""
    best, floor = -1, None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            placed = module == prefix or (prefix != "kvdemo" and module.startswith(prefix + "."))
            if placed and len(prefix) > best:
                best, floor = len(prefix), index
    return floor


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module (floor) -> module (floor)`` for every import that runs to a higher floor (a module on no floor is
    :func:`test_every_module_is_on_a_floor`'s to report)."""
    return sorted(
        f"{a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})"
        for a, targets in graph.items()
        for b in targets
        if floor_of(a) is not None and floor_of(b) is not None and floor_of(b) > floor_of(a)
    )


def test_every_module_is_on_a_floor():
    unplaced = sorted(name for name in modules() if floor_of(name) is None)
    assert unplaced == [], "place these modules in a room of FLOORS (the floor of what they import, or above)"


def test_no_module_imports_upward():
    known = modules()
    graph = {name: imported(name, path, set(known)) for name, path in known.items()}
    assert upward_imports(graph) == []


def test_the_floor_check_finds_an_upward_import():
    graph = {"kvdemo.cache.memory": {"kvdemo.models.base", "kvdemo.policies.contract"}, "kvdemo.models.base": set()}
    assert upward_imports(graph) == [
        "kvdemo.cache.memory (the memory under a budget) -> kvdemo.models.base (the model families)"
    ]
    assert floor_of("kvdemo") == floor_of("kvdemo.cli") != floor_of("kvdemo.cache")
    assert floor_of("kvdemo.somewhere_new") is None


#: Modules outside kvdemo/models that may name a model family, and why.
NAMES_A_FAMILY = {
    "world/training.py": "it trains the offline tiny model, a Qwen2.5-VL: that family by definition",
    "world/batches.py": "the tiny model's training sequences, in its Qwen2.5-VL template and M-RoPE positions",
}


def test_nothing_outside_the_models_names_a_family():
    """Outside ``kvdemo/models`` code neither imports a family's file nor names a family's model type or offline
    model: what a family is reaches the rest through its spec (``kvdemo.models.catalog``)."""
    from kvdemo.models.catalog import families

    specs = set(families().values())
    files = {spec.load.__module__ for spec in specs}
    names = {t for spec in specs for t in spec.model_types} | {
        m.name for spec in specs for m in spec.offline if m.name.startswith("tiny-random-")
    }
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
