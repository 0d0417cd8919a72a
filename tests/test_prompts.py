"""Code extraction and the per-turn prompt: the rule the prompt states is the rule the code runs."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from rlmtrain.envs.base import Env, Task
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rlm.builtins import clip_text
from rlmtrain.rlm.extract import CODE_BLOCK_RULE, STOP_STRINGS, extract_code
from rlmtrain.rlm.generation import Completion, SamplingParams
from rlmtrain.rlm.prompts import (
    RLMEnv,
    builtin_docs,
    history_messages,
    plain_call_messages,
    query_message,
    system_prompt,
    tool_docs,
    turn_messages,
)
from rlmtrain.rlm.records import Turn

# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------


def test_first_python_block_runs_and_text_outside_is_ignored():
    text = (
        "I will look first. FINAL('not code')\n"
        "```python\nx = 1\nprint(x)\n```\n"
        "Then maybe:\n```python\nFINAL('second block')\n```\n"
    )
    got = extract_code(text)
    assert got.code == "x = 1\nprint(x)"
    assert got.feedback == ""


def test_block_must_open_with_a_python_line():
    for text in ("```py\nprint(1)\n```", "```\nprint(1)\n```", "print(1)", "say ```python inline"):
        got = extract_code(text)
        assert got.code == ""
        assert "no code ran" in got.feedback and "```python" in got.feedback


def test_fence_inside_a_line_of_code_does_not_close_the_block():
    text = '```python\nfence = "```"\nprint(fence)\n  ```  \nafter'
    assert extract_code(text).code == 'fence = "```"\nprint(fence)'


def test_unterminated_block_runs_when_stopped_and_not_when_cut_off():
    text = "Let me count.\n```python\nprint(len(context))"
    assert extract_code(text, finish_reason="stop").code == "print(len(context))"
    for reason in ("length", "abort"):
        got = extract_code(text, finish_reason=reason)
        assert got.code == ""
        assert "token limit" in got.feedback


def test_terminated_block_runs_even_when_the_token_limit_came_after_it():
    text = "```python\nprint(1)\n```\nand then some rambling that was cut off mid-wo"
    assert extract_code(text, finish_reason="length").code == "print(1)"


def test_empty_block_gets_feedback():
    got = extract_code("```python\n\n```\n")
    assert got.code == "" and "empty" in got.feedback


def test_stop_string_ends_the_turn_at_the_closing_fence_not_the_opening_one():
    completion = (
        "Plan: count.\n```python\nn = len(context)\nprint(n)\n```\nMore text\n```python\nx\n"
    )
    stop = STOP_STRINGS[0]
    first = completion.index(stop)
    assert completion[:first].endswith("print(n)")  # the opening fence never matched
    kept_by_engine = completion[: first + len(stop)]  # vLLM keeps the stop string's token
    trimmed_by_engine = completion[:first]  # other engines trim it
    assert extract_code(kept_by_engine).code == "n = len(context)\nprint(n)"
    assert (
        extract_code(trimmed_by_engine, finish_reason="stop").code == "n = len(context)\nprint(n)"
    )


# ---------------------------------------------------------------------------------------------
# Generation types
# ---------------------------------------------------------------------------------------------


def test_completion_rejects_mismatched_logprobs():
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        Completion(token_ids=[1, 2], logprobs=[-0.1], finish_reason="stop")


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", 0.0), ("top_p", 1.5), ("top_k", -1), ("max_new_tokens", 0)]
)
def test_sampling_params_name_the_bad_field(field: str, value: Any):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


# ---------------------------------------------------------------------------------------------
# System prompt
# ---------------------------------------------------------------------------------------------


class TextEnv(Env):
    """A minimal environment whose tools are the standard library's textwrap functions."""

    def system_prompt(self) -> str:
        return "Strategy: read the text in small pieces."

    def context(self, task: Task) -> Any:
        return "some text"

    def tool_modules(self) -> list[str]:
        return ["textwrap"]


def test_env_base_class_satisfies_the_protocol():
    assert isinstance(TextEnv(), RLMEnv)


def test_tool_docs_come_from_signatures_and_docstrings():
    docs = tool_docs(("textwrap",))
    assert "dedent(text)\n    Remove any common leading whitespace" in docs
    assert "shorten(text, width, **kwargs)" in docs


def test_tool_module_without_tools_is_named_in_the_error():
    with pytest.raises(ValueError, match="'stat' has neither TOOLS nor __all__"):
        tool_docs(("stat",))


def test_system_prompt_holds_strategy_tools_builtins_and_the_exact_code_rule():
    builtins = builtin_docs(
        output_limit_chars=1234,
        subcalls="repl",
        max_children_per_call=3,
        max_children_per_trajectory=7,
    )
    text = system_prompt(TextEnv(), builtins=builtins)
    assert text.startswith("Strategy: read the text in small pieces.")
    assert "dedent(text)" in text
    assert CODE_BLOCK_RULE in text
    for name in ("FINAL(answer)", "FINAL_VAR(name)", "rlm_query(prompt", "rlm_query_batched("):
        assert name in text
    assert "1234 characters" in text
    assert "At most 3 prompts per call and 7 queries in all" in text


def test_builtin_docs_follow_the_depth_limit_mode():
    def docs(mode: str) -> str:
        return builtin_docs(
            output_limit_chars=100,
            subcalls=mode,
            max_children_per_call=2,
            max_children_per_trajectory=2,
        )

    assert "its own REPL" in docs("repl")
    assert "without a REPL" in docs("plain")
    assert "not available here" in docs("none") and "rlm_query(prompt" not in docs("none")


# ---------------------------------------------------------------------------------------------
# History and the fresh query message
# ---------------------------------------------------------------------------------------------


def _turn(i: int, output_chars: int = 50) -> Turn:
    return Turn(
        prompt_ids=[],
        completion_ids=[],
        sampler_logprobs=[],
        code=f"step_{i}()",
        output=f"<out {i}>" + "x" * output_chars,
    )


def _size(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


def test_history_under_budget_is_verbatim_and_alternates_roles():
    turns = [_turn(i) for i in range(3)]
    messages = history_messages(turns, budget_chars=10_000)
    assert [m["role"] for m in messages] == ["assistant", "user"] * 3
    assert messages[0]["content"] == "```python\nstep_0()\n```"
    assert messages[5]["content"] == "REPL output:\n" + turns[2].output


def test_history_over_budget_shortens_older_outputs_first_and_keeps_the_newest():
    turns = [_turn(i, output_chars=2000) for i in range(4)]
    full = _size(history_messages(turns, budget_chars=10**9))
    messages = history_messages(turns, budget_chars=full - 1000)
    reports = [m["content"] for m in messages if m["role"] == "user"]
    assert "characters cut" in reports[0]  # the oldest paid first ...
    assert reports[1:] == ["REPL output:\n" + t.output for t in turns[1:]]  # ... and was enough
    assert _size(messages) <= full - 1000


def test_history_stages_go_from_shortening_to_omitting_outputs_then_code():
    turns = [_turn(i, output_chars=2000) for i in range(4)]
    newest = "REPL output:\n" + turns[-1].output
    omitted = history_messages(turns, budget_chars=2300)
    assert [m["content"] for m in omitted if m["role"] == "user"][:3] == [
        f"[REPL output of turn {i + 1} omitted]" for i in range(3)
    ]
    assert omitted[0]["content"] == "```python\nstep_0()\n```"
    smallest = history_messages(turns, budget_chars=0)
    assert smallest[0]["content"] == "[code of turn 1 omitted]"
    assert smallest[-2:] == [
        {"role": "assistant", "content": "```python\nstep_3()\n```"},
        {"role": "user", "content": newest},
    ]


def test_error_and_empty_output_are_shown():
    turn = Turn(
        prompt_ids=[], completion_ids=[], sampler_logprobs=[], code="1/0", error="ZeroDivisionError"
    )
    report = history_messages([turn], budget_chars=1000)[1]["content"]
    assert report == "REPL output:\n(nothing printed)\n\nREPL error:\nZeroDivisionError"


def test_clip_text_keeps_head_and_tail_and_says_what_was_cut():
    assert clip_text("abcdef", 10) == "abcdef"
    assert clip_text("a" * 10 + "b" * 10, 4) == "aa\n... [16 characters cut] ...\nbb"
    assert clip_text("abc", 0) == "\n... [3 characters cut] ...\n"


def test_fresh_query_is_rewritten_each_turn_so_prompts_are_not_prefix_extensions():
    tokenizer = ByteTokenizer()
    env = TextEnv()
    task = Task(id="t", query="How long is the text?")
    system = "sys"
    turns = [_turn(0)]
    first = turn_messages(system, [], env.user_prompt(task, 0, 3), budget_chars=1000)
    second = turn_messages(system, turns, env.user_prompt(task, 1, 3), budget_chars=1000)
    assert [m["role"] for m in first] == ["system", "user"]
    assert [m["role"] for m in second] == ["system", "assistant", "user"]
    assert second[-1]["content"].startswith("REPL output:\n" + turns[0].output)
    assert second[-1]["content"].endswith(env.user_prompt(task, 1, 3))
    assert "turn 1 of 3" in first[-1]["content"] and "turn 2 of 3" in second[-1]["content"]
    ids_first = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    ids_second = tokenizer.apply_chat_template(second, add_generation_prompt=True)
    assert ids_second[: len(ids_first)] != ids_first


def test_child_query_message_restates_the_query_and_turns_left():
    text = query_message("Which paper is about eels?", 2, 5)
    assert text.startswith("Query: Which paper is about eels?")
    assert "turn 3 of 5 (3 left" in text


def test_plain_call_prompt_shows_passed_context_cut_to_size():
    messages = plain_call_messages("Summarise.", "z" * 100, context_chars=10)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == "Summarise.\n\nContext:\n" + clip_text("z" * 100, 10)
    assert plain_call_messages("Hi?", None, context_chars=10)[1]["content"] == "Hi?"
    assert "'k': 1" in plain_call_messages("Hi?", {"k": 1}, context_chars=100)[1]["content"]


def test_a_plain_call_decodes_an_encoded_context_only_where_it_is_cheap():
    def shown(context):
        return plain_call_messages("Q?", context, context_chars=10_000)[1]["content"]

    encode = msgspec.msgpack.encode
    assert shown(msgspec.Raw(encode("x" * 600_000))).endswith("x" * 100)  # a string: as is
    assert "{'a': [1, 2]}" in shown(msgspec.Raw(encode({"a": [1, 2]})))
    paper = {"p0": {"title": "T", "abstract": "A", "text": "word " * 400_000}}  # 2 MB of text
    assert shown(msgspec.Raw(encode(paper))).startswith("Q?\n\nContext:\n{'p0': {'title'")
    nested = msgspec.Raw(encode([[]] * 1_000_000))  # 1 MB that would decode to ~60 MiB
    assert "too large to show without a REPL" in shown(nested)
    assert "could not be decoded" in shown(msgspec.Raw(b"\x92\x01"))


# ---------------------------------------------------------------------------------------------
# The trainer side needs no compiled extension
# ---------------------------------------------------------------------------------------------

_WITHOUT_JAIL = """
import sys

class RefuseJail:
    def find_spec(self, name, path=None, target=None):
        if name == "rlmtrain._jail":
            raise ImportError("the compiled jail is not importable here")

sys.meta_path.insert(0, RefuseJail())
from rlmtrain.envs.evidence import EvidenceEnv
from rlmtrain.rlm.code_calls import tool_names
import rlmtrain.rlm.agent, rlmtrain.rollout.scheduler

prompt = EvidenceEnv().system_prompt()
assert "extract_section(" in prompt and "rlm_query_batched" in prompt, prompt[:500]
assert "search" in tool_names(("rlmtrain.envs.evidence_tools",))
assert "rlmtrain._jail" not in sys.modules
print("ok")
"""


def test_prompts_agents_and_schedulers_build_without_the_jail():
    """Only a REPL worker loads the jail; documenting tools for a prompt must not."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_JAIL], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
