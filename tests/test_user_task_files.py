"""Task files of a user's own, through `rlmtrain data prepare`: what they name is checked as
they load (a missing code base or book, one that cannot be read, an id used twice) and refused
in one line naming the file, the line or the key; a task the scripted teacher has no plan for
still gets a BPE vocabulary (the teacher's code of the other tasks in it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmtrain.cli import main

ROOT = Path(__file__).resolve().parents[1]


def prepare(
    run: Path, config: str, tasks: Path, *extra: str, held_out: Path | None = None
) -> list[str]:
    """Training and held-out tasks from `tasks` (the refusals: whichever set loads it), or
    held-out ones from a file of their own."""
    argv = ["data", "prepare", "--config", str(ROOT / "configs" / config)]
    argv += [f"--checkpoint.dir={run}", f"--data.train_path={tasks}"]
    argv += [f"--data.eval_path={held_out or tasks}"]
    return [*argv, "--logging.progress=false", *extra]


def refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    return lines[-1]


def synthesized(env: str, tmp_path: Path) -> Path:
    from rlmtrain.config import Config
    from rlmtrain.envs.base import get_env

    out = tmp_path / "data"
    out.mkdir()
    if env == "booknav":  # its env needs a judge's endpoint, its synthesis none
        from rlmtrain.envs.booknav import write_synthetic

        return write_synthetic(out, 1, 0)
    return get_env(env, Config()).synthesize(out, groups=1, first_group=0, config=Config())


def rewrite(tasks: Path, **fields) -> None:
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    tasks.write_text("".join(json.dumps({**rows[0], **fields}) + "\n" for _ in rows[:1]))


def test_a_codenav_task_naming_a_missing_code_base_names_its_line(tmp_path, capsys):
    tasks = synthesized("codenav", tmp_path)
    rewrite(tasks, codebase="code/nosuch")
    line = refusal(capsys, prepare(tmp_path / "run", "codenav-cpu.toml", tasks))
    assert f"{tasks}:1: field `codebase`: no folder {tasks.parent / 'code' / 'nosuch'}" in line


def test_a_code_base_file_that_is_not_utf8_is_named(tmp_path, capsys):
    tasks = synthesized("codenav", tmp_path)
    rewrite(tasks)
    codebase = tasks.parent / json.loads(tasks.read_text())["codebase"]
    bad = next(codebase.rglob("*.py"))
    bad.write_bytes(b"x = '\xff'\n")
    line = refusal(capsys, prepare(tmp_path / "run", "codenav-cpu.toml", tasks))
    assert line.startswith("rlmtrain data prepare: error: data.train_path: "), line
    assert f"{bad}: not UTF-8 text" in line, line


@pytest.mark.parametrize(
    ("book", "content", "says"),
    [
        ("nosuch.json", None, "field `book`: no file"),
        ("folder.json", "folder", "field `book`: no file"),
        ("bad.json", b'{"title": 1}', "not a valid book"),
        ("binary.json", b"\xff\xfe", "not a valid book"),
    ],
)
def test_a_booknav_task_naming_a_book_that_is_not_one_is_named(
    tmp_path, capsys, book, content, says
):
    tasks = synthesized("booknav", tmp_path)
    rewrite(tasks, book=book)
    if content == "folder":
        (tasks.parent / book).mkdir()
    elif content is not None:
        (tasks.parent / book).write_bytes(content)
    line = refusal(capsys, prepare(tmp_path / "run", "booknav-cpu.toml", tasks))
    assert says in line and book in line, line


def test_a_task_id_used_twice_is_refused(tmp_path, capsys):
    tasks = synthesized("codenav", tmp_path)
    first = tasks.read_text().splitlines()[0]
    tasks.write_text(f"{first}\n{first}\n")
    line = refusal(capsys, prepare(tmp_path / "run", "codenav-cpu.toml", tasks))
    assert "data.train_path: task id" in line and "appears more than once" in line, line


def test_queries_the_teacher_has_no_plan_for_still_get_a_bpe_vocabulary(tmp_path, capsys):
    tasks = synthesized("evidence", tmp_path)
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    rows[0]["query"] = "What is the main contribution?"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    held_out = tasks.with_name("held-out.jsonl")  # another question, not a training task
    held_out.write_text(
        json.dumps({**rows[-1], "id": "held-out", "query": "Which dataset?"}) + "\n"
    )
    run = tmp_path / "run"
    argv = prepare(run, "tiny-cpu.toml", tasks, "--model.tokenizer=bpe", held_out=held_out)
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    assert (run / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize("named", ["the same file", "a copy", "the sft file"])
def test_held_out_tasks_a_phase_trains_on_are_refused(tmp_path, capsys, named):
    """Their figures would be training figures reported as held-out."""
    tasks = synthesized("evidence", tmp_path)
    held_out, extra = tasks, []
    if named != "the same file":
        held_out = tasks.with_name("held-out.jsonl")
        other = json.loads(tasks.read_text().splitlines()[0])
        held_out.write_text(tasks.read_text() + json.dumps({**other, "id": "new"}) + "\n")
    if named == "the sft file":
        extra = [f"--data.sft_path={tasks}", "--train.steps=0"]
    argv = prepare(tmp_path / "run", "tiny-cpu.toml", tasks, *extra, held_out=held_out)
    line = refusal(capsys, argv)
    key = "sft_path" if named == "the sft file" else "train_path"
    first = json.loads(tasks.read_text().splitlines()[0])["id"]
    shared = len(tasks.read_text().splitlines())
    held = len(held_out.read_text().splitlines())
    assert line.startswith(
        f"rlmtrain data prepare: error: data.eval_path: {shared} of the {held} held-out tasks "
        f"are training tasks too (task {first!r} is also in data.{key})"
    ), line
