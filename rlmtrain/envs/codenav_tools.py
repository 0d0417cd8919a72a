"""Code navigation REPL tools (docs/algorithm.md §2): search, jump to a definition, list calls.

Standard library only (with `repl_context`): every REPL zygote imports this module. The code
base is the REPL's `context`, one string in which every source line carries its position and
every definition is announced (`render_codebase` writes it):

    === file pkg/util.py ===
    === def Parser.parse @ pkg/util.py:12 ===
    pkg/util.py:12| def parse(self, text):

so plain string code can find positions too. The tools rebuild the files from those lines and
parse them with `ast` once per code base (`CodeIndex`, which the environment's task generator
and scripted expert use as well, so tools and gold answers agree by construction). They find the
string as the global `context` of the calling code, or take `code=` explicitly.

Names: a function is known by its qualified name inside its file (`helper`, `Parser.parse`,
`outer.inner` for nested functions); `goto_definition` and `list_calls` also accept the last
component alone (`parse`) and return every match. A call's callee is written as in the source
(`self.helper`, `os.path.join`); calls inside a nested function belong to that function.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from typing import Any

from rlmtrain.envs.repl_context import caller_context

__all__ = [
    "TOOLS",
    "CodeIndex",
    "Definition",
    "goto_definition",
    "list_calls",
    "render_codebase",
    "search_code",
]

MAX_SEARCH_HITS = 50
MAX_SOURCE_LINES = 80
"""Lines of a definition goto_definition prints."""


def render_codebase(files: Iterable[tuple[str, str]]) -> str:
    """The context string for (path, source) pairs, in the given order."""
    out: list[str] = []
    for path, source in files:
        defs: dict[int, list[str]] = {}
        try:
            for d in _definitions(path, ast.parse(source)):
                defs.setdefault(d.line, []).append(d.qualname)
        except SyntaxError:
            pass  # still searchable as text; it just announces no definitions
        out.append(f"=== file {path} ===")
        for number, line in enumerate(source.splitlines(), 1):
            out.extend(f"=== def {q} @ {path}:{number} ===" for q in defs.get(number, ()))
            out.append(f"{path}:{number}| {line}")
    return "\n".join(out) + "\n"


class Definition:
    """A function or class: where it is, and the calls its own body makes."""

    __slots__ = ("calls", "end_line", "kind", "line", "path", "qualname")

    def __init__(self, path: str, qualname: str, kind: str, line: int, end_line: int):
        self.path, self.qualname, self.kind = path, qualname, kind
        self.line, self.end_line = line, end_line
        self.calls: list[tuple[str, int]] = []
        """(callee as written, line) in source order."""

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"

    def matches(self, name: str) -> bool:
        return self.qualname == name or self.qualname.endswith("." + name)


def _definitions(path: str, tree: ast.Module) -> list[Definition]:
    found: list[Definition] = []

    def visit(node: ast.AST, prefix: str, owner: Definition | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                d = Definition(path, prefix + child.name, kind, child.lineno, child.end_lineno)
                found.append(d)
                visit(child, d.qualname + ".", d if kind == "function" else None)
            else:
                if isinstance(child, ast.Call) and owner is not None:
                    owner.calls.append((ast.unparse(child.func), child.lineno))
                visit(child, prefix, owner)

    visit(tree, "", None)
    for d in found:
        d.calls.sort(key=lambda c: c[1])
    return found


class CodeIndex:
    """Files and definitions of a rendered code base."""

    def __init__(self, code: str):
        self.files: dict[str, list[str]] = {}
        for raw in code.splitlines():
            if raw.startswith("=== "):
                continue
            position, sep, text = raw.partition("| ")
            path, colon, number = position.rpartition(":")
            if not sep or not colon or not number.isdigit():
                continue
            self.files.setdefault(path, []).append(text)
        self.definitions: list[Definition] = []
        for path, lines in self.files.items():
            try:
                tree = ast.parse("\n".join(lines))
            except SyntaxError:
                continue
            self.definitions.extend(_definitions(path, tree))

    def find(self, name: str) -> list[Definition]:
        """Definitions named exactly `name` if any, else those whose last parts match it;
        "path.py:name" looks in that file only."""
        path, sep, qualname = name.rpartition(":")
        scope = self.definitions
        if sep and path.endswith(".py"):
            scope, name = [d for d in scope if d.path == path], qualname
        exact = [d for d in scope if d.qualname == name]
        return exact or [d for d in scope if d.matches(name)]


_indexes: dict[int, tuple[str, CodeIndex]] = {}


def _index(code: Any, tool: str) -> CodeIndex:
    if code is None:
        code = caller_context(sys._getframe(2), tool, "code")
    if not isinstance(code, str):
        raise TypeError(f"{tool}: expected the code base string, got {type(code).__name__}")
    cached = _indexes.get(id(code))
    if cached is None or cached[0] is not code:
        if len(_indexes) >= 4:
            _indexes.clear()
        cached = (code, CodeIndex(code))
        _indexes[id(code)] = cached
    return cached[1]


def search_code(text, code=None):
    """Find the source lines containing `text` (case-insensitive). Prints each hit as
    "path:line| source line", at most 50, and returns the list of "path:line" positions.
    No hit prints "(no hits)" and returns []. `code` defaults to `context`."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"search_code: text must be a non-empty string, got {text!r}")
    index = _index(code, "search_code")
    needle = text.lower()
    hits = []
    for path, lines in index.files.items():
        for number, line in enumerate(lines, 1):
            if needle in line.lower():
                hits.append((f"{path}:{number}", line))
    if not hits:
        print("(no hits)")
        return []
    for position, line in hits[:MAX_SEARCH_HITS]:
        print(f"{position}| {line}")
    if len(hits) > MAX_SEARCH_HITS:
        print(f"... {len(hits) - MAX_SEARCH_HITS} more hits not shown")
    return [position for position, _ in hits[:MAX_SEARCH_HITS]]


def goto_definition(name, code=None):
    """Jump to the definition of function or class `name` ("helper", "Parser.parse", or the
    last part alone, "parse"; "path.py:name" picks one file). Prints, per match, the header
    "path:line  qualified.name" and up to 80 numbered lines of its source; returns the list
    of "path:line" positions of the matches. No match raises KeyError. `code` defaults to
    `context`."""
    index = _index(code, "goto_definition")
    matches = index.find(str(name))
    if not matches:
        raise KeyError(f"goto_definition: no function or class named {name!r}")
    for d in matches:
        print(f"{d.location}  {d.qualname}")
        lines = index.files[d.path][d.line - 1 : min(d.end_line, d.line + MAX_SOURCE_LINES - 1)]
        for offset, line in enumerate(lines):
            print(f"{d.path}:{d.line + offset}| {line}")
    return [d.location for d in matches]


def list_calls(function, code=None):
    """List the calls made in the body of `function` (named as for goto_definition; calls in
    nested functions belong to those). Prints one "path:line  callee" line per call in source
    order, the callee as written (e.g. "self.parse", "os.path.join"); returns the list of
    (callee, "path:line") pairs of all matches. No such function raises KeyError. `code`
    defaults to `context`."""
    index = _index(code, "list_calls")
    matches = [d for d in index.find(str(function)) if d.kind == "function"]
    if not matches:
        raise KeyError(f"list_calls: no function named {function!r}")
    calls = []
    for d in matches:
        print(f"# {d.qualname} ({d.location})")
        for callee, line in d.calls:
            print(f"{d.path}:{line}  {callee}")
            calls.append((callee, f"{d.path}:{line}"))
        if not d.calls:
            print("(no calls)")
    return calls


TOOLS = [search_code, goto_definition, list_calls]
