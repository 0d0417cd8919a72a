"""What every env's scripted teacher is made of: a reply that reads a rendered prompt and answers.

Cold-start SFT data (docs/algorithm.md §5) must be the records a policy leaves, so every env's
teacher is played through exactly the path RL takes (`rollout.teaching.teach`: the `Scheduler`,
its REPLs, limits and records, with a scripted engine over the reply). A reply
reads the prompt as a policy would, from its last user message alone (the query and the turn
number), and answers with that turn's block of the expert's plan, fenced; past the end of its
plan it says nothing, so a plan that failed in the REPL cannot pass for a finished one.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable

__all__ = ["fenced_code", "flaw_of", "last_user_message", "plan_reply", "query_and_turn"]

log = logging.getLogger("rlmtrain")

# Both prompt styles: "Query: <q>\n\nThis is turn N of M ..." and "Query: <q>\nTurn N of M."
_QUERY_AND_TURN = re.compile(
    r"Query: (?P<query>.*?)\n+(?:This is turn|Turn) (?P<turn>\d+) of \d+", re.S
)


def fenced_code(code: str) -> str:
    return f"```python\n{code}\n```\n"


def last_user_message(prompt_text: str) -> str:
    """The fresh user message that ends a rendered chat prompt."""
    return prompt_text.rsplit("<|im_start|>user", 1)[-1]


def query_and_turn(prompt_text: str, who: str) -> tuple[str, int]:
    """The query and the 0-based turn index of the prompt's last user message; ValueError
    naming `who` when the message is not one of the templated ones."""
    fresh = last_user_message(prompt_text)
    matches = list(_QUERY_AND_TURN.finditer(fresh))
    if not matches:
        raise ValueError(f"{who}: no query or turn in the prompt: {fresh[-300:]!r}")
    return matches[-1]["query"].strip(), int(matches[-1]["turn"]) - 1


def flaw_of(query: str, share: float, flaws: int) -> int | None:
    """Which of a teacher's `flaws` flawed variants of its plan it plays for `query`, or None
    for the plan itself. A `share` of the queries get a flaw, spread evenly over the variants;
    the draw is a CRC of the query, the same in every process and run, so every turn of a tree
    (and its children, who see the same query) plays the same variant."""
    draw = zlib.crc32(query.encode()) / 2**32
    if draw >= share:
        return None
    return min(int(draw / share * flaws), flaws - 1)


def plan_reply(plan_of: Callable[[str], list[str]], who: str) -> Callable[[str], str]:
    """The reply of a teacher whose plan depends on the query alone."""

    def reply(prompt_text: str) -> str:
        query, turn = query_and_turn(prompt_text, who)
        blocks = plan_of(query)
        return fenced_code(blocks[turn]) if turn < len(blocks) else ""

    return reply
