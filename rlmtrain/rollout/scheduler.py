"""The rollout scheduler: every trajectory of every tree as a coroutine over one shared engine.

`Scheduler.rollout(tasks, env, n_samples)` runs G = n_samples root trajectories per task and all
the children their REPL code asks for, and returns one `RolloutGroup` per task. There are no
rounds and no thread pool: each trajectory is an asyncio task running `rlm.agent.run_trajectory`,
so a trajectory waits only for its own engine requests and its own children, and the engine's
continuous batching sees every live request at once. Children are spawned as tasks of their tree
(`spawn` runs a call's children concurrently and answers in order).

Admission and priority:
- trees: at most `max_live_trees` roots run at once, over every rollout running on the
  scheduler, admitted by batch then task order; one REPL zygote per task (its context loaded
  once, shared copy-on-write by the G roots and their children), closed when the task's last
  tree ends;
- engine requests: at most `max_inflight_requests` in flight, the rest queued by priority
  (an earlier batch first, then deeper first so blocked parents resume sooner, then older trees
  so trees finish rather than all progressing slowly; with `priority = "critical_path"`, the
  longest expected chain of turns to the tree's end first, `critical_path.py`);
- REPL workers: at most `max_live_workers`, same priority, with a per-depth reserve that makes
  the limit deadlock-free (see `gate.py`). Plain LM calls at the depth limit need no worker.

Limits on turns, depth, children and tokens are enforced by `run_trajectory`; the scheduler adds
the wall clock: every trajectory of a tree shares the deadline `tree_timeout_s` after the root's
admission, and ends with finish_reason "timeout" (a child's timeout is reported to its parent as
an answer string, as any failed child is). `abort(root_id)` cancels a whole tree: its engine
requests are cancelled (the engine frees their batch slots), its workers killed, and its
unfinished trajectories keep finish_reason "aborted".

Every prompt is rendered by the tokenizer bound to `rollout.chat_template_kwargs` here
(`model.tokenizer.with_chat_template_kwargs`), so RL rollouts, evaluations and the teacher's
trees (the SFT samples) share one prompt format; the engines take the token ids as rendered.

Several rollouts may run at once on one scheduler, each with its `batch` number: the rollouts
of training steps to come (`rollout.ahead`) fill the engine only with what the earlier steps'
trees leave of it, so an engine whose step is down to its last deep trees backfills with the
next step's roots instead of idling.

The REPL is reached through `start_zygote` (default: `rlm.repl.Zygote.start` with the config's
limits), which a benchmark may replace to drive the engine path without executing code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

import msgspec

from rlmtrain import watchdog
from rlmtrain.config import RolloutConfig, too_few_workers
from rlmtrain.model.tokenizer import with_chat_template_kwargs
from rlmtrain.rlm.agent import (
    Agent,
    AgentLimits,
    ChatTokenizer,
    ChildCall,
    child_answer,
    root_trajectory,
    run_plain_call,
    run_trajectory,
)
from rlmtrain.rlm.prompts import RLMEnv
from rlmtrain.rlm.records import RolloutGroup, Trajectory
from rlmtrain.rlm.repl import ExecResult, QueryHandler, ReplLimits, Zygote
from rlmtrain.rollout.critical_path import TurnCounts, chain_turns
from rlmtrain.rollout.engine import Completion, Engine, SamplingParams
from rlmtrain.rollout.gate import PriorityGate
from rlmtrain.rollout.metrics import (
    OccupancySample,
    RolloutMetrics,
    occupancy_between,
    summarize,
)

__all__ = ["ReplHost", "ReplSession", "Scheduler", "StartZygote"]

log = logging.getLogger("rlmtrain.rollout")


class ReplSession(Protocol):
    async def exec(self, code: str, on_query: QueryHandler | None = None) -> ExecResult: ...

    async def close(self) -> None: ...


class ReplHost(Protocol):
    """What the scheduler needs of a `rlm.repl.Zygote`."""

    async def session(self, *, context: Any | None = None) -> ReplSession: ...

    def live_workers(self) -> int: ...

    async def close(self) -> None: ...


StartZygote = Callable[..., Awaitable[ReplHost]]
"""start_zygote(context=..., tool_modules=[...]) -> a started zygote."""


@dataclasses.dataclass(eq=False)
class _TaskRun:
    """One task's G trees and the zygote they share."""

    task: Any
    group: RolloutGroup
    sampling: SamplingParams
    zygote: ReplHost | None = None
    zygote_ready: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    trees_left: int = 0
    dealt: bool = True
    """Its roots were all known at the start (not claimed one by one): its group is whole once
    no tree is left."""


@dataclasses.dataclass(eq=False)
class _Tree:
    run: _TaskRun
    root: Trajectory
    batch: int
    order: int
    deadline: float
    tasks: set[asyncio.Task[Any]] = dataclasses.field(default_factory=set)
    aborted: bool = False
    live: dict[str, Trajectory] = dataclasses.field(default_factory=dict)
    """Its trajectories running now, by id (their chains, for `critical_path`)."""

    def priority(self, depth: int) -> tuple[int, int, int]:
        """Where a call of this tree at `depth` queues: an earlier batch first, then deeper
        calls, then older trees."""
        return (self.batch, -depth, self.order)

    def critical_priority(
        self, trajectory: Trajectory, counts: TurnCounts
    ) -> tuple[int, float, int]:
        """Where `trajectory`'s next request queues: an earlier batch first, then the longest
        expected chain of turns to the tree's end, then older trees."""
        return (self.batch, -chain_turns(trajectory, self.live, counts), self.order)

    @contextlib.contextmanager
    def running(self, trajectory: Trajectory, counts: TurnCounts) -> Iterator[None]:
        """`trajectory` is live while inside; once it ends by itself (not cut off by a
        timeout or an abort), its turns count towards the estimate of the turns to come."""
        self.live[trajectory.id] = trajectory
        try:
            yield
        finally:
            del self.live[trajectory.id]
            if trajectory.finish_reason not in ("timeout", "aborted"):
                counts.record(trajectory.depth, len(trajectory.turns))

    @contextlib.contextmanager
    def timeout_on_cancel(self, trajectory: Trajectory) -> Iterator[None]:
        """Mark `trajectory` "timeout" when it is cancelled because its tree's deadline passed.

        At the deadline every trajectory of the tree times out at once; a parent's timeout
        cancels its children before their own timeouts fire, which would leave them "aborted".
        """
        try:
            yield
        except asyncio.CancelledError:
            if not self.aborted and asyncio.get_running_loop().time() >= self.deadline:
                trajectory.finish_reason = "timeout"
            raise


class Scheduler:
    """Runs rollouts of an environment's tasks on `engine`; see the module docstring.

    sampling: temperature, top-p/k and seed (per-turn max_new_tokens and stops are set by the
    agent from the limits); default: the config's temperature and top_p, no seed.
    metrics_every_s: how often the engine's counters are sampled into `metrics.timeline`.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: ChatTokenizer,
        config: RolloutConfig,
        *,
        sampling: SamplingParams | None = None,
        start_zygote: StartZygote | None = None,
        metrics_every_s: float = 0.5,
    ) -> None:
        if too_few_workers(config):
            raise ValueError(too_few_workers(config))
        self.engine = engine
        self.tokenizer = with_chat_template_kwargs(tokenizer, config.chat_template_kwargs)
        self.config = config
        self.limits = AgentLimits.from_config(config)
        self.sampling = sampling or SamplingParams(
            temperature=config.temperature, top_p=config.top_p
        )
        if start_zygote is None:
            repl_limits = ReplLimits.from_config(config)

            async def start_zygote(*, context: Any, tool_modules: list[str]) -> ReplHost:
                return await Zygote.start(
                    context=context, tool_modules=tool_modules, limits=repl_limits
                )

        self.start_zygote = start_zygote
        self.metrics_every_s = metrics_every_s
        self.metrics: RolloutMetrics | None = None
        """The last rollout's metrics."""
        self.on_tree_done: Callable[[Trajectory], None] | None = None
        """Called with each root as its tree ends (progress display)."""
        self.on_group_done: Callable[[RolloutGroup], None] | None = None
        """Called with each task's group as its last tree ends, where the roots were dealt at
        the start (not claimed): what a caller keeps as it goes, so a killed rollout has them."""
        self._requests = PriorityGate(config.max_inflight_requests, "max_inflight_requests")
        self._workers = PriorityGate(config.max_live_workers, "max_live_workers")
        self._live_trees = PriorityGate(config.max_live_trees, "max_live_trees")
        # By (batch, root id): concurrent rollouts (training steps) may run the same task.
        self._trees: dict[tuple[int, str], _Tree] = {}
        self._zygotes: set[ReplHost] = set()
        self._order = itertools.count()
        self._turn_counts = TurnCounts(config.max_turns)

    # -- public ----------------------------------------------------------------------------

    async def rollout(
        self,
        tasks: Sequence[Any],
        env: RLMEnv,
        n_samples: int,
        samples: Sequence[Sequence[int]] | None = None,
        *,
        batch: int = 0,
        sampling: SamplingParams | None = None,
        claim: Callable[[], int | None] | None = None,
        window: int | None = None,
    ) -> list[RolloutGroup]:
        """G = n_samples trees per task; one RolloutGroup per task, in task order.

        samples: the sample indices (roots) of each task to roll out here, where a group's
        roots are dealt over several engines (`rollout.dealing`); None = all G. A root's ids
        and sampling seeds come from its task and index alone, so it is the same tree on
        whichever engine runs it.
        batch: where this rollout's trees and requests queue among other rollouts running at
        the same time on this scheduler (lower first).
        sampling: this rollout's sampling parameters (its seed: a training step's own); default
        the scheduler's.
        claim: instead of `samples`, roots taken while this scheduler has room for another tree:
        each call returns the next root of the task-major list (task i's sample j is
        i * n_samples + j) that no engine has taken yet, or None once none is left. Engines that
        share one `claim` share the roots by load: the one whose trees end sooner takes more. A
        task none of whose roots came here is an empty group.
        window: with `claim`, the most claimed trees this rollout runs at once (default and at
        most `max_live_trees`): what keeps one engine from taking a whole step that fits it
        before the others have started."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if claim is not None and samples is not None:
            raise ValueError("rollout: give the roots as samples or as claim, not both")
        if claim is not None:
            indices = [[] for _ in tasks]  # the claimed roots are counted as they come
        elif samples is None:
            indices = [list(range(n_samples)) for _ in tasks]
        else:
            indices = samples
        if len(indices) != len(tasks):
            raise ValueError(f"samples: {len(indices)} lists for {len(tasks)} tasks")
        runs = [
            _TaskRun(
                task=task,
                group=RolloutGroup(task=task, trajectories=[]),
                sampling=sampling or self.sampling,
                trees_left=len(mine),
                dealt=claim is None,
            )
            for task, mine in zip(tasks, indices, strict=True)
        ]
        latencies: list[float] = []
        start_stats = msgspec.structs.replace(self.engine.stats())
        timeline: list[OccupancySample] = []
        began = time.perf_counter()
        sampler = asyncio.create_task(self._sample_engine(began, timeline), name="metrics")

        async def timed_tree(run: _TaskRun, sample_idx: int) -> None:
            admitted = time.perf_counter()
            await self._run_tree(run, env, sample_idx, batch)
            latencies.append(time.perf_counter() - admitted)

        async def one_tree(run: _TaskRun, sample_idx: int, order: int) -> None:
            async with self._live_trees.slot((batch, order)):
                await timed_tree(run, sample_idx)

        async def claimed_trees(feeder: int) -> None:
            # A root is claimed only once a tree slot is held: an engine takes no more roots
            # than it can start now.
            while True:
                async with self._live_trees.slot((batch, feeder)):
                    index = claim()
                    if index is None:
                        return
                    task, sample_idx = divmod(index, n_samples)
                    if not 0 <= task < len(runs):
                        raise ValueError(f"claim gave root {index}; there are {len(runs)} tasks")
                    runs[task].trees_left += 1
                    await timed_tree(runs[task], sample_idx)

        try:
            async with asyncio.TaskGroup() as group:
                if claim is not None:
                    feeders = min(window or self.config.max_live_trees, self.config.max_live_trees)
                    for feeder in range(feeders):
                        group.create_task(claimed_trees(feeder))
                roots = ((run, i) for run, mine in zip(runs, indices, strict=True) for i in mine)
                for order, (run, sample_idx) in enumerate(roots):
                    group.create_task(one_tree(run, sample_idx, order))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await asyncio.gather(*(self._close_zygote(r) for r in runs))
        groups = [run.group for run in runs]
        end_stats = self.engine.stats()
        self.metrics = summarize(
            groups,
            wall_s=time.perf_counter() - began,
            tree_latencies_s=latencies,
            start=start_stats,
            end=end_stats,
            timeline=timeline,
        )
        return groups

    def abort(self, root_id: str) -> bool:
        """Cancel the tree of `root_id` (in every rollout running it); False if no such tree is
        running."""
        trees = [tree for (_, key), tree in self._trees.items() if key == root_id]
        for tree in trees:
            tree.aborted = True
            for task in list(tree.tasks):
                task.cancel()
        return bool(trees)

    def live(self) -> dict[str, int]:
        """What is running now: trees, trajectory tasks, engine requests (held and queued),
        REPL workers and zygotes; all zero between rollouts."""
        return {
            "trees": len(self._trees),
            "tasks": sum(len(t.tasks) for t in self._trees.values()),
            "requests": self._requests.held + self._requests.waiting,
            "workers": sum(z.live_workers() for z in self._zygotes),
            "worker_slots": self._workers.held + self._workers.waiting,
            "zygotes": len(self._zygotes),
        }

    # -- trees -----------------------------------------------------------------------------

    async def _run_tree(self, run: _TaskRun, env: RLMEnv, sample_idx: int, batch: int) -> None:
        root = root_trajectory(run.task.id, sample_idx, run.task.query)
        run.group.trajectories.append(root)
        loop = asyncio.get_running_loop()
        tree = _Tree(
            run=run,
            root=root,
            batch=batch,
            order=next(self._order),
            deadline=loop.time() + self.config.tree_timeout_s,
        )
        self._trees[batch, root.id] = tree
        try:
            zygote = await self._zygote(run, env)
            task = self._start(tree, self._run_with_repl(tree, env, zygote, root, context=None))
            try:
                await task
            except asyncio.CancelledError:
                # abort() cancelled the tree: its records stay "aborted"; a cancelled rollout
                # cancels this coroutine too, and that must propagate.
                if asyncio.current_task().cancelling():
                    raise
        except Exception as exc:  # no zygote, or the engine refused a request
            _failed(root, exc)
        finally:
            del self._trees[batch, root.id]
            run.trees_left -= 1
            if run.trees_left == 0:
                await self._close_zygote(run)
            if self.on_tree_done is not None:
                self.on_tree_done(root)
            if run.trees_left == 0 and run.dealt and self.on_group_done is not None:
                self.on_group_done(run.group)

    def _start(self, tree: _Tree, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        tree.tasks.add(task)
        task.add_done_callback(tree.tasks.discard)
        return task

    async def _zygote(self, run: _TaskRun, env: RLMEnv) -> ReplHost:
        async with run.zygote_ready:
            if run.zygote is None:
                run.zygote = await self.start_zygote(
                    context=env.context(run.task), tool_modules=env.tool_modules()
                )
                self._zygotes.add(run.zygote)
            return run.zygote

    async def _close_zygote(self, run: _TaskRun) -> None:
        zygote, run.zygote = run.zygote, None
        if zygote is not None:
            self._zygotes.discard(zygote)
            await zygote.close()

    # -- trajectories ------------------------------------------------------------------------

    def _agent(self, env: RLMEnv, tree: _Tree, trajectory: Trajectory) -> Agent:
        by_depth = tree.priority(trajectory.depth)
        critical = self.config.priority == "critical_path"

        async def generate(prompt_ids: list[int], params: SamplingParams) -> Completion:
            priority = (
                tree.critical_priority(trajectory, self._turn_counts) if critical else by_depth
            )
            async with self._requests.slot(priority):
                completion = await self.engine.generate(prompt_ids, params)
            watchdog.mark()
            return completion

        return Agent(
            env=env,
            generate=generate,
            tokenizer=self.tokenizer,
            limits=self.limits,
            sampling=tree.run.sampling,
            prompt_style=self.config.prompt_style,
        )

    async def _run_with_repl(
        self, tree: _Tree, env: RLMEnv, zygote: ReplHost, trajectory: Trajectory, context: Any
    ) -> None:
        depth = trajectory.depth
        reserve = max(self.config.max_depth - depth, 0)
        async with self._workers.slot(tree.priority(depth), reserve=reserve):
            try:
                session = await zygote.session(context=context)
            except Exception as exc:  # no worker: the trajectory fails, its parent is told
                _failed(trajectory, exc)
                return
            try:

                async def spawn(calls: list[ChildCall]) -> list[str]:
                    return await self._spawn(tree, env, zygote, calls)

                with (
                    tree.running(trajectory, self._turn_counts),
                    tree.timeout_on_cancel(trajectory),
                ):
                    await run_trajectory(
                        self._agent(env, tree, trajectory),
                        trajectory,
                        task=tree.run.task,
                        session=session,
                        spawn=spawn,
                        context=context,
                        deadline=tree.deadline,
                    )
            finally:
                await session.close()

    async def _spawn(
        self, tree: _Tree, env: RLMEnv, zygote: ReplHost, calls: list[ChildCall]
    ) -> list[str]:
        tree.run.group.trajectories.extend(call.trajectory for call in calls)
        children = []
        for call in calls:
            if call.with_repl:
                child = self._run_with_repl(tree, env, zygote, call.trajectory, call.context)
            else:
                child = self._run_plain(tree, env, call)
            children.append(self._start(tree, child))
        results = await asyncio.gather(*children, return_exceptions=True)
        answers = []
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                _failed(call.trajectory, result)
            answers.append(child_answer(call.trajectory))
        return answers

    async def _run_plain(self, tree: _Tree, env: RLMEnv, call: ChildCall) -> None:
        with (
            tree.running(call.trajectory, self._turn_counts),
            tree.timeout_on_cancel(call.trajectory),
        ):
            await run_plain_call(
                self._agent(env, tree, call.trajectory),
                call.trajectory,
                context=call.context,
                deadline=tree.deadline,
            )

    # -- metrics -----------------------------------------------------------------------------

    async def _sample_engine(self, began: float, timeline: list[OccupancySample]) -> None:
        previous = msgspec.structs.replace(self.engine.stats())
        previous_t = time.perf_counter()
        while True:
            await asyncio.sleep(self.metrics_every_s)
            now = msgspec.structs.replace(self.engine.stats())
            t = time.perf_counter()
            occupancy, busy_s = occupancy_between(previous, now)
            timeline.append(
                OccupancySample(
                    t=t - began,
                    occupancy=occupancy,
                    busy=busy_s / (t - previous_t),
                    running=now.running,
                    waiting=now.waiting,
                )
            )
            previous, previous_t = now, t


_FAILURE_CHARS = 500
"""What a record keeps of a failure's message: the cause, not a whole dump."""


def _failed(trajectory: Trajectory, exc: BaseException) -> None:
    """A trajectory the scheduler could not run (no REPL worker, engine error): "error"; its
    parent's rlm_query gets `child_answer`'s explanation."""
    log.warning("trajectory %s failed: %s: %s", trajectory.id, type(exc).__name__, exc)
    trajectory.finish_reason = "error"
    trajectory.failure = f"{type(exc).__name__}: {exc}"[:_FAILURE_CHARS]
