"""Which functions a tool module gives the REPL: one resolution for the worker and the trainer.

A worker injects these functions into model code's globals; the trainer reads the same list to
document the tools in the system prompt and to tell tool calls apart from other calls. This
module imports nothing but the tool modules themselves, so building a prompt never loads the
compiled jail the worker needs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["load_tools"]


def load_tools(module_names: list[str]) -> dict[str, Callable]:
    """Import tool modules; each exposes its tools as a module-level TOOLS list (or __all__)."""
    tools: dict[str, Callable] = {}
    for module_name in module_names:
        module = importlib.import_module(module_name)
        if hasattr(module, "TOOLS"):
            functions = list(module.TOOLS)
        elif hasattr(module, "__all__"):
            functions = [getattr(module, name) for name in module.__all__]
        else:
            raise ValueError(f"tool module {module_name!r} has neither TOOLS nor __all__")
        for fn in functions:
            name = getattr(fn, "__name__", None)
            if not callable(fn) or not name:
                raise ValueError(f"tool module {module_name!r}: {fn!r} is not a named function")
            if name in tools:
                raise ValueError(f"tool {name!r} is defined twice (again in {module_name!r})")
            tools[name] = fn
    return tools
