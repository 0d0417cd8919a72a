"""The embedded default, shortened, as a user runs it: deterministic, on its stored curve, the
same through the fused and the unfused loss, reproducible by `rlmtrain eval`, and run again,
going on from its checkpoints.

The short run is `configs/tiny-cpu.toml` with fewer groups and steps (`SHORT`): the whole loop
(synthesis, BPE tokenizer, teacher through the scheduler, SFT, GRPO, evaluations, plot, events)
in well under a minute. Its per-step losses and rewards are kept in `tests/assets/`; regenerate
them only on purpose, after a change meant to move the curve:

    RLMTRAIN_REGENERATE_CURVES=1 .venv/bin/python -m pytest tests/test_train_default.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clocks import RUN_HANG_S

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CURVE = ROOT / "tests" / "assets" / "tiny_short_curve.json"

SHORT = (
    "--data.sft_groups=3",
    "--data.synth_groups=2",
    "--data.eval_groups=1",
    "--train.sft_steps=6",
    "--train.steps=2",
    "--train.tasks_per_step=2",
    "--rollout.n_samples=4",
    "--eval.every=1",
    "--eval.tasks=2",
    "--logging.progress=false",
)


def _cli(command: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """`rlmtrain <command>` on the short default in `run_dir`, as a user runs it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmtrain",
            command,
            "--config",
            "configs/tiny-cpu.toml",
            f"--checkpoint.dir={run_dir}",
            *SHORT,
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_HANG_S,
    )


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return _cli("train", run_dir, *extra)


def _curve(run_dir: Path) -> list[dict]:
    keys = ("phase", "step", "loss", "reward_mean", "tokens", "generated_tokens")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: row[k] for k in keys if k in row} for row in rows]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    runs = []
    for name in ("a", "b"):
        run_dir = tmp_path_factory.mktemp(f"short-{name}")
        result = _train(run_dir)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(run_dir)
    return runs[0], runs[1]


def test_short_default_is_deterministic(two_runs):
    a, b = two_runs
    assert (a / "tokenizer" / "tokenizer.json").read_bytes() == (
        b / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    curve = _curve(a)
    assert [r["phase"] for r in curve] == ["sft"] * 6 + ["rl"] * 2
    assert curve == _curve(b)
    evals = [json.loads(line) for line in (a / "eval.jsonl").read_text().splitlines()]
    assert [e["phase"] for e in evals] == ["init", "sft", "rl", "final"]
    trees = [e["roots"] // e["tasks"] for e in evals]
    assert trees == [1, 8, 8, 8], "eval.init_samples = 1 at init, eval.samples = 8 after"
    for report in evals:
        assert {"step", "reward_mean", "tasks", "children_per_root", "spawn_rate"} <= set(report)


def test_short_default_follows_its_stored_curve(two_runs):
    curve = _curve(two_runs[0])
    if os.environ.get("RLMTRAIN_REGENERATE_CURVES"):
        CURVE.parent.mkdir(parents=True, exist_ok=True)
        CURVE.write_text(json.dumps(curve, indent=1) + "\n")
    stored = json.loads(CURVE.read_text())
    assert [(r["phase"], r["step"]) for r in curve] == [(r["phase"], r["step"]) for r in stored]
    for got, want in zip(curve, stored, strict=True):
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (got, want)
            else:
                assert got[key] == value, (got, want)


def test_short_default_fused_and_unfused_losses_agree(two_runs, tmp_path):
    """The fused ops (the run's automatic choice: the chunked torch backend on a CPU, Triton on
    CUDA) against full logits, step for step (fp32)."""
    unfused_dir = tmp_path / "unfused"
    result = _train(unfused_dir, "--train.loss_impl=unfused")
    assert result.returncode == 0, result.stderr[-3000:]
    fused, unfused = _curve(two_runs[0]), _curve(unfused_dir)
    assert len(fused) == len(unfused) == 8
    for f, u in zip(fused, unfused, strict=True):
        assert (f["phase"], f["step"]) == (u["phase"], u["step"])
        if "loss" in f:
            assert u["loss"] == pytest.approx(f["loss"], abs=1e-5), (f, u)
        assert f.get("reward_mean") == u.get("reward_mean") or (f, u)


def test_short_default_leaves_what_a_user_watches(two_runs):
    run_dir = two_runs[0]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["phase"] == "rl" and s["trajectories"] for s in samples)
    final = run_dir / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    pytest.importorskip("tensorboard")
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


def test_eval_reproduces_the_final_evaluation(two_runs):
    run_dir = two_runs[0]
    final = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
    result = _cli("eval", run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("reward_mean", "tasks", "spawn_rate", "children_per_root", "sample_digest"):
        assert report[key] == final[key], key


def test_the_same_command_again_goes_on_from_the_checkpoints(two_runs):
    """The default checkpoints each phase's end and resumes: run again, a finished run
    redoes no step and no evaluation (its records stay as they were) and exports again."""
    run_dir = two_runs[1]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["rl-000002", "sft-000006"]
    records = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "eval.jsonl")}
    exported = (run_dir / "final" / "model.safetensors").read_bytes()
    result = _train(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and "rl-000002" in result.stderr
    assert "eval " not in result.stderr  # no evaluation line
    assert {name: (run_dir / name).read_bytes() for name in records} == records
    assert (run_dir / "final" / "model.safetensors").read_bytes() == exported
