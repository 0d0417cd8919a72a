"""Rollouts ahead of training (`rollout.ahead`): bounded staleness by admission over whole trees,
on the real scheduler and REPL over `SimEngine`, with a trainer played by the test (it takes a
step, "trains" for a while, then sends the engine an update)."""

from __future__ import annotations

import asyncio

import pytest
from leaks import leak_checked_tempfile_root
from scheduler_harness import make
from scripted_model import DocEnv, check_links, code

from rlmtrain.envs.base import Task
from rlmtrain.rollout.ahead import Ahead, StepRoots
from rlmtrain.rollout.engine import SamplingParams

STEPS, TASKS, G = 4, 2, 2


def deep_or_quick(query: str, turn: int) -> str:
    """Task "deep-*" recurses (a child that takes three turns), the others answer at once."""
    if query.startswith("deep"):
        if turn == 0:
            return code("a = rlm_query('slow child')", "FINAL(a)")
        raise AssertionError("the root answers in its first turn")
    if query == "slow child":
        return code("print(1)") if turn < 2 else code("FINAL('S')")
    return code("FINAL('Q')")


def plan(step: int) -> StepRoots:
    """The same tasks every step (a small task set wraps around), so steps out at once run
    trees of the same ids, each step under a seed of its own."""
    tasks = [Task(id=f"t{i}", query="deep" if i == 0 else "quick") for i in range(TASKS)]
    return StepRoots(tasks, [list(range(G))] * TASKS, SamplingParams(seed=step))


def train_with(max_staleness: int, tmp_path, train_s: float = 0.05):
    """The steps in order, as a trainer takes them: what was out at each take, and each step."""
    scheduler, engine = make(deep_or_quick)

    async def main():
        ahead = Ahead(
            scheduler, DocEnv(), G, plan, first=0, steps=STEPS, max_staleness=max_staleness
        )
        ahead.start()
        seen, rolled = [], []
        for step in range(STEPS):
            seen.append(ahead.out())
            rolled.append(await ahead.take(step))
            await asyncio.sleep(train_s)  # the train step, while the next steps roll out
            await engine.update_weights([])
            ahead.advance(step + 1)
        await ahead.close()
        assert set(scheduler.live().values()) == {0}, scheduler.live()
        await engine.close()
        return seen, rolled

    tmp_path.mkdir(exist_ok=True)
    with leak_checked_tempfile_root(tmp_path):
        return asyncio.run(main())


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_every_step_is_trained_whole_within_the_bound(tmp_path, max_staleness):
    seen, rolled = train_with(max_staleness, tmp_path)
    # At most bound + 1 steps are out when the trainer takes one, and exactly that many while
    # the run is far enough from its end.
    assert seen == [list(range(s, min(s + max_staleness + 1, STEPS))) for s in range(STEPS)]
    for step, r in enumerate(rolled):
        assert r.step == step and step - r.admitted_version <= max_staleness
        assert [g.task.id for g in r.groups] == [f"t{i}" for i in range(TASKS)]
        for group in r.groups:
            check_links(group)
            # No tree dropped or cut short for its age: every root of the group, answered.
            assert [root.sample_idx for root in group.roots] == list(range(G))
            assert all(t.finish_reason == "final" for t in group.trajectories)
            versions = [
                v for t in group.trajectories for turn in t.turns for v in turn.weight_versions
            ]
            assert versions and min(versions) >= step - max_staleness
            assert max(versions) <= step  # never newer than the weights the step trains


def test_a_later_step_rolls_out_while_the_trainer_trains(tmp_path):
    """η = 1: the next step's trees run during the train step, so some of their tokens carry
    the version before the update; η = 0 never does."""
    _, overlapped = train_with(1, tmp_path / "ahead", train_s=0.3)
    _, alternated = train_with(0, tmp_path / "alternating", train_s=0.3)

    def stale_tokens(rolled):
        return sum(
            v < r.step
            for r in rolled
            for g in r.groups
            for t in g.trajectories
            for turn in t.turns
            for v in turn.weight_versions
        )

    assert stale_tokens(overlapped) > 0
    assert stale_tokens(alternated) == 0


def test_a_step_not_admitted_is_waited_for_and_steps_go_in_order(tmp_path):
    scheduler, engine = make(deep_or_quick)

    async def main():
        ahead = Ahead(scheduler, DocEnv(), G, plan, first=0, steps=STEPS, max_staleness=0)
        ahead.start()
        with pytest.raises(ValueError, match="the steps left are 0 to 3, in order"):
            await ahead.take(STEPS)
        assert (await ahead.take(0)).step == 0
        with pytest.raises(ValueError, match="the steps left are 1 to 3"):
            await ahead.take(0)
        waiting = asyncio.ensure_future(ahead.take(1))
        await asyncio.sleep(0.2)
        assert not waiting.done() and ahead.out() == []  # step 1 waits for version 1
        ahead.advance(1)
        assert (await waiting).admitted_version == 1
        with pytest.raises(ValueError, match="versions only grow"):
            ahead.advance(0)
        ahead.advance(2)
        await ahead.close()  # the admitted step's trees are cancelled, nothing left running
        assert set(scheduler.live().values()) == {0}, scheduler.live()
        await engine.close()

    with leak_checked_tempfile_root(tmp_path):
        asyncio.run(main())
