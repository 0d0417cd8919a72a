"""Rollouts ahead of training: the trees of the steps to come, each step's started on one
scheduler as soon as bounded staleness admits it, taken by the trainer in step order.

Versions count the policy's updates: the trainer trains step j's groups with the weights of
version j (j updates after the phase began). With `algo.max_staleness` = η, step j's roots are
admitted once the engine holds version j - η or newer, so every token the step trains was
sampled by weights at most η updates older than the ones it updates (a token's own version is
recorded, `Turn.weight_versions`, and only grows while its tree runs). This is the capacity rule
of bounded-staleness trainers counted over whole trees: at most η + 1 steps are out at once, and
the trainer takes them in admission order, waiting for a step's slowest tree rather than
dropping it, so no tree is ever abandoned for its age and the trees that recurse deeply (the
slow ones) are trained as often as the quick ones. η = 0 alternates rollout and training.

Admitted steps run as concurrent rollouts of the one scheduler, each under its step as its
`batch`: the earlier step's trees and requests go first, and the later step's fill what they
leave of the engine (the backfill that keeps an engine busy while a step's last deep trees
finish).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from rlmtrain.rlm.prompts import RLMEnv
from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.metrics import RolloutMetrics
from rlmtrain.rollout.scheduler import Scheduler

__all__ = ["Ahead", "Rolled", "StepRoots"]


class StepRoots(NamedTuple):
    """A step's roots for this engine: its tasks and, per task, the sample indices to run,
    sampled with `sampling` (the step's seed; None: the scheduler's). With `claim`, the roots
    are the step's whole task-major list shared with other engines, each taken by whichever
    has room, at most `window` running here at once (`Scheduler.rollout`'s claim and window),
    and `samples` is None."""

    tasks: Sequence[Any]
    samples: Sequence[Sequence[int]] | None
    sampling: SamplingParams | None = None
    claim: Callable[[], int | None] | None = None
    window: int | None = None


class Rolled(NamedTuple):
    """A step's rollout on this engine."""

    step: int
    groups: list[RolloutGroup]
    metrics: RolloutMetrics | None
    """None when this engine drew no root of the step."""
    admitted_version: int
    """The version the step's roots were admitted under (the oldest any of its tokens has)."""


class Ahead:
    """Steps [first, steps) rolled out on `scheduler`, each admitted while the engine's version
    is within `max_staleness` of it; see the module docstring.

    plan(step): the step's roots for this engine (deterministic in the step: a resumed run
    plans the same). version: the weights the engine holds now (the trainer's at `first`).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        env: RLMEnv,
        n_samples: int,
        plan: Callable[[int], StepRoots],
        *,
        first: int,
        steps: int,
        max_staleness: int,
        version: int | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.scheduler = scheduler
        self.env = env
        self.n_samples = n_samples
        self.plan = plan
        self.max_staleness = max_staleness
        self.version = first if version is None else version
        self._next = first
        self._steps = steps
        self._next_taken = first
        self._rollouts: dict[int, asyncio.Task[Rolled]] = {}
        self._advanced = asyncio.Event()

    def start(self) -> None:
        """Admit what the current version allows (call inside the running loop)."""
        self._admit()

    def advance(self, version: int) -> None:
        """The engine now holds `version`: admit the steps it brings within the bound."""
        if version < self.version:
            raise ValueError(f"versions only grow: {version} after {self.version}")
        self.version = version
        self._admit()

    def out(self) -> list[int]:
        """The steps admitted and not yet taken."""
        return sorted(self._rollouts)

    async def take(self, step: int) -> Rolled:
        """Step `step`'s rollout, once all its trees have ended; a step not admitted yet is
        waited for (the trainer's next update admits it). Steps are taken in order."""
        if not self._next_taken <= step < self._steps:
            raise ValueError(
                f"step {step} cannot be taken: the steps left are {self._next_taken} to "
                f"{self._steps - 1}, in order"
            )
        while step not in self._rollouts:
            self._advanced.clear()
            await self._advanced.wait()
        self._next_taken = step + 1
        try:
            return await self._rollouts[step]
        finally:
            del self._rollouts[step]

    async def close(self) -> None:
        """Cancel the steps still out (their trees end "aborted", their REPLs close)."""
        out = list(self._rollouts.values())
        self._rollouts.clear()
        for task in out:
            task.cancel()
        await asyncio.gather(*out, return_exceptions=True)

    def _admit(self) -> None:
        while self._next < self._steps and self._next - self.max_staleness <= self.version:
            step = self._next
            self._rollouts[step] = asyncio.ensure_future(self._roll(step, self.version))
            self._next += 1
            self._advanced.set()

    async def _roll(self, step: int, version: int) -> Rolled:
        roots = self.plan(step)
        if not roots.tasks:
            return Rolled(step, [], None, version)
        groups = await self.scheduler.rollout(
            roots.tasks,
            self.env,
            self.n_samples,
            samples=roots.samples,
            batch=step,
            sampling=roots.sampling,
            claim=roots.claim,
            window=roots.window,
        )
        # Read before any await: the scheduler's metrics are its last finished rollout's.
        return Rolled(step, groups, self.scheduler.metrics, version)
