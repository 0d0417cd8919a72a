"""A scripted code-navigation teacher: the AST-backed expert's moves as REPL code.

The expert parses the question ("where does `A` (defined in P) call `B`?"), reads A's definition,
lists the calls of A's body, keeps those whose callee is written `B`, and answers with the
position: three turns through the real trajectory loop (`rlm.scripted.ScriptedPolicy` plays
them). `list_calls` is the same AST index the gold answers come from, so the plan is exact
wherever the task generator would ask; a question in any other form raises ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rlmtrain.envs.base import Env, Task
from rlmtrain.envs.booknav_teacher import run_scripted
from rlmtrain.rlm.agent import ChatTokenizer
from rlmtrain.rlm.records import RolloutGroup

__all__ = ["parse_question", "plan", "teach"]

_QUESTION = re.compile(
    r"Where does the function `(?P<caller>[^`]+)` \(defined in (?P<path>[^)\s]+)\) "
    r"call `(?P<callee>[^`]+)`\?"
)


def parse_question(query: str) -> tuple[str, str, str]:
    """(caller path, caller, callee) of a generated question."""
    match = _QUESTION.search(query)
    if match is None:
        raise ValueError(f"codenav teacher: not a where-does-A-call-B question: {query!r}")
    return match["path"], match["caller"], match["callee"]


def plan(query: str) -> list[str]:
    """The expert's code, one string per turn."""
    path, caller, callee = parse_question(query)
    target = f"{path}:{caller}"
    return [
        f"where = goto_definition({target!r})",
        f"calls = list_calls({target!r})\n"
        f"hits = [position for name, position in calls if name == {callee!r}]\n"
        "print(hits)",
        "FINAL(hits[0])",
    ]


async def teach(
    env: Env, tasks: Sequence[Task], tokenizer: ChatTokenizer, **kwargs: Any
) -> list[RolloutGroup]:
    """Teacher trees for code-navigation tasks (`run_scripted` with this module's `plan`)."""
    return await run_scripted(env, tasks, plan, tokenizer, **kwargs)
