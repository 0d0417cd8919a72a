"""Tool calls are read off the code the trainer sent: what the code writes, in order."""

from __future__ import annotations

from rlmtrain.rlm.code_calls import SUBQUERY_BUILTINS, calls_in_code, tool_names

NAMES = SUBQUERY_BUILTINS | {"search", "read_section", "FINAL_VAR"}


def pairs(code: str) -> list[tuple[str, str]]:
    return [(c.name, c.args) for c in calls_in_code(code, NAMES)]


def test_calls_come_in_source_order_with_their_arguments_as_written():
    code = (
        "hits = search(context, 'We evaluate', window=150)\n"
        "print(read_section(context, key=hits[0]))\n"
        "FINAL_VAR('answer')"
    )
    assert pairs(code) == [
        ("search", "context, 'We evaluate', window=150"),
        ("read_section", "context, key=hits[0]"),
        ("FINAL_VAR", "'answer'"),
    ]


def test_nested_calls_count_outer_first_and_other_names_do_not_count():
    code = "answers = rlm_query_batched([search(c, q) for q in qs])\nprint(len(answers))"
    assert pairs(code) == [("rlm_query_batched", "[search(c, q) for q in qs]"), ("search", "c, q")]


def test_a_loop_is_one_call_and_a_method_of_the_same_name_is_none():
    code = "for kw in kws:\n    search(text, kw)\nobj.search(text)\nre.search('a', text)"
    assert pairs(code) == [("search", "text, kw")]


def test_code_that_does_not_parse_has_no_calls():
    assert pairs("search(context, 'x'\nFINAL(") == []
    assert pairs("") == []


def test_long_arguments_are_clipped():
    [(name, args)] = pairs(f"search(context, {'x' * 1000!r})")
    assert name == "search" and len(args) == 200


def test_tool_names_are_the_tools_a_worker_loads_and_the_builtins():
    names = tool_names(("rlmtrain.envs.evidence_tools",))
    assert names >= SUBQUERY_BUILTINS and {"search", "list_papers", "extract_section"} <= names
    assert "TOOLS" not in names
