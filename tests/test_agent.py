"""The trajectory loop against the real jailed REPL, driven by a scripted deterministic model.

The "model" is a function of (query, turn) returning the reply text; `ScriptedEngine` turns it
into byte tokens the way an engine would (stop string kept, stop token appended, cut at
max_new_tokens) with fixed log-probs. Children run through a small recursive spawn that forks a
session per child from one zygote and calls `run_trajectory` at depth + 1, standing in for the
scheduler. Every tree is checked for the invariants a trainer relies on (`check_tree`), and
every run for leftover workers and temp dirs.

Trees run on `clocks.SkippingLoop`, so a test of a timeout skips the clock past it once the run
has reached the point where it must fire.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path

import clocks
import msgspec
import pytest
from leaks import leak_checked_tempfile_root
from scripted_model import DocEnv, check_links, code, script_reply

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.base import Task
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rlm.agent import (
    Agent,
    AgentLimits,
    ChildCall,
    child_answer,
    root_trajectory,
    run_plain_call,
    run_trajectory,
)
from rlmtrain.rlm.extract import STOP_STRINGS
from rlmtrain.rlm.generation import Completion, SamplingParams
from rlmtrain.rlm.prompts import (
    PLAIN_CALL_SYSTEM,
    builtin_docs,
    query_message,
    system_prompt,
    turn_messages,
)
from rlmtrain.rlm.records import RolloutGroup, Trajectory, read_groups, write_groups
from rlmtrain.rlm.repl import ReplLimits, Zygote

TOKENIZER = ByteTokenizer()
TASK = Task(id="task-1", query="ROOT")
Script = Callable[[str, int], str | None]
"""(query, 0-based turn) -> the model's reply; plain LM calls get turn -1. None = never reply."""
ABORT = "<the engine aborts this request>"


class ScriptedEngine:
    """A deterministic `GenerateFn`: reads the query and turn from the prompt, replies by script."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def __call__(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.requests.append((prompt_ids, params))
        await asyncio.sleep(0)
        reply = script_reply(self.script, TOKENIZER.decode(prompt_ids))
        if reply is None:  # the engine never answers: only cancellation ends this request
            await asyncio.Event().wait()
        if reply == ABORT:
            return Completion(token_ids=[], logprobs=[], finish_reason="abort")
        for stop in params.stop_strings:  # like vLLM: the stop string stays in the output
            if stop in reply:
                reply = reply[: reply.index(stop) + len(stop)]
        ids = TOKENIZER.encode(reply)
        finish = "stop"
        if len(ids) >= params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        elif not any(stop in reply for stop in params.stop_strings):
            ids.append(params.stop_token_ids[-1])  # the reply ends with the end-of-turn token
        logprobs = [-0.01 - (i % 7) / 10 for i in range(len(ids))]
        return Completion(token_ids=ids, logprobs=logprobs, finish_reason=finish)


class Tree:
    """The scheduler's part, minimal: spawn children recursively, keep every record."""

    def __init__(self, agent: Agent, zygote: Zygote, child_timeout_s: float | None) -> None:
        self.agent = agent
        self.zygote = zygote
        self.child_timeout_s = child_timeout_s
        self.records: list[Trajectory] = []
        self.ended: list[Trajectory] = []
        """Children whose run has returned, their REPL session closed."""

    async def run_root(self, sample_idx: int) -> Trajectory:
        root = root_trajectory(TASK.id, sample_idx, TASK.query)
        self.records.append(root)
        session = await self.zygote.session()
        try:
            return await run_trajectory(
                self.agent, root, task=TASK, session=session, spawn=self.spawn
            )
        finally:
            await session.close()

    async def spawn(self, calls: list[ChildCall]) -> list[str]:
        return list(await asyncio.gather(*(self.run_child(call) for call in calls)))

    async def run_child(self, call: ChildCall) -> str:
        self.records.append(call.trajectory)
        deadline = None
        if self.child_timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + self.child_timeout_s
        if not call.with_repl:
            await run_plain_call(
                self.agent, call.trajectory, context=call.context, deadline=deadline
            )
        else:
            session = await self.zygote.session(context=call.context)
            try:
                await run_trajectory(
                    self.agent,
                    call.trajectory,
                    task=TASK,
                    session=session,
                    spawn=self.spawn,
                    context=call.context,
                    deadline=deadline,
                )
            finally:
                await session.close()
        self.ended.append(call.trajectory)
        return child_answer(call.trajectory)


def in_exec(tree: Tree, prompt: str) -> bool:
    """Whether the trajectory of `prompt` has reached its first exec: a turn is recorded when its
    completion comes in, and the exec, its timeout set, starts in that same step."""
    return any(t.prompt == prompt and t.turns for t in tree.records)


def run_tree(
    script: Script,
    *,
    limits: AgentLimits | None = None,
    repl: ReplLimits | None = None,
    n_roots: int = 1,
    child_timeout_s: float | None = None,
    cancel_after_requests: int | None = None,
    skip_when: tuple[Callable[[Tree], bool], float] | None = None,
    exact_prompts: bool = True,
    tmp_path: Path,
) -> tuple[RolloutGroup, ScriptedEngine]:
    """Run `n_roots` trees of TASK; checks that no worker process or temp dir outlives them.

    `cancel_after_requests`: cancel the roots once the engine has seen that many requests.
    `skip_when`: (condition, seconds): once `condition(tree)` holds, the clock skips `seconds`
    ahead, forcing the timeouts it passes.
    `exact_prompts`: rebuild every prompt at the full history budget and compare ids (off when
    a test makes the agent shrink the budget).
    """
    engine = ScriptedEngine(script)
    agent = Agent(
        env=DocEnv(),
        generate=engine,
        tokenizer=TOKENIZER,
        limits=limits or AgentLimits(max_turns=4, max_depth=2, max_prompt_tokens=16384),
    )

    async def main() -> RolloutGroup:
        env = agent.env
        zygote = await Zygote.start(
            context=env.context(TASK),
            tool_modules=env.tool_modules(),
            limits=repl or ReplLimits(exec_timeout_s=30.0),
        )
        try:
            tree = Tree(agent, zygote, child_timeout_s)
            roots = [asyncio.create_task(tree.run_root(i)) for i in range(n_roots)]
            if skip_when is not None:
                condition, seconds = skip_when
                await clocks.until(lambda: condition(tree), "the point a timeout must fire")
                clocks.skip(seconds)
            if cancel_after_requests is not None:
                while len(engine.requests) < cancel_after_requests:
                    await asyncio.sleep(0.01)
                for root in roots:
                    root.cancel()
            results = await asyncio.gather(*roots, return_exceptions=True)
            for result in results:
                if cancel_after_requests is None or not isinstance(result, asyncio.CancelledError):
                    assert isinstance(result, Trajectory), result
            assert zygote.live_workers() == 0
        finally:
            await zygote.close()
        return RolloutGroup(task=TASK, trajectories=tree.records)

    with leak_checked_tempfile_root(tmp_path):
        group = clocks.run(main())
    check_tree(group, agent, exact_prompts=exact_prompts)
    return group, engine


def check_tree(group: RolloutGroup, agent: Agent, *, exact_prompts: bool) -> None:
    """Invariants of every tree: linkage, exact prompt ids, fresh final messages, JSONL trip."""
    check_links(group)
    if exact_prompts:
        for trajectory in group.trajectories:
            check_prompts(trajectory, agent)
    loaded = read_back(group)
    assert loaded.trajectories == group.trajectories
    assert msgspec.convert(loaded.task, Task) == group.task


def check_prompts(trajectory: Trajectory, agent: Agent) -> None:
    """Each turn's prompt ids are the chat template of the prompt rebuilt from the records."""
    if not trajectory.turns or PLAIN_CALL_SYSTEM in TOKENIZER.decode(
        trajectory.turns[0].prompt_ids
    ):
        return
    limits = agent.limits
    mode = (
        "repl"
        if trajectory.depth < limits.max_depth
        else ("plain" if limits.depth_limit_mode == "lm" else "none")
    )
    system = system_prompt(
        agent.env,
        builtins=builtin_docs(
            output_limit_chars=limits.output_limit_chars,
            subcalls=mode,
            max_children_per_call=limits.max_children_per_call,
            max_children_per_trajectory=limits.max_children_per_trajectory,
        ),
    )
    previous: list[int] = []
    for t, turn in enumerate(trajectory.turns):
        if trajectory.is_root:
            fresh = agent.env.user_prompt(TASK, t, limits.max_turns)
        else:
            fresh = query_message(trajectory.prompt, t, limits.max_turns)
        messages = turn_messages(
            system, trajectory.turns[:t], fresh, budget_chars=limits.history_budget_chars
        )
        assert turn.prompt_ids == TOKENIZER.apply_chat_template(
            messages, add_generation_prompt=True
        )
        assert f"This is turn {t + 1} of {limits.max_turns}" in TOKENIZER.decode(turn.prompt_ids)
        if previous:
            assert turn.prompt_ids[: len(previous)] != previous
        previous = turn.prompt_ids


def read_back(group: RolloutGroup) -> RolloutGroup:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "groups.jsonl"
        assert write_groups(path, [group]) == 1
        (loaded,) = read_groups(path)
    return loaded


# ---------------------------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------------------------


def test_depth_two_tree_answers_come_back_in_order(tmp_path: Path):
    def script(query: str, turn: int) -> str:
        replies = {
            ("ROOT", 0): code('answers = rlm_query_batched(["A", "B"])', "print(answers)"),
            ("ROOT", 1): code('FINAL(" | ".join(answers))'),
            # A is slower than B (two turns and a child of its own), yet its answer comes first.
            ("A", 0): code('g = rlm_query("A1", context="ctx-A")', "print(g)"),
            ("A", 1): code('FINAL("A got " + g)'),
            ("A1", 0): code('FINAL("A1 saw " + context + "; " + rlm_query("A1x"))'),
            # A plain call at the depth limit; the context A1 inherited from A is shown to it.
            ("A1x\n\nContext:\nctx-A", -1): "plain answer\n",
            ("B", 0): code('FINAL("B saw " + context["doc"])'),
        }
        return replies[query, turn]

    group, _ = run_tree(script, tmp_path=tmp_path)
    by_prompt = {t.prompt: t for t in group.trajectories}
    root = by_prompt["ROOT"]
    expected = "A got A1 saw ctx-A; plain answer | B saw the quick brown fox"
    assert (root.finish_reason, root.answer) == ("final", expected)
    assert (
        "['A got A1 saw ctx-A; plain answer', 'B saw the quick brown fox']" in root.turns[0].output
    )
    assert root.children == [by_prompt["A"].id, by_prompt["B"].id]
    assert by_prompt["A"].children == [by_prompt["A1"].id]
    assert by_prompt["A1"].children == [by_prompt["A1x"].id]
    assert [by_prompt[q].depth for q in ("ROOT", "A", "A1", "A1x")] == [0, 1, 2, 3]
    plain = by_prompt["A1x"]
    assert (plain.finish_reason, plain.answer, len(plain.turns)) == ("final", "plain answer", 1)
    assert plain.turns[0].code == ""
    assert {t.root_id for t in group.trajectories} == {root.id}
    assert [call.name for call in root.turns[0].tool_calls] == ["rlm_query_batched"]


def test_failing_children_return_explanations_to_the_parent(tmp_path: Path):
    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            if turn == 0:
                return code('answers = rlm_query_batched(["raises", "hangs", "dies", "ok"])')
            return code('FINAL("\\n".join(answers))')
        return {
            "raises": code("1 / 0"),
            "hangs": code("while True:", "    pass"),
            "dies": code("import os", "os._exit(3)"),
            "ok": code('FINAL("fine")'),
        }[query]

    def hang_alone(tree: Tree) -> bool:  # every other child done, so no other exec is timed
        return len(tree.ended) == 3 and in_exec(tree, "hangs")

    group, _ = run_tree(
        script,
        limits=AgentLimits(max_turns=2, max_depth=1),
        repl=ReplLimits(exec_timeout_s=30.0),
        skip_when=(hang_alone, 30.0),
        tmp_path=tmp_path,
    )
    by_prompt = {t.prompt: t for t in group.trajectories}
    raises, hangs, dies, ok = group.by_id()["task-1#0"].answer.split("\n")
    assert raises.startswith("[rlm_query failed: the sub-query used all its turns")
    assert "ZeroDivisionError" in raises
    assert (by_prompt["raises"].finish_reason, len(by_prompt["raises"].turns)) == ("max_turns", 2)
    assert hangs.startswith("[rlm_query failed: the sub-query lost its REPL worker (error)")
    assert "timed out" in hangs
    assert dies.startswith("[rlm_query failed: the sub-query lost its REPL worker (error)")
    assert "exited with status 3" in dies
    assert (by_prompt["hangs"].finish_reason, len(by_prompt["hangs"].turns)) == ("error", 1)
    assert ok == "fine"


def test_child_past_its_deadline_times_out_and_the_parent_goes_on(tmp_path: Path):
    def script(query: str, turn: int) -> str:
        return {
            ("ROOT", 0): code('slow = rlm_query("slow")', "FINAL(slow)"),
            ("slow", 0): code("import time", "time.sleep(600)"),
        }[query, turn]

    # The skip passes the child's deadline, not its exec's timeout.
    group, _ = run_tree(
        script,
        repl=ReplLimits(exec_timeout_s=60.0),
        child_timeout_s=30.0,
        skip_when=(lambda tree: in_exec(tree, "slow"), 30.0),
        tmp_path=tmp_path,
    )
    root, slow = sorted(group.trajectories, key=lambda t: t.depth)
    assert slow.finish_reason == "timeout"
    assert slow.turns[0].error == "[the trajectory's time ran out during this turn]"
    assert root.finish_reason == "final"
    assert root.answer.startswith("[rlm_query failed: the sub-query ran out of time (timeout)")


def test_final_in_a_string_comment_or_prose_does_not_end_the_trajectory(tmp_path: Path):
    def script(query: str, turn: int) -> str:
        if turn == 0:
            return 'FINAL("prose")\n' + code("s = \"FINAL('no')\"  # FINAL('no')", "print(s)")
        return code('FINAL_VAR("s")')

    group, _ = run_tree(script, tmp_path=tmp_path)
    (root,) = group.trajectories
    assert len(root.turns) == 2
    assert root.turns[0].output.strip() == "FINAL('no')"
    assert (root.finish_reason, root.answer) == ("final", "FINAL('no')")


def test_replies_without_code_or_cut_off_get_feedback_and_the_turn_counts(tmp_path: Path):
    def script(query: str, turn: int) -> str:
        return [
            "The answer is surely 42.",
            code("x = '" + "y" * 300 + "'"),
            code('FINAL("done")'),
        ][turn]

    limits = AgentLimits(max_turns=4, max_new_tokens=100)
    group, engine = run_tree(script, limits=limits, tmp_path=tmp_path)
    (root,) = group.trajectories
    no_code, cut_off, final = root.turns
    assert (no_code.code, cut_off.code) == ("", "")
    assert "no ```python block" in no_code.output
    assert "token limit" in cut_off.output and len(cut_off.completion_ids) == 100
    assert "no ```python block" in TOKENIZER.decode(cut_off.prompt_ids)  # feedback shown next turn
    assert (root.finish_reason, root.answer) == ("final", "done")
    for _, params in engine.requests:
        assert params.stop_strings == STOP_STRINGS
        assert params.stop_token_ids == list(TOKENIZER.stop_ids)
        assert params.max_new_tokens == 100


def test_max_turns_ends_without_an_answer(tmp_path: Path):
    group, _ = run_tree(
        lambda query, turn: code(f'print("still looking {turn}")'),
        limits=AgentLimits(max_turns=3),
        tmp_path=tmp_path,
    )
    (root,) = group.trajectories
    assert (root.finish_reason, root.answer, len(root.turns)) == ("max_turns", None, 3)
    assert [t.output.strip() for t in root.turns] == [f"still looking {i}" for i in range(3)]


def test_dead_worker_ends_with_error(tmp_path: Path):
    group, _ = run_tree(
        lambda query, turn: code("while True:", "    pass"),
        repl=ReplLimits(exec_timeout_s=30.0),
        skip_when=(lambda tree: in_exec(tree, TASK.query), 30.0),
        tmp_path=tmp_path,
    )
    (root,) = group.trajectories
    assert (root.finish_reason, len(root.turns)) == ("error", 1)
    assert root.turns[0].error


def _first_prompt_tokens(limits: AgentLimits) -> int:
    agent = Agent(
        env=DocEnv(), generate=ScriptedEngine(lambda q, t: ""), tokenizer=TOKENIZER, limits=limits
    )
    system = system_prompt(
        agent.env,
        builtins=builtin_docs(
            output_limit_chars=limits.output_limit_chars,
            subcalls="repl",
            max_children_per_call=limits.max_children_per_call,
            max_children_per_trajectory=limits.max_children_per_trajectory,
        ),
    )
    fresh = agent.env.user_prompt(TASK, 0, limits.max_turns)
    messages = turn_messages(system, [], fresh, budget_chars=limits.history_budget_chars)
    return len(TOKENIZER.apply_chat_template(messages, add_generation_prompt=True))


def test_prompt_over_the_token_limit_ends_with_context(tmp_path: Path):
    limits = AgentLimits(max_turns=4)
    limits = msgspec.structs.replace(limits, max_prompt_tokens=_first_prompt_tokens(limits) + 500)
    group, _ = run_tree(
        lambda query, turn: code('print("z" * 3000)'), limits=limits, tmp_path=tmp_path
    )
    (root,) = group.trajectories
    assert (root.finish_reason, len(root.turns)) == ("context", 1)


def test_long_history_is_shortened_to_fit_and_the_newest_output_kept(tmp_path: Path):
    limits = AgentLimits(max_turns=5)
    limits = msgspec.structs.replace(limits, max_prompt_tokens=_first_prompt_tokens(limits) + 3000)

    def script(query: str, turn: int) -> str:
        if turn == 4:
            return code('FINAL("ok")')
        return code(f'print("{turn}" * 1500)')

    group, _ = run_tree(script, limits=limits, exact_prompts=False, tmp_path=tmp_path)
    (root,) = group.trajectories
    assert (root.finish_reason, len(root.turns)) == ("final", 5)
    last_prompt = TOKENIZER.decode(root.turns[-1].prompt_ids)
    assert len(root.turns[-1].prompt_ids) <= limits.max_prompt_tokens
    assert "3" * 1500 in last_prompt
    assert "0" * 1500 not in last_prompt
    assert "characters cut" in last_prompt or "omitted" in last_prompt


@pytest.mark.parametrize("mode", ["lm", "error"])
def test_depth_limit_gives_a_plain_call_or_an_error(tmp_path: Path, mode: str):
    def script(query: str, turn: int) -> str:
        if query == "ROOT":
            return [
                code('got = rlm_query("sub?", context="tiny")', "print(got)"),
                code("FINAL(got)"),
            ][turn]
        assert (query, turn) == ("sub?\n\nContext:\ntiny", -1)
        return "direct answer"

    limits = AgentLimits(max_depth=0, depth_limit_mode=mode)
    group, _ = run_tree(script, limits=limits, tmp_path=tmp_path)
    root = group.by_id()["task-1#0"]
    assert root.finish_reason == "final"
    if mode == "lm":
        (child,) = [t for t in group.trajectories if t is not root]
        assert root.children == [child.id]
        assert (child.depth, child.answer, child.finish_reason) == (1, "direct answer", "final")
        assert root.answer == "direct answer"
    else:
        assert group.trajectories == [root] and root.children == []
        assert root.answer.startswith("[rlm_query not run: the depth limit (0) is reached")


def test_children_per_call_and_per_trajectory_limits(tmp_path: Path):
    def script(query: str, turn: int) -> str:
        if query != "ROOT":
            return code(f'FINAL("{query.upper()}")')
        return [
            code('a = rlm_query_batched(["c1", "c2", "c3"])'),
            code('b = rlm_query_batched(["c4", "c5"])'),
            code("FINAL(repr(a + b))"),
        ][turn]

    limits = AgentLimits(max_children_per_call=2, max_children_per_trajectory=3)
    group, _ = run_tree(script, limits=limits, tmp_path=tmp_path)
    root = group.by_id()["task-1#0"]
    answers = eval(root.answer)  # the repr of a list of str, written by our own script
    assert answers[:2] == ["C1", "C2"]
    assert answers[2] == "[rlm_query not run: at most 2 prompts run per call; this was prompt 3]"
    assert answers[3] == "C4"
    assert answers[4] == "[rlm_query not run: this trajectory has used all 3 sub-queries]"
    assert len(root.children) == 3 and len(group.trajectories) == 4


def test_cancelled_trajectories_are_left_aborted(tmp_path: Path):
    def script(query: str, turn: int) -> str | None:
        if query == "ROOT":
            return code('rlm_query("stuck")')
        return None  # the child's engine request never returns

    group, _ = run_tree(script, cancel_after_requests=2, tmp_path=tmp_path)
    root, child = sorted(group.trajectories, key=lambda t: t.depth)
    assert root.finish_reason == child.finish_reason == "aborted"
    assert root.turns[0].error == "[the trajectory was cancelled during this turn]"
    assert child.turns == []


def test_engine_abort_ends_with_aborted(tmp_path: Path):
    group, _ = run_tree(lambda query, turn: ABORT, tmp_path=tmp_path)
    (root,) = group.trajectories
    assert (root.finish_reason, len(root.turns), root.turns[0].completion_ids) == ("aborted", 1, [])


def test_roots_of_one_task_get_distinct_ids_and_seeds(tmp_path: Path):
    def script(query: str, turn: int) -> str:
        return code('FINAL("x")')

    limits = AgentLimits()
    group, engine = run_tree(script, limits=limits, n_roots=3, tmp_path=tmp_path)
    engine_seeds = [params.seed for _, params in engine.requests]
    assert engine_seeds == [None, None, None]
    assert sorted(t.id for t in group.trajectories) == ["task-1#0", "task-1#1", "task-1#2"]
    assert [t.sample_idx for t in group.roots] == [0, 1, 2]


def test_fixed_seed_is_mixed_per_trajectory_and_turn():
    agent = Agent(
        env=DocEnv(),
        generate=ScriptedEngine(lambda q, t: ""),
        tokenizer=TOKENIZER,
        sampling=SamplingParams(seed=7, temperature=0.8),
    )
    roots = [root_trajectory("t", i, "q") for i in range(2)]
    seeds = {agent.params(r, turn, stop_strings=[]).seed for r in roots for turn in range(3)}
    assert len(seeds) == 6
    assert (
        agent.params(roots[0], 1, stop_strings=[]).seed
        == agent.params(roots[0], 1, stop_strings=[]).seed
    )
    assert agent.params(roots[0], 0, stop_strings=[]).temperature == 0.8


def test_limits_from_rollout_config():
    config = RolloutConfig(
        max_turns=3,
        max_depth=2,
        depth_limit_mode="error",
        max_children_per_call=4,
        max_children_per_trajectory=5,
        max_new_tokens=64,
        max_prompt_tokens=1024,
        output_limit_chars=500,
    )
    limits = AgentLimits.from_config(config)
    assert (limits.max_turns, limits.max_depth, limits.depth_limit_mode) == (3, 2, "error")
    assert (limits.max_children_per_call, limits.max_children_per_trajectory) == (4, 5)
    assert (limits.max_new_tokens, limits.max_prompt_tokens) == (64, 1024)
    assert limits.output_limit_chars == 500 and limits.history_budget_chars == 4096
    with pytest.raises(ValueError, match="AgentLimits.max_turns"):
        AgentLimits(max_turns=0)
