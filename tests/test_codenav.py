"""Code navigation: rendering, the tools and the AST expert on a small package made here, task
generation (also over a stdlib package), and the exact-position reward."""

import asyncio
import json as stdlib_json
import textwrap
from pathlib import Path

import pytest

from rlmtrain.envs import codenav_tools as tools
from rlmtrain.envs.base import get_env, write_tasks
from rlmtrain.envs.codenav import (
    CodeNavEnv,
    answer_position,
    expert_answer,
    generate_tasks,
    package_files,
)
from rlmtrain.rlm.records import RolloutGroup, Trajectory

UTIL = textwrap.dedent(
    """\
    import os


    def helper(x):
        return os.path.join("a", str(x))


    def twice(x):
        helper(x)
        return helper(x + 1)
    """
)

PARSER = textwrap.dedent(
    """\
    from shop.util import helper


    class Parser:
        def __init__(self, text):
            self.text = text.strip()

        @staticmethod
        def clean(text):
            return text.lower()

        def parse(self):
            words = self.clean(self.text).split()

            def keep(word):
                return helper(word)

            return [keep(w) for w in words]
    """
)


@pytest.fixture
def package(tmp_path) -> Path:
    root = tmp_path / "shop"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "util.py").write_text(UTIL)
    (root / "parser.py").write_text(PARSER)
    return root


@pytest.fixture
def code(package) -> str:
    return tools.render_codebase(package_files(package))


def test_render_marks_files_lines_and_definitions(code):
    lines = code.splitlines()
    assert lines[0] == "=== file shop/__init__.py ==="
    assert "=== file shop/parser.py ===" in lines
    assert "=== def Parser.parse @ shop/parser.py:12 ===" in lines
    i = lines.index("=== def Parser.parse @ shop/parser.py:12 ===")
    assert lines[i + 1] == "shop/parser.py:12|     def parse(self):"
    assert 'shop/util.py:5|     return os.path.join("a", str(x))' in lines


def test_search_code(code, capsys):
    assert tools.search_code("HELPER(", code=code) == [
        "shop/parser.py:16",
        "shop/util.py:4",
        "shop/util.py:9",
        "shop/util.py:10",
    ]
    assert "shop/util.py:9|     helper(x)" in capsys.readouterr().out
    assert tools.search_code("no such thing", code=code) == []


def test_goto_definition(code, capsys):
    assert tools.goto_definition("parse", code=code) == ["shop/parser.py:12"]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "shop/parser.py:12  Parser.parse"
    assert out[-1] == "shop/parser.py:18|         return [keep(w) for w in words]"
    assert tools.goto_definition("Parser", code=code) == ["shop/parser.py:4"]
    assert tools.goto_definition("shop/util.py:helper", code=code) == ["shop/util.py:4"]
    assert tools.goto_definition("Parser.parse.keep", code=code) == ["shop/parser.py:15"]
    with pytest.raises(KeyError, match="no function or class named 'nope'"):
        tools.goto_definition("nope", code=code)


def test_list_calls_keeps_nested_calls_apart(code):
    assert tools.list_calls("Parser.parse", code=code) == [
        ("self.clean(self.text).split", "shop/parser.py:13"),
        ("self.clean", "shop/parser.py:13"),
        ("keep", "shop/parser.py:18"),
    ]
    assert tools.list_calls("keep", code=code) == [("helper", "shop/parser.py:16")]
    assert tools.list_calls("clean", code=code) == [("text.lower", "shop/parser.py:10")]
    with pytest.raises(KeyError, match="no function named 'Parser'"):
        tools.list_calls("Parser", code=code)


def test_tools_read_context_from_the_calling_namespace(code):
    namespace = {"context": code, "list_calls": tools.list_calls}
    exec("calls = list_calls('twice')", namespace)
    assert namespace["calls"] == [("helper", "shop/util.py:9"), ("helper", "shop/util.py:10")]
    with pytest.raises(TypeError, match="expected the code base string"):
        tools.search_code("x", code={"not": "code"})


def test_generated_tasks_skip_ambiguous_calls_and_the_expert_solves_them(package, code):
    tasks = generate_tasks(package)
    pairs = {(t.caller, t.callee): t.answer for t in tasks}
    assert pairs == {
        ("helper", "os.path.join"): "shop/util.py:5",
        ("helper", "str"): "shop/util.py:5",
        ("Parser.__init__", "text.strip"): "shop/parser.py:6",
        ("Parser.clean", "text.lower"): "shop/parser.py:10",
        ("Parser.parse", "self.clean(self.text).split"): "shop/parser.py:13",
        ("Parser.parse", "self.clean"): "shop/parser.py:13",
        ("Parser.parse", "keep"): "shop/parser.py:18",
        ("Parser.parse.keep", "helper"): "shop/parser.py:16",
    }  # twice() calls helper twice: no task
    index = tools.CodeIndex(code)
    for task in tasks:
        assert expert_answer(index, task.caller_path, task.caller, task.callee) == task.answer
    with pytest.raises(ValueError, match="calls 'helper' 2 times"):
        expert_answer(index, "shop/util.py", "twice", "helper")


def test_tasks_from_a_stdlib_package():
    directory = Path(stdlib_json.__file__).parent
    tasks = generate_tasks(directory, n=20, seed=1)
    assert len(tasks) == 20 and tasks == generate_tasks(directory, n=20, seed=1)
    index = tools.CodeIndex(CodeNavEnv().context(tasks[0]))
    for task in tasks:
        assert task.caller_path.startswith("json/")
        assert expert_answer(index, task.caller_path, task.caller, task.callee) == task.answer
        path, line = task.answer.rsplit(":", 1)
        assert task.callee.split("(")[0].split(".")[-1] in index.files[path][int(line) - 1]


def test_task_file_and_reward(package, tmp_path):
    tasks = generate_tasks(package, codebase="shop")
    write_tasks(tmp_path / "tasks.jsonl", tasks)
    env = get_env("codenav")
    loaded = env.load_tasks(tmp_path / "tasks.jsonl")
    assert loaded[0].codebase == str(tmp_path / "shop")
    assert "shop/parser.py:12|" in env.context(loaded[0])
    task = next(t for t in loaded if t.callee == "keep")
    answers = ["It is at shop/parser.py:18.", "shop/parser.py:13", None]
    group = RolloutGroup(
        task=task,
        trajectories=[
            Trajectory(
                id=f"r{i}",
                root_id=f"r{i}",
                parent_id=None,
                depth=0,
                task_id=task.id,
                sample_idx=i,
                prompt=task.query,
                answer=a,
            )
            for i, a in enumerate(answers)
        ],
    )
    result = asyncio.run(env.reward(task, group))
    assert result.scores == [1.0, 0.0, 0.0]
    assert [d["position"] for d in result.details] == [
        "shop/parser.py:18",
        "shop/parser.py:13",
        None,
    ]


def test_answer_position():
    assert answer_position("see pkg/a_b.py:12, then x.py:3") == "pkg/a_b.py:12"
    assert answer_position("line 12") is None and answer_position(None) is None
    with pytest.raises(FileNotFoundError, match="code base directory not found"):
        package_files("/nonexistent/dir")


def test_exact_name_wins_over_suffix_matches():
    code = tools.render_codebase(
        [("m.py", "def parse():\n    a()\n\n\nclass P:\n    def parse(self):\n        b()\n")]
    )
    assert tools.goto_definition("parse", code=code) == ["m.py:1"]
    assert tools.goto_definition("P.parse", code=code) == ["m.py:6"]
    assert tools.list_calls("m.py:P.parse", code=code) == [("b", "m.py:7")]
