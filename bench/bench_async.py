"""Rollouts ahead of training against the synchronous loop and a drop-stale baseline, on
simulated GPU engines and a simulated trainer.

Workload: the default's own trees (`default_trees.py`: 24 groups of 8 trees rolled out by the
default's trained policy; turns, completion tokens, REPL output, children per root, and the
seconds of its REPL execs). A step is 12 tasks x 8 roots; each task's group is one recorded
group (seeded draw), each trajectory replays its recorded turns: the completion length (at least
the 40-odd tokens the simulated reply needs to name its trajectory), the REPL's output, an exec
lasting a recorded REPL time, and at the recorded turn its recorded children.

Engines: `SimEngine` at the latency curve of `bench_scheduler.py` (a ~4B model in bf16 on one
H100: 7 ms a step, 30 us a sequence, 6.25 us a prompt byte token), one per inference rank, each
with its own scheduler, the step's groups dealt over them (`rollout.dealing`). Trainer: a step
costs its tokens (prompt bytes / 4 + completion tokens, every turn of every trained tree) at
12k tokens/s per trainer rank (a 4B model at ~30% MFU on an H100) plus 1 s to send the new
weights to the engines, during which the engines hold their requests (vLLM's paused update).
Ranks: 4 inference + 4 trainer and 2 + 6.

Four schedules of the same steps:
- sync: roll out a step, train it, send the weights (η = 0 on separate ranks);
- η = 1, η = 2: `rollout.ahead`, the next steps admitted within the bound and backfilling the
  engines, the trainer taking the steps whole in order;
- drop-stale (η = 1): what prime-rl and TRL do: every engine keeps (η + 1) steps' worth of groups
  in flight, admitting a new group whenever one ends; the trainer takes groups in the order they
  end and drops any admitted more than η updates before the weights it trains.

Dealing: the step's roots in equal shares (`rollout.dealing`), or by load as a split world's
inference ranks take them (each engine claims the next root whenever it has room for another
tree, at most an equal share at once: `Scheduler.rollout(claim=, window=)`). Where every root
of a step runs at once the two are the same; the comparison holds each engine to 8 trees at a
time (`rollout.max_live_trees`), synchronous, at 4 + 4, with the four engines alike and with one
of them at half speed (a slower card, or one shared with other work).

Priority: where each engine runs at most INFLIGHT requests at once (its memory the limit, not
the trees), the queued ones go deeper first (`rollout.priority = "depth"`) or by their tree's
expected remaining chain of turns (`"critical_path"`), synchronous and at η = 1, 4 + 4.

Reported per schedule: steps per hour, the engines' and the trainer's idle fractions, the mean
and maximum staleness of trained tokens, groups dropped, and the share of trained tokens that
come from trees with children against that share in the recorded trees (the bias a scheme that
drops slow trees has against recursion). Targets: η = 1 >= 1.4x sync's steps per hour at 4 + 4;
drop-stale's share of trained tokens from trees with children below η = 1's.

    python -m pytest bench/bench_async.py --benchmark-only -s
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
import time
from typing import Any

import msgspec
import torch.distributed as dist
import uvloop
from bench_scheduler import (
    MAX_BATCH,
    TOKENIZER,
    A,
    B,
    BenchEnv,
    C,
    SimRepl,
    TimedSimEngine,
    system_tokens,
)
from default_trees import load

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.base import Task
from rlmtrain.rlm.agent import Agent
from rlmtrain.rlm.extract import STOP_STRINGS
from rlmtrain.rlm.records import RolloutGroup, Trajectory
from rlmtrain.rlm.repl import ExecResult
from rlmtrain.rollout import dealing
from rlmtrain.rollout.ahead import Ahead, StepRoots
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines.sim import LatencyModel
from rlmtrain.rollout.scheduler import Scheduler
from rlmtrain.training.split import RootClaims, in_tree_order

TASKS, G, STEPS = 12, 8, 8
INFLIGHT = 8  # requests an engine runs at once where its memory, not the trees, is the limit
TRAIN_TOKENS_PER_S_PER_RANK = 12_000
SYNC_S = 1.0
SPLITS = [(4, 4), (2, 6)]
SAMPLING = SamplingParams(seed=1)
TREES, REPL_S = load()
GROUPS = [TREES[i : i + G] for i in range(0, len(TREES), G)]

CONFIG = RolloutConfig(
    max_turns=6,
    max_depth=2,
    max_children_per_call=10,
    max_new_tokens=1024,
    max_prompt_tokens=65536,
    max_inflight_requests=MAX_BATCH,
    max_live_trees=4 * TASKS * G,
    max_live_workers=1 << 16,
    tree_timeout_s=3600.0,
    max_batch_size=MAX_BATCH,
)


@dataclasses.dataclass
class Plan:
    """One trajectory to replay: its recorded turns and children."""

    id: str
    turns: list[list[int]]
    spawn: int
    children: list[Plan]
    repl_s: list[float]


def plan_of(trajectory_id: str, shape: dict[str, Any], rng: random.Random) -> Plan:
    return Plan(
        id=trajectory_id,
        turns=shape["turns"],
        spawn=shape["spawn"],
        children=[
            plan_of(f"{trajectory_id}.{k}", child, rng) for k, child in enumerate(shape["children"])
        ],
        repl_s=[rng.choice(REPL_S) for _ in shape["turns"]],
    )


def step_plans(step: int) -> dict[str, Plan]:
    """Every trajectory of step `step`'s trees by id, the same for every schedule."""
    rng = random.Random(f"async/{step}")
    plans: dict[str, Plan] = {}

    def add(plan: Plan) -> None:
        plans[plan.id] = plan
        for child in plan.children:
            add(child)

    for t in range(TASKS):
        group = rng.choice(GROUPS)
        for g, tree in enumerate(group):
            add(plan_of(f"s{step}t{t}#{g}", tree, rng))
    return plans


def step_tasks(step: int) -> list[Task]:
    return [Task(id=f"s{step}t{t}", query=f"question {step}.{t}") for t in range(TASKS)]


def reply(plan: Plan, turn: int) -> list[int]:
    """The recorded completion length in byte tokens (at least what names the turn)."""
    head = f"```python\nstep({plan.id!r}, {turn})\n#"
    tail = STOP_STRINGS[0]
    pad = max(plan.turns[turn][0] - len(head) - len(tail), 0)
    return TOKENIZER.encode(head + "x" * pad + tail)


class ReplayRepl(SimRepl):
    """A REPL host whose exec replays the plan: the recorded REPL time, children, output."""

    class Session(SimRepl.Session):
        async def exec(self, code: str, on_query: Any = None) -> ExecResult:
            step = re.match(r"step\('(.*?)', (\d+)\)", code)
            if step is None:  # the agent's own setup (the query bound into the session)
                return ExecResult(output="", error="", final=None, dead=False)
            plan, turn = self.host.plans[step[1]], int(step[2])
            await asyncio.sleep(plan.repl_s[turn])
            if turn == plan.spawn:
                prompts = [f"helper question {c.id}" for c in plan.children]
                await on_query(prompts, [None] * len(prompts))
            final = "answer" if turn == len(plan.turns) - 1 else None
            return ExecResult(output="o" * plan.turns[turn][1], error="", final=final, dead=False)


class SyncingSimEngine(TimedSimEngine):
    """An update holds the engine's requests for SYNC_S (the weights arriving), then resumes."""

    async def _apply_weights(self, named_tensors) -> None:
        await asyncio.sleep(SYNC_S)


class Cluster:
    """k simulated engines, each with its scheduler, over the plans of `steps` steps;
    `live_trees`: each scheduler's `max_live_trees` (default CONFIG's, room for every root);
    `slow`: the first engine's step time is this many times the others'; `inflight` and
    `priority`: each scheduler's `max_inflight_requests` (default CONFIG's, room for every
    request) and the order its queued requests go in."""

    def __init__(
        self,
        engines: int,
        steps: int = STEPS,
        live_trees: int | None = None,
        slow: float = 1.0,
        inflight: int | None = None,
        priority: str = "depth",
    ) -> None:
        self.plans: dict[str, Plan] = {}
        for step in range(steps):
            self.plans.update(step_plans(step))
        agent = Agent(env=BenchEnv(), generate=None, tokenizer=TOKENIZER, sampling=SAMPLING)
        self.by_seed: dict[int, tuple[Plan, int]] = {}
        for plan in self.plans.values():
            record = Trajectory(id=plan.id, root_id="", parent_id=None, depth=0, task_id="",
                                sample_idx=0, prompt="")  # fmt: skip
            for turn in range(len(plan.turns)):
                self.by_seed[agent.params(record, turn, stop_strings=[]).seed] = (plan, turn)
        prefix = self.prefix = system_tokens()
        repl = ReplayRepl(self.plans)

        async def start_zygote(*, context: Any, tool_modules: list[str]) -> ReplayRepl:
            return repl

        self.engines = [
            SyncingSimEngine(
                script=lambda prompt, params: reply(*self.by_seed[params.seed]),
                eos_id=TOKENIZER.eos_id,
                latency=LatencyModel(a=A * k, b=B * k, c=C * k, cached_prefix_tokens=prefix),
                max_batch_size=MAX_BATCH,
                kv_budget_tokens=1 << 30,
                decode=TOKENIZER.decode,
            )
            for k in [slow] + [1.0] * (engines - 1)
        ]
        config = msgspec.structs.replace(CONFIG, priority=priority)
        if live_trees is not None:
            config = msgspec.structs.replace(config, max_live_trees=live_trees)
        if inflight is not None:
            config = msgspec.structs.replace(config, max_inflight_requests=inflight)
        self.schedulers = [
            Scheduler(e, TOKENIZER, config, sampling=SAMPLING, start_zygote=start_zygote)
            for e in self.engines
        ]

    async def sync_weights(self) -> None:
        """The trainer's new weights into every engine (SYNC_S, requests held meanwhile)."""
        await asyncio.gather(*(e.update_weights([]) for e in self.engines))

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))


PREFIX = system_tokens()


def trained_tokens(groups: list[RolloutGroup]) -> int:
    """Tokens the trainer forwards: every turn's prompt less the system prompt the packer
    forwards once per micro-batch (byte tokens, 4 to a BPE token) and its completion."""
    return sum(
        max(len(turn.prompt_ids) - PREFIX, 0) // 4 + len(turn.completion_ids)
        for group in groups
        for trajectory in group.trajectories
        for turn in trajectory.turns
    )


def tree_tokens(groups: list[RolloutGroup]) -> list[tuple[int, int]]:
    """(children of the root, trained tokens of its tree) for every tree of `groups`."""
    return [
        (
            len(root.children),
            trained_tokens([RolloutGroup(task=None, trajectories=group.tree(root))]),
        )
        for group in groups
        for root in group.roots
    ]


@dataclasses.dataclass
class Tally:
    """What a schedule rolled out and what its trainer trained."""

    rolled: list[RolloutGroup] = dataclasses.field(default_factory=list)
    trained: list[RolloutGroup] = dataclasses.field(default_factory=list)
    ages: list[int] = dataclasses.field(default_factory=list)
    train_s: float = 0.0
    dropped: int = 0

    def train(self, groups: list[RolloutGroup], version: int, ranks: int) -> float:
        self.trained += groups
        self.ages += [
            version - v
            for group in groups
            for trajectory in group.trajectories
            for turn in trajectory.turns
            for v in turn.weight_versions
        ]
        seconds = trained_tokens(groups) / (ranks * TRAIN_TOKENS_PER_S_PER_RANK)
        self.train_s += seconds
        return seconds


async def run_ahead(
    inference: int,
    trainers: int,
    max_staleness: int,
    *,
    by_load: bool = False,
    live_trees: int | None = None,
    slow: float = 1.0,
    inflight: int | None = None,
    priority: str = "depth",
) -> dict[str, Any]:
    cluster = Cluster(
        inference, live_trees=live_trees, slow=slow, inflight=inflight, priority=priority
    )
    shares_of = [dealing.deal(TASKS, G, inference) for _ in range(STEPS)]
    claims = RootClaims(dist.HashStore())  # the split world's, on an in-process store

    def plan_for(rank: int):
        def plan(step: int) -> StepRoots:
            tasks = step_tasks(step)
            if by_load:
                roots = TASKS * G
                claim = claims.of_step(step, roots)
                return StepRoots(tasks, None, None, claim, -(-roots // inference))
            mine = shares_of[step][rank]
            return StepRoots([tasks[t] for t, _ in mine], [s for _, s in mine])

        return plan

    def parts(step: int, rank: int, groups: list[RolloutGroup]) -> list[tuple[int, RolloutGroup]]:
        if by_load:
            return [(t, g) for t, g in enumerate(groups) if g.trajectories]
        return [(t, g) for (t, _), g in zip(shares_of[step][rank], groups, strict=True)]

    aheads = [
        Ahead(s, BenchEnv(), G, plan_for(r), first=0, steps=STEPS, max_staleness=max_staleness)
        for r, s in enumerate(cluster.schedulers)
    ]
    tally = Tally()
    began = time.perf_counter()
    for ahead in aheads:
        ahead.start()
    for step in range(STEPS):
        rolled = await asyncio.gather(*(a.take(step) for a in aheads))
        groups = dealing.merge(
            step_tasks(step),
            list(range(TASKS)),
            [parts(step, r, rolled[r].groups) for r in range(inference)],
        )
        groups = [in_tree_order(group) for group in groups]
        tally.rolled += groups
        await asyncio.sleep(tally.train(groups, step, trainers))
        await cluster.sync_weights()
        for ahead in aheads:
            ahead.advance(step + 1)
    wall = time.perf_counter() - began
    for ahead in aheads:
        await ahead.close()
    await cluster.close()
    return summary(cluster, tally, wall, trainers)


async def run_drop_stale(inference: int, trainers: int, max_staleness: int) -> dict[str, Any]:
    """Groups admitted whenever fewer than (η + 1) steps' worth are out (rolling out or ended
    and not yet taken), each to the engine with the fewest; the trainer takes them in the order
    they end and drops those admitted more than η updates before the weights it trains."""
    spare = 3 * STEPS  # tasks enough for the steps however many groups are dropped
    cluster = Cluster(inference, spare)
    ended: asyncio.Queue[tuple[RolloutGroup, int]] = asyncio.Queue()
    version = 0
    pending = [(step, task) for step in range(spare) for task in step_tasks(step)]
    out = [0] * inference
    room = asyncio.Event()
    capacity = (max_staleness + 1) * TASKS

    async def one(engine: int, step: int, task: Task, admitted: int) -> None:
        (group,) = await cluster.schedulers[engine].rollout([task], BenchEnv(), G, batch=step)
        out[engine] -= 1
        await ended.put((group, admitted))

    async def admit() -> None:
        while pending:
            while sum(out) + ended.qsize() >= capacity:
                room.clear()
                await room.wait()
            engine = out.index(min(out))
            out[engine] += 1
            step, task = pending.pop(0)
            running.add(asyncio.ensure_future(one(engine, step, task, version)))

    running: set[asyncio.Task[None]] = set()
    admitter = asyncio.ensure_future(admit())
    tally = Tally()
    began = time.perf_counter()
    for _ in range(STEPS):
        batch: list[RolloutGroup] = []
        while len(batch) < TASKS:
            group, admitted = await ended.get()
            room.set()
            tally.rolled.append(group)
            if version - admitted > max_staleness:
                tally.dropped += 1
            else:
                batch.append(group)
        await asyncio.sleep(tally.train(batch, version, trainers))
        await cluster.sync_weights()
        version += 1
    wall = time.perf_counter() - began
    admitter.cancel()
    for task in running:
        task.cancel()
    await asyncio.gather(admitter, *running, return_exceptions=True)
    await cluster.close()
    return summary(cluster, tally, wall, trainers)


def summary(cluster: Cluster, tally: Tally, wall: float, trainers: int) -> dict[str, Any]:
    busy = sum(e.modelled_s for e in cluster.engines) / len(cluster.engines)
    rolled, trained = tree_tokens(tally.rolled), tree_tokens(tally.trained)

    def share_with_children(trees: list[tuple[int, int]]) -> float:
        return sum(t for c, t in trees if c) / max(1, sum(t for _, t in trees))

    by_children = {}
    for children in sorted({c for c, _ in rolled}):
        made = sum(t for c, t in rolled if c == children)
        by_children[children] = sum(t for c, t in trained if c == children) / max(1, made)
    return {
        "steps_per_hour": STEPS / wall * 3600,
        "engine_idle": max(0.0, 1 - busy / wall),
        "trainer_idle": max(0.0, 1 - (tally.train_s + STEPS * SYNC_S) / wall),
        "staleness_mean": sum(tally.ages) / max(1, len(tally.ages)),
        "staleness_max": max(tally.ages, default=0),
        "groups_dropped": tally.dropped,
        "rolled_share_with_children": share_with_children(rolled),
        "trained_share_with_children": share_with_children(trained),
        "trained_of_rolled_by_children": by_children,
    }


async def compare() -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for inference, trainers in SPLITS:
        split = f"{inference}+{trainers}"
        results[f"{split} sync"] = await run_ahead(inference, trainers, 0)
        results[f"{split} eta=1"] = await run_ahead(inference, trainers, 1)
        results[f"{split} eta=2"] = await run_ahead(inference, trainers, 2)
        results[f"{split} drop-stale eta=1"] = await run_drop_stale(inference, trainers, 1)
    for slow in (1.0, 2.0):
        for by_load in (False, True):
            name = f"4+4 sync 8 trees{' 1 slow' if slow > 1 else ''} {DEALS[by_load]}"
            results[name] = await run_ahead(4, 4, 0, by_load=by_load, live_trees=8, slow=slow)
    for priority in PRIORITIES:
        for eta in (0, 1):
            name = f"4+4 {ETAS[eta]} {INFLIGHT} requests {priority}"
            results[name] = await run_ahead(4, 4, eta, inflight=INFLIGHT, priority=priority)
    return results


PRIORITIES = ("depth", "critical_path")
ETAS = {0: "sync", 1: "eta=1"}


DEALS = {False: "equal", True: "by load"}


def test_async_schedules(benchmark) -> None:
    results = benchmark.pedantic(lambda: uvloop.run(compare()), rounds=1, iterations=1)
    print(
        f"\n{'schedule':<22}{'steps/h':>8}{'idle: engines':>14}{'trainer':>8}"
        f"{'staleness':>10}{'max':>4}{'dropped':>8}{'children share':>15}{'of rolled':>10}"
        "   trained/rolled tokens by children per tree"
    )
    for name, r in results.items():
        by_children = "  ".join(
            f"{c}: {share:.2f}" for c, share in r["trained_of_rolled_by_children"].items()
        )
        print(
            f"{name:<22}{r['steps_per_hour']:>8.0f}{r['engine_idle']:>14.2f}"
            f"{r['trainer_idle']:>8.2f}{r['staleness_mean']:>10.2f}{r['staleness_max']:>4}"
            f"{r['groups_dropped']:>8}{r['trained_share_with_children']:>15.3f}"
            f"{r['rolled_share_with_children']:>10.3f}   {by_children}"
        )
    for inference, trainers in SPLITS:
        split = f"{inference}+{trainers}"
        speedup = (
            results[f"{split} eta=1"]["steps_per_hour"] / results[f"{split} sync"]["steps_per_hour"]
        )
        print(f"{split}: eta=1 / sync = {speedup:.2f}x steps per hour")
        benchmark.extra_info[f"{split}_eta1_speedup"] = speedup
    for engines, label in (("", "alike"), (" 1 slow", "one at half speed")):
        by_load = (
            results[f"4+4 sync 8 trees{engines} by load"]["steps_per_hour"]
            / results[f"4+4 sync 8 trees{engines} equal"]["steps_per_hour"]
        )
        print(
            f"4+4 sync, 8 trees an engine, engines {label}: by load / equal shares = "
            f"{by_load:.2f}x steps per hour"
        )
        benchmark.extra_info[f"4+4_sync_8_trees{engines.replace(' ', '_')}_by_load"] = by_load
    for eta in ETAS.values():
        depth, critical = (
            results[f"4+4 {eta} {INFLIGHT} requests {p}"]["steps_per_hour"] for p in PRIORITIES
        )
        print(
            f"4+4 {eta}, {INFLIGHT} requests in flight an engine: critical path / depth first = "
            f"{critical / depth:.2f}x steps per hour"
        )
        benchmark.extra_info[f"4+4_{eta}_{INFLIGHT}_requests_critical_path"] = critical / depth
    benchmark.extra_info["schedules"] = results
