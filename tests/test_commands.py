"""The front door: every command's bad input ends the same way, and the commands that read a run
work on the embedded default in a fresh folder, before any `rlmtrain train`.

Bad input (a config, a checkpoint, a PDF folder, a model file, ...) is a `UserError` wherever it
is found, and `rlmtrain.cli.main` alone turns it into one line on stderr, `rlmtrain <command>:
error: ...`, and exit code 2.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clocks import RUN_HANG_S

from rlmtrain.cli import main
from rlmtrain.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "configs" / "tiny-cpu.toml")


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, what the line must name) for each command's bad input."""
    missing_config = str(tmp / "missing.toml")
    return [
        (["train", "--config", missing_config], missing_config),
        (["eval", "--config", missing_config], missing_config),
        (["rollout", "--config", missing_config, "--out", str(tmp / "t.jsonl")], missing_config),
        (["data", "prepare", "--config", missing_config], missing_config),
        (["config", "show", "--config", missing_config], missing_config),
        (["train", "--config", DEFAULT, "--train.nosuch=1"], "train.nosuch"),
        (["eval", "--config", DEFAULT, "--checkpoint", str(tmp / "no-model")], "no-model"),
        (["data", "ingest", str(tmp / "no-pdfs"), "--out", str(tmp / "c.jsonl")], "no-pdfs"),
        (["data", "synth", "--out", str(tmp / "s"), "--groups", "0"], "--groups"),
        (["model", "import-gguf", str(tmp / "no.gguf"), "--out", str(tmp / "m")], "no.gguf"),
        (["rollout", "--config", DEFAULT, "--out", str(tmp / "none" / "t.jsonl")], "none"),
        (["data", "ingest", str(tmp), "--out", str(tmp / "none" / "c.jsonl")], "none"),
        (["data", "ingest", str(tmp), "--out", str(tmp / "c.jsonl"), "--workers", "0"], "workers"),
        (["eval", "--config", DEFAULT, "--out", str(tmp / "none" / "r.json")], "none"),
    ]


def test_every_command_is_in_the_bad_input_table(tmp_path):
    covered = {
        tuple(w for w in argv if not w.startswith("-"))[:2] for argv, _ in _bad_inputs(tmp_path)
    }
    for command in COMMANDS:
        assert any(words[: len(command.words)] == command.words for words in covered), command


@pytest.mark.parametrize("case", range(len(_bad_inputs(Path("/")))))
def test_bad_input_is_one_line_and_exit_2_from_every_command(tmp_path, capsys, case):
    argv, needle = _bad_inputs(tmp_path)[case]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    words = " ".join(w for w in argv[:2] if not w.startswith("-") and "/" not in w)
    assert err[0].startswith(f"rlmtrain {words}: error: "), err[0]
    assert needle in err[0], err[0]


@pytest.mark.parametrize("command", ["train", "rollout"])
def test_a_model_hf_dir_that_describes_no_model_is_one_line(tmp_path, capsys, command):
    """As `eval --checkpoint` says it (these were tracebacks from deep in the model's build)."""
    from rlmtrain.config import ModelConfig
    from rlmtrain.model import build_model, save_hf

    model = tmp_path / "model"
    save_hf(build_model(ModelConfig()), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": "256"}))
    argv = [command, "--config", DEFAULT, f"--checkpoint.dir={tmp_path / 'run'}"]
    argv += [f"--model.hf_dir={model}", "--model.tokenizer=byte", "--logging.progress=false"]
    if command == "rollout":
        argv += ["--out", str(tmp_path / "trees.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"rlmtrain {command}: error: {model / 'config.json'}: "), err[-1]
    assert "Traceback" not in "\n".join(err)


def test_a_kv_cache_larger_than_the_machine_is_refused_in_one_line(tmp_path, capsys):
    """Named before its allocation (a RuntimeError from the allocator before)."""
    argv = ["eval", "--config", DEFAULT, f"--checkpoint.dir={tmp_path}", "--eval.tasks=1"]
    assert main([*argv, "--rollout.kv_cache_tokens=1000000000000"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rlmtrain eval: error: rollout.kv_cache_tokens: 1000000000000 tokens")


def test_only_the_front_door_reports_user_errors():
    """No command catches bad input and prints it itself: one handler, one format."""
    for path in sorted((ROOT / "rlmtrain").rglob("*.py")):
        if path.name == "cli.py" and path.parent.name == "rlmtrain":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert ": error: " not in node.value, f"{path}: prints its own error line"
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                assert "UserError" not in names, f"{path}:{node.lineno} catches UserError"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmtrain", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_HANG_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


# The default config, made smaller where only the run time depends on it.
SMALL = (
    "--data.sft_groups=2",
    "--data.synth_groups=1",
    "--data.eval_groups=1",
    "--rollout.max_turns=1",
    "--rollout.max_new_tokens=8",
    "--rollout.n_samples=2",
)


@pytest.mark.slow
def test_data_prepare_rollout_and_eval_run_on_the_default_in_fresh_folders(tmp_path):
    prepared = tmp_path / "prepared"
    result = _run("data", "prepare", "--config", DEFAULT, f"--checkpoint.dir={prepared}", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (prepared / "tokenizer" / "tokenizer.json").is_file()
    for split in ("sft", "rl", "eval"):
        assert (prepared / "data" / split / "tasks.jsonl").is_file(), split
        assert f"{prepared / 'data' / split / 'tasks.jsonl'}" in result.stdout

    rolled = tmp_path / "rolled"
    out = tmp_path / "trees.jsonl"
    result = _run(
        "rollout", "--config", DEFAULT, "--out", str(out), "--limit", "1",
        f"--checkpoint.dir={rolled}", *SMALL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wrote 1 groups" in result.stdout and out.is_file()
    # The BPE it made is the one train makes from the same config.
    assert (rolled / "tokenizer" / "tokenizer.json").read_bytes() == (
        prepared / "tokenizer" / "tokenizer.json"
    ).read_bytes()

    evaluated = tmp_path / "evaluated"
    result = _run(
        "eval", "--config", DEFAULT, "--tasks", "1", "--samples", "1",
        f"--checkpoint.dir={evaluated}", *SMALL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "holds no checkpoint; evaluating the config's starting model" in result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["roots"] == 1 and report["phase"] == "eval"


def test_the_envs_rules_refuse_a_run_before_it_writes_anything(tmp_path, capsys):
    """The evidence teacher's trees need turns the run's limits do not give: refused before the
    data is synthesised, the tokenizer trained or the run folder made."""
    run = tmp_path / "run"
    argv = ["train", "--config", DEFAULT, f"--checkpoint.dir={run}", "--rollout.max_turns=1"]
    assert main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rlmtrain train: error: rollout.max_turns: the evidence teacher"), line
    assert not run.exists()


@pytest.mark.parametrize("module", ["rlmtrain.train", "rlmtrain.cli"])
def test_an_old_launch_line_fails_instead_of_doing_nothing(module):
    result = subprocess.run(
        [sys.executable, "-m", module, "train", "--config", DEFAULT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_HANG_S,
    )
    assert result.returncode != 0
    assert "is not a script" in result.stderr and "-m rlmtrain" in result.stderr


def test_a_killed_rollout_keeps_the_groups_it_finished(tmp_path):
    """SIGKILLed midway (no handler runs): every group that ended is in --out, whole."""
    import signal
    import time

    from rlmtrain.config import load_config
    from rlmtrain.rlm.records import read_groups

    out = tmp_path / "trees.jsonl"
    command = [sys.executable, "-m", "rlmtrain", "rollout", "--config", DEFAULT, "--out", str(out)]
    command += [f"--checkpoint.dir={tmp_path / 'run'}", "--logging.progress=false"]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + RUN_HANG_S
        while not out.exists() or out.read_bytes().count(b"\n") < 2:
            assert job.poll() is None, "no group kept before the rollout ended"
            assert time.monotonic() < deadline, "no group written"
            time.sleep(0.05)
        assert job.poll() is None, "the rollout ended before its groups were seen"
        job.send_signal(signal.SIGKILL)
        job.wait()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        job.stderr.close()
    kept = out.read_bytes()
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(kept[: kept.rfind(b"\n") + 1])  # a line cut by the kill, if any
    groups = list(read_groups(whole))
    tasks = (tmp_path / "run" / "data" / "rl" / "tasks.jsonl").read_text().count("\n")
    assert 2 <= len(groups) < tasks  # kept as they ended, not written at the end
    dealt = load_config(DEFAULT).rollout.n_samples
    for group in groups:  # each group whole: every root it was dealt, every tree ended
        assert len(group.roots) == dealt, group.task
        assert all(root.finish_reason != "aborted" for root in group.roots)


@pytest.mark.parametrize("phase", ["sft", "rl"])
def test_a_phase_no_tree_of_which_could_run_stops_the_run_saying_why(
    tmp_path, capsys, monkeypatch, phase
):
    """Every root of an RL step failed in the scheduler: a step that trains nothing, again and
    again, until the last; the run stops at the first, naming the cause and what the same
    command does next. Every tree of the SFT teacher: the cause, not the teacher's limits."""
    from rlmtrain.rlm import repl

    async def no_processes_left(cls, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(repl.Zygote, "start", classmethod(no_processes_left))
    argv = ["train", "--config", DEFAULT, f"--checkpoint.dir={tmp_path}", *SMALL]
    argv += ["--logging.progress=false", f"--train.sft_steps={2 if phase == 'sft' else 0}"]
    argv += ["--rollout.max_turns=2"] if phase == "sft" else []  # the teacher's least
    assert main([*argv, "--train.steps=3"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in last, last
    if phase == "sft":
        assert last.startswith("rlmtrain train: error: sft: no tree of the evidence teacher could")
        return
    assert last.startswith("rlmtrain train: error: rl step 0: no tree could run"), last
    assert "so the same command starts over" in last, last
    # The evaluation before it went on (a final one must not lose the export), saying so.
    assert "eval init: no tree could run, no figure is the policy's: BlockingIOError" in err
    assert not (tmp_path / "final").exists()


@pytest.mark.parametrize("command", ["rollout", "eval"])
def test_a_rollout_no_tree_of_which_could_run_says_why(tmp_path, capsys, monkeypatch, command):
    """Every tree failed in the scheduler (here no REPL could start: the machine is out of
    processes): exit 2 naming the cause, not a report of a policy that scored 0."""
    from rlmtrain.rlm import repl

    async def no_processes_left(cls, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(repl.Zygote, "start", classmethod(no_processes_left))
    argv = [command, "--config", DEFAULT, f"--checkpoint.dir={tmp_path}", *SMALL]
    argv += ["--logging.progress=false"]
    if command == "rollout":
        argv += ["--out", str(tmp_path / "trees.jsonl")]
    else:
        argv += ["--eval.tasks=2"]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"rlmtrain {command}: error: no tree could run"), last
    assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in last, last
    if command == "rollout":
        assert len((tmp_path / "trees.jsonl").read_text().splitlines()) == 2  # kept, written
