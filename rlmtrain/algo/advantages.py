"""GRPO advantages over trajectory trees (docs/algorithm.md §3-§4).

Only roots are rewarded. Within a task's group the scored roots give
A_g = (r_g - mean) / (std + eps), or r_g - mean without std normalisation. Every turn of a root
carries its A_g and every descendant inherits it unchanged, so a child is credited for the answer
its root finally gave. With `child_credit = "answered"` a descendant that ended without an
answer (out of turns, cut off, failed) carries -|A_g| instead: a root can succeed while one of its
children wrote broken code, and inheriting the root's positive advantage would raise the
probability of exactly that code. Two optional per-turn refinements follow, both given as inputs
because judges compute them elsewhere:

- tool credit (BookNavigator): Ã_t = A + alpha * |A| * (c_t - c̄), c_t in {-1, 0, 1} a judge's label
  of turn t and c̄ the mean label of that trajectory; the |A| scale keeps the sign of A for
  alpha <= 1/2 and makes credit vanish where the outcome carries no signal;
- step rubric rewards (LongTraceRL): one combined score per turn, added to that turn's advantage;
  with `step_reward_baseline = "group"` less the mean score over every turn of the group's scored
  trees. The rubric's scores are mostly positive, so added as they are they raise every sampled
  token, a slip in a good turn most of all (its gradient is largest where its probability is
  least); centred, they only move credit from a group's weaker turns to its stronger ones.

The std is the population std (ddof=0) of the scored rewards. The group is the whole population
being compared, not a sample from which a wider spread is estimated; with ddof=0 the normalised
advantages of a group have unit mean square for every G, whereas the sample std shrinks them as
G falls (G=2 gives ±0.71 instead of ±1) and is undefined for a single scored root.

A root whose reward is `None` (the judge failed, the scheduler could not run it) is left out of
its group's statistics and yields no samples, nor do its descendants: an unscored answer is not
a zero. A descendant the scheduler could not run (`Trajectory.failure`: no REPL, an engine
error) yields no samples either, whatever its root earned: how it ended is not the policy's
doing (one whose own code killed its REPL worker has no `failure` and trains as it ended). A
group whose scored rewards are all equal has zero advantage everywhere; it is dropped when
`drop_uniform_groups` is set, otherwise kept (its tokens still count, e.g. towards a KL term).
A group with no scored root is always dropped. Every drop is counted in `AdvantageStats`.
Uniformity is judged on root rewards alone: step rewards do not keep a group that
`drop_uniform_groups` drops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from rlmtrain.config import AlgoConfig
from rlmtrain.rewards.step_rewards import StepRewards
from rlmtrain.rlm.records import RolloutGroup, Trajectory

__all__ = [
    "AdvantageStats",
    "GroupAdvantages",
    "compute_advantages",
    "group_advantages",
    "refine_turns",
]

DEFAULT_EPS = 1e-6


class GroupAdvantages(msgspec.Struct, kw_only=True):
    """The advantages of one group that goes on to training."""

    group_index: int
    """Position of the group in the list given to `compute_advantages`."""
    roots: dict[str, float]
    """Scored root id -> A_g (before per-turn refinement). Unscored roots are absent."""
    turns: dict[str, list[float]]
    """Trajectory id -> advantage of each of its turns, for every scored root and descendant."""


class AdvantageStats(msgspec.Struct, kw_only=True):
    groups: int = 0
    """Groups given."""
    groups_used: int = 0
    """Groups that go on to training (returned)."""
    groups_dropped_uniform: int = 0
    """Groups whose scored rewards were all equal, dropped by `drop_uniform_groups`."""
    groups_kept_uniform: int = 0
    """Groups whose scored rewards were all equal, kept with zero advantage."""
    groups_unscored: int = 0
    """Groups without a single scored root, always dropped."""
    roots_scored: int = 0
    roots_unscored: int = 0


def group_advantages(
    rewards: Sequence[float | None], *, std_normalize: bool = True, eps: float = DEFAULT_EPS
) -> list[float | None]:
    """GRPO advantage of each root from the group's rewards; `None` stays `None`.

    Statistics are over the scored rewards only, std is the population std (ddof=0). All-equal
    scored rewards give exactly 0.0 (never (r - mean) / eps of rounding noise).
    """
    scored = [float(r) for r in rewards if r is not None]
    for i, r in enumerate(rewards):
        if r is not None and not math.isfinite(r):
            raise ValueError(f"reward of root {i} is {r}; rewards must be finite or None")
    if not scored:
        return [None] * len(rewards)
    if _uniform(rewards):
        return [None if r is None else 0.0 for r in rewards]
    mean = math.fsum(scored) / len(scored)
    scale = 1.0
    if std_normalize:
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in scored) / len(scored))
        scale = 1.0 / (std + eps)
    return [None if r is None else (float(r) - mean) * scale for r in rewards]


def compute_advantages(
    groups: Sequence[RolloutGroup],
    step_rewards: StepRewards,
    config: AlgoConfig,
    *,
    eps: float = DEFAULT_EPS,
) -> tuple[list[GroupAdvantages], AdvantageStats]:
    """Per-turn advantages of every trajectory that trains, and what was dropped.

    step_rewards.roots[i][g]: reward of `groups[i].roots[g]` (roots ordered by sample_idx),
        None = unscored.
    step_rewards.tool_credit: trajectory id -> one label in {-1, 0, 1} per turn; required when
        `config.tool_credit_alpha > 0`. A trajectory absent from it is unlabelled (every c_t = 0,
        so its turns keep A).
    step_rewards.turn_rewards: trajectory id -> one combined rubric score per turn, added to
        that turn's advantage; None = no step rewards. A trajectory absent from it gets nothing
        added.
    """
    rewards = step_rewards.roots
    tool_credit = step_rewards.tool_credit
    per_turn = step_rewards.turn_rewards
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} reward lists for {len(groups)} groups")
    alpha = config.tool_credit_alpha
    if alpha > 0 and tool_credit is None:
        raise ValueError(f"tool_credit_alpha={alpha} but no tool-credit labels were given")
    stats = AdvantageStats(groups=len(groups))
    result: list[GroupAdvantages] = []
    for index, (group, group_rewards) in enumerate(zip(groups, rewards, strict=True)):
        roots = group.roots
        if len(group_rewards) != len(roots):
            raise ValueError(
                f"task {_task_id(group)}: {len(group_rewards)} rewards for {len(roots)} roots"
            )
        advantages = group_advantages(group_rewards, std_normalize=config.std_normalize, eps=eps)
        scored = [(root, a) for root, a in zip(roots, advantages, strict=True) if a is not None]
        stats.roots_scored += len(scored)
        stats.roots_unscored += len(roots) - len(scored)
        if not scored:
            stats.groups_unscored += 1
            continue
        if _uniform(group_rewards):
            if config.drop_uniform_groups:
                stats.groups_dropped_uniform += 1
                continue
            stats.groups_kept_uniform += 1
        trees = [(traj, a) for root, a in scored for traj in group.tree(root)]
        baseline = 0.0
        if per_turn is not None and config.step_reward_baseline == "group":
            baseline = _mean_step_reward(per_turn, [traj for traj, _ in trees])
        turns: dict[str, list[float]] = {}
        for traj, a in trees:
            if traj.failure:  # the scheduler could not run it: its end is not the policy's
                continue
            if (
                config.child_credit == "answered"
                and traj.depth > 0
                and traj.finish_reason != "final"
            ):
                a = -abs(a)
            credit = tool_credit.get(traj.id) if alpha > 0 else None
            steps = per_turn.get(traj.id) if per_turn is not None else None
            if steps is not None and baseline:
                steps = [s - baseline for s in steps]
            turns[traj.id] = refine_turns(traj, a, alpha=alpha, credit=credit, steps=steps)
        root_advantages = {root.id: a for root, a in scored}
        result.append(GroupAdvantages(group_index=index, roots=root_advantages, turns=turns))
    stats.groups_used = len(result)
    return result, stats


def refine_turns(
    traj: Trajectory,
    advantage: float,
    *,
    alpha: float = 0.0,
    credit: Sequence[int] | None = None,
    steps: Sequence[float] | None = None,
) -> list[float]:
    """Advantage of each turn of `traj`: A + alpha*|A|*(c_t - c̄) + step_t."""
    n = len(traj.turns)
    values = [advantage] * n
    if credit is not None and alpha > 0:
        _check_per_turn(traj, "tool-credit labels", credit)
        bad = [c for c in credit if c not in (-1, 0, 1)]
        if bad:
            raise ValueError(
                f"trajectory {traj.id}: tool-credit labels must be -1, 0 or 1, got {bad[0]}"
            )
        mean = math.fsum(credit) / n if n else 0.0
        spread = alpha * abs(advantage)
        values = [v + spread * (c - mean) for v, c in zip(values, credit, strict=True)]
    if steps is not None:
        _check_per_turn(traj, "step rewards", steps)
        values = [v + float(s) for v, s in zip(values, steps, strict=True)]
    return values


def _mean_step_reward(
    per_turn: dict[str, Sequence[float]], trajectories: list[Trajectory]
) -> float:
    """Mean step reward over every turn of `trajectories` that has one (0.0 if none has)."""
    values = [float(s) for traj in trajectories for s in per_turn.get(traj.id, ())]
    return math.fsum(values) / len(values) if values else 0.0


def _check_per_turn(traj: Trajectory, what: str, values: Sequence) -> None:
    if len(values) != len(traj.turns):
        raise ValueError(f"trajectory {traj.id}: {len(values)} {what} for {len(traj.turns)} turns")


def _uniform(rewards: Sequence[float | None]) -> bool:
    """All scored rewards equal (exactly: the GRPO numerator is then exactly zero)."""
    scored = [r for r in rewards if r is not None]
    return bool(scored) and max(scored) == min(scored)


def _task_id(group: RolloutGroup) -> str:
    return group.trajectories[0].task_id if group.trajectories else "?"
