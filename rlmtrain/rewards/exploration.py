"""The annealed exploration bonus of BookNavigator (docs/algorithm.md §3).

    R_n(τ) = r(τ) + β_n · b(τ) · 1[r(τ) ≥ 1]

Correctness-only RL taught the policy to stop calling tools; a bonus for varied tool use, paid
only on successful trajectories (so it never rewards flailing), brought tool use back. It is
annealed so the final policy is trained on correctness alone:

    β_n = β_0 · (1 + cos(π · min(n, N) / N)) / 2,

with n the 0-based optimizer step and N the number of steps of the run: β_0 at n = 0, β_0 / 2 at
n = N / 2, 0 from n = N on.

b(τ) ∈ [0, 1] is the share of non-redundant calls: distinct (tool name, normalised arguments)
pairs divided by all calls, over every turn of the root *and its descendants* (a root that
delegates its reading to children explored through them). Arguments are normalised by lower-
casing, collapsing whitespace and unifying quote characters, so `search('Prime')` and
`search("prime")` are the same call. FINAL and FINAL_VAR end a trajectory and are not tool use;
a tree with no tool call gets b = 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from rlmtrain.rlm.records import RolloutGroup, ToolCall, Trajectory, Turn

__all__ = [
    "FINISHING_BUILTINS",
    "beta_schedule",
    "call_key",
    "diversity_bonus",
    "explored_reward",
    "tool_calls",
    "tree_turns",
    "with_exploration_bonus",
]

FINISHING_BUILTINS = frozenset({"FINAL", "FINAL_VAR"})


def call_key(call: ToolCall) -> tuple[str, str]:
    """(name, normalised args): two calls with the same key fetch the same thing."""
    args = " ".join(call.args.replace('"', "'").split()).lower()
    return call.name, args


def tool_calls(turns: Iterable[Turn]) -> list[ToolCall]:
    """The tool calls of `turns` in order, without the finishing builtins."""
    return [c for turn in turns for c in turn.tool_calls if c.name not in FINISHING_BUILTINS]


def tree_turns(group: RolloutGroup, root: Trajectory) -> list[Turn]:
    """Every turn of `root` and its descendants, depth-first in spawn order."""
    return [turn for trajectory in group.tree(root) for turn in trajectory.turns]


def diversity_bonus(turns: Iterable[Turn]) -> float:
    """b(τ): distinct calls / all calls (0.0 without calls)."""
    calls = tool_calls(turns)
    if not calls:
        return 0.0
    return len({call_key(c) for c in calls}) / len(calls)


def beta_schedule(step: int, total_steps: int, beta0: float) -> float:
    """β_n on the cosine schedule from β_0 at step 0 to 0 at `total_steps`."""
    if total_steps < 1:
        raise ValueError(f"beta_schedule: total_steps must be >= 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"beta_schedule: step must be >= 0, got {step}")
    progress = min(step, total_steps) / total_steps
    return beta0 * (1.0 + math.cos(math.pi * progress)) / 2.0


def explored_reward(reward: float | None, bonus: float, beta: float) -> float | None:
    """R_n(τ): the bonus is added only to successful trajectories (r ≥ 1); None stays None."""
    if reward is None or reward < 1.0:
        return reward
    return reward + beta * bonus


def with_exploration_bonus(
    groups: Sequence[RolloutGroup],
    scores: Sequence[Sequence[float | None]],
    beta0: float,
    step: int,
    total_steps: int,
) -> list[list[float | None]]:
    """R_n = r + beta_n * b * 1[r = 1] for every root of every group, b its tree's tool
    diversity and beta_n the cosine schedule from `beta0` over the RL steps; the scores as they
    are when the bonus is off (beta0 = 0)."""
    if beta0 <= 0:
        return [list(rs) for rs in scores]
    beta = beta_schedule(step, total_steps, beta0)
    return [
        [
            explored_reward(r, diversity_bonus(tree_turns(group, root)), beta)
            for r, root in zip(rs, group.roots, strict=True)
        ]
        for group, rs in zip(groups, scores, strict=True)
    ]
