"""A teacher's reply reads a prompt as a policy would: the query and turn of its last message."""

import pytest

from rlmtrain.envs.base import Env
from rlmtrain.envs.teacher import flaw_of, plan_reply, query_and_turn
from rlmtrain.rlm.prompts import compact_query_message, query_message


def _prompt(fresh: str) -> str:
    stale = query_message("an older query", 0, 3)
    return (
        f"<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\n{stale}<|im_end|>\n"
        f"<|im_start|>assistant\n```python\nx = 1\n```<|im_end|>\n"
        f"<|im_start|>user\n{fresh}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("style", ["full", "compact"])
def test_query_and_turn_of_the_last_message_in_both_styles(style):
    fresh = (compact_query_message if style == "compact" else query_message)(
        "Which passage states X?", 2, 4
    )
    assert query_and_turn(_prompt(fresh), "t") == ("Which passage states X?", 2)


def test_the_root_prompt_of_an_env_parses_too():
    task = type("T", (), {"query": "Prove that 3 divides 4^n - 1."})()
    fresh = Env().user_prompt(task, 1, 4)
    assert query_and_turn(_prompt(fresh), "t") == ("Prove that 3 divides 4^n - 1.", 1)


def test_plan_reply_answers_each_turn_then_nothing_and_names_itself():
    reply = plan_reply(lambda query: [f"a = {query!r}", "FINAL(a)"], "probe teacher")
    first = _prompt(query_message("q", 0, 3))
    assert reply(first) == "```python\na = 'q'\n```\n"
    assert reply(_prompt(query_message("q", 1, 3))) == "```python\nFINAL(a)\n```\n"
    assert reply(_prompt(query_message("q", 2, 3))) == ""
    with pytest.raises(ValueError, match="probe teacher: no query or turn"):
        reply(_prompt("hello"))


def test_flaw_of_draws_a_stable_share_spread_over_the_variants():
    queries = [f"Which datasets are used to evaluate Method{i}?" for i in range(3000)]
    assert {flaw_of(q, 0.0, 2) for q in queries} == {None}
    draws = [flaw_of(q, 0.67, 2) for q in queries]
    assert draws == [flaw_of(q, 0.67, 2) for q in queries]  # the same query, the same draw
    share = sum(d is not None for d in draws) / len(draws)
    assert 0.62 < share < 0.72, share
    assert abs(draws.count(0) - draws.count(1)) < 0.1 * len(draws), draws
    # A larger share flaws every query a smaller one flaws.
    wider = [flaw_of(q, 0.9, 1) for q in queries]
    assert all(w is not None for d, w in zip(draws, wider, strict=True) if d is not None)
