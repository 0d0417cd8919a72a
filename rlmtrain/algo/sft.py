"""Cold-start SFT on teacher trees through the RL sample path (docs/algorithm.md §5).

Teacher trajectories are the same records as rollouts. A tree (a root and all its descendants)
is dropped if any of its turns hit a REPL error, otherwise if its root scores <= 0 (span F1 of
zero; a judge's negative score likewise); each drop is counted by reason, errors checked first.
Dropping the whole tree for a child's error keeps the root from being taught to build on a
failed call.

The kept trees become samples exactly as rollouts do, with advantage 1 on every turn: within a
teacher group the kept roots share 1/G, children are averaged by 1/k, tokens by the configured
aggregation, and groups by their number. So sum(weight * -log p) is the NLL mean that matches
the RL objective's normalisation, and the same packing and log-prob kernel serve both phases.
The scoring function is a parameter (span F1 lives in rewards/, which algo/ does not import).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from rlmtrain.algo.advantages import GroupAdvantages
from rlmtrain.algo.samples import Sample, build_samples
from rlmtrain.config import AlgoConfig
from rlmtrain.rlm.records import RolloutGroup, Trajectory

__all__ = ["SftFilterStats", "build_sft_samples", "filter_teacher"]

Score = Callable[[Trajectory, Any], float]
"""score(root, task) -> float, e.g. span F1 of the root's answer against the task's truth."""


class SftFilterStats(msgspec.Struct, kw_only=True):
    trees: int = 0
    kept: int = 0
    repl_error: int = 0
    """Trees dropped because some turn of some trajectory in them had a REPL error."""
    zero_score: int = 0
    """Error-free trees dropped because their root scored <= 0."""


def filter_teacher(
    groups: Sequence[RolloutGroup], score: Score
) -> tuple[list[GroupAdvantages], SftFilterStats]:
    """The kept trees of each group as advantage-1 GroupAdvantages; groups with none kept are
    left out."""
    stats = SftFilterStats()
    kept_groups: list[GroupAdvantages] = []
    for index, group in enumerate(groups):
        roots: dict[str, float] = {}
        turns: dict[str, list[float]] = {}
        for root in group.roots:
            stats.trees += 1
            tree = group.tree(root)
            if any(turn.error for traj in tree for turn in traj.turns):
                stats.repl_error += 1
                continue
            value = float(score(root, group.task))
            if not math.isfinite(value):
                raise ValueError(f"task {root.task_id} root {root.id}: score is {value}")
            if value <= 0.0:
                stats.zero_score += 1
                continue
            stats.kept += 1
            roots[root.id] = 1.0
            turns.update({traj.id: [1.0] * len(traj.turns) for traj in tree})
        if roots:
            kept_groups.append(GroupAdvantages(group_index=index, roots=roots, turns=turns))
    return kept_groups, stats


def build_sft_samples(
    groups: Sequence[RolloutGroup],
    score: Score,
    config: AlgoConfig,
    *,
    num_groups: int | None = None,
) -> tuple[list[Sample], SftFilterStats]:
    """Filter teacher groups and turn every kept turn into an advantage-1 sample. Teacher turns
    may lack sampler log-probs; those samples carry NaN there (see build_samples)."""
    kept, stats = filter_teacher(groups, score)
    samples = build_samples(
        groups, kept, config, num_groups=num_groups, require_sampler_logprobs=False
    )
    return samples, stats
