"""ToolCreditJudge and StepRubricJudge through the real chat client and a local HTTP server."""

import asyncio
import json
import re

import pytest
from test_judge import JudgeServer, completion
from test_rewards_shaping import QUERY, step_turns

from rlmtrain.rewards.chat_client import JudgeConfig
from rlmtrain.rewards.step_rubric import StepRubricJudge, heuristic_step_scores
from rlmtrain.rewards.tool_credit import ToolCreditJudge, rule_labels
from rlmtrain.rlm.records import RolloutGroup, Trajectory


@pytest.fixture
def server():
    with JudgeServer() as s:
        yield s


def config(server: JudgeServer) -> JudgeConfig:
    return JudgeConfig(base_url=server.url, max_retries=2, backoff_base_s=0.01, timeout_s=30.0)


def test_tool_credit_from_the_judge(server):
    server.cases["credit"] = lambda nth: (200, completion(json.dumps({"labels": [1, 0, -1, 1, 0]})))
    result = asyncio.run(ToolCreditJudge(config(server)).label("case:credit q", step_turns()))
    assert (result.method, result.labels) == ("judge", [1, 0, -1, 1, 0])
    assert server.count("credit") == 1


def test_tool_credit_wrong_length_is_retried_then_rules(server):
    server.cases["short"] = lambda nth: (200, completion(json.dumps({"labels": [1, 1]})))
    turns = step_turns()
    judge = ToolCreditJudge(config(server))
    result = asyncio.run(judge.label("case:short q", turns))
    assert server.count("short") == 3
    assert result.method == "rules" and result.labels == rule_labels(turns)
    assert "array` of length >= 5" in result.reason  # the length the schema asks for
    assert judge.client.stats.failures == 1


def test_tool_credit_label_outside_range_is_malformed(server):
    replies = iter([{"labels": [2, 0, 0, 0, 0]}, {"labels": [0, 0, 0, 0, -1]}])
    server.cases["range"] = lambda nth: (200, completion(json.dumps(next(replies))))
    result = asyncio.run(ToolCreditJudge(config(server)).label("case:range q", step_turns()))
    assert result.labels == [0, 0, 0, 0, -1] and server.count("range") == 2


def test_step_rubric_from_the_judge(server):
    ratings = [
        {"relevance": r, "coherence": c} for r, c in [(10, 10), (8, 6), (0, 0), (5, 5), (0, 0)]
    ]
    server.cases["steps"] = lambda nth: (200, completion(json.dumps({"steps": ratings})))
    turns = step_turns()
    result = asyncio.run(StepRubricJudge(config(server)).score("case:steps " + QUERY, turns))
    assert result.method == "judge"
    gains = [s.info_gain for s in heuristic_step_scores(QUERY, turns)]
    assert [s.info_gain for s in result.scores] == gains
    # second step: 0.3·0.8 + 0.4·1.0 + 0.3·0.6 − 0.05
    assert result.scores[1].total == pytest.approx(0.77)
    assert result.scores[0].relevance == 1.0 and result.scores[2].coherence == 0.0


def test_step_rubric_falls_back_to_heuristic(server):
    server.cases["down"] = lambda nth: (503, b"overloaded")
    turns = step_turns()
    result = asyncio.run(StepRubricJudge(config(server)).score("case:down " + QUERY, turns))
    assert result.method == "heuristic" and "HTTP 503" in result.reason
    expected = heuristic_step_scores("case:down " + QUERY, turns)
    assert [s.total for s in result.scores] == [s.total for s in expected]
    assert server.count("down") == 3


def test_label_group_asks_once_per_trajectory(server):
    def label_every_step(nth, body):
        steps = len(re.findall(r"^Step \d+$", body["messages"][-1]["content"], re.M))
        return 200, completion(json.dumps({"labels": [1] * steps}))

    server.handlers["tree"] = label_every_step
    turns = step_turns()

    def traj(id_, parent, prompt, turns):
        return Trajectory(
            id=id_,
            root_id="r",
            parent_id=parent,
            depth=0 if parent is None else 1,
            task_id="t",
            sample_idx=0,
            prompt=prompt,
            turns=turns,
        )

    group = RolloutGroup(
        task={},
        trajectories=[
            traj("r", None, "case:tree root", turns),
            traj("r.0", "r", "case:tree child", turns[:2]),
        ],
    )
    judge = ToolCreditJudge(config(server))
    labels = asyncio.run(judge.label_group(group))
    assert {k: (v.method, v.labels) for k, v in labels.items()} == {
        "r": ("judge", [1] * 5),
        "r.0": ("judge", [1, 1]),
    }
    assert server.count("tree") == 2
    again = asyncio.run(judge.label_group(group))  # a new event loop, same client
    assert again == labels and judge.client.stats.cache_hits == 2
