"""How stale a step's tokens are: the updates between the weights that sampled each token and
the weights the step trains.

Every turn records the engine's weight version of each completion token (`Turn.weight_versions`,
a turn in flight across an update has both), and the trainer knows the version of the weights it
is about to update; their difference per token is the token's staleness. The synchronous loop
trains every token at staleness 0; with rollouts running ahead of training
(`algo.max_staleness`) it is at most the bound. Turns without versions (a teacher's, or an
engine that does not say) are not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec

from rlmtrain.rlm.records import RolloutGroup

__all__ = ["Staleness", "summarise", "token_staleness"]


class Staleness(msgspec.Struct, frozen=True):
    """A step's per-token staleness, summarised for its row."""

    tokens: int
    """Tokens with a recorded version."""
    mean: float
    max: int
    fresh_frac: float
    """The share of those tokens sampled by the very weights being trained (staleness 0)."""

    def row(self) -> dict[str, float | int]:
        return {
            "staleness_mean": self.mean,
            "staleness_max": self.max,
            "staleness_fresh_frac": self.fresh_frac,
        }


def token_staleness(groups: Iterable[RolloutGroup], version: int) -> Counter[int]:
    """How many completion tokens of `groups` are at each staleness: `version` less the version
    that sampled them (a count per age, which ranks add together and gather cheaply)."""
    ages: Counter[int] = Counter()
    for group in groups:
        for trajectory in group.trajectories:
            for turn in trajectory.turns:
                ages.update(version - v for v in turn.weight_versions)
    newest = min(ages, default=0)
    if newest < 0:
        raise ValueError(
            f"a token was sampled by weights {-newest} update(s) newer than the version being "
            f"trained ({version}): the engine's versions and the trainer's disagree"
        )
    return ages


def summarise(ages: Counter[int]) -> Staleness:
    tokens = sum(ages.values())
    if not tokens:
        return Staleness(tokens=0, mean=0.0, max=0, fresh_frac=1.0)
    return Staleness(
        tokens=tokens,
        mean=sum(age * n for age, n in ages.items()) / tokens,
        max=max(ages),
        fresh_frac=ages[0] / tokens,
    )
