"""Killed and resumed, a run goes on exactly as if it had never stopped.

At one rank and at two, on the default shortened to two tasks, starting from the tiny model that
130 SFT steps taught them by heart (made once for the module and exported, tokenizer and all), so
that its RL steps score unevenly and make real GRPO updates, with truncated importance sampling
on:

- an uninterrupted run A checkpoints every step;
- run B, with every REPL exec delayed at random (`tests/perturbed_train.py`: requests reach the
  engine in another order and company), is SIGKILLed as a whole job during SFT, resumed with
  `checkpoint.resume=true` and a checkpoint every step where the first launch made one every
  other step, SIGKILLed again during RL step 3 and resumed again;
- at the end of SFT and at the end of RL the two agree bitwise: parameters, optimizer state,
  LR, step and the per-step curve. Each RL step plays both tasks, one whole pass, so the second
  resume lands on a data-pass boundary, where it must go on training.

This holds with TIS on because the native engine's sampled-token log-probs, which TIS reads,
are the same bits in any batch company (`model.paged_attention`), and each request's seed is its
place in the tree.

A checkpoint cut short, missing its completion mark or with a manifest that is none is refused
with one line, and so is a resume under other values of the keys the LR, exploration and
tool-credit schedules follow, under another seed or into another model shape, and a new run
started over an earlier run's checkpoints. A checkpoint written before RL's first update resumes.
A finished run given more RL steps evaluates its new end, its first end's evaluation kept.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from clocks import RUN_HANG_S
from memorised_run import (
    RL_STEPS,
    ROOT,
    SFT_STEPS,
    env,
    kill_when,
    launch,
    rows,
    run_args,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = pytest.mark.slow


def _state(checkpoint: Path, scratch: Path) -> dict:
    out = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "state", out)
    return torch.load(out, weights_only=False)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}/{key}")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _flat(value, f"{prefix}/{i}")
    else:
        yield prefix, tree


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    left, right = dict(_flat(a)), dict(_flat(b))
    assert left.keys() == right.keys()
    for key, value in left.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, right[key]), key
        else:
            assert value == right[key], key


@pytest.mark.parametrize(
    ("ranks", "options"),
    [(1, ()), (2, ()), (2, ("--train.optimizer_offload=true",))],
    ids=["1", "2", "2-moments-in-host-memory"],
)
def test_a_killed_run_resumes_bitwise(tmp_path, two_tasks, memorised, ranks, options):
    memorised = (*memorised, *options)
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    a = subprocess.run(
        [*launch(ranks, False), *run_args(uninterrupted, two_tasks, *memorised)],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=env(),
    )  # fmt: skip
    assert a.returncode == 0, a.stderr[-3000:]
    # The start's memory estimate names where the moments are.
    assert ("AdamW moments in host memory" in a.stderr) == bool(options)
    curve = rows(uninterrupted)
    rl = [row for row in curve if row["phase"] == "rl"]
    # The premise: GRPO updates in most RL steps, read through TIS.
    assert sum(row["groups_kept"] > 0 for row in rl) >= 3, rl
    assert all(row["loss"] != 0 for row in rl if row["groups_kept"]), rl

    checkpoints = resumed / "checkpoints"
    perturbed = [*launch(ranks, True), *run_args(resumed, two_tasks, *memorised)]
    last_sft = f"sft-{SFT_STEPS:06d}"
    kill_when(
        [*perturbed, "--checkpoint.every=2"], checkpoints / "sft-000004" / "COMPLETE", last_sft
    )
    assert not (checkpoints / last_sft).exists()
    assert not (checkpoints / "sft-000003").exists()  # every other step
    kill_when(
        [*perturbed, "--checkpoint.resume=true"], checkpoints / "rl-000002" / "COMPLETE",
        "rl-000003",
    )  # fmt: skip
    assert not (checkpoints / "rl-000003").exists()  # killed during step 3
    b = subprocess.run(
        [*perturbed, "--checkpoint.resume=true"],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=env(),
    )  # fmt: skip
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resumed from" in b.stderr and "rl-00000" in b.stderr

    for name in (f"sft-{SFT_STEPS:06d}", f"rl-{RL_STEPS:06d}"):
        left, right = uninterrupted / "checkpoints" / name, checkpoints / name
        assert json.loads((left / "trainer.json").read_text()) == json.loads(
            (right / "trainer.json").read_text()
        )
        _assert_bitwise_equal(_state(left, tmp_path), _state(right, tmp_path))
    # The resumed run's curve is the uninterrupted one: each step once, the same numbers.
    keys = ("phase", "step", "loss", "lr", "reward_mean", "generated_tokens", "groups_kept")
    assert [[r.get(k) for k in keys] for r in rows(resumed)] == [
        [r.get(k) for k in keys] for r in curve
    ]


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, two_tasks) -> Path:
    """A run folder holding a real checkpoint: a 1-step SFT run."""
    run = tmp_path_factory.mktemp("one-step") / "run"
    args = run_args(run, two_tasks, "--train.sft_steps=1", "--train.steps=0")
    result = subprocess.run(
        [*launch(1, False), *args], cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S,
        env=env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def _one_checkpoint(tmp_path: Path, one_step_run: Path) -> Path:
    """A copy of the 1-step run's folder for a test to damage or resume."""
    return Path(shutil.copytree(one_step_run, tmp_path / "run"))


# How each damage is named in the one line that refuses it.
DAMAGES = {
    "truncated": "damaged",
    "unmarked": "incomplete",
    "manifest a list": "not a manifest",
    "manifest emptied": "lists no trainer state",
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, two_tasks, one_step_run, damage):
    run = _one_checkpoint(tmp_path, one_step_run)
    checkpoint = run / "checkpoints" / "sft-000001"
    if damage == "truncated":
        victim = max((p for p in (checkpoint / "state").iterdir()), key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "unmarked":
        (checkpoint / "COMPLETE").unlink()
    elif damage == "manifest a list":
        (checkpoint / "COMPLETE").write_text("[]")
    else:  # a manifest promising nothing, beside a trainer state that is gone
        (checkpoint / "COMPLETE").write_text("{}")
        (checkpoint / "trainer.json").unlink()
    before = {p.name for p in (run / "checkpoints").iterdir()}
    result = subprocess.run(
        [*launch(1, False), *run_args(run, two_tasks, "--checkpoint.resume=true")],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=env(),
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(checkpoint) in lines[0]
    assert DAMAGES[damage] in lines[0]
    assert {p.name for p in (run / "checkpoints").iterdir()} == before  # nothing removed
    shutil.rmtree(run)


def test_a_resume_under_other_schedules_is_refused_in_one_line(tmp_path, two_tasks, one_step_run):
    run = _one_checkpoint(tmp_path, one_step_run)
    checkpoint = run / "checkpoints" / "sft-000001"
    recorded = json.loads((checkpoint / "trainer.json").read_text())["schedules"]
    assert recorded["algo.exploration_beta"] == 0.0 and recorded["algo.tool_credit_alpha"] == 0.0
    assert recorded["train.steps"] == 0 and recorded["train.lr_schedule"] == "constant"
    result = subprocess.run(
        [
            *launch(1, False),
            *run_args(run, two_tasks, "--train.sft_steps=1", "--train.steps=0"),
            "--checkpoint.resume=true", "--algo.exploration_beta=0.5",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=env(),
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(checkpoint) in lines[0] and "algo.exploration_beta=0.0" in lines[0], lines[0]


def test_a_finished_run_goes_on_for_the_rl_steps_asked_for(tmp_path, two_tasks, one_step_run):
    # Its RL rate is constant and it has no exploration bonus: nothing depends on train.steps.
    run = _one_checkpoint(tmp_path, one_step_run)
    result = _train(run, two_tasks, "--train.steps=2", "--checkpoint.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and "sft-000001" in result.stderr
    steps = [row["step"] for row in rows(run) if row["phase"] == "rl"]
    assert steps == [0, 1]


def test_a_finished_run_given_more_steps_evaluates_its_new_end(tmp_path, two_tasks):
    from rlmtrain.envs.synth import synthesize

    # Held-out tasks of their own (another paper group): a run on `two_tasks` alone has none.
    synthesize(tmp_path / "eval", groups=1, seed=0, first_group=1, max_papers=2, progress=False)
    run = tmp_path / "run"

    def train(steps: int) -> str:
        result = _train(
            run, two_tasks, f"--train.steps={steps}",
            f"--data.eval_path={tmp_path / 'eval' / 'tasks.jsonl'}", "--eval.every=100",
            "--eval.samples=2", "--train.warmup_steps=0",  # a warm-up cut short would differ
            "--checkpoint.resume=true",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    train(1)
    table = train(2).splitlines()
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    # The first end's evaluation stays on record; the new end has its own.
    assert [(r["phase"], r["step"]) for r in evals if r["phase"] == "final"] == [
        ("final", 2),
        ("final", 3),
    ]
    # The closing table names the first end by its step and the new one as the end.
    stages = [line.split("  ")[0] for line in table if line.startswith(("RL step", "after RL"))]
    assert stages == ["RL step 2", "after RL"], table[-6:]


def test_more_rl_steps_are_refused_where_the_bonus_decays_over_them(tmp_path, two_tasks):
    run = tmp_path / "run"
    bonus = "--algo.exploration_beta=0.5"
    first = _train(run, two_tasks, bonus)
    assert first.returncode == 0, first.stderr[-3000:]
    line = _refusal(_train(run, two_tasks, bonus, "--train.steps=2", "--checkpoint.resume=true"))
    assert "train.steps=0 (the config says 2)" in line, line


def _refusal(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _train(run: Path, two_tasks: Path, *extra: str) -> subprocess.CompletedProcess:
    """A run of one SFT step and no RL on the two tasks, `extra` overriding (the last of a
    key given twice wins)."""
    return subprocess.run(
        [*launch(1, False), *run_args(run, two_tasks, "--train.sft_steps=1", "--train.steps=0"),
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=env(),
    )  # fmt: skip


def test_a_resume_under_another_seed_is_refused_in_one_line(tmp_path, two_tasks, one_step_run):
    run = _one_checkpoint(tmp_path, one_step_run)
    line = _refusal(_train(run, two_tasks, "--checkpoint.resume=true", "--train.seed=7"))
    assert str(run / "checkpoints" / "sft-000001") in line
    assert "train.seed=0" in line and "7" in line, line


def test_a_resume_under_another_data_seed_is_refused_and_touches_nothing(
    tmp_path, two_tasks, one_step_run
):
    """The data seed orders the tasks (and seeds any synthesised set): resumed under another,
    the run would go on over other tasks, or synthesise them over its own."""
    run = _one_checkpoint(tmp_path, one_step_run)
    recorded = json.loads((run / "checkpoints" / "sft-000001" / "trainer.json").read_text())
    assert recorded["data"]["data.seed"] == 0 and recorded["data"]["data.env"] == "evidence"
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    line = _refusal(_train(run, two_tasks, "--checkpoint.resume=true", "--data.seed=7"))
    assert str(run / "checkpoints" / "sft-000001") in line, line
    assert "data.seed=0 (the config says 7)" in line, line
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("written", ["zeros", "NaNs, sizes alone recorded"])
def test_a_checkpoint_overwritten_in_place_is_refused(tmp_path, two_tasks, one_step_run, written):
    """Every size as the manifest says: other finite values are caught by the file's CRC-32,
    NaNs in a checkpoint whose manifest holds sizes alone (written before the sums were) once
    read, before a step or an export uses them (a resume trained on and exported either)."""
    run = _one_checkpoint(tmp_path, one_step_run)
    checkpoint = run / "checkpoints" / "sft-000001"
    victim = max((p for p in (checkpoint / "state").iterdir()), key=lambda p: p.stat().st_size)
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size // 3)
        f.write((b"\x00" if written == "zeros" else b"\xff") * 65536)
    manifest = json.loads((checkpoint / "COMPLETE").read_text())
    assert all(set(entry) == {"bytes", "crc32"} for entry in manifest.values()), manifest
    if written != "zeros":
        sizes = {name: entry["bytes"] for name, entry in manifest.items()}
        (checkpoint / "COMPLETE").write_text(json.dumps(sizes))
    exported = (run / "final" / "model.safetensors").read_bytes()
    result = _train(run, two_tasks, "--checkpoint.resume=true")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert f"{checkpoint}: damaged checkpoint: " in line, line
    if written == "zeros":
        assert f"the bytes of {victim.relative_to(checkpoint)} are not those saved" in line, line
    else:
        assert "holds NaN or infinite values" in line, line
    assert (run / "final" / "model.safetensors").read_bytes() == exported


def test_a_resume_into_another_model_shape_is_refused_in_one_line(
    tmp_path, two_tasks, one_step_run
):
    """The reader's own error (a CheckpointException, which is no Exception) comes back as
    the one line, naming the checkpoint."""
    run = _one_checkpoint(tmp_path, one_step_run)
    result = _train(run, two_tasks, "--checkpoint.resume=true", "--model.vocab_size=4096")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]  # after the run's own log lines
    assert line.startswith("rlmtrain train: error: ") and "Size mismatch" in line, line
    assert str(run / "checkpoints" / "sft-000001") in line and "unreadable" in line, line


def test_a_new_run_over_an_earlier_runs_checkpoints_is_refused(tmp_path, two_tasks, one_step_run):
    """Mixed into one folder, the new run's pruning could delete its own checkpoints and a later
    resume pick the old run's; its records would be emptied. Nothing is touched."""
    run = _one_checkpoint(tmp_path, one_step_run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    line = _refusal(_train(run, two_tasks))
    assert str(run / "checkpoints") in line and "sft-000001" in line, line
    assert "--checkpoint.resume=true" in line
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_checkpoint_before_the_first_rl_update_resumes(tmp_path, two_tasks):
    """RL steps that find nothing to learn from (every sample scored alike: the untrained
    model) leave the RL optimizer fresh. Its checkpoint records it so, and the resume keeps it
    fresh, where torch's reader would look for moments that were never made."""
    run = tmp_path / "run"
    rl = ("--train.sft_steps=1", "--train.steps=2", "--train.tasks_per_step=1",
          "--rollout.n_samples=2")  # fmt: skip
    first = subprocess.run(
        [*launch(1, False), *run_args(run, two_tasks, *rl)],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=env(),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    rl_rows = [r for r in rows(run) if r["phase"] == "rl"]
    assert [r["groups_kept"] for r in rl_rows] == [0, 0], rl_rows
    states = {
        name: json.loads((run / "checkpoints" / name / "trainer.json").read_text())
        for name in ("sft-000001", "rl-000001", "rl-000002")
    }
    assert states["sft-000001"]["optimizer_stepped"] is True
    assert states["rl-000001"]["optimizer_stepped"] is False
    shutil.rmtree(run / "checkpoints" / "rl-000002")
    # And as a checkpoint from before the flag was recorded: read off the saved keys.
    older = Path(shutil.copytree(run, tmp_path / "older"))
    checkpoint = older / "checkpoints" / "rl-000001"
    recorded = json.loads((checkpoint / "trainer.json").read_text())
    del recorded["optimizer_stepped"]
    (checkpoint / "trainer.json").write_text(json.dumps(recorded))
    manifest = json.loads((checkpoint / "COMPLETE").read_text())
    manifest["trainer.json"] = (checkpoint / "trainer.json").stat().st_size
    (checkpoint / "COMPLETE").write_text(json.dumps(manifest))
    for folder in (run, older):
        resumed = subprocess.run(
            [*launch(1, False), *run_args(folder, two_tasks, *rl), "--checkpoint.resume=true"],
            cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=env(),
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resumed from" in resumed.stderr and "rl-000001" in resumed.stderr


class _Texts:
    """The one thing `run_tokenizer` asks of an env: the text to train a BPE on."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def vocabulary_texts(self, tasks) -> list[str]:
        return self.texts


def test_a_resumed_run_reads_its_tokenizer_instead_of_training_another(tmp_path):
    from rlmtrain import parallel
    from rlmtrain.config import Config, ConfigError, ModelConfig
    from rlmtrain.run_folder import RunFolder
    from rlmtrain.training.startup import run_tokenizer

    world = parallel.World()
    cfg = Config(model=ModelConfig(preset="tiny", tokenizer="bpe", bpe_vocab_size=300))
    first = ["def search(query): return [p for p in papers if query in p]"] * 50
    _, trained, folder = run_tokenizer(cfg, _Texts(first), [], RunFolder(tmp_path), world)
    saved = (folder / "tokenizer.json").read_bytes()
    # The data changed between the runs: a fresh tokenizer would get other merges.
    other = ["zebra quagga okapi " * 20] * 50
    _, fresh, _ = run_tokenizer(cfg, _Texts(other), [], RunFolder(tmp_path / "fresh"), world)
    assert fresh.encode(first[0]) != trained.encode(first[0])
    _, resumed, _ = run_tokenizer(cfg, _Texts(other), [], RunFolder(tmp_path), world, resuming=True)
    assert (folder / "tokenizer.json").read_bytes() == saved
    assert resumed.encode(first[0]) == trained.encode(first[0])
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        run_tokenizer(cfg, _Texts(first), [], RunFolder(tmp_path / "empty"), world, resuming=True)


def test_a_stopped_run_says_what_the_same_command_does_next(tmp_path, one_step_run):
    """The line a SIGTERMed run ends with: resumed, resumable with the switch, or started over."""
    from rlmtrain.config import load_config
    from rlmtrain.resume import after_a_stop

    run = _one_checkpoint(tmp_path, one_step_run)
    newest = run / "checkpoints" / "sft-000001"
    folder = f"--checkpoint.dir={run}"
    resuming = load_config(None, [folder, "--checkpoint.resume=true"])
    assert after_a_stop(resuming) == f"the same command resumes from {newest}"
    fresh = load_config(None, [folder, "--checkpoint.resume=false"])
    assert after_a_stop(fresh) == (
        f"the same command with --checkpoint.resume=true resumes from {newest}"
    )
    (newest / "COMPLETE").unlink()
    assert after_a_stop(resuming).startswith("its newest checkpoint cannot be resumed")
    empty = f"--checkpoint.dir={tmp_path / 'empty'}"
    assert "starts over; checkpoint.every = N" in after_a_stop(load_config(None, [empty]))
    saving = load_config(None, [empty, "--checkpoint.every=5"])
    assert after_a_stop(saving) == "no checkpoint was saved yet, so the same command starts over"
