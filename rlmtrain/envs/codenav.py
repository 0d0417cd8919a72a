"""Code navigation (docs/algorithm.md §2): answer "where does A call B?" about a Python code base.

The REPL's `context` is the code base as one string with position markers (`codenav_tools.
render_codebase`); the model navigates it with `search_code`, `goto_definition` and `list_calls`
and answers with the call's position, `path:line`. Tasks are generated from any Python package
directory: for every function A and every callee B that A's body calls exactly once, one task
(a callee called twice would have two right answers). The gold answer and the scripted expert
both come from the AST (`codenav_tools.CodeIndex`), so they are exact.

Reward: 1.0 when the first `path.py:line` in the answer is the gold position, else 0.0 — a
verifiable reward, no judge needed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from rlmtrain.config import Config, RolloutConfig
from rlmtrain.envs.base import (
    Env,
    RewardResult,
    Task,
    read_tasks_beside,
    register_env,
    root_answers,
    write_tasks,
)
from rlmtrain.envs.codenav_tools import CodeIndex, render_codebase
from rlmtrain.rlm.records import RolloutGroup

__all__ = [
    "CodeNavEnv",
    "CodeTask",
    "answer_position",
    "expert_answer",
    "generate_tasks",
    "package_files",
]


class CodeTask(Task):
    codebase: str
    """Package directory; relative = relative to the task file."""
    caller: str
    """Qualified name of A inside its file."""
    caller_path: str
    """A's file, as the context names it (e.g. "json/decoder.py")."""
    callee: str
    """B as written at the call site."""
    answer: str
    """Gold position "path:line" of the call."""


TASKS_PER_PACKAGE = 4
"""Tasks a synthesised package yields (of the dozens it could)."""

_POSITION = re.compile(r"[\w./\\-]+\.py:\d+")


def answer_position(answer: str | None) -> str | None:
    """The first "path.py:line" in an answer, or None."""
    if not answer:
        return None
    match = _POSITION.search(answer)
    return match.group(0) if match else None


def package_files(directory: str | Path) -> list[tuple[str, str]]:
    """(path, source) of every .py file under `directory`, sorted, paths starting with the
    directory's own name (so "json/decoder.py", not "decoder.py")."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"code base directory not found: {root}")
    files = []
    for file in sorted(root.rglob("*.py")):
        if "__pycache__" in file.parts:
            continue
        try:
            source = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        files.append((file.relative_to(root.parent).as_posix(), source))
    if not files:
        raise ValueError(f"code base directory has no .py files: {root}")
    return files


def expert_answer(index: CodeIndex, caller_path: str, caller: str, callee: str) -> str:
    """The exact position of A's call of B, read from the AST; ValueError if not unique."""
    found = [
        f"{d.path}:{line}"
        for d in index.find(f"{caller_path}:{caller}")
        if d.qualname == caller and d.kind == "function"
        for name, line in d.calls
        if name == callee
    ]
    if len(found) != 1:
        raise ValueError(f"{caller_path}:{caller} calls {callee!r} {len(found)} times, not once")
    return found[0]


def _query(caller: str, caller_path: str, callee: str) -> str:
    # Names are quoted as Python writes them, each a word of its own: code can cut them out of
    # the REPL's `query` at the quotes, and the tokenizer splits them as it splits them in code.
    return (
        f"Where does the function {caller!r} of the file {caller_path!r} call {callee!r} in "
        "its body? Answer with the position of the call as path:line."
    )


def generate_tasks(
    directory: str | Path, n: int | None = None, seed: int = 0, codebase: str | None = None
) -> list[CodeTask]:
    """Tasks from a package directory: all of them (n=None) or `n` drawn with `seed`.

    `codebase` is what the tasks record as their directory (default: the absolute path).
    """
    index = CodeIndex(render_codebase(package_files(directory)))
    candidates = []
    for d in index.definitions:
        if d.kind != "function":
            continue
        names = [name for name, _ in d.calls]
        for callee, line in d.calls:
            if names.count(callee) == 1:
                candidates.append((d, callee, f"{d.path}:{line}"))
    if n is not None:
        candidates = random.Random(seed).sample(candidates, min(n, len(candidates)))
    where = codebase if codebase is not None else str(Path(directory).resolve())
    return [
        CodeTask(
            id=f"codenav-{seed}-{i}",
            query=_query(d.qualname, d.path, callee),
            codebase=where,
            caller=d.qualname,
            caller_path=d.path,
            callee=callee,
            answer=answer,
        )
        for i, (d, callee, answer) in enumerate(candidates)
    ]


STRATEGY = """\
You answer questions about a Python code base. `context` is the whole code base as one string:
every line is prefixed with its position "path:line| ", and each definition is announced by a
line "=== def name @ path:line ===". Do not print it whole. Use goto_definition(name) to read the
function the question is about, list_calls(name) to see the calls its body makes with their
positions, and search_code(text) for anything else. Answer with the position of the call as
path:line, e.g. FINAL("pkg/util.py:42"). Usually 2-3 turns."""


class CodeNavEnv(Env):
    name = "codenav"
    task_type = CodeTask

    def __init__(self, flawed_share: float = 0.0) -> None:
        self._codebases: dict[str, str] = {}
        self.flawed_share = flawed_share
        """The share of the tasks the teacher plays with a flawed plan (`codenav_teacher`)."""

    def system_prompt(self) -> str:
        return STRATEGY

    def context(self, task: CodeTask) -> str:
        key = str(Path(task.codebase).resolve())
        if key not in self._codebases:
            self._codebases[key] = render_codebase(package_files(key))
        return self._codebases[key]

    def tool_modules(self) -> list[str]:
        return ["rlmtrain.envs.codenav_tools"]

    def teacher(self, rollout: RolloutConfig) -> Callable[[str], str]:
        """The scripted teacher's reply (`codenav_teacher`), for `rollout.teaching.teach`."""
        from rlmtrain.envs.codenav_teacher import teacher

        return teacher(rollout, self.flawed_share)

    def load_tasks(self, path: str | Path) -> list[CodeTask]:
        tasks = read_tasks_beside(path, CodeTask, "codebase", folder=True)
        for task in tasks:  # read (and kept) now: a code base that cannot be is named up front
            self.context(task)
        return tasks

    def synthesize(self, out_dir: Path, *, groups: int, first_group: int, config: Config) -> Path:
        """One synthetic package per group (`codenav_synth`) under `out_dir/code`, and
        `TASKS_PER_PACKAGE` tasks drawn from each."""
        from rlmtrain.envs.codenav_synth import write_packages

        seed = config.data.seed
        tasks = []
        span = range(first_group, first_group + groups)
        for group, package in zip(span, write_packages(out_dir / "code", seed, span), strict=True):
            drawn = generate_tasks(
                package, n=TASKS_PER_PACKAGE, seed=seed, codebase=f"code/{package.name}"
            )
            tasks += [
                msgspec.structs.replace(task, id=f"codenav-{seed}-{group}-{i}")
                for i, task in enumerate(drawn)
            ]
        path = out_dir / "tasks.jsonl"
        write_tasks(path, tasks)
        return path

    def vocabulary_texts(self, tasks: list[CodeTask]) -> list[str]:
        """The base texts, the tasks' code bases as the REPL shows them and the teacher's code
        once per task (it is the same for every task and names nothing of it, so counting it
        per task weights it up without giving any task's names tokens of their own)."""
        from rlmtrain.envs.codenav_teacher import plan

        texts = super().vocabulary_texts(tasks)
        texts += list(dict.fromkeys(self.context(task) for task in tasks))
        for task in tasks:
            try:
                texts += plan(task.query, self.flawed_share)
            except ValueError:
                continue  # a question of the user's own the teacher has no plan for: no code
        return texts

    async def reward(self, task: CodeTask, group: RolloutGroup) -> RewardResult:
        scores: list[float | None] = []
        details: list[dict[str, Any]] = []
        for answer in root_answers(group):
            position = answer_position(answer)
            scores.append(1.0 if position == task.answer else 0.0)
            details.append({"method": "exact_position", "position": position})
        return RewardResult(scores=scores, details=details)


@register_env("codenav")
def make_codenav(config: Config | None) -> CodeNavEnv:
    return CodeNavEnv(config.data.teacher_flawed_share if config is not None else 0.0)
