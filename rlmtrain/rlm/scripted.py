"""A scripted policy: a `GenerateFn` that plays a fixed plan of code blocks, one per turn.

Teachers (`envs.booknav_teacher`, `envs.codenav_teacher`, `envs.evidence_teacher`) must leave
the same records a policy leaves, so they play through the real trajectory loop and REPL with
this in place of an engine: turn t gets the t-th block of the plan, fenced and encoded by the
student's tokenizer, with log-probs 0 (a deterministic policy). `play_plan` runs one trajectory
that way in a fresh session of a zygote.
"""

from __future__ import annotations

from typing import Any

from rlmtrain.rlm.agent import Agent, AgentLimits, ChatTokenizer, SpawnFn, run_trajectory
from rlmtrain.rlm.generation import Completion, SamplingParams
from rlmtrain.rlm.prompts import RLMEnv
from rlmtrain.rlm.records import Trajectory
from rlmtrain.rlm.repl import Zygote

__all__ = ["ScriptedPolicy", "fenced_code", "play_plan"]


def fenced_code(code: str) -> str:
    return f"```python\n{code}\n```\n"


class ScriptedPolicy:
    """A `GenerateFn` playing one trajectory's plan: request t gets block t.

    One instance per trajectory. Requests past the end of the plan are aborted (the trajectory
    ends "aborted"), so a plan that failed in the REPL cannot pass for a finished one.
    """

    def __init__(self, blocks: list[str], tokenizer) -> None:
        self.blocks = list(blocks)
        self.tokenizer = tokenizer
        self.requests = 0

    async def __call__(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        turn = self.requests
        self.requests += 1
        if turn >= len(self.blocks):
            return Completion(token_ids=[], logprobs=[], finish_reason="abort")
        text = fenced_code(self.blocks[turn])
        # Like an engine: generation ends on a stop string (kept in the ids, as vLLM does) or,
        # failing one, on the end-of-turn token.
        stops = [s for s in params.stop_strings if s in text]
        if stops:
            cut = min(text.index(s) + len(s) for s in stops)
            ids = self.tokenizer.encode(text[:cut])
        else:
            ids = self.tokenizer.encode(text) + list(params.stop_token_ids[:1])
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")


async def play_plan(
    blocks: list[str],
    trajectory: Trajectory,
    *,
    env: RLMEnv,
    tokenizer: ChatTokenizer,
    limits: AgentLimits,
    zygote: Zygote,
    task: Any,
    spawn: SpawnFn,
    context: Any | None = None,
) -> None:
    """Plays `blocks` as `trajectory` (filled in place) through `run_trajectory`, in a session of
    `zygote` forked with `context` (None = the zygote's) and closed afterwards."""
    agent = Agent(
        env=env, generate=ScriptedPolicy(blocks, tokenizer), tokenizer=tokenizer, limits=limits
    )
    session = await zygote.session(context=context)
    try:
        await run_trajectory(
            agent, trajectory, task=task, session=session, spawn=spawn, context=context
        )
    finally:
        await session.close()
