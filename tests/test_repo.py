"""The repository's promises: README's two commands, CI running its test command, the reference."""

import re
import subprocess
from pathlib import Path

from rlmtrain.config import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _setup_commands() -> list[str]:
    block = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)\n(.*?)\n```", block, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = _setup_commands()
    assert len(commands) == 2
    assert all("\n" not in c.strip() for c in commands), "each set-up command is one line"
    assert "configs/tiny-cpu.toml" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_after_lint():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ruff = lines.index(".venv/bin/ruff check . && .venv/bin/ruff format --check .")
    install, pytest = lines[ruff - 1], lines[ruff + 1]
    assert f"{install} && {pytest}" == _setup_commands()[1].strip()
    assert "set -euo pipefail" in lines


def test_readme_config_reference_is_current():
    assert reference_markdown() in README, (
        "regenerate: python -c 'from rlmtrain.config import reference_markdown as r; print(r())'"
    )


def test_top_level_layout():
    allowed = {
        "csrc",
        "rlmtrain",
        "kernels",
        "bench",
        "tests",
        "configs",
        "docs",
        "LICENSE",
        "pyproject.toml",
        "README.md",
        ".ci",
    }
    tool_files = {".gitignore", "conftest.py"}
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    top = {line.split("/", 1)[0] for line in listed.splitlines()}
    assert top - allowed - tool_files == set(), "unexpected top-level entries"


# A path ending in .md, not part of a longer word or path (so "docs/algorithm.md" as a whole).
_MD_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.md)\b")


def test_every_cited_markdown_file_is_in_the_repository():
    """Comments and docstrings cite `docs/algorithm.md §4` and the like; each must be there."""
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.sh", "*.toml", "*.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    cited: dict[str, set[str]] = {}
    for name in listed:
        for path in _MD_PATH.findall((ROOT / name).read_text()):
            cited.setdefault(path, set()).add(name)
    assert "docs/algorithm.md" in cited and "docs/architecture.md" in cited
    missing = {path: sorted(where) for path, where in cited.items() if not (ROOT / path).is_file()}
    assert not missing, f"cited but not in the repository: {missing}"


def test_a_module_over_600_lines_says_why_at_its_top():
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    unexplained = []
    for name in listed:
        lines = (ROOT / name).read_text().splitlines()
        if len(lines) > 600 and not any("Why one file:" in line for line in lines[:40]):
            unexplained.append(f"{name} ({len(lines)} lines)")
    assert not unexplained, f"split these, or say why they are one file: {unexplained}"


def test_the_training_script_stays_a_table_of_contents():
    lines = (ROOT / "rlmtrain" / "train.py").read_text().splitlines()
    assert len(lines) <= 400, f"rlmtrain/train.py has {len(lines)} lines; its parts go in training/"


def test_no_function_of_the_trainer_takes_more_than_8_parameters():
    """Named parameters (a `**options` pass-through is not one); a longer list wants an object."""
    import ast

    crowded = []
    for path in sorted((ROOT / "rlmtrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                names = [n for n in names if n not in ("self", "cls")]
                if len(names) > 8:
                    crowded.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not crowded, crowded
