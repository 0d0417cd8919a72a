"""The scheduler tests' harness: a scripted model served by `SimEngine` through the byte
tokenizer, a scheduler over it, one rollout run with its leak checks, and what the tests read
from inside a running scheduler. Rollouts run on `clocks.SkippingLoop` (see `tests/clocks.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import clocks
from leaks import leak_checked_tempfile_root
from scripted_model import DocEnv, check_links, script_reply

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.base import Task
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rlm.records import RolloutGroup, Trajectory
from rlmtrain.rollout.engine import Completion, EngineStats, SamplingParams
from rlmtrain.rollout.engines.sim import LatencyModel, SimEngine, text_script
from rlmtrain.rollout.scheduler import Scheduler

TOKENIZER = ByteTokenizer()
Script = Callable[[str, int], str]
"""(query, 0-based turn) -> reply text; plain LM calls get turn -1."""
NEVER = "<generate until max_new_tokens>"


def reply_of(script: Script) -> Callable[[str], str]:
    def reply(prompt: str) -> str:
        text = script_reply(script, prompt)
        return "x" * 100_000 if text == NEVER else text

    return reply


def make(script: Script, **config: Any) -> tuple[Scheduler, SimEngine]:
    engine = SimEngine(
        script=text_script(TOKENIZER, reply_of(script)),
        eos_id=TOKENIZER.eos_id,
        latency=LatencyModel(a=0.002, b=0.0001),
        max_batch_size=8,
        decode=TOKENIZER.decode,
    )
    defaults = {
        "max_turns": 4,
        "max_depth": 2,
        "max_new_tokens": 512,
        "max_prompt_tokens": 16384,
        "repl_timeout_s": 30.0,
        "tree_timeout_s": 60.0,
    }
    scheduler = Scheduler(engine, TOKENIZER, RolloutConfig(**{**defaults, **config}))
    return scheduler, engine


def run(
    scheduler: Scheduler,
    engine: SimEngine,
    tmp_path: Path,
    *,
    tasks: list[Task] | None = None,
    n_samples: int = 1,
    during: Callable[[Scheduler, SimEngine], Any] | None = None,
) -> list[RolloutGroup]:
    """One rollout, with `during(scheduler, engine)` run beside it (cancelled if still running
    when the rollout returns); then the leak checks."""
    tasks = tasks or [Task(id="t0", query="ROOT")]

    async def main() -> list[RolloutGroup]:
        async with asyncio.TaskGroup() as group:
            rollout = group.create_task(scheduler.rollout(tasks, DocEnv(), n_samples))
            if during is not None:
                beside = group.create_task(during(scheduler, engine))
                rollout.add_done_callback(lambda _: beside.cancel())
        groups = rollout.result()
        assert set(scheduler.live().values()) == {0}, scheduler.live()
        stats = engine.stats()
        assert (stats.running, stats.waiting) == (0, 0)
        await engine.wait_idle()
        await engine.close()
        return groups

    with leak_checked_tempfile_root(tmp_path):
        groups = clocks.run(main())
    for group in groups:
        check_links(group)
    return groups


class Callers:
    """`engine` passed through, knowing which tasks are inside its `generate`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inside: set[asyncio.Task[Any]] = set()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        caller = asyncio.current_task()
        self.inside.add(caller)
        try:
            return await self.engine.generate(prompt_ids, params)
        finally:
            self.inside.discard(caller)

    def stats(self) -> EngineStats:
        return self.engine.stats()


def records(scheduler: Scheduler) -> Iterable[Trajectory]:
    """The trajectories of the trees running now (read from inside the scheduler)."""
    return (t for tree in scheduler._trees.values() for t in tree.run.group.trajectories)


def in_exec(scheduler: Scheduler, prompt: str) -> bool:
    """Whether a running trajectory of `prompt` has reached its first exec: a turn is recorded
    when its completion comes in, and the exec, its timeout set, starts in that same step."""
    return any(t.prompt == prompt and t.turns for t in records(scheduler))


async def skip_when(condition: Callable[[], bool], seconds: float) -> None:
    """Once `condition()` holds, skip the clock `seconds` ahead: the timeouts it passes fire."""
    await clocks.until(condition, "the point a timeout must fire")
    clocks.skip(seconds)


def shape(group: RolloutGroup, trajectory_id: str) -> Any:
    """A tree as nested (id, finish_reason, [children...])."""
    t = group.by_id()[trajectory_id]
    return (t.id, t.finish_reason, [shape(group, c) for c in t.children])
