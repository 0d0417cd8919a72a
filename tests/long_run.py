"""A training run that goes on long enough to be interrupted: the shortened default with 200 RL
steps and a checkpoint after every one, started in the background (`start`), and a wait for one
of its checkpoints (`until_checkpoint`), the point where a test then stops, kills or hangs it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from clocks import RUN_HANG_S

ROOT = Path(__file__).resolve().parents[1]


def start(run: Path, head: list[str], *overrides: str, **popen: Any) -> subprocess.Popen:
    """`head` (an interpreter, or torchrun's line) running `rlmtrain train` into `run`, its
    stderr piped (text), one thread a rank."""
    command = [*head, "-m", "rlmtrain", "train", "--config", "configs/tiny-cpu.toml"]
    command += [f"--checkpoint.dir={run}", "--data.sft_groups=3", "--data.synth_groups=2"]
    command += ["--data.eval_groups=1", "--train.sft_steps=2", "--train.steps=200"]
    command += ["--train.tasks_per_step=2", "--rollout.n_samples=2", "--eval.every=0"]
    command += ["--logging.progress=false", "--checkpoint.every=1", *overrides]
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen,
    )  # fmt: skip


def until_checkpoint(job: subprocess.Popen, run: Path, name: str) -> None:
    """Wait until the run has written checkpoint `name` whole; the run must still be going."""
    complete = run / "checkpoints" / name / "COMPLETE"
    give_up = time.monotonic() + RUN_HANG_S
    while not complete.exists():
        assert job.poll() is None, job.stderr.read()[-3000:]
        assert time.monotonic() < give_up, f"no checkpoint {name}"
        time.sleep(0.05)
