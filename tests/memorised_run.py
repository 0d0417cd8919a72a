"""A run of the default shortened to two tasks, from the tiny model that 130 SFT steps taught
them by heart, for the tests that need RL steps with signal on a CPU in seconds
(`test_resume.py`, `test_inference_ranks.py`): the command lines, the memorised model, and a
whole job SIGKILLed at a checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from clocks import RUN_HANG_S

ROOT = Path(__file__).resolve().parents[1]
PERTURBED = ROOT / "tests" / "perturbed_train.py"


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(ranks: int, perturbed: bool) -> list[str]:
    entry = [str(PERTURBED)] if perturbed else ["-m", "rlmtrain", "train"]
    if ranks == 1:
        return [sys.executable, *entry]
    port = str(29700 + (os.getpid() + 10 * ranks + perturbed) % 1000)
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--master_port", port, *entry,
    ]  # fmt: skip


# The runs compared go on from the memorised model: a few SFT steps (killed in the middle of
# them), then RL steps each playing both tasks once.
MEMORISING_STEPS, SFT_STEPS, RL_STEPS = 130, 8, 4


# Rates of the test's own, not the default's: constant SFT and RL at 3e-4, and RL sampling at
# temperature 1.3, whose trees on these two tasks keep groups with signal in most RL steps (a
# resume that only replays dropped groups would prove little). At temperature 1 the memorised
# model samples the same tree nearly every time: on one CPU 3 of 4 steps had a group with
# signal, on another 1 of 4 (rounding decides the rare slip); at 1.3, 5 of 6 steps had two.
LEARNING = (
    "--train.sft_lr_schedule=same",
    "--train.min_lr_ratio=0",
    "--train.lr=3e-4",
    "--rollout.temperature=1.3",
)


def synth_two_tasks(folder: Path) -> Path:
    """One synthetic paper group's tasks (two questions over two papers) and their corpus."""
    from rlmtrain.envs.synth import synthesize

    synthesize(folder, groups=1, seed=0, first_group=0, max_papers=2, progress=False)
    return folder / "tasks.jsonl"


def run_args(run_dir: Path, tasks: Path, *extra: str) -> list[str]:
    return [
        "--config", "configs/tiny-cpu.toml", f"--checkpoint.dir={run_dir}",
        f"--data.train_path={tasks}", f"--data.sft_path={tasks}",
        f"--train.sft_steps={SFT_STEPS}", f"--train.steps={RL_STEPS}", "--train.tasks_per_step=2",
        "--rollout.n_samples=4", "--eval.every=0", "--logging.progress=false",
        "--logging.tensorboard=false", "--checkpoint.every=1", "--checkpoint.keep=20",
        "--checkpoint.resume=false", *LEARNING, *extra,
    ]  # fmt: skip


def memorise(run: Path, two_tasks: Path) -> tuple[str, ...]:
    """The arguments that start a run from the tiny model after MEMORISING_STEPS SFT steps on
    the two tasks: its exported folder, whose tokenizer the run then reads, and an SFT rate low
    enough that a fresh optimizer's first steps do not undo what it learned."""
    args = run_args(run, two_tasks, f"--train.sft_steps={MEMORISING_STEPS}", "--train.steps=0",
                 "--checkpoint.every=0")  # fmt: skip
    result = subprocess.run(
        [*launch(1, False), *args], cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S,
        env=env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return f"--model.hf_dir={run / 'final'}", "--model.tokenizer=", "--train.sft_lr=1e-4"


def kill_job(pid: int) -> None:
    """SIGKILL the launcher and everything under it at once, as a node failure does: torchrun
    starts each rank in a session of its own, so a process-group kill would miss them."""
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        tree += map(int, children)
        frontier += map(int, children)
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def kill_when(command: list[str], mark: Path, hold_at: str) -> None:
    """Run perturbed `command` until `mark` exists, then SIGKILL the whole job; the job stops
    for good before writing checkpoint `hold_at`, so the kill lands before that one."""
    job = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**env(), "RLMTRAIN_TEST_HOLD_AT": hold_at}, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + RUN_HANG_S
    while not mark.exists():
        assert job.poll() is None, job.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    kill_job(job.pid)
    job.wait()
    job.stderr.close()


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").open()]
