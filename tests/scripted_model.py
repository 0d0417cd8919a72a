"""The task and the scripted "model" that the agent and scheduler tests share.

A script is a function of (query, 0-based turn) returning the reply text; `script_reply` reads
the query and turn back out of a rendered prompt (plain LM calls get the user message as query
and turn -1), so a test can drive the real prompt builder and trajectory loop deterministically.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from rlmtrain.envs.base import Env, Task
from rlmtrain.rlm.prompts import PLAIN_CALL_SYSTEM
from rlmtrain.rlm.records import RolloutGroup

__all__ = ["DocEnv", "check_links", "code", "script_reply"]

R = TypeVar("R")


class DocEnv(Env):
    """A task context of one short document; the standard library's textwrap as the tools."""

    def system_prompt(self) -> str:
        return "Strategy: look at the document, then answer."

    def context(self, task: Task) -> Any:
        return {"doc": "the quick brown fox"}

    def tool_modules(self) -> list[str]:
        return ["textwrap"]


def code(*lines: str) -> str:
    return "```python\n" + "\n".join(lines) + "\n```\n"


def script_reply(script: Callable[[str, int], R], prompt: str) -> R:
    """`script(query, turn)` for a decoded prompt."""
    if PLAIN_CALL_SYSTEM in prompt:
        question = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return script(question, -1)
    query, turn = re.findall(r"Query: (.*?)\n\nThis is turn (\d+) of", prompt, re.S)[-1]
    return script(query, int(turn) - 1)


def check_links(group: RolloutGroup) -> None:
    """What every rolled-out tree must hold, whoever ran it: parents and children name each
    other, depth and root follow the parent, each turn has a log-prob per completion token and
    ends after it starts, and the group survives a JSON round trip."""
    by_id = group.by_id()
    assert len(by_id) == len(group.trajectories)
    for trajectory in group.trajectories:
        if trajectory.parent_id is not None:
            parent = by_id[trajectory.parent_id]
            assert trajectory.id in parent.children
            assert trajectory.depth == parent.depth + 1
            assert trajectory.root_id == parent.root_id
        for child_id in trajectory.children:
            assert by_id[child_id].parent_id == trajectory.id
        for turn in trajectory.turns:
            assert len(turn.completion_ids) == len(turn.sampler_logprobs)
            assert turn.started <= turn.ended
    loaded = msgspec.json.decode(msgspec.json.encode(group), type=RolloutGroup)
    assert loaded.trajectories == group.trajectories
