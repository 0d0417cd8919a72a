"""How a REPL tool finds the task context when the model does not pass it.

Tool modules (`booknav_tools`, `codenav_tools`) let the model write `read_section("2.1")` rather
than `read_section(context, "2.1")`: the context is the global `context` of the REPL code that
called the tool. That code's frame is not at a fixed depth (a model-defined helper may sit in
between), so the search walks outwards from the tool's caller to the nearest frame whose
globals hold `context`. Standard library only: every REPL zygote imports this with the tools.
"""

from __future__ import annotations

from types import FrameType
from typing import Any

__all__ = ["caller_context"]


def caller_context(frame: FrameType | None, tool: str, argument: str) -> Any:
    """The `context` global of `frame` (the tool's caller) or of the nearest frame outside it
    that has one; NameError naming `tool` and its explicit `argument=` when there is none."""
    while frame is not None and "context" not in frame.f_globals:
        frame = frame.f_back
    if frame is None:
        raise NameError(f"{tool}: no `context` in the REPL and no {argument}= was given")
    return frame.f_globals["context"]
