"""How many turns a tree still has to play after a given request: its remaining critical path.

A tree ends when its last trajectory does, and a trajectory waiting on children ends only after
they answer and it plays its own remaining turns. So a request of trajectory t, at depth d with
k turns played, lies on a chain of turns still to come: t's own (this one and those after it),
then, for each ancestor blocked in its current turn, the turns it plays once the answers are in.
Requests on the longest chains go first, as in longest-processing-time scheduling: a step waits
for its slowest tree, and the engine's spare room is best spent on whatever makes that tree
shorter. A deeper request sits under more ancestors, each with turns to play after its
children answer: the depth rule (`rollout.priority = "depth"`) orders by that count alone.

The turns a trajectory plays are not known until it ends; `TurnCounts` estimates them from the
trajectories that have already ended at the same depth (on this scheduler, over every rollout it
has run), starting from a prior of one pseudo-trajectory per possible count. The expected turns
left after k played is E[T - k | T > k] over that histogram.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlmtrain.rlm.records import Trajectory

__all__ = ["TurnCounts", "chain_turns"]


class TurnCounts:
    """Turns played by ended trajectories, by depth, over 1..max_turns."""

    def __init__(self, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self._counts: dict[int, list[float]] = {}

    def _histogram(self, depth: int) -> list[float]:
        if depth not in self._counts:
            # the prior: one pseudo-trajectory per count 1..max_turns (index 0 is unused)
            self._counts[depth] = [0.0] + [1.0] * self.max_turns
        return self._counts[depth]

    def record(self, depth: int, turns: int) -> None:
        """A trajectory at `depth` ended after `turns` turns (0 = it never generated)."""
        if turns >= 1:
            self._histogram(depth)[min(turns, self.max_turns)] += 1.0

    def left_after(self, depth: int, played: int) -> float:
        """Expected turns still to play by a trajectory at `depth` that has played `played`
        and goes on: E[T - played | T > played], at least 1 (the turn it is about to play)."""
        counts = self._histogram(depth)
        mass = weighted = 0.0
        for turns in range(played + 1, self.max_turns + 1):
            mass += counts[turns]
            weighted += counts[turns] * (turns - played)
        return weighted / mass if mass else 1.0


def chain_turns(
    trajectory: Trajectory, live: Mapping[str, Trajectory], counts: TurnCounts
) -> float:
    """Expected turns on the chain from `trajectory`'s next request to its tree's end.

    `trajectory` is about to play a turn; every ancestor (found in `live` by id) is blocked in
    its last recorded turn, and plays its turns after that one once its children answer."""
    total = counts.left_after(trajectory.depth, len(trajectory.turns))
    parent_id = trajectory.parent_id
    while parent_id is not None and parent_id in live:
        parent = live[parent_id]
        if parent.turns:  # the turns after the one it is blocked in
            total += counts.left_after(parent.depth, len(parent.turns) - 1) - 1.0
        parent_id = parent.parent_id
    return total
