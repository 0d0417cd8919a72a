"""The import rules of docs/architecture.md, held against the code.

Every module's imports are read from its source (top-level, inside functions, under
TYPE_CHECKING: each one is a dependency), mapped to the part of `rlmtrain/` it names (a
subpackage, or a top-level module) and checked against the table of allowed imports in
docs/architecture.md; and the module graph must have no circle. The checks run on the real tree
and, to show they bite, on the tree with one forbidden import or one circle added.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs/architecture.md"


def _rules() -> dict[str, set[str]]:
    """part -> the parts it may import, from the table between the import-rules markers."""
    text = ARCHITECTURE.read_text()
    table = text.split("<!-- import-rules -->")[1].split("<!-- /import-rules -->")[0]
    rules: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        part = cells[0].strip("`")
        rules[part] = set(re.findall(r"`([\w]+)`", cells[1]))
        if cells[1] == "every part above":
            rules[part] = set(rules)
    return rules


def _sources() -> dict[str, str]:
    """Module name -> source text, for the trainer and the kernels."""
    sources = {}
    for base, package in ((ROOT, "rlmtrain"), (ROOT / "kernels", "rlmtrain_kernels")):
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            sources[".".join(parts)] = path.read_text()
    return sources


def _imported(source: str) -> set[str]:
    """Every absolute module name `source` imports, with each `from M import n` as M.n too."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "rlmtrain_kernels":
        return "rlmtrain_kernels"
    if parts[0] != "rlmtrain" or len(parts) == 1:
        return None
    return parts[1]


def forbidden_imports(sources: Mapping[str, str], rules: dict[str, set[str]]) -> list[str]:
    found = []
    for module, source in sources.items():
        mine = _part(module)
        for name in sorted(_imported(source)):
            theirs = _part(name)
            if theirs is None or theirs == mine:
                continue
            if mine == "rlmtrain_kernels" or mine not in rules or theirs not in rules[mine]:
                found.append(f"{module} imports {name}")
    return found


def import_circles(sources: Mapping[str, str]) -> list[list[str]]:
    """The module graph's strongly connected components of more than one module."""

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in sources:
                return ".".join(parts[:k])
        return None

    graph = {
        module: {r for r in map(resolve, _imported(source)) if r is not None and r != module}
        for module, source in sources.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return circles


def test_every_part_has_a_row():
    rules = _rules()
    parts = {_part(module) for module in _sources()} - {None, "rlmtrain_kernels", "_jail"}
    assert parts <= set(rules), f"parts without a row in the import table: {parts - set(rules)}"


def test_the_code_keeps_the_import_table():
    assert forbidden_imports(_sources(), _rules()) == []


def test_the_check_finds_a_forbidden_import():
    sources = dict(_sources())
    sources["rlmtrain.rlm.shortcut"] = "from rlmtrain.rollout.scheduler import Scheduler\n"
    sources["rlmtrain_kernels.leak"] = "def f():\n    import rlmtrain.config\n"
    found = forbidden_imports(sources, _rules())
    assert found == [
        "rlmtrain.rlm.shortcut imports rlmtrain.rollout.scheduler",
        "rlmtrain.rlm.shortcut imports rlmtrain.rollout.scheduler.Scheduler",
        "rlmtrain_kernels.leak imports rlmtrain.config",
    ]


def test_no_import_circle():
    assert import_circles(_sources()) == []


def test_the_check_finds_a_circle_hidden_in_a_function():
    sources = dict(_sources())
    sources["rlmtrain.model.chat"] += "\n\ndef _late():\n    from rlmtrain.model import tokenizer\n"
    (circle,) = import_circles(sources)
    assert {"rlmtrain.model.chat", "rlmtrain.model.tokenizer"} <= set(circle)
