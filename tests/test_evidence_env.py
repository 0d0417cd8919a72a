"""The evidence environment: loading, context, prompts and rewards on synthetic tasks."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rlmtrain.config import load_config
from rlmtrain.envs.base import get_env, write_tasks
from rlmtrain.envs.evidence import EvidenceEnv, EvidenceTask
from rlmtrain.envs.synth import synthesize
from rlmtrain.rlm.prompts import RLMEnv, system_prompt
from rlmtrain.rlm.records import RolloutGroup, Trajectory


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("evidence")
    synthesize(out, groups=3, seed=7, workers=1)
    return out


def _group(task, answers):
    roots = [
        Trajectory(
            id=f"r{i}",
            root_id=f"r{i}",
            parent_id=None,
            depth=0,
            task_id=task.id,
            sample_idx=i,
            prompt=task.query,
            answer=a,
            finish_reason="final" if a is not None else "max_turns",
        )
        for i, a in enumerate(answers)
    ]
    child = Trajectory(
        id="r0.0",
        root_id="r0",
        parent_id="r0",
        depth=1,
        task_id=task.id,
        sample_idx=0,
        prompt="sub",
        answer="irrelevant",
        finish_reason="final",
    )
    return RolloutGroup(task=task, trajectories=[*roots, child])


def test_registry_loads_corpus_beside_train_path(data):
    config = load_config(None, [f"--data.train_path={str(data / 'tasks.jsonl')!r}"])
    env = get_env("evidence", config)
    assert isinstance(env, EvidenceEnv) and isinstance(env, RLMEnv)
    task = env.load_tasks(data / "tasks.jsonl")[0]
    ctx = env.context(task)
    assert list(ctx) == task.paper_ids
    assert set(ctx[task.paper_ids[0]]) == {"title", "abstract", "text"}
    span = task.evidence[0]
    assert ctx[span.paper_id]["text"][span.start : span.end] == span.text


def test_prompts(data):
    env = EvidenceEnv()
    task = env.load_tasks(data / "tasks.jsonl")[0]
    prompt = env.user_prompt(task, 1, 6)
    assert prompt.startswith(f"`context` holds {len(task.paper_ids)} paper")
    assert task.query in prompt and "turn 2 of 6" in prompt
    full = system_prompt(env, builtins="BUILTINS")
    for needle in (
        "rlm_query_batched",
        "extract_section(snippet, start_phrase, end_phrase)",
        "search(text, keyword, window=300, bidirectional=True)",
        "5-7 turns",
    ):
        assert needle in full


def test_span_f1_reward_per_root(data):
    env = EvidenceEnv()
    task = next(t for t in env.load_tasks(data / "tasks.jsonl") if len(t.evidence) >= 1)
    gold = "\n".join(f"[{s.paper_id}] {s.text}" for s in task.evidence)
    half = task.evidence[0].text[: len(task.evidence[0].text) // 2]
    wrong = "Completely unrelated words about cooking pasta with tomatoes."
    result = asyncio.run(env.reward(task, _group(task, [gold, half, wrong, None])))
    best, partial, bad, none = result.scores
    assert best > 0.9 and 0.1 < partial < best and bad < 0.1 and none == 0.0
    assert [d["method"] for d in result.details] == ["span_f1"] * 3 + ["no_answer"]


def test_judge_failure_falls_back_to_span_f1(data):
    from rlmtrain.config import JudgeConfig
    from rlmtrain.rewards.judge import RubricJudge

    with socket.socket() as s:  # a port with nobody listening: every request is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = RubricJudge(
        JudgeConfig(
            base_url=f"http://127.0.0.1:{port}/v1",
            max_retries=0,
            timeout_s=2.0,
            on_unscored="span_f1",
        )
    )
    env = EvidenceEnv(judge=judge)
    task = env.load_tasks(data / "tasks.jsonl")[0]
    gold = " ".join(s.text for s in task.evidence)
    result = asyncio.run(env.reward(task, _group(task, [gold, None])))
    assert result.scores[0] > 0.9 and result.scores[1] == 0.0
    assert [d["method"] for d in result.details] == ["span_f1", "no_answer"]


def test_registry_builds_the_judge_only_when_configured():
    assert get_env("evidence", load_config(None)).judge is None
    config = load_config(None, ["--judge.base_url='http://127.0.0.1:9/v1'"])
    assert get_env("evidence", config).judge is not None


def test_task_naming_a_missing_paper_is_an_error(data, tmp_path):
    env = EvidenceEnv()
    task = env.load_tasks(data / "tasks.jsonl")[0]
    (tmp_path / "corpus.jsonl").write_bytes((data / "corpus.jsonl").read_bytes())
    bad = EvidenceTask(id="bad", query="q", paper_ids=[task.paper_ids[0], "nope"], evidence=[])
    write_tasks(tmp_path / "tasks.jsonl", [bad])
    with pytest.raises(ValueError, match="task 'bad' names papers not in the corpus.*nope"):
        EvidenceEnv().load_tasks(tmp_path / "tasks.jsonl")
    with pytest.raises(KeyError, match="paper 'nope' is not in the loaded corpus"):
        env.context(bad)
