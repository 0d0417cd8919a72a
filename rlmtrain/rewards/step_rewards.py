"""What an RL step's groups earned, in one call: `StepRewarder(cfg, env)(tasks, groups, step)`.

It asks the env for its root scores, adds the exploration bonus (docs/algorithm.md §3) to make
the root rewards, and asks `TurnSignals` for the per-turn signals the config switches on (tool
credit, step-rubric scores), all into one `StepRewards` that `algo.compute_advantages` takes
whole and the step's metrics and logs read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from rlmtrain.config import Config
from rlmtrain.rewards.exploration import with_exploration_bonus
from rlmtrain.rewards.step_rubric import StepScore
from rlmtrain.rewards.turn_signals import TurnSignals, step_totals
from rlmtrain.rlm.records import RolloutGroup

__all__ = ["StepRewarder", "StepRewards"]


class StepRewards(msgspec.Struct, kw_only=True):
    """One step's rewards; every list runs over the groups, then their roots (by sample_idx)."""

    roots: list[list[float | None]]
    """R: each root's reward, the env's score plus the exploration bonus; None = unscored."""
    scores: list[list[float | None]] | None = None
    """The env's scores as it gave them (the step's mean reward, the logged trees); None =
    `roots`."""
    tool_credit: dict[str, list[int]] | None = None
    """Trajectory id -> a label in {-1, 0, 1} per turn; None when the credit is off."""
    turn_rewards: dict[str, list[float]] | None = None
    """Trajectory id -> each turn's combined step reward, added to its advantage; None when
    step rewards are off."""
    step_scores: dict[str, list[StepScore]] | None = None
    """The step rubric's scores per turn behind `turn_rewards`, criterion by criterion (the
    step's metrics)."""

    @property
    def env_scores(self) -> list[list[float | None]]:
        return self.roots if self.scores is None else self.scores


class StepRewarder:
    """The rewards of one RL step after another, for one run (it keeps the judge's client and
    the per-step judge counts of `TurnSignals`)."""

    def __init__(self, cfg: Config, env: Any) -> None:
        self._cfg = cfg
        self._env = env
        self.signals = TurnSignals(cfg)

    async def __call__(
        self, tasks: Sequence[Any], groups: list[RolloutGroup], step: int
    ) -> StepRewards:
        scores = await self._env.root_scores(tasks, groups) if tasks else []
        algo, steps = self._cfg.algo, self._cfg.train.steps
        roots = with_exploration_bonus(groups, scores, algo.exploration_beta, step, steps)
        credit = await self.signals.credit(groups)
        step_scores = await self.signals.steps(groups)
        return StepRewards(
            roots=roots,
            scores=scores,
            tool_credit=credit,
            turn_rewards=step_totals(step_scores),
            step_scores=step_scores,
        )

    def local_sums(self, rewards: StepRewards) -> list[float]:
        """This rank's numbers for the step's all-reduce (`TurnSignals.local_sums`)."""
        return self.signals.local_sums(rewards.step_scores)

    def row(self, summed: Sequence[float]) -> dict[str, float | int]:
        return self.signals.row(summed)

    async def close(self) -> None:
        await self.signals.close()
