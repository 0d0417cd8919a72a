"""The tool calls of a turn, read off the code the trainer sent, never reported by the worker.

Model code owns its worker's interpreter: whatever the worker says about its own run (which
tools ran, how often, with what) the policy being trained can rewrite, and a reward that reads
it can be inflated by that policy. So the records that rewards and credit read (exploration
diversity, turn-level tool credit) and the tree-shape metrics are taken from what the trainer
itself holds: the code of the turn. Each call of a tool or builtin by name in that code is one
record, in source order, with its arguments as written (`search(text, kw)` inside a loop is one
call with argument `text, kw`, however many times the loop runs). Code that does not parse has
no calls. These are calls written, not calls run: one in dead code counts too. That is the
policy's own output, not a forged report, but a reward paying per call can teach it to pad.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Collection

from rlmtrain.rlm.records import ToolCall
from rlmtrain.rlm.tools import load_tools

__all__ = ["SUBQUERY_BUILTINS", "calls_in_code", "tool_names"]

SUBQUERY_BUILTINS = frozenset({"rlm_query", "rlm_query_batched"})
"""The sub-query builtins every REPL puts beside the environment's tools: they count as tool
use (FINAL and FINAL_VAR end a trajectory: they are not)."""

_ARGS_CHARS = 200


@functools.cache
def tool_names(module_names: tuple[str, ...]) -> frozenset[str]:
    """The names of an environment's tools, found as the worker finds them, and the builtins."""
    return SUBQUERY_BUILTINS | frozenset(load_tools(list(module_names)))


def calls_in_code(code: str, names: Collection[str]) -> list[ToolCall]:
    """Every call `name(...)` in `code` of a name in `names`, in source order."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    found: list[tuple[int, int, ToolCall]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            try:
                parts = [ast.unparse(arg) for arg in node.args]
                parts += [ast.unparse(keyword) for keyword in node.keywords]
                args = ", ".join(parts)[:_ARGS_CHARS]
            except RecursionError:  # an argument nested past what unparse can recurse
                args = "..."
            found.append((node.lineno, node.col_offset, ToolCall(name=node.func.id, args=args)))
    found.sort(key=lambda item: item[:2])
    return [call for _, _, call in found]
