"""The scheduler end to end: SimEngine with scripted replies, the real jailed REPL.

The "model" is a function of (query, turn) returning reply text (plain LM calls get turn -1),
served by `SimEngine` through the byte tokenizer with a small step latency, so requests really
batch and interleave. Every rollout is checked for leaks: no live trees, tasks, engine requests,
worker slots or zygotes in the scheduler, no running or queued request in the engine, no worker
process left below this one and no REPL temp dir left behind.

Rollouts run on `clocks.SkippingLoop`: a test of a timeout sets it long, as a bound on a hang,
and skips the clock past it once the rollout has reached the point where it must fire.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from leaks import descendants
from scheduler_harness import (
    NEVER,
    TOKENIZER,
    Callers,
    in_exec,
    make,
    records,
    run,
    shape,
    skip_when,
)
from scripted_model import DocEnv, code, script_reply

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.base import Task
from rlmtrain.rollout.engine import Completion, SamplingParams
from rlmtrain.rollout.engines.sim import SimEngine
from rlmtrain.rollout.scheduler import Scheduler

# ---------------------------------------------------------------------------------------------
# Tree shapes
# ---------------------------------------------------------------------------------------------


def fan_out_script(query: str, turn: int) -> str:
    if query == "ROOT":
        if turn == 0:
            return code("answers = rlm_query_batched(['slow', 'mid', 'fast'])", "print(answers)")
        return code("FINAL('|'.join(answers))")
    if query == "slow":  # three turns: finishes last, answers first
        if turn < 2:
            return code(f"print({turn})")
        return code("FINAL('S')")
    if query == "mid":
        return code("inner = rlm_query('leaf')", "FINAL('M' + inner)")
    if query == "fast":
        return code("FINAL('F')")
    if query == "leaf":
        return code("FINAL('L')")
    raise AssertionError(f"unscripted query {query!r}")


def test_tree_shape_and_batched_answers_in_order(tmp_path: Path) -> None:
    def fast_children_ended() -> int:
        return sum(t.prompt == "fast" and t.finish_reason == "final" for t in records(scheduler))

    class SlowWaitsForFast(Callers):
        """Holds each slow child's last request until both fast children have ended: children run
        one after another would time the trees out instead."""

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
            asked = script_reply(lambda query, turn: (query, turn), TOKENIZER.decode(prompt_ids))
            while asked == ("slow", 2) and fast_children_ended() < 2:
                await asyncio.sleep(0.01)
            return await super().generate(prompt_ids, params)

    scheduler, engine = make(fan_out_script)
    scheduler = Scheduler(SlowWaitsForFast(engine), TOKENIZER, scheduler.config)
    [group] = run(scheduler, engine, tmp_path, n_samples=2)
    for root in group.roots:
        assert root.answer == "S|ML|F"
        rid = root.id
        assert shape(group, rid) == (
            rid,
            "final",
            [
                (f"{rid}.0", "final", []),
                (f"{rid}.1", "final", [(f"{rid}.1.0", "final", [])]),
                (f"{rid}.2", "final", []),
            ],
        )
        by_id = group.by_id()
        assert len(by_id[f"{rid}.0"].turns) == 3
        # The fast child really finished before the slow one: they ran concurrently.
        assert by_id[f"{rid}.2"].turns[-1].ended < by_id[f"{rid}.0"].turns[-1].ended
    assert len(group.trajectories) == 2 * 5
    metrics = scheduler.metrics
    assert metrics.trees == 2 and metrics.trajectories == 10
    assert metrics.children_per_root_mean == 4 and metrics.finish_reasons == {"final": 10}
    assert metrics.generated_tokens == sum(
        len(turn.completion_ids) for t in group.trajectories for turn in t.turns
    )
    # Every request the engine saw went through the agent's prompts (exact ids kept).
    prompts = sorted(tuple(turn.prompt_ids) for t in group.trajectories for turn in t.turns)
    assert prompts == sorted(tuple(p) for p, _ in engine.requests_seen)


def test_groups_follow_task_order_with_g_roots_each(tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        return code(f"FINAL({query!r})")

    tasks = [Task(id=f"t{i}", query=f"Q{i}") for i in range(5)]
    scheduler, engine = make(script, max_live_trees=3)
    groups = run(scheduler, engine, tmp_path, tasks=tasks, n_samples=3)
    assert [g.task.id for g in groups] == [t.id for t in tasks]
    for task, group in zip(tasks, groups, strict=True):
        assert [r.sample_idx for r in group.roots] == [0, 1, 2]
        assert [r.answer for r in group.roots] == [task.query] * 3


# ---------------------------------------------------------------------------------------------
# Limits, each with its finish reason or refusal
# ---------------------------------------------------------------------------------------------


def test_max_turns(tmp_path: Path) -> None:
    scheduler, engine = make(lambda q, t: code("print('still looking')"), max_turns=3)
    [group] = run(scheduler, engine, tmp_path)
    [root] = group.roots
    assert root.finish_reason == "max_turns" and len(root.turns) == 3


def test_max_new_tokens_cuts_completion(tmp_path: Path) -> None:
    scheduler, engine = make(lambda q, t: NEVER, max_new_tokens=40, max_turns=2)
    [group] = run(scheduler, engine, tmp_path)
    [root] = group.roots
    assert [len(turn.completion_ids) for turn in root.turns] == [40, 40]
    assert root.finish_reason == "max_turns"


def test_max_prompt_tokens_ends_with_context(tmp_path: Path) -> None:
    scheduler, engine = make(lambda q, t: code("print('y' * 3000)"), max_prompt_tokens=1200)
    [group] = run(scheduler, engine, tmp_path)
    [root] = group.roots
    assert root.finish_reason == "context"
    assert all(len(turn.prompt_ids) <= 1200 for turn in root.turns)


def test_children_per_call_and_per_trajectory(tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            if turn == 0:
                return code("a = rlm_query_batched(['c0', 'c1', 'c2'])", "print(a)")
            if turn == 1:
                return code("b = rlm_query_batched(['c3', 'c4'])", "print(b)")
            return code("FINAL(repr(a + b))")
        return code(f"FINAL({query!r})")

    scheduler, engine = make(script, max_children_per_call=2, max_children_per_trajectory=3)
    [group] = run(scheduler, engine, tmp_path)
    [root] = group.roots
    answers = eval(root.answer)  # the repr of a list of str written by the scripted code
    assert answers[:2] == ["c0", "c1"]
    assert "at most 2 prompts run per call" in answers[2]
    assert answers[3] == "c3"
    assert "used all 3 sub-queries" in answers[4]
    assert len(root.children) == 3


@pytest.mark.parametrize("mode", ["lm", "error"])
def test_depth_limit(mode: str, tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        if turn == -1:  # a plain LM call: no code, the reply is the answer
            return f"plain answer to {query}"
        if query == "ROOT":
            return code("FINAL(rlm_query('deep'))")
        return code("FINAL('never reached')")

    scheduler, engine = make(script, max_depth=0, depth_limit_mode=mode, max_live_workers=1)
    [group] = run(scheduler, engine, tmp_path)
    [root] = group.roots
    if mode == "lm":
        assert root.answer == "plain answer to deep"
        [child] = [t for t in group.trajectories if t.parent_id]
        assert child.finish_reason == "final" and len(child.turns) == 1
        assert child.turns[0].code == ""
    else:
        assert "depth limit (0) is reached" in root.answer
        assert len(group.trajectories) == 1


def test_tree_timeout(tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            return code("FINAL(rlm_query('child'))")
        return code("print('thinking')")  # the child never finishes on its own

    async def time_out_once_the_child_runs(scheduler: Scheduler, engine: SimEngine) -> None:
        await skip_when(lambda: in_exec(scheduler, "child"), 30.0)

    # The skip passes the tree's deadline, not the child's exec timeout.
    scheduler, engine = make(script, max_turns=10_000, tree_timeout_s=30.0, repl_timeout_s=60.0)
    [group] = run(scheduler, engine, tmp_path, during=time_out_once_the_child_runs)
    assert {t.finish_reason for t in group.trajectories} == {"timeout"}
    assert len(group.trajectories) == 2


# ---------------------------------------------------------------------------------------------
# Failing children
# ---------------------------------------------------------------------------------------------


def test_failing_and_timed_out_children_answer_their_parent(tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            if turn == 0:
                return code("a = rlm_query_batched(['ok', 'loops', 'hangs'])", "print(a)")
            return code("FINAL(repr(a))")
        if query == "ok":
            return code("FINAL('fine')")
        if query == "loops":
            return code("raise ValueError('broken tool')")
        if query == "hangs":
            return code("import time", "time.sleep(60)")
        raise AssertionError(query)

    async def time_out_the_hang_alone(scheduler: Scheduler, engine: SimEngine) -> None:
        # Only the root's task and the hang's are left: no other exec is timed then.
        await skip_when(
            lambda: scheduler.live()["tasks"] == 2 and in_exec(scheduler, "hangs"), 30.0
        )

    scheduler, engine = make(script, max_turns=2, repl_timeout_s=30.0, tree_timeout_s=600.0)
    [group] = run(scheduler, engine, tmp_path, during=time_out_the_hang_alone)
    [root] = group.roots
    ok, loops, hangs = eval(root.answer)
    assert ok == "fine"
    assert "rlm_query failed" in loops and "max_turns" in loops and "broken tool" in loops
    assert "rlm_query failed" in hangs and "(error)" in hangs and "timed out" in hangs
    by_id = group.by_id()
    assert by_id[f"{root.id}.1"].finish_reason == "max_turns"
    assert by_id[f"{root.id}.2"].finish_reason == "error"
    assert root.finish_reason == "final"


# ---------------------------------------------------------------------------------------------
# Cancellation and leaks
# ---------------------------------------------------------------------------------------------


def test_abort_cancels_one_tree_and_kills_its_workers(tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        if query == "DOOMED":
            return code("a = rlm_query_batched(['spin', 'spin'])")
        if query == "spin":
            return NEVER
        return code("FINAL('done')")

    tasks = [Task(id="doomed", query="DOOMED"), Task(id="fine", query="FINE")]
    aborted: list[bool] = []

    async def abort_when_children_generate(scheduler: Scheduler, engine: SimEngine) -> None:
        # Wait for the doomed root and its two children to hold workers, the children generating.
        while scheduler.live()["workers"] < 3 or engine.stats().running < 2:
            await asyncio.sleep(0.01)
        aborted.append(scheduler.abort("doomed#0"))
        assert not scheduler.abort("no-such#0")

    scheduler, engine = make(script, max_new_tokens=100_000, tree_timeout_s=60.0)
    doomed, fine = run(
        scheduler, engine, tmp_path, tasks=tasks, during=abort_when_children_generate
    )
    assert aborted == [True]
    assert [t.finish_reason for t in doomed.trajectories] == ["aborted"] * 3
    assert [r.answer for r in fine.roots] == ["done"]
    assert engine.stats().requests_done == 2  # doomed's root turn and fine's; spins never ended


def test_cancelled_rollout_leaves_nothing_running(tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            return code("rlm_query_batched(['a', 'b'])")
        return code("import time", "time.sleep(600)")

    scheduler, engine = make(script, n_samples=1)
    before = descendants()

    async def main() -> None:
        rollout = asyncio.create_task(scheduler.rollout([Task(id="t", query="ROOT")], DocEnv(), 3))
        # Cancelled with every child asleep in its exec, the roots waiting on them (a cancel
        # that meets a frame on its way is the next test's).
        while sum(bool(t.parent_id and t.turns) for t in records(scheduler)) < 6:
            await asyncio.sleep(0.01)
        assert scheduler.live()["workers"] == 9
        rollout.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rollout
        assert set(scheduler.live().values()) == {0}, scheduler.live()
        await engine.close()

    asyncio.run(main())
    assert descendants() - before == set()


def test_a_cancel_that_meets_a_workers_frame_is_not_lost(tmp_path: Path) -> None:
    """Cancelled the moment the last worker has forked, while the workers' first frames are on
    their way: every exec the cancel meets must end then, not at its timeout. (On Python 3.11,
    asyncio.wait_for lost such a cancellation and the exec ran on to its full timeout.)"""

    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            return code("rlm_query_batched(['a', 'b'])")
        return code("import time", "time.sleep(600)")

    scheduler, engine = make(script, n_samples=1, repl_timeout_s=240.0, tree_timeout_s=480.0)

    async def main() -> None:
        rollout = asyncio.create_task(scheduler.rollout([Task(id="t", query="ROOT")], DocEnv(), 3))
        while scheduler.live()["workers"] < 9:
            await asyncio.sleep(0)
        rollout.cancel()
        # A bound far under the exec timeout a lost cancellation would wait out.
        await asyncio.wait({rollout}, timeout=60.0)
        assert rollout.done(), "the cancelled rollout runs on: a cancellation was lost"
        with pytest.raises(asyncio.CancelledError):
            await rollout
        assert set(scheduler.live().values()) == {0}, scheduler.live()
        await engine.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# Admission and priority
# ---------------------------------------------------------------------------------------------


def test_limits_on_trees_requests_and_workers_hold(tmp_path: Path) -> None:
    def script(query: str, turn: int) -> str:
        if query.startswith("Q"):
            if turn == 0:
                return code("a = rlm_query_batched(['x', 'y', 'z'])")
            return code("FINAL(''.join(a))")
        return code(f"FINAL({query!r})")

    peaks = {"trees": 0, "requests": 0, "workers": 0, "running": 0}

    async def watch(scheduler: Scheduler, engine: SimEngine) -> None:
        while not scheduler.live()["trees"]:  # admitted a step after the rollout starts
            await asyncio.sleep(0)
        while scheduler.live()["trees"]:
            live = scheduler.live()
            peaks["trees"] = max(peaks["trees"], live["trees"])
            peaks["requests"] = max(peaks["requests"], scheduler._requests.held)
            peaks["workers"] = max(peaks["workers"], live["workers"])
            peaks["running"] = max(peaks["running"], engine.stats().running)
            await asyncio.sleep(0.002)

    tasks = [Task(id=f"t{i}", query=f"Q{i}") for i in range(4)]
    scheduler, engine = make(
        script, max_live_trees=3, max_inflight_requests=4, max_live_workers=5, max_depth=1
    )
    groups = run(scheduler, engine, tmp_path, tasks=tasks, n_samples=2, during=watch)
    assert all(r.answer == "xyz" for g in groups for r in g.roots)
    assert 1 <= peaks["trees"] <= 3
    assert 1 <= peaks["requests"] <= 4 and peaks["running"] <= 4
    assert 1 <= peaks["workers"] <= 5


def _held_until_queued(
    scheduler: Scheduler, engine: SimEngine, *, calls: int, waiting: int
) -> Scheduler:
    """`scheduler` again, over an engine that holds each of its first `calls` calls until
    `waiting` requests queue behind it: what the queue then holds is known, whatever the
    timing."""

    class Held(Callers):
        served = 0

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
            self.served += 1
            if self.served <= calls:
                while held._requests.waiting < waiting:
                    await asyncio.sleep(0.01)
            return await super().generate(prompt_ids, params)

    held = Scheduler(Held(engine), TOKENIZER, scheduler.config)
    return held


def test_deeper_requests_go_first(tmp_path: Path) -> None:
    """With one request in flight, a child's request overtakes the queued root requests."""
    order: list[str] = []

    def script(query: str, turn: int) -> str:
        order.append(query)
        if order.count("R") == 1:  # the first root served spawns a child
            return code("FINAL(rlm_query('child'))")
        return code(f"FINAL({query!r})")

    # The first two calls are held until five requests wait behind each: the other roots
    # behind the first, the child and four roots behind the second.
    scheduler, engine = make(script, max_inflight_requests=1, max_depth=1)
    scheduler = _held_until_queued(scheduler, engine, calls=2, waiting=5)
    run(scheduler, engine, tmp_path, tasks=[Task(id="t", query="R")], n_samples=6)
    # The child arrives after the first root's REPL exec, behind the other roots. In FIFO order
    # it would run last (index 6); deeper first, it runs as soon as the request in flight ends.
    assert len(order) == 7 and order.count("child") == 1
    assert order.index("child") == 2


def test_critical_path_serves_trees_with_more_turns_to_play_first(tmp_path: Path) -> None:
    """Six two-turn roots, one request in flight. The first root served has its second turn
    queued behind four first turns, and it waits for them all: a root that has played a turn
    has fewer expected turns left (1.5 of the prior over 1..3 turns) than one that has played
    none (2). (By depth, the queued second turn of a tree older than the waiting ones would go
    first.)"""
    served: list[int] = []

    def script(query: str, turn: int) -> str:
        served.append(turn)
        return code("print(0)") if turn == 0 else code("FINAL('done')")

    # The first call is held until the other five first turns wait, the second until the first
    # root's second turn waits behind the last four.
    config = {"max_inflight_requests": 1, "max_turns": 3, "priority": "critical_path"}
    scheduler, engine = make(script, **config)
    scheduler = _held_until_queued(scheduler, engine, calls=2, waiting=5)
    [group] = run(scheduler, engine, tmp_path, tasks=[Task(id="t", query="R")], n_samples=6)
    assert [root.answer for root in group.roots] == ["done"] * 6
    assert served[:7] == [0] * 6 + [1]


@pytest.mark.slow
def test_worker_limit_is_deadlock_free_under_deep_trees(tmp_path: Path) -> None:
    """Three levels of REPL trajectories, many trees, and only max_depth + 1 workers."""

    def script(query: str, turn: int) -> str:
        depth = query.count("/")
        if depth < 2:
            return code(f"FINAL('+'.join(rlm_query_batched(['{query}/a', '{query}/b'])))")
        return code(f"FINAL({query!r})")

    tasks = [Task(id=f"t{i}", query=f"q{i}") for i in range(3)]
    scheduler, engine = make(script, max_depth=2, max_live_workers=3, max_live_trees=3)
    groups = run(scheduler, engine, tmp_path, tasks=tasks, n_samples=2)
    for i, group in enumerate(groups):
        for root in group.roots:
            assert root.answer == f"q{i}/a/a+q{i}/a/b+q{i}/b/a+q{i}/b/b"


def test_worker_limit_below_depth_is_refused() -> None:
    engine = SimEngine(script=lambda p, s: [], eos_id=0)
    with pytest.raises(ValueError, match="max_live_workers=2 must be at least max_depth"):
        Scheduler(engine, TOKENIZER, RolloutConfig(max_depth=2, max_live_workers=2))


def test_a_tree_that_breaks_its_teardown_costs_only_itself(tmp_path: Path) -> None:
    """A root that leaves a directory tree too deep for a recursive removal: its session and its
    zygote still close, and the rollout's other trees finish."""

    def script(query: str, turn: int) -> str:
        if query == "DEEP":
            return code(
                "import os",
                "for _ in range(3000):",
                "    os.mkdir('d')",
                "    os.chdir('d')",
                "FINAL('dug')",
            )
        return code("FINAL('fine')")

    scheduler, engine = make(script)
    tasks = [Task(id="deep", query="DEEP"), Task(id="calm", query="ROOT")]
    deep, calm = run(scheduler, engine, tmp_path, tasks=tasks, n_samples=2)
    assert [t.answer for t in calm.roots] == ["fine", "fine"]
    assert [t.finish_reason for t in deep.roots] == ["final", "final"]


def test_injected_faults_cost_only_the_trees_they_touch(tmp_path: Path) -> None:
    """Engine calls that raise or never return and workers killed mid-exec: every tree ends
    (error or timeout where a fault hit it, final elsewhere), the faults are counted, nothing
    leaks, and the rollout returns every group."""
    from collections import Counter

    from rlmtrain.rollout.faults import FaultPlan, FaultyEngine, killing_workers

    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            if turn == 0:
                return code("a = rlm_query_batched(['c1', 'c2', 'c3'])", "print(a)")
            return code("FINAL('|'.join(a))")
        return code("import time", "time.sleep(0.1)", "FINAL('ok')")

    scheduler, engine = make(script, max_turns=3, tree_timeout_s=60.0)
    # Which calls a fault hits depends on timing (a kill or a timeout ends a tree early, and
    # with it its later draws), so the rates and the 24 trees are set to make every kind of
    # fault, and a tree no fault touches, near certain (each missing under 0.2%) in any timing.
    plan = FaultPlan(engine_error=0.08, engine_hang=0.06, worker_kill=0.15, seed=3)
    # A call hangs while it is inside the faulty engine and not inside the engine it wraps.
    reaching = Callers(engine)
    faulty = FaultyEngine(reaching, plan)
    asked = Callers(faulty)
    kills: Counter[str] = Counter()
    scheduler = Scheduler(
        asked,
        TOKENIZER,
        scheduler.config,
        start_zygote=killing_workers(scheduler.start_zygote, plan, kills),
    )

    def every_tree_hung() -> bool:
        hung = asked.inside - reaching.inside
        trees = scheduler._trees.values()
        return bool(trees) and all(tree.tasks & hung for tree in trees)

    async def time_out_hung_trees(scheduler: Scheduler, engine: SimEngine) -> None:
        # The tree timeout ends the hung calls' trees; it fires when only those are left, so
        # it times out no tree a fault left alone, however slow a busy machine's forks are.
        while True:
            await skip_when(every_tree_hung, 60.0)
            timed_out = set(scheduler._trees)
            while timed_out & scheduler._trees.keys():  # they end before the next look
                await asyncio.sleep(0.01)

    tasks = [Task(id=f"t{i}", query="ROOT") for i in range(12)]
    groups = run(scheduler, engine, tmp_path, tasks=tasks, n_samples=2, during=time_out_hung_trees)
    assert [g.task.id for g in groups] == [t.id for t in tasks]
    roots = [t for g in groups for t in g.roots]
    everyone = [t for g in groups for t in g.trajectories]
    assert len(roots) == 24
    reasons = Counter(t.finish_reason for t in everyone)
    # aborted: children whose parent died under them (its worker killed while they ran)
    assert set(reasons) <= {"final", "error", "timeout", "aborted", "max_turns"}, reasons
    assert faulty.injected["engine_error"] and faulty.injected["engine_hang"] and kills
    assert reasons["error"] >= faulty.injected["engine_error"] // 2
    assert reasons["timeout"] >= 1
    untouched = [r for r in roots if r.finish_reason == "final" and r.answer == "ok|ok|ok"]
    assert untouched, f"every tree was hit ({reasons}): the faults are too dense to mean much"
