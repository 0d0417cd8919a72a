"""Roots dealt by load: engines that share one claim (`Scheduler.rollout(claim=...)`, what the
inference ranks of a split world do through the launch's store) roll out every root of a step
exactly once between them, the faster engine taking more, and the groups put back together
(`training.split.in_tree_order`) are the trees one engine rolls out alone."""

from __future__ import annotations

import asyncio

import clocks
import pytest
import torch.distributed as dist
from leaks import leak_checked_tempfile_root
from scheduler_harness import make
from scripted_model import DocEnv, check_links, code

from rlmtrain.envs.base import Task
from rlmtrain.rollout import dealing
from rlmtrain.rollout.engines.sim import LatencyModel
from rlmtrain.training.split import RootClaims, in_tree_order

G = 4
TASKS = [Task(id=f"t{i}", query="deep" if i % 2 == 0 else "quick") for i in range(3)]


def script(query: str, turn: int) -> str:
    """ "deep" roots ask two helpers, each of which takes two turns; "quick" roots answer."""
    if query == "deep":
        if turn == 0:
            return code("a = rlm_query_batched(['helper one', 'helper two'])", "FINAL(a[0] + a[1])")
        raise AssertionError("the root answers in its first turn")
    if query.startswith("helper"):
        return code("print(2)") if turn == 0 else code("FINAL('H')")
    return code("FINAL('Q')")


def shared_claim(roots: int):
    """One step's claim as the inference ranks share it (`RootClaims`), on an in-process store."""
    return RootClaims(dist.HashStore()).of_step(0, roots)


def trees(groups) -> list[list[tuple]]:
    """Each group's trajectories as (id, finish reason, completions), in tree order."""
    return [
        [
            (t.id, t.finish_reason, [turn.completion_ids for turn in t.turns])
            for t in in_tree_order(group).trajectories
        ]
        for group in groups
    ]


def test_engines_sharing_a_claim_roll_out_every_root_once_the_faster_taking_more(tmp_path):
    fast, fast_engine = make(script, max_live_trees=2)
    slow, slow_engine = make(script, max_live_trees=2)
    slow_engine.latency = LatencyModel(a=0.02, b=0.001)  # ten times the fast engine's step
    alone, alone_engine = make(script, max_live_trees=2)
    claim = shared_claim(len(TASKS) * G)

    async def main():
        by_fast, by_slow = await asyncio.gather(
            fast.rollout(TASKS, DocEnv(), G, claim=claim),
            slow.rollout(TASKS, DocEnv(), G, claim=claim),
        )
        reference = await alone.rollout(TASKS, DocEnv(), G)
        for scheduler, engine in ((fast, fast_engine), (slow, slow_engine), (alone, alone_engine)):
            assert set(scheduler.live().values()) == {0}, scheduler.live()
            await engine.close()
        return by_fast, by_slow, reference

    with leak_checked_tempfile_root(tmp_path):
        by_fast, by_slow, reference = clocks.run(main())
    parts = [list(enumerate(by_fast)), list(enumerate(by_slow))]
    merged = dealing.merge(TASKS, range(len(TASKS)), parts)
    for group in merged:
        check_links(group)
        assert sorted(root.sample_idx for root in group.roots) == list(range(G))
    assert trees(merged) == trees(reference)
    roots_run = [sum(len(g.roots) for g in side) for side in (by_fast, by_slow)]
    assert sum(roots_run) == len(TASKS) * G
    assert roots_run[0] > roots_run[1] > 0, roots_run
    # Groups this engine drew no root of come back empty, in their place.
    assert [g.task.id for g in by_slow] == [t.id for t in TASKS]


def test_roots_given_both_ways_are_refused(tmp_path):
    scheduler, engine = make(script)

    async def main():
        try:
            with pytest.raises(ValueError, match="not both"):
                await scheduler.rollout(
                    TASKS, DocEnv(), G, samples=[[0]] * len(TASKS), claim=shared_claim(1)
                )
        finally:
            await engine.close()

    clocks.run(main())


def test_tree_order_is_root_by_root_in_preorder():
    from rlmtrain.rlm.records import RolloutGroup, Trajectory

    # Each trajectory's children in spawn order, as a parent records them.
    children = {
        "t#x#2": ["t#x#2.0", "t#x#2.1", "t#x#2.10"],
        "t#x#2.0": ["t#x#2.0.1"],
        "t#x#10": ["t#x#10.0"],
    }

    def trajectory(id_: str) -> Trajectory:
        root = id_.split(".")[0]
        return Trajectory(
            id=id_,
            root_id=root,
            parent_id=id_.rsplit(".", 1)[0] if "." in id_ else None,
            depth=id_.count("."),
            task_id="t#x",
            sample_idx=int(root.rsplit("#", 1)[1]),
            prompt="",
            children=children.get(id_, []),
        )

    # As two ranks' parts arrive: roots and descendants interleaved.
    ids = ["t#x#10", "t#x#2.1", "t#x#2", "t#x#10.0", "t#x#2.0.1", "t#x#2.0", "t#x#2.10"]
    group = RolloutGroup(task=Task(id="t#x", query=""), trajectories=[trajectory(i) for i in ids])
    ordered = [t.id for t in in_tree_order(group).trajectories]
    assert ordered == ["t#x#2", "t#x#2.0", "t#x#2.0.1", "t#x#2.1", "t#x#2.10", "t#x#10", "t#x#10.0"]


def test_a_window_keeps_the_first_engine_from_taking_a_step_that_fits_it(tmp_path):
    # Room for every root on each engine: without a window the engine that starts first
    # would claim all twelve before the other asks.
    first, first_engine = make(script, max_live_trees=32)
    second, second_engine = make(script, max_live_trees=32)
    claim = shared_claim(len(TASKS) * G)
    half = len(TASKS) * G // 2

    async def main():
        taken = await asyncio.gather(
            first.rollout(TASKS, DocEnv(), G, claim=claim, window=half),
            second.rollout(TASKS, DocEnv(), G, claim=claim, window=half),
        )
        await first_engine.close()
        await second_engine.close()
        return taken

    with leak_checked_tempfile_root(tmp_path):
        taken = clocks.run(main())
    assert [sum(len(g.roots) for g in side) for side in taken] == [half, half]
