"""The task and the scripted "model" that the agent and scheduler tests share.

A script is a function of (query, 0-based turn) returning the reply text; `script_reply` reads
the query and turn back out of a rendered prompt (plain LM calls get the user message as query
and turn -1), so a test can drive the real prompt builder and trajectory loop deterministically.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from rlmtrain.envs.base import Env, Task
from rlmtrain.rlm.prompts import PLAIN_CALL_SYSTEM

__all__ = ["DocEnv", "code", "script_reply"]

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
