"""A world split into trainer ranks and inference ranks (`rollout.inference_ranks` = k): both
ends of the RL phase's traffic over the bridge (`rlmtrain.bridge`).

The trainers start, evaluate and run SFT as in any run (evaluations on their own engines). When
RL begins, trainer rank 0 broadcasts a `Hello` (the run's config as the trainers resolved it,
its tokenizer and data already in the run folder, and the steps to go) and the policy's
weights. Each inference rank then builds the env, the RL task set, the tokenizer and an engine
(weights arriving, never loaded), and rolls out its share of every step from the first on
(`rollout.ahead`: each step admitted within `algo.max_staleness` updates of the weights that
will train it), sending each step's groups to trainer rank 0 in step order. A step's roots go by
load: each inference rank takes the step's next root from a counter in the launch's store
whenever it has room for another tree (`RootClaims`; at most an equal share at once), so an
engine whose trees end sooner takes more of them, and a root is the same tree on whichever
engine runs it. After every update but the
last the trainers gather the weights and trainer rank 0 broadcasts them; each inference rank
puts them into its engine between two engine steps and admits what the new version allows.

Trainer rank 0 takes a step's groups from every inference rank, puts them back whole (each
group's trajectories in one order, root by root, whichever ranks ran them) and hands every
trainer the groups it scores (the groups dealt over the trainers as a step's roots are);
from there the step is the colocated loop's. Versions: every token carries the version of the
weights that sampled it, counted as the trainer counts its updates from the phase's start, so
a step's staleness is its number less its tokens' versions.

A run killed and resumed goes on from its checkpoint: the Hello names the step to start from,
and the trees that were in flight or finished but untrained are rolled out again from their
seeds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rlmtrain import parallel, watchdog
from rlmtrain.bridge import Bridge
from rlmtrain.config import Config
from rlmtrain.envs.base import Task, get_env
from rlmtrain.evaluation import spawned
from rlmtrain.model.hf import hf_named
from rlmtrain.model.tokenizer import load_tokenizer, with_chat_template_kwargs
from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout import dealing
from rlmtrain.rollout.ahead import Ahead, Rolled, StepRoots
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines import build_engine
from rlmtrain.rollout.metrics import RolloutMetrics
from rlmtrain.rollout.scheduler import Scheduler
from rlmtrain.training.batches import task_batches
from rlmtrain.training.run import mean_or_nan
from rlmtrain.training.steps import DTYPES

log = logging.getLogger("rlmtrain.train")

__all__ = ["Hello", "RemoteRollouts", "StepRollout", "serve_rollouts", "step_sampling"]


class Hello(msgspec.Struct, frozen=True):
    """What trainer rank 0 tells the inference ranks as RL begins."""

    cfg: Config
    first: int
    """The step the RL phase starts from (a resumed run's checkpoint)."""
    steps: int


class StepRollout(msgspec.Struct):
    """A step's rollout as one trainer sees it."""

    groups: list[RolloutGroup]
    """The groups this trainer scores."""
    scored: list[int]
    """Their places among the step's tasks."""
    fields: dict[str, Any]
    """The step row's rollout figures."""


def step_sampling(cfg: Config, step: int) -> SamplingParams:
    """A step's sampling: each request's seed comes from (this seed, trajectory id, turn), so a
    rerun samples the same trees whatever order the engine batched them in, on any number of
    ranks."""
    return SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        seed=cfg.train.seed * 1_000_003 + step,
    )


def rollout_fields(metrics: RolloutMetrics | None, groups: list[RolloutGroup]) -> dict[str, Any]:
    """One engine's rollout figures for a step's row."""
    roots = [root for group in groups for root in group.roots]
    if metrics is None or not roots:  # this engine drew no root this step
        return {"rollout_s": 0.0, "generated_tokens": 0, "finish_reasons": {}, "spawn_rate": 0.0}
    return {
        "rollout_s": metrics.wall_s,
        "generated_tokens": metrics.generated_tokens,
        "engine_tokens_per_s": metrics.tokens_per_s,
        "engine_occupancy": metrics.engine_occupancy,
        "finish_reasons": metrics.finish_reasons,
        "children_per_root": metrics.children_per_root_mean,
        "spawn_rate": mean_or_nan(spawned(root) for root in roots),
    }


# -- the trainers' end ----------------------------------------------------------------------


class RemoteRollouts:
    """The trainers' end: every trainer rank makes one; trainer rank 0's talks to the bridge."""

    def __init__(self, world: parallel.World, cfg: Config, device: torch.device) -> None:
        self.world = world
        self.cfg = cfg
        self.bridge = Bridge(world, device) if world.is_main else None

    async def start(self, first: int, model: torch.nn.Module) -> None:
        """Tell the inference ranks where RL starts; send them the policy if steps remain."""
        steps = self.cfg.train.steps
        if self.bridge is not None:
            hello = Hello(cfg=self.cfg, first=first, steps=steps)
            await asyncio.to_thread(self.bridge.broadcast, hello)
        if first < steps:
            await self.send_weights(model)

    async def send_weights(self, model: torch.nn.Module) -> None:
        """The policy's weights to every inference rank, in `model.dtype` (what the engines
        compute in: bf16 halves the bytes of the fp32 masters): gathered by all trainers in
        lockstep, sent by rank 0."""
        gathered = hf_named(parallel.full_parameters(model))
        if self.bridge is None:
            for _ in gathered:  # this rank's part of each gather
                pass
            return
        dtype = DTYPES[self.cfg.model.dtype]
        header = [(name, tuple(p.shape), dtype) for name, p in hf_named(model.named_parameters())]
        named = ((name, tensor.to(dtype)) for name, tensor in gathered)
        await asyncio.to_thread(self.bridge.send_weights, header, named)

    async def take(self, step: int, tasks: list[Task]) -> StepRollout:
        """Step `step`'s groups, whole, dealt over the trainers; waits for the slowest engine."""
        everyone = None
        if self.bridge is not None:
            everyone = await asyncio.to_thread(self._receive, step)
        parts, fields = parallel.broadcast(everyone)
        groups = [in_tree_order(group) for group in dealing.merge(tasks, range(len(tasks)), parts)]
        shares = dealing.deal(len(tasks), self.cfg.rollout.n_samples, self.world.size)
        scored = [i for i in range(len(tasks)) if dealing.owner(i, shares) == self.world.rank]
        return StepRollout([groups[i] for i in scored], scored, fields)

    def _receive(self, step: int) -> tuple[list[list[tuple[int, RolloutGroup]]], dict[str, Any]]:
        parts, rows = [], []
        for rank in range(self.world.inference_ranks):
            got, part, row = self.bridge.recv(rank + 1)
            if got != step:
                raise RuntimeError(f"inference rank {rank} sent step {got} where {step} was due")
            parts.append(part)
            rows.append(row)
        return parts, merged_fields(rows)


def in_tree_order(group: RolloutGroup) -> RolloutGroup:
    """`group` with its trajectories root by root (`RolloutGroup.roots`), each tree walked by
    `RolloutGroup.tree`: the same order whichever inference ranks ran its roots."""
    ordered = [trajectory for root in group.roots for trajectory in group.tree(root)]
    return RolloutGroup(task=group.task, trajectories=ordered)


class RootClaims:
    """The roots of each step taken one at a time by the inference ranks that have room: one
    counter per step in the launch's store, which every inference rank adds to (`store.add` is
    atomic), so each root goes to exactly one rank."""

    def __init__(self, store: Any) -> None:
        self.store = dist.PrefixStore("claims/", store)

    def of_step(self, step: int, roots: int) -> Callable[[], int | None]:
        """Step `step`'s claim: the index of a root no rank has taken, or None."""
        key = str(step)

        def claim() -> int | None:
            index = self.store.add(key, 1) - 1
            return index if index < roots else None

        return claim


def merged_fields(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The inference ranks' figures for a step as one row: the slowest rollout, every rank's
    tokens (an idle engine shows as 0), summed counts."""
    reasons: Counter[str] = Counter()
    for row in rows:
        reasons.update(row["finish_reasons"])
    busy = [row for row in rows if "engine_occupancy" in row]
    return {
        "rollout_s": max(row["rollout_s"] for row in rows),
        "generated_tokens": sum(row["generated_tokens"] for row in rows),
        "generated_tokens_per_rank": [row["generated_tokens"] for row in rows],
        "engine_tokens_per_s": sum(row.get("engine_tokens_per_s", 0.0) for row in rows),
        "engine_occupancy": mean_or_nan(row["engine_occupancy"] for row in busy),
        "finish_reasons": dict(reasons),
        "children_per_root": mean_or_nan(row["children_per_root"] for row in busy),
        "spawn_rate": mean_or_nan(row["spawn_rate"] for row in busy),
    }


# -- the inference ranks' end ---------------------------------------------------------------


async def serve_rollouts(world: parallel.World, device: torch.device) -> int:
    """An inference rank's whole run: wait for RL to begin, then roll out every step's share
    and send it, taking each new policy as it comes."""
    bridge = Bridge(world, device)
    with watchdog.waiting("the trainers' start of RL"):
        hello: Hello = await asyncio.to_thread(bridge.broadcast)
    cfg, first, steps = hello.cfg, hello.first, hello.steps
    if first >= steps:
        return 0
    env = get_env(cfg.data.env, cfg)
    tasks = env.split_tasks(cfg, "rl")
    tokenizer = with_chat_template_kwargs(
        load_tokenizer(cfg.model.tokenizer, cfg.model.hf_dir), cfg.rollout.chat_template_kwargs
    )
    batches = list(
        itertools.islice(task_batches(tasks, cfg.train.tasks_per_step, cfg.train.seed), steps)
    )
    n_samples = cfg.rollout.n_samples
    claims = RootClaims(parallel.launch_store())

    def plan(step: int) -> StepRoots:
        tasks = batches[step]
        roots = len(tasks) * n_samples
        # An equal share at most at once: where a step fits one engine, the first rank to start
        # would otherwise take all of it; the roots past the shares go to the ranks that free
        # room first.
        window = -(-roots // world.size)
        return StepRoots(tasks, None, step_sampling(cfg, step), claims.of_step(step, roots), window)

    engine = build_engine(cfg, tokenizer, device=device, weights="sync")
    ahead: Ahead | None = None
    try:
        await engine.update_weights(await asyncio.to_thread(_weights, bridge))
        # The engine's count of updates, less this, is the policy's version less `first`.
        base = engine.stats().weight_version
        scheduler = Scheduler(engine, tokenizer, cfg.rollout)
        ahead = Ahead(
            scheduler, env, n_samples, plan,
            first=first, steps=steps, max_staleness=cfg.algo.max_staleness,
        )  # fmt: skip
        ahead.start()

        async def take_updates() -> None:
            for version in range(first + 1, steps):
                await engine.update_weights(await asyncio.to_thread(_weights, bridge))
                ahead.advance(version)

        updates = asyncio.ensure_future(take_updates())
        try:
            for step in range(first, steps):
                watchdog.phase(f"rollouts of rl step {step}")
                rolled = await _first_of(ahead.take(step), updates)
                _renumber(rolled, first - base)
                share = [
                    (task, group) for task, group in enumerate(rolled.groups) if group.trajectories
                ]
                row = rollout_fields(rolled.metrics, rolled.groups)
                await asyncio.to_thread(bridge.send, (step, share, row), 0)
            await updates
        finally:
            updates.cancel()
            await asyncio.gather(updates, return_exceptions=True)
    finally:
        if ahead is not None:
            await ahead.close()
        await engine.close()
    return 0


def _weights(bridge: Bridge) -> list[tuple[str, torch.Tensor]]:
    return list(bridge.recv_weights())


async def _first_of(step: Any, updates: asyncio.Future[None]) -> Rolled:
    """The step's rollout, unless the update loop fails first (the step might then never be
    admitted, and the wait would never end)."""
    taking = asyncio.ensure_future(step)
    if not updates.done():
        await asyncio.wait({taking, updates}, return_when=asyncio.FIRST_COMPLETED)
    if updates.done() and not updates.cancelled() and updates.exception() is not None:
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)
        updates.result()
    return await taking


def _renumber(rolled: Rolled, shift: int) -> None:
    """The engine's versions as the trainer counts them."""
    for group in rolled.groups:
        for trajectory in group.trajectories:
            for turn in trajectory.turns:
                turn.weight_versions = [v + shift for v in turn.weight_versions]
