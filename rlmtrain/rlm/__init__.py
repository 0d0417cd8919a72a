"""The RLM scaffold: jailed REPL, per-turn prompts, code extraction, the trajectory loop, records.

    records.py     Turn / Trajectory / RolloutGroup, JSONL in and out
    generation.py  SamplingParams, Completion, GenerateFn: the engine-agnostic request types
    prompts.py     RLMEnv protocol; system prompt, history budget, fresh per-turn query message
    extract.py     the code-block rule: the first ```python block runs
    agent.py       run_trajectory / run_plain_call, AgentLimits, ChildCall, child_answer
    repl.py        Zygote / Session / ReplLimits: forked, jailed workers (worker.py, builtins.py,
                   protocol.py run partly inside them; control.py reads the zygote's socket)

The names below are importable from `rlmtrain.rlm` but loaded on first use (PEP 562): REPL
workers import modules of this package, and must not pay for the agent and its imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Agent": "agent",
    "AgentLimits": "agent",
    "ChildCall": "agent",
    "SpawnFn": "agent",
    "child_answer": "agent",
    "root_trajectory": "agent",
    "run_plain_call": "agent",
    "run_trajectory": "agent",
    "Completion": "generation",
    "GenerateFn": "generation",
    "SamplingParams": "generation",
    "RLMEnv": "prompts",
    "extract_code": "extract",
    "RolloutGroup": "records",
    "ToolCall": "records",
    "Trajectory": "records",
    "Turn": "records",
    "read_groups": "records",
    "write_groups": "records",
    "ExecResult": "repl",
    "ReplLimits": "repl",
    "Session": "repl",
    "Zygote": "repl",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlmtrain.rlm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlmtrain.rlm.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
