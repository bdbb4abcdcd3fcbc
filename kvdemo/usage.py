"""What ``python -m kvdemo`` says about itself: the parser (each command's options, description and examples are
:mod:`kvdemo.subcommands`, :mod:`kvdemo.tool_commands`) and how a usage error reads (one line). What the commands do is :mod:`kvdemo.cli`."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .dialogue import ECHO_LIMIT, clipped
from .errors import UserError
from .subcommands import FORMATTER, PolicyHelp, add_compare, add_eval, add_run, add_stream_options
from .tool_commands import add_bench, add_doctor, add_make_tasks, add_results, add_train_tiny

DESCRIPTION = """\
Stream a video into a vision-language model frame chunk by frame chunk, keep its KV cache under a hard
budget with a compression policy, and report what survives (and answers, if asked)."""


class UsageError(UserError):
    """A command-line argument that cannot work (the message names it)."""


def one_line(message: str, argv: list[str]) -> str:
    """An error ``message`` as one line in which every long argument of ``argv`` (and the value after its ``=``)
    it repeats, quoted or not, and any other long quoted text is :func:`clipped`."""
    pieces = {
        piece for arg in argv for piece in (arg, arg.split("=", 1)[-1]) if len(piece) > ECHO_LIMIT or "\n" in piece
    }
    for piece in sorted(pieces, key=len, reverse=True):
        for form in (repr(piece), repr(piece)[1:-1], piece):
            message = message.replace(form, repr(clipped(piece)) if form == repr(piece) else clipped(piece))
    message = re.sub(
        f"'([^']{{{ECHO_LIMIT + 1},}})'", lambda quoted: repr(quoted.group(1)[:ECHO_LIMIT] + "..."), message
    )
    return " ".join(message.split())


class Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors kept to one line that repeats no long argument (argparse echoes an
    invalid choice whole)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {one_line(message, [])}\n")


def parse_param(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as JSON when it parses (numbers, true/false), else as text."""
    if "=" not in text:
        raise UsageError(f"--param takes key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().replace("-", "_"), value


def build_parser(catalog: Any = None) -> argparse.ArgumentParser:
    """The argument parser; ``catalog`` (the :mod:`kvdemo.policies` module: the registered classes and the
    defaults) only for the help text, which is the one place that needs them before the arguments are checked
    (importing the policies imports torch)."""
    parser = Parser(
        prog="kvdemo" if Path(sys.argv[0]).name == "kvdemo" else "python -m kvdemo",
        description=DESCRIPTION,
        formatter_class=FORMATTER,
        epilog="Run 'python -m kvdemo <command> --help' for a command's options and examples.",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{run,compare,bench,eval,results,make-tasks,doctor,train-tiny}"
    )
    about = PolicyHelp(catalog)
    stream = add_stream_options(Parser(add_help=False))
    add_run(commands, stream, about)
    add_compare(commands, stream, about)
    add_bench(commands, about)
    add_eval(commands, about)
    add_results(commands)
    add_make_tasks(commands)
    add_doctor(commands)
    add_train_tiny(commands)
    return parser
