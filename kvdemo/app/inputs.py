"""Values sent to the app's API checked before Gradio preprocesses them: a string where a number belongs, an unknown
choice, a file that is not one. Gradio's own preprocessing raises on such values and prints a traceback to the
app's log for each (``queueing.process_events`` prints every error but a ``gr.Error(print_exception=False)``); here
each is said to the client as one line naming the field, and the log gets one line too.

:func:`guard_inputs` wraps the Blocks' ``preprocess_data`` (the step that turns the sent values into the handler's
arguments). The checks read the components' own settings (choices, bounds), duck-typed: Gradio is handed in by
:mod:`kvdemo.app.layout`, the app's only module that imports it.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

log = logging.getLogger("kvdemo")

#: Longest part of a sent value repeated in a message.
SHOWN_CHARS = 40


def shown(value: Any) -> str:
    """``value`` as a message repeats it: its repr, cut to :data:`SHOWN_CHARS` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def field_name(block) -> str:
    """How a message names a component: its label, else its kind."""
    return str(getattr(block, "label", None) or block.get_block_name())


def number_problem(value: Any, minimum: float | None, maximum: float | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return f"a number, got {shown(value)}"
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        return f"between {minimum:g} and {maximum:g}, got {value:g}"
    return None


def choice_problem(value: Any, choices: list[Any], many: bool = False) -> str | None:
    offered = ", ".join(str(c) for c in choices)
    if many:
        if not isinstance(value, list):
            return f"a list of choices among {offered}, got {shown(value)}"
        unknown = [v for v in value if v not in choices]
        return f"unknown choice {shown(unknown[0])}; the choices: {offered}" if unknown else None
    if value is not None and value not in choices:
        return f"unknown choice {shown(value)}; the choices: {offered}"
    return None


def file_problem(value: Any) -> str | None:
    if value is None:
        return None
    sent = value.get("video", value) if isinstance(value, dict) else value  # a Video's payload wraps its file
    if not isinstance(sent, dict) or not sent.get("path"):
        return f"a file (gradio_client's handle_file(path)), got {shown(value)}"
    return None


def value_problem(gr, block, value: Any) -> str | None:
    """Why ``value`` cannot go to ``block`` (a Gradio component), or None if Gradio's preprocessing can take it."""
    if isinstance(block, (gr.Number, gr.Slider)):
        return number_problem(value, getattr(block, "minimum", None), getattr(block, "maximum", None))
    if isinstance(block, gr.CheckboxGroup):
        return choice_problem(value, [v for _, v in block.choices], many=True)
    if isinstance(block, (gr.Radio, gr.Dropdown)) and not getattr(block, "allow_custom_value", False):
        return choice_problem(value, [v for _, v in block.choices], many=getattr(block, "multiselect", False))
    if isinstance(block, (gr.Dropdown, gr.Textbox)):
        return None if value is None or isinstance(value, (str, int, float)) else f"text, got {shown(value)}"
    if isinstance(block, gr.Checkbox):
        return None if value is None or isinstance(value, bool) else f"true or false, got {shown(value)}"
    if isinstance(block, (gr.Video, gr.File, gr.Image)) and not getattr(block, "streaming", False):
        return file_problem(value)
    return None


def input_problem(gr, block_fn, inputs: list[Any], state) -> str | None:
    """The first input of an event that its component cannot take, said in one line (``"M (max visual tokens): a
    number, got 'abc'"``), or None."""
    for block, value in zip(block_fn.inputs, inputs):
        if getattr(block, "stateful", False):
            continue
        if state is not None and block._id in state:  # the session's copy (its choices may have been updated)
            block = state[block._id]
        problem = value_problem(gr, block, value)
        if problem:
            return f"{field_name(block)}: {problem}"
    return None


def guard_inputs(gr, blocks) -> None:
    """Check every event's inputs before Gradio preprocesses them; a value that does not fit (or one Gradio rejects
    anyway) ends the call with a one-line ``gr.Error`` and one line in the log, never a traceback."""
    original = blocks.preprocess_data

    @functools.wraps(original)
    async def preprocess_data(block_fn, inputs, state, *args, **kwargs):
        problem = input_problem(gr, block_fn, inputs, state)
        if problem is None:
            try:
                return await original(block_fn, inputs, state, *args, **kwargs)
            except Exception as exc:  # what the checks above did not foresee (Gradio's own errors too): one line
                text = str(getattr(exc, "message", None) or exc).strip()
                problem = (text.splitlines() or [type(exc).__name__])[0][:200]
        log.info("rejected a call to %s: %s", block_fn.api_name or block_fn.name, problem)
        raise gr.Error(problem, print_exception=False)

    blocks.preprocess_data = preprocess_data
