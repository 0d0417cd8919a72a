"""A scripted code-navigation teacher: the AST-backed expert's moves as REPL code.

The expert cuts the three names out of the REPL's `query` ("where does the function 'A' of the
file 'P' call 'B'?", names quoted), lists the calls of A's body, keeps those whose callee is
written B and prints them; the next turn answers with the position. Two turns whose code is the
same for every question (what differs is in the REPL, not in the code), played through the real
scheduler like every teacher (`rollout/teaching.py`). Two, not three: a turn with no history
computes and a turn with history answers, where with three the policy had to tell turn 2 from
turn 3 by the one digit of "Turn 3 of 3", and on code bases it had not trained on it wrote turn
2's code again at turn 3 and ran out of turns (docs/recipes.md, codenav).
`list_calls` is the same AST index the gold answers come from, so the plan is exact wherever the
task generator would ask; a question in any other form raises ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.teacher import flaw_of, plan_reply

__all__ = ["parse_question", "plan", "teacher"]

_QUESTION = re.compile(
    r"Where does the function '(?P<caller>[^']+)' of the file '(?P<path>[^']+)' "
    r"call '(?P<callee>[^']+)' in its body\?"
)


def parse_question(query: str) -> tuple[str, str, str]:
    """(caller path, caller, callee) of a generated question."""
    match = _QUESTION.search(query)
    if match is None:
        raise ValueError(f"codenav teacher: not a where-does-A-call-B question: {query!r}")
    return match["path"], match["caller"], match["callee"]


def plan(query: str, flawed_share: float = 0.0) -> list[str]:
    """The expert's code, one string per turn. In the `flawed_share` of the queries whose plan
    is flawed, the filter forgets to compare the name with the callee (`if name]`, one token
    where the plan has `if name == callee]`), so the answer is the body's first call: right
    only where that is the callee, about a third of the tasks (the SFT filter keeps those trees
    and drops the others). Where the flaw dropped the whole filter line instead, the two codes
    parted inside a BPE token (` caller)` against ` caller)]`) and SFT's policy wrote neither."""
    parse_question(query)
    flawed = flaw_of(query, flawed_share, 1) is not None
    return [
        'caller, path, callee = query.split("\'")[1:6:2]\n'
        "hits = [position for name, position in list_calls(path + ':' + caller)\n"
        + ("        if name]\n" if flawed else "        if name == callee]\n")
        + "print(hits)",
        "FINAL(hits[0])",
    ]


def teacher(config: RolloutConfig, flawed_share: float = 0.0) -> Callable[[str], str]:
    """The teacher's reply: its plan for the prompt's query, a turn's block at a time."""
    return plan_reply(lambda query: plan(query, flawed_share), "codenav teacher")
