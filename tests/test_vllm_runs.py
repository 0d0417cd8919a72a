"""`rlmtrain train` and `rlmtrain rollout` on the default config with `--rollout.engine=vllm`, as a
user runs them (subprocesses: vLLM spawns its engine process from a `__main__`), on a real vLLM.

A short train (a few SFT steps, two GRPO steps that train on every group) must finish, export its
policy, and log for each RL step how far the trainer's log-probs of the sampled tokens are from
the ones vLLM returned (`engine_logp_gap`, the mean |pi_old - pi_sampler| over trained tokens),
within the tolerance measured for fp32 (`test_engine_vllm`: ~2e-6 at most). `rollout` then serves
the exported policy. Under torchrun, two FSDP2 ranks each sample from a vLLM engine of their own
(kept in step by the lockstep sync of the shards) and train as one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from clocks import RUN_HANG_S

from rlmtrain.devices import HAS_VLLM

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

ROOT = Path(__file__).resolve().parents[1]
GAP_TOLERANCE = 1e-4


def cli(*args: str, head: tuple[str, ...] = ("-m", "rlmtrain")) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *head, *args, "--config", "configs/tiny-cpu.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_HANG_S,
    )


SHORT_TRAIN = (
    "--rollout.engine=vllm",
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


def _check_rl_steps(run: Path) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [row for row in rows if row.get("phase") == "rl"]
    assert [row["step"] for row in rl] == [0, 1]
    for row in rl:
        assert row["generated_tokens"] > 0 and row["finish_reasons"].get("error", 0) == 0
        assert row["tokens"] > 0, "the step trained on nothing"
        assert 0 <= row["engine_logp_gap"] < GAP_TOLERANCE, row["engine_logp_gap"]
    assert (run / "final" / "config.json").is_file()


def test_train_then_rollout_on_vllm(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trained = cli("train", *SHORT_TRAIN, f"--checkpoint.dir={run}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    _check_rl_steps(run)

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


def test_two_ranks_each_train_on_their_own_vllm(tmp_path: Path) -> None:
    """Each rank's engine serves the synced policy: a rank whose engine kept other weights
    would sample tokens whose trainer log-probs miss vLLM's by far more than the tolerance."""
    run = tmp_path / "run"
    port = str(29700 + os.getpid() % 1000)
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port)
    head = (*torchrun, "-m", "rlmtrain", "train")
    trained = cli(*SHORT_TRAIN, f"--checkpoint.dir={run}", head=head)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "on 2 x cpu" in trained.stderr
    _check_rl_steps(run)


def test_sigterm_stops_the_run_and_its_vllm_engine(tmp_path: Path) -> None:
    """A plain `kill` of a training run that samples with vLLM: the run stops with exit code 143
    and closes its engine, so no vLLM process outlives it (before, the engine core and its
    worker were left orphaned, each polling a core)."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "rlmtrain", "train", "--config", "configs/tiny-cpu.toml"]
    command += [*SHORT_TRAIN, "--train.sft_steps=100000", f"--checkpoint.dir={run}"]
    trainer = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    below: list[psutil.Process] = []
    try:
        # The engine is up before SFT starts; the first SFT checkpoint says SFT has (the log
        # files are written in blocks, not line by line).
        checkpoints, give_up = run / "checkpoints", time.monotonic() + RUN_HANG_S
        while not any(checkpoints.glob("sft-*/COMPLETE")):
            assert trainer.poll() is None, trainer.stderr.read()[-3000:]
            assert time.monotonic() < give_up, "no SFT checkpoint written"
            time.sleep(0.1)
        below = psutil.Process(trainer.pid).children(recursive=True)
        assert any(p.name().startswith("VLLM") for p in below), [p.name() for p in below]
        trainer.send_signal(signal.SIGTERM)
        _, stderr = trainer.communicate(timeout=RUN_HANG_S)
        assert trainer.returncode == 143, stderr[-3000:]
        assert "stopped by SIGTERM; the same command resumes from " in stderr, stderr[-3000:]
        assert str(checkpoints / "sft-") in stderr, stderr[-3000:]
        _, alive = psutil.wait_procs(below, timeout=60)
        assert alive == [], f"left running: {[(p.pid, p.name()) for p in alive]}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for process in below:
            with contextlib.suppress(psutil.Error):
                process.kill()
