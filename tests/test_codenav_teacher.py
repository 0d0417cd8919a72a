"""The scripted code-navigation teacher answers generated questions through the real jailed REPL
and trajectory loop, on a package made here and on a stdlib package."""

import asyncio
import json as stdlib_json
from pathlib import Path

import pytest
from test_codenav import package  # noqa: F401  (fixture)

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.codenav import CodeNavEnv, generate_tasks
from rlmtrain.envs.codenav_teacher import parse_question
from rlmtrain.envs.codenav_tools import CodeIndex
from rlmtrain.envs.teacher import flaw_of
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout.teaching import teach


def solve(env, tasks) -> list[RolloutGroup]:
    return asyncio.run(
        teach(
            env,
            tasks,
            ByteTokenizer(),
            RolloutConfig(max_turns=4, max_prompt_tokens=32768, repl_timeout_s=60.0),
        )
    )


def test_teacher_solves_every_question_on_a_small_package(package):  # noqa: F811
    env = CodeNavEnv()
    tasks = generate_tasks(package)
    groups = solve(env, tasks)
    for task, group in zip(tasks, groups, strict=True):
        (root,) = group.trajectories
        assert root.finish_reason == "final" and root.answer == task.answer, root.turns
        names = [c.name for t in root.turns for c in t.tool_calls]
        assert names == ["list_calls"] and len(root.turns) == 2
        assert asyncio.run(env.reward(task, group)).scores == [1.0]


def test_teacher_on_a_stdlib_package():
    env = CodeNavEnv()
    tasks = generate_tasks(Path(stdlib_json.__file__).parent, n=6, seed=2)
    groups = solve(env, tasks)
    assert [g.trajectories[0].answer for g in groups] == [t.answer for t in tasks]


def test_parse_question():
    task = generate_tasks(Path(stdlib_json.__file__).parent, n=1, seed=0)[0]
    assert parse_question(task.query) == (task.caller_path, task.caller, task.callee)
    with pytest.raises(ValueError, match="not a where-does-A-call-B question"):
        parse_question("What does json do?")


def test_flawed_plan_answers_the_first_call(package):  # noqa: F811
    """In the flawed share of the questions the teacher answers with the body's first call
    (right only where that is the callee); the others keep the plan and are all right."""
    share = 0.5
    env = CodeNavEnv(flawed_share=share)
    tasks = generate_tasks(package)
    groups = solve(env, tasks)
    index = CodeIndex(env.context(tasks[0]))
    flawed = 0
    for task, group in zip(tasks, groups, strict=True):
        (root,) = group.trajectories
        first_call = next(
            line
            for d in index.find(f"{task.caller_path}:{task.caller}")
            if d.kind == "function"
            for _, line in d.calls
        )
        if flaw_of(task.query, share, 1) is None:
            assert root.answer == task.answer
        else:
            flawed += 1
            assert root.answer == f"{task.caller_path}:{first_call}"
    assert 0 < flawed < len(tasks)
    scores = [asyncio.run(env.reward(t, g)).scores[0] for t, g in zip(tasks, groups, strict=True)]
    assert sum(scores) < len(tasks)
