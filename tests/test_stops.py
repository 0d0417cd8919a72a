"""A run stopped by a signal stops: a plain `kill` (SIGTERM: a scheduler's cancel, torchrun
stopping the ranks after one failed) or Ctrl-C (SIGINT), wherever the run is, and says in its
last line what the same command does next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import long_run
import pytest
from clocks import RUN_HANG_S

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("where", ["in the idle loop", "in a task", "in a task group"])
def test_a_sigterm_stops_the_loop_s_main_task_after_its_cleanup(where):
    """The loop processes a signal that comes while it is idle (waiting on engines and REPLs,
    most of a rollout) in a callback of its own, and hands an exception raised there to its
    exception handler: the run went on. Raised in a task, it goes up the awaits. Either way the
    main task's cleanup runs to its end on the live loop (a shielded close included), then
    `Terminated` reaches the caller."""
    code = textwrap.dedent(
        f"""
        import asyncio, os, signal, threading
        from rlmtrain import stops

        async def close():
            await asyncio.sleep(0.2)
            print("closed")

        async def tree():
            os.kill(os.getpid(), signal.SIGTERM)  # in one of a group's tasks (a scheduler's tree)
            await asyncio.sleep(5)

        async def rollout():
            try:
                if {where == "in the idle loop"!r}:  # from another thread, while the loop waits
                    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
                elif {where == "in a task group"!r}:
                    async with asyncio.TaskGroup() as group:
                        group.create_task(tree())
                        group.create_task(asyncio.sleep(5))
                else:
                    os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(5)
            finally:
                await asyncio.shield(asyncio.ensure_future(close()))

        try:
            with stops.stop_on_sigterm():
                stops.run(rollout())
            print("went on")
        except stops.Terminated:
            print("stopped")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["closed", "stopped"], done.stdout + done.stderr
    assert "Task was destroyed" not in done.stderr, done.stderr


def _interruptible() -> None:
    """Ctrl-C's default back: a process started with SIGINT ignored (a test runner's worker, a
    background job of a script) passes that on, and Python then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signalled_during_rl(run: Path, signum: int, head: list[str]) -> tuple[int, str]:
    """A run of 200 RL steps given `signum` after its second RL checkpoint, mid-rollout: its
    exit code and stderr."""
    trainer = long_run.start(run, head, preexec_fn=_interruptible)
    try:
        long_run.until_checkpoint(trainer, run, "rl-000002")
        trainer.send_signal(signum)
        _, stderr = trainer.communicate(timeout=RUN_HANG_S)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    return trainer.returncode, stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_signalled_during_rl_stops_saying_what_comes_next(tmp_path, signum):
    """Exit 128 + the signal's number, the last line naming the checkpoint to resume from
    (SIGTERM was ignored in 2 of 3 such runs, which trained to the end and exited 0; SIGINT
    printed a traceback)."""
    run = tmp_path / "run"
    returncode, stderr = _signalled_during_rl(run, signum, [sys.executable])
    assert returncode == 128 + signum, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signum.name}; the same command resumes from "), last
    assert str(run / "checkpoints" / "rl-") in last, last
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not (run / "final").exists()  # it stopped: 200 steps would have ended in an export


@pytest.mark.slow
def test_torchrun_s_sigterm_stops_every_rank_by_itself(tmp_path):
    """A cancelled job: torchrun passes SIGTERM to its ranks, and SIGKILLs those still running
    30 s later, skipping their cleanup (the engine's processes, the REPLs). Each rank stops by
    itself and says so (both ranks ignored it and trained on until the SIGKILL)."""
    port = str(29900 + os.getpid() % 100)
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    returncode, stderr = _signalled_during_rl(
        tmp_path / "run", signal.SIGTERM, [*head, "--master_port", port]
    )
    assert returncode != 0, stderr[-3000:]
    stops = [line for line in stderr.splitlines() if line.startswith("stopped by SIGTERM; ")]
    assert len(stops) == 2, stderr[-3000:]  # one from each rank
    assert "forcefully exiting via 9" not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_a_sigterm_stops_any_command_after_its_cleanup(tmp_path):
    """`rlmtrain rollout` SIGTERMed midway: its engine and REPL zygotes are closed on the way
    (each process it started is gone), the groups that ended stay in --out, and it ends in one
    line, exit 143 (it died at once, by the signal's default)."""
    import psutil

    out = tmp_path / "trees.jsonl"
    command = [sys.executable, "-m", "rlmtrain", "rollout", "--config", "configs/tiny-cpu.toml"]
    command += ["--out", str(out), f"--checkpoint.dir={tmp_path / 'run'}"]
    command += ["--logging.progress=false"]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    below: list[psutil.Process] = []
    try:
        give_up = time.monotonic() + RUN_HANG_S
        while not out.exists() or not out.read_bytes().count(b"\n"):
            assert job.poll() is None, job.stderr.read()[-3000:]
            assert time.monotonic() < give_up, "no group written"
            time.sleep(0.05)
        below = psutil.Process(job.pid).children(recursive=True)
        assert below, "the rollout started no process of its own"
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=RUN_HANG_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    text = stderr.decode()
    assert job.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert text.strip().splitlines()[-1] == "rlmtrain rollout: stopped by SIGTERM", text[-3000:]
    _, alive = psutil.wait_procs(below, timeout=30)
    assert alive == [], f"left running: {[(p.pid, p.name()) for p in alive]}"
    assert out.read_bytes().count(b"\n") >= 1  # what ended before the signal is kept
