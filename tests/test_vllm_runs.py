"""`rlmtrain train` and `rlmtrain rollout` on the default config with `--rollout.engine=vllm`, as a
user runs them (subprocesses: vLLM spawns its engine process from a `__main__`), on a real vLLM.

A short train (a few SFT steps, two GRPO steps that train on every group) must finish, export its
policy, and log for each RL step how far the trainer's log-probs of the sampled tokens are from
the ones vLLM returned (`engine_logp_gap`, the mean |pi_old - pi_sampler| over trained tokens),
within the tolerance measured for fp32 (`test_engine_vllm`: ~2e-6 at most). `rollout` then serves
the exported policy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlmtrain.devices import HAS_VLLM

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

ROOT = Path(__file__).resolve().parents[1]
GAP_TOLERANCE = 1e-4


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmtrain.cli", *args, "--config", "configs/tiny-cpu.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_train_then_rollout_on_vllm(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trained = cli(
        "train",
        "--rollout.engine=vllm",
        f"--checkpoint.dir={run}",
        "--data.sft_groups=3",
        "--data.synth_groups=2",
        "--train.sft_steps=8",
        "--train.steps=2",
        "--train.tasks_per_step=2",
        "--rollout.n_samples=2",
        "--algo.drop_uniform_groups=false",
        "--eval.every=0",
        "--logging.progress=false",
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [row for row in rows if row.get("phase") == "rl"]
    assert [row["step"] for row in rl] == [0, 1]
    for row in rl:
        assert row["generated_tokens"] > 0 and row["finish_reasons"].get("error", 0) == 0
        assert row["tokens"] > 0, "the step trained on nothing"
        assert 0 <= row["engine_logp_gap"] < GAP_TOLERANCE, row["engine_logp_gap"]
    assert (run / "final" / "config.json").is_file()

    out = tmp_path / "groups.jsonl"
    rolled = cli(
        "rollout",
        "--rollout.engine=vllm",
        f"--checkpoint.dir={run}",
        f"--model.hf_dir={run / 'final'}",
        "--model.tokenizer=",
        "--rollout.n_samples=2",
        "--limit=1",
        f"--out={out}",
    )
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    assert "wrote 1 groups" in rolled.stdout
    assert len(out.read_text().splitlines()) == 1
