"""The docs stay true to the project: every page is reachable from the README, every relative link and anchor
resolves, every kvdemo command line the docs show parses with the CLI's own parser, the files and modules they
name exist, the screenshots are small enough for a Space card, and no tracker numbers leak into them."""

import re
import shlex
from pathlib import Path

import pytest

from kvdemo.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
MARKDOWN = [README, *PAGES]
REPO_FOLDERS = ("kvdemo/", "tests/", "docs/", ".ci/")  # a backticked path starting so names a file of this repository


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The text outside fenced blocks (a ``#`` line inside a block is a comment, not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def links(text: str) -> list[str]:
    """Targets of Markdown links and images, ``[text](target)`` and ``![alt](target)``, and of HTML ``src``/``href``."""
    text = prose(text)
    markdown = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    return markdown + re.findall(r"<[a-z]+\s[^>]*?\b(?:src|href)=\"([^\"]+)\"", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in prose(path.read_text()).splitlines() if line.startswith("#")}


def bash_lines(text: str) -> list[str]:
    """Every command line of the ```bash blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def inline_commands(text: str) -> list[str]:
    """Commands quoted inline as `python -m kvdemo ...` (a code span may wrap onto the next line)."""
    return [" ".join(span.split()) for span in re.findall(r"`(python -m kvdemo[ .][^`]*)`", prose(text))]


def kvdemo_arguments(line: str) -> list[str] | None:
    """The arguments of a ``python -m kvdemo`` / ``kvdemo`` command line (comments dropped), else None."""
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # leading environment assignments
        words = words[1:]
    if words[:3] == ["python", "-m", "kvdemo"]:
        return words[3:]
    if words[:1] == ["kvdemo"]:
        return words[1:]
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for path in MARKDOWN:
        text = path.read_text()
        for line in bash_lines(text) + inline_commands(text):
            arguments = kvdemo_arguments(line)
            # `python -m kvdemo <command> --help` is a pattern, not a command
            if arguments and not any("<" in word for word in arguments):
                commands.append((f"{name(path)}: {line}", arguments))
    return commands


COMMANDS = documented_commands()


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in links(README.read_text())}
    missing = [name(page) for page in PAGES if page.resolve() not in linked]
    assert PAGES and not missing, f"docs pages the README's map does not link: {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=name)
def test_every_relative_link_and_anchor_resolves(path):
    broken = []
    for target in links(path.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{name(path)} links to what does not exist: {broken}"


def test_the_docs_show_commands_of_every_kind():
    """The collection below must find the commands (a changed block format would otherwise pass silently)."""
    used = {arguments[0] for _, arguments in COMMANDS if arguments and not arguments[0].startswith("-")}
    assert {"run", "compare", "bench", "eval", "doctor", "train-tiny"} <= used, used


@pytest.mark.parametrize("where, arguments", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_documented_command_parses_with_the_clis_parser(where, arguments, capsys):
    try:
        build_parser().parse_args(arguments)
    except SystemExit as exit:  # argparse exits 0 after printing --help, 2 on an argument it refuses
        assert exit.code == 0, f"{where}\n{capsys.readouterr().err}"


def test_the_parser_check_catches_a_wrong_option(capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(kvdemo_arguments("python -m kvdemo run --budjet 64"))
    assert exit.value.code == 2 and "--budjet" in capsys.readouterr().err


@pytest.mark.parametrize("path", MARKDOWN, ids=name)
def test_the_files_and_modules_the_docs_name_exist(path):
    text = path.read_text()
    spans = re.findall(r"`([^`\n]+)`", prose(text)) + [word for line in bash_lines(text) for word in line.split()]
    missing = []
    for span in spans:
        span = span.strip()
        if span.startswith(REPO_FOLDERS) and re.fullmatch(r"[\w./-]+", span) and not (ROOT / span).exists():
            missing.append(span)
        for module in re.findall(r"python -m (kvdemo(?:\.\w+)+)", span):
            file = ROOT / module.replace(".", "/")
            if not (file.with_suffix(".py").exists() or (file / "__main__.py").exists()):
                missing.append(module)
        if re.fullmatch(r"kvdemo(\.[a-z_]+)+(\.[A-Za-z_]+)?", span):  # a module (and perhaps a name in it)
            parts = span.split(".")
            if not any(
                (ROOT / "/".join(parts[:n])).with_suffix(".py").exists() or (ROOT / "/".join(parts[:n])).is_dir()
                for n in range(2, len(parts) + 1)
            ):
                missing.append(span)
    assert not missing, f"{name(path)} names what the repository does not have: {missing}"


def test_no_tracker_numbers_in_user_facing_text():
    found = [
        f"{name(path)}: {match}"
        for path in MARKDOWN
        for match in re.findall(r"\bissues?\s*#?\d+|(?<![\w/])#\d+\b", path.read_text(), flags=re.IGNORECASE)
    ]
    assert not found, found


def test_the_screenshots_are_pngs_under_400_kb():
    images = [ROOT / target for target in links(README.read_text()) if target.endswith(".png")]
    assert len(images) >= 2, "a screenshot of each tab"
    for image in images:
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size < 400_000, name(image)


def test_the_code_map_names_files_that_exist():
    """The file-by-file map in how-it-works names modules by their file names; each must still be there."""
    block = re.search(r"^```\n(app\.py.*?)^```", (DOCS / "how-it-works.md").read_text(), flags=re.DOTALL | re.MULTILINE)
    assert block, "the code map is a plain ``` block starting with app.py"
    files = {path.name for path in [*ROOT.glob("*.py"), *(ROOT / "kvdemo").rglob("*.py")]}
    named = set(re.findall(r"\b\w+\.py\b", block.group(1)))
    assert len(named) > 30 and not named - files, sorted(named - files)
