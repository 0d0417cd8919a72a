"""BookNavigator: the tools on the synthetic book, task files, and the reward through a judge
served over real HTTP on 127.0.0.1."""

import asyncio
import json
import re

import msgspec
import pytest
from test_judge import JudgeServer, completion

from rlmtrain.config import Config, ConfigError
from rlmtrain.envs import booknav_tools as tools
from rlmtrain.envs.base import get_env
from rlmtrain.envs.booknav import (
    BookNavEnv,
    read_book,
    synthetic_book,
    synthetic_problems,
    write_synthetic,
)
from rlmtrain.rewards.chat_client import JudgeConfig
from rlmtrain.rewards.span_f1 import span_f1
from rlmtrain.rlm.records import RolloutGroup, ToolCall, Trajectory, Turn

UNUSED_JUDGE = JudgeConfig(base_url="http://127.0.0.1:9/v1")
"""A judge endpoint for tests that never score (nothing listens on port 9)."""

BOOK = msgspec.to_builtins(synthetic_book())


def test_toc_lists_sections_in_order(capsys):
    lines = tools.get_toc(book=BOOK)
    assert lines[0] == "1.1  Parity" and len(lines) == 8
    assert capsys.readouterr().out.splitlines() == lines


def test_search_index_titles_first_then_text(capsys):
    assert tools.search_index("consecutive   INTEGERS", book=BOOK) == ["2.3", "3.2"]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2.3  Products of consecutive integers: Lemma 2.3")
    assert "(consecutive integers are coprime)" in out[1]
    assert tools.search_index("zeta function", book=BOOK) == []
    assert capsys.readouterr().out == "(no hits)\n"
    with pytest.raises(ValueError, match="search_index: keyword must be"):
        tools.search_index("  ", book=BOOK)


def test_read_section_and_unknown_id():
    text = tools.read_section("3.2", book=BOOK)
    assert text.startswith("3.2 Greatest common divisors\n\n") and "gcd(n, n + 1) = 1" in text
    with pytest.raises(KeyError, match=r"no section '9.9'; sections are: 1.1, 1.2"):
        tools.read_section("9.9", book=BOOK)


def test_tools_find_context_in_the_calling_namespace():
    namespace = {"context": BOOK, "read_section": tools.read_section}
    exec("text = read_section('1.1')", namespace)
    assert namespace["text"].startswith("1.1 Parity")
    with pytest.raises(NameError, match="no `context`"):
        exec("read_section('1.1')", {"read_section": tools.read_section})
    with pytest.raises(TypeError, match="expected the book dict"):
        tools.get_toc(book=["not", "a", "book"])


def test_synthetic_problems_are_deterministic_and_indexed():
    a, b = synthetic_problems(10, seed=3), synthetic_problems(10, seed=3)
    assert a == b and a != synthetic_problems(10, seed=4)
    for task in a:
        hits = tools.search_index(task.index_keyword, book=BOOK)
        assert task.section_ids[0] == hits[0], task.query


def test_task_file_resolves_book_relative_to_it(tmp_path):
    path = write_synthetic(tmp_path / "data", n=4, seed=1)
    env = BookNavEnv(UNUSED_JUDGE)
    tasks = env.load_tasks(path)
    assert len(tasks) == 4 and tasks[0].book == str(tmp_path / "data" / "book.json")
    assert env.context(tasks[0]) == BOOK
    (tmp_path / "bad.json").write_text('{"title": "x"}')
    with pytest.raises(ValueError, match=r"bad.json: not a valid book"):
        read_book(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="book file not found"):
        read_book(tmp_path / "missing.json")


def test_registered_as_booknav_and_needs_a_judge():
    config = msgspec.structs.replace(Config(), judge=UNUSED_JUDGE)
    env = get_env("booknav", config)
    assert isinstance(env, BookNavEnv)
    assert env.tool_modules() == ["rlmtrain.envs.booknav_tools"]
    assert "search_index" in env.system_prompt()
    with pytest.raises(ConfigError, match=r"judge\.base_url"):
        get_env("booknav", Config())
    flawed = msgspec.structs.replace(
        config, data=msgspec.structs.replace(config.data, teacher_flawed_share=0.5)
    )
    with pytest.raises(ConfigError, match=r"data\.teacher_flawed_share: the booknav teacher"):
        get_env("booknav", flawed)


def proof_verdicts(nth: int, body: dict) -> tuple[int, bytes]:
    """A stand-in grader: pass when the proof overlaps the reference (span F1 >= 0.5)."""
    text = body["messages"][-1]["content"]
    reference = re.search(r"Reference solution:\n(.*)\n\nSubmitted proof:", text, re.S).group(1)
    proof = text.split("Submitted proof:\n", 1)[1]
    verdict = "pass" if span_f1(proof, reference) >= 0.5 else "fail"
    return 200, completion(json.dumps({"verdict": verdict, "reason": "compared"}))


def root(i: int, answer: str | None, calls: list[tuple[str, str]]) -> Trajectory:
    turns = [
        Turn(
            prompt_ids=[1],
            completion_ids=[2],
            sampler_logprobs=[-0.5],
            tool_calls=[ToolCall(name=n, args=a) for n, a in calls],
        )
    ]
    return Trajectory(
        id=f"r{i}",
        root_id=f"r{i}",
        parent_id=None,
        depth=0,
        task_id="t",
        sample_idx=i,
        prompt="q",
        turns=turns,
        answer=answer,
        finish_reason="final" if answer else "max_turns",
    )


def test_reward_from_the_proof_judge():
    task = synthetic_problems(1, seed=0)[0]
    group = RolloutGroup(
        task=task,
        trajectories=[
            root(
                0,
                task.reference_solution,
                [("search_index", "'powers'"), ("read_section", "'2.1'")],
            ),
            root(1, "It is obvious.", [("get_toc", "")]),
            root(2, None, []),
        ],
    )
    with JudgeServer() as server:
        server.handlers["proof"] = proof_verdicts
        config = JudgeConfig(base_url=server.url, max_retries=1, backoff_base_s=0.01)
        env = BookNavEnv(config)
        # The server plays a case named in the prompt; the problem text is the task's query.
        task = msgspec.structs.replace(task, query="case:proof " + task.query)
        result = asyncio.run(env.reward(task, group))
        assert result.scores == [1.0, -1.0, -1.0]
        assert [d["method"] for d in result.details] == ["judge", "judge", "no_answer"]
        assert [d["tool_diversity"] for d in result.details] == [1.0, 1.0, 0.0]
        assert server.count("proof") == 2

        server.cases["down"] = lambda nth: (500, b"down")
        down = msgspec.structs.replace(task, query="case:down " + task.query)
        result = asyncio.run(env.reward(down, group))
        assert result.scores == [None, None, -1.0]
        assert "HTTP 500" in result.details[0]["reason"]
