"""A step's roots dealt over the ranks' engines (`rollout.dealing`): every root once, the shares
within one root of each other and contiguous, so no engine idles while another holds a queue;
the groups put back whole; and a root the same tree on whichever engine rolls it out (its ids
and sampling seeds come from its task and index), so dealing changes who computes, not what.

The dealing inside a real two-rank run (both engines working with one task a step) is
`tests/test_distributed.py`'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from leaks import leak_checked_tempfile_root
from scripted_model import DocEnv

from rlmtrain.config import ModelConfig, RolloutConfig
from rlmtrain.envs.base import Task
from rlmtrain.model import build_model
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout import dealing
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines.native import NativeEngine
from rlmtrain.rollout.scheduler import Scheduler


@pytest.mark.parametrize(
    ("tasks", "samples", "ranks"),
    [(4, 8, 2), (1, 8, 2), (3, 5, 4), (1, 2, 4), (5, 1, 3), (2, 4, 8)],
)
def test_every_root_once_in_contiguous_shares_within_one_of_each_other(tasks, samples, ranks):
    shares = dealing.deal(tasks, samples, ranks)
    assert len(shares) == ranks
    flat = [(task, sample) for share in shares for task, picks in share for sample in picks]
    assert flat == [(t, s) for t in range(tasks) for s in range(samples)]  # once, in order
    sizes = [sum(len(picks) for _, picks in share) for share in shares]
    assert max(sizes) - min(sizes) <= 1
    for share in shares:  # a task appears once per share, its samples ascending
        assert len({task for task, _ in share}) == len(share)


def test_whole_tasks_when_they_divide_and_roots_when_they_do_not():
    assert dealing.deal(4, 2, 2) == [[(0, [0, 1]), (1, [0, 1])], [(2, [0, 1]), (3, [0, 1])]]
    # One task on two engines: each rolls out half of its group.
    assert dealing.deal(1, 8, 2) == [[(0, [0, 1, 2, 3])], [(0, [4, 5, 6, 7])]]
    shares = dealing.deal(1, 8, 2)
    assert dealing.owner(0, shares) == 0
    shares = dealing.deal(3, 2, 2)  # task 1 is split; its first root is on rank 0
    assert [dealing.owner(t, shares) for t in range(3)] == [0, 0, 1]


def test_merge_puts_the_wanted_groups_back_whole_in_rank_order():
    from rlmtrain.rlm.records import Trajectory

    def root(task: str, index: int) -> Trajectory:
        return Trajectory(
            id=f"{task}#{index}", root_id=f"{task}#{index}", parent_id=None, depth=0,
            task_id=task, sample_idx=index, prompt="q", turns=[],
        )  # fmt: skip

    def part(task: int, *indices: int) -> tuple[int, RolloutGroup]:
        name = "ab"[task]
        return task, RolloutGroup(task=name, trajectories=[root(name, i) for i in indices])

    # dealing.deal(2, 3, 2): rank 0 holds a0 a1 a2 b0, rank 1 holds b1 b2
    by_rank = [[part(0, 0, 1, 2), part(1, 0)], [part(1, 1, 2)]]
    merged = dealing.merge(["a", "b"], [1], by_rank)
    assert [g.task for g in merged] == ["b"]
    assert [t.id for t in merged[0].trajectories] == ["b#0", "b#1", "b#2"]
    both = dealing.merge(["a", "b"], range(2), by_rank)
    assert [len(g.trajectories) for g in both] == [3, 3]


def _rollout(
    model: torch.nn.Module, tasks: list[Task], samples: list[list[int]] | None
) -> list[RolloutGroup]:
    tokenizer = ByteTokenizer()
    config = RolloutConfig(max_turns=2, max_new_tokens=24, max_depth=0, prompt_style="compact")

    async def main() -> list[RolloutGroup]:
        engine = NativeEngine(
            model, max_batch_size=4, kv_cache_tokens=32768, decode=tokenizer.decode
        )
        try:
            scheduler = Scheduler(
                engine, tokenizer, config, sampling=SamplingParams(temperature=1.0, seed=11)
            )
            return await scheduler.rollout(tasks, DocEnv(), 3, samples=samples)
        finally:
            await engine.close()

    return asyncio.run(main())


def test_a_root_is_the_same_tree_on_whichever_engine_rolls_it_out(tmp_path: Path):
    """Two tasks x 3 roots sampled at temperature 1 on one engine, and dealt over two engines
    (task 0's roots split between them): the merged groups hold the same completions."""
    model = build_model(ModelConfig(preset="tiny", seed=3))
    tasks = [Task(id="t0", query="what is the doc?"), Task(id="t1", query="say the doc")]
    shares = dealing.deal(len(tasks), 3, 2)
    with leak_checked_tempfile_root(tmp_path):
        alone = _rollout(model, tasks, None)
        parts = [
            _rollout(model, [tasks[t] for t, _ in share], [picks for _, picks in share])
            for share in shares
        ]
    by_rank = [
        [(task, group) for (task, _), group in zip(share, groups, strict=True)]
        for share, groups in zip(shares, parts, strict=True)
    ]
    merged = dealing.merge(tasks, range(len(tasks)), by_rank)

    def completions(groups: list[RolloutGroup]) -> dict[str, list[list[int]]]:
        return {
            t.id: [turn.completion_ids for turn in t.turns]
            for group in groups
            for t in group.trajectories
        }

    assert len(completions(alone)) == 6
    assert completions(merged) == completions(alone)
    assert len({str(c) for c in completions(alone).values()}) == 6  # sampled, not one reply
