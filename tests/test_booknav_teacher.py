"""The scripted BookNavigator teacher solves the synthetic problems through the real jailed REPL
and trajectory loop; its proofs pass a judge served over HTTP on 127.0.0.1."""

import asyncio

import msgspec
import pytest
from test_booknav import proof_verdicts
from test_judge import JudgeServer

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.booknav import BookNavEnv, synthetic_problems, write_synthetic
from rlmtrain.envs.booknav_teacher import plan, prove
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rewards.chat_client import JudgeConfig
from rlmtrain.rollout.teaching import teach


def test_teacher_solves_the_synthetic_problems(tmp_path):
    tasks_path = write_synthetic(tmp_path, n=10, seed=7)
    with JudgeServer() as server:
        server.handlers["proof"] = proof_verdicts
        env = BookNavEnv(JudgeConfig(base_url=server.url, max_retries=0))
        tasks = env.load_tasks(tasks_path)
        groups = asyncio.run(
            teach(
                env,
                tasks,
                ByteTokenizer(),
                RolloutConfig(max_turns=4, max_prompt_tokens=16384, repl_timeout_s=60.0),
            )
        )
        for task, group in zip(tasks, groups, strict=True):
            (root,) = group.trajectories
            assert root.finish_reason == "final", root.turns[-1].error
            assert [t.error for t in root.turns] == ["", "", ""]
            assert [c.name for c in root.turns[0].tool_calls] == ["get_toc", "search_index"]
            assert root.turns[1].output.startswith(task.section_ids[0] + " ")
            assert root.answer == prove(task.query)[1]
            judged = group_with_query(group, "case:proof " + task.query)
            result = asyncio.run(env.reward(judged.task, judged))
            assert result.scores == [1.0], result.details
        assert server.count("proof") == len(tasks)


def group_with_query(group, query):
    """The same group with the task's query carrying the judge server's case marker."""
    return msgspec.structs.replace(group, task=msgspec.structs.replace(group.task, query=query))


def test_every_family_has_a_rule_and_strangers_are_refused():
    for task in synthetic_problems(5, seed=11):
        assert plan(task.query)[-1].endswith("FINAL(proof)")
    with pytest.raises(ValueError, match="no rule for problem"):
        plan("Prove the Riemann hypothesis.")
    with pytest.raises(ValueError, match="is not 8 - 1"):
        plan("Prove that 6 divides 8^n - 1 for every integer n >= 1.")
