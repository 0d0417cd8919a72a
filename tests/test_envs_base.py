"""Env base: task files (round trip, errors naming file/line/field) and the registry."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rlmtrain.envs.base import (
    Env,
    RewardResult,
    Task,
    TaskFormatError,
    available_envs,
    get_env,
    read_tasks,
    register_env,
    root_answers,
    write_tasks,
)
from rlmtrain.rlm.records import RolloutGroup, Trajectory


class CountTask(Task, kw_only=True):
    target: int
    tags: list[str] = []


def test_tasks_round_trip(tmp_path):
    tasks = [
        CountTask(id="a", query="q1", target=1),
        CountTask(id="b", query="q2", target=2, tags=["x"]),
    ]
    path = tmp_path / "tasks.jsonl"
    assert write_tasks(path, tasks) == 2
    # A blank line in the middle is not a task and not an error.
    path.write_bytes(path.read_bytes().replace(b"\n", b"\n\n", 1))
    assert list(read_tasks(path, CountTask)) == tasks


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"id": "c", "query": "q", "target": "three"}', "field `$.target`"),
        (b'{"id": "c", "target": 3}', "missing field 'query'"),
        (b'{"id": "c", "query": "q", "target": 3, "tags": [1]}', "field `$.tags[0]`"),
        (b'{"id": "c", "query": ', "not valid JSON"),
    ],
)
def test_malformed_line_names_file_line_and_field(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": "a", "query": "q", "target": 1}\n' + line + b"\n")
    with pytest.raises(TaskFormatError) as info:
        list(read_tasks(path, CountTask))
    message = str(info.value)
    assert message.startswith(f"{path}:2: ")
    assert expected in message


def test_missing_task_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(read_tasks(tmp_path / "nope.jsonl", CountTask))


class EchoEnv(Env):
    """Scores a root 1.0 when its answer equals the task's target."""

    name = "test-echo"
    task_type = CountTask

    def __init__(self, config):
        self.config = config

    def system_prompt(self) -> str:
        return "say the number"

    def context(self, task):
        return {"n": task.target}

    async def reward(self, task, group):
        answers = root_answers(group)
        return RewardResult(
            scores=[None if a is None else float(a == str(task.target)) for a in answers]
        )


register_env("test-echo")(EchoEnv)


def _root(idx: int, answer: str | None) -> Trajectory:
    return Trajectory(
        id=f"r{idx}",
        root_id=f"r{idx}",
        parent_id=None,
        depth=0,
        task_id="a",
        sample_idx=idx,
        prompt="q",
        answer=answer,
        finish_reason="final" if answer else "max_turns",
    )


def test_registry_builds_env_and_reward_runs():
    env = get_env("test-echo", None)
    assert isinstance(env, EchoEnv)
    task = CountTask(id="a", query="how many?", target=3)
    child = Trajectory(
        id="c",
        root_id="r1",
        parent_id="r1",
        depth=1,
        task_id="a",
        sample_idx=1,
        prompt="sub",
        answer="3",
    )
    # Roots out of order plus a child: scores follow `group.roots` (sample_idx) and skip children.
    group = RolloutGroup(
        task=task, trajectories=[_root(1, "4"), child, _root(0, "3"), _root(2, None)]
    )
    result = asyncio.run(env.reward(task, group))
    assert result.scores == [1.0, 0.0, None]
    prompt = env.user_prompt(task, turn=2, max_turns=6)
    assert "how many?" in prompt and "turn 3 of 6" in prompt


def test_a_root_the_scheduler_could_not_run_is_unscored_not_zero():
    env = get_env("test-echo", None)
    task = CountTask(id="a", query="how many?", target=3)
    failed = _root(1, "4")
    failed.finish_reason, failed.failure = "error", "RuntimeError: engine died"
    group = RolloutGroup(task=task, trajectories=[_root(0, "4"), failed, _root(2, "3")])
    assert asyncio.run(env.reward(task, group)).scores == [0.0, 0.0, 1.0]
    assert asyncio.run(env.root_scores([task], [group])) == [[0.0, None, 1.0]]
    short = RolloutGroup(task=task, trajectories=[_root(0, "4")])

    class Short(EchoEnv):
        async def reward(self, task, group):
            return RewardResult(scores=[1.0, 0.0])

    with pytest.raises(ValueError, match="env test-echo: 2 scores for the 1 roots of a group"):
        asyncio.run(Short(None).root_scores([task], [short]))


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown environment 'nope'.*evidence"):
        get_env("nope")
    assert {"evidence", "booknav", "codenav", "test-echo"} <= set(available_envs())

    def other(config):
        return EchoEnv(config)

    with pytest.raises(ValueError, match="already registered"):
        register_env("test-echo")(other)


def test_task_is_a_plain_struct():
    # Tasks travel inside RolloutGroup records, so they must encode without custom hooks.
    task = CountTask(id="a", query="q", target=1)
    assert msgspec.json.decode(msgspec.json.encode(task), type=CountTask) == task
