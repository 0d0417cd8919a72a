"""A step's roots dealt over the ranks' engines, and the groups put back together after.

A step (or an evaluation) has `tasks x G` roots. Dealing whole tasks (`tasks[rank::size]`)
left engines idle whenever the tasks were fewer than the ranks, and half of them idle on a
shipped config (4 tasks on 8 GPUs). Roots are dealt instead: the task-major list of roots is cut
into one contiguous run per rank whose lengths differ by at most one, so every engine gets the
same number of trees, and a rank holds as few tasks (REPL zygotes) as that allows; with tasks a
multiple of the ranks it is the whole-task deal. A root's ids and sampling seeds come from its
task and index alone, so the trees are the same on any number of ranks.

A group's advantages need all its roots, so each group is scored on one rank, the one holding
its first root (`owner`), which receives the other ranks' parts of it (only the groups a share
boundary cut travel) and puts it back whole (`merge`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rlmtrain.rlm.records import RolloutGroup


def deal(n_tasks: int, n_samples: int, size: int) -> list[list[tuple[int, list[int]]]]:
    """Per rank, the (task index, sample indices) it rolls out, tasks in order."""
    roots = [(task, sample) for task in range(n_tasks) for sample in range(n_samples)]
    base, extra = divmod(len(roots), size)
    shares: list[list[tuple[int, list[int]]]] = []
    start = 0
    for rank in range(size):
        stop = start + base + (rank < extra)
        mine: list[tuple[int, list[int]]] = []
        for task, sample in roots[start:stop]:
            if mine and mine[-1][0] == task:
                mine[-1][1].append(sample)
            else:
                mine.append((task, [sample]))
        shares.append(mine)
        start = stop
    return shares


def owner(task: int, shares: list[list[tuple[int, list[int]]]]) -> int:
    """The rank that scores task `task`'s group: the one holding its first root."""
    return next(rank for rank, mine in enumerate(shares) if any(t == task for t, _ in mine))


def merge(
    tasks: Sequence[Any], wanted: Iterable[int], parts_by_rank: list[list[tuple[int, RolloutGroup]]]
) -> list[RolloutGroup]:
    """The whole groups of the `wanted` task indices, in task order, from every rank's
    (task index, partial group) pairs; a group's trajectories in rank order."""
    merged = {task: RolloutGroup(task=tasks[task], trajectories=[]) for task in wanted}
    for parts in parts_by_rank:
        for task, group in parts:
            if task in merged:
                merged[task].trajectories.extend(group.trajectories)
    return [merged[task] for task in sorted(merged)]
