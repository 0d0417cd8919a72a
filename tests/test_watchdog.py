"""A run in which no rank makes progress stops, naming the rank that holds it up (`watchdog`).

The verdicts are driven round by round on a clock the test moves (`Watchdog.check`, several
ranks sharing one in-memory store), so no test races the wall clock; the stops themselves run
for real in a subprocess (a SIGTERM its main thread unwinds with, or a forced exit from a
collective with its child processes ended), and under torchrun with one rank SIGSTOPped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import long_run
import pytest
import torch.distributed as dist
from clocks import HANG_S, RUN_HANG_S

from rlmtrain import watchdog
from rlmtrain.watchdog import Progress, Watchdog

ROOT = Path(__file__).resolve().parents[1]
STALL_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ranks(size: int, store=None, clock=None) -> tuple[list[Watchdog], list[Progress], Clock]:
    store = store if store is not None else dist.HashStore()
    clock = clock or Clock()
    progress = [Progress(phase=f"rl step 3 on {r}") for r in range(size)]
    dogs = [
        Watchdog(store, r, size, STALL_S, progress=progress[r], on_stall=None, clock=clock)
        for r in range(size)
    ]
    return dogs, progress, clock


def _round(dogs: list[Watchdog], clock: Clock, seconds: float, ranks=None) -> list[str | None]:
    """`seconds` pass, then every rank in `ranks` (all by default) checks once."""
    clock.now += seconds
    return [dog.check() for r, dog in enumerate(dogs) if ranks is None or r in ranks]


def test_a_run_whose_ranks_mark_progress_is_never_stalled():
    dogs, progress, clock = _ranks(3)
    _round(dogs, clock, 0)
    for _ in range(20):  # one rank works, the others wait for it in a collective
        progress[1].marks += 1
        with_waits = [p for r, p in enumerate(progress) if r != 1]
        for p in with_waits:
            p.waiting = "all_gather"
        assert _round(dogs, clock, STALL_S - 1) == [None, None, None]


def test_the_longest_work_without_a_mark_leaves_out_the_waits():
    clock = Clock()
    progress = Progress(clock=clock)
    progress.restart()
    clock.now += 3
    progress.begin("rl step 0: rollout")  # 3 s of work before it
    with progress.wait("all_gather"):
        clock.now += 50  # another rank's work
    clock.now += 7
    progress.mark()
    assert progress.take_longest() == 7
    assert progress.take_longest() == 0  # taken: it starts again


def _until_stalled(dogs, clock, ranks=None, step_s: float = 10) -> tuple[float, list]:
    """Rounds `step_s` apart until a rank reports a stall: how long that took, and every rank's
    verdict in that round (a rank reads the others' reports of the round before)."""
    began = clock.now
    while True:
        verdicts = _round(dogs, clock, step_s, ranks)
        if any(v is not None for v in verdicts):
            return clock.now - began, verdicts
        assert clock.now - began < 10 * STALL_S, "never stalled"


def test_a_stopped_rank_is_named_by_the_lowest_rank_still_running():
    dogs, progress, clock = _ranks(3)
    progress[0].waiting = progress[2].waiting = "all_gather"
    _round(dogs, clock, 0)
    _round(dogs, clock, 0)  # each has read every other's first report
    # Rank 1 stops: no heartbeat, no progress; the others wait for it.
    took, (report, also) = _until_stalled(dogs, clock, ranks={0, 2})
    assert took == STALL_S  # nobody has marked since the first reports
    assert "rank 1 is not running" in also  # rank 2 sees it too; one of the two says it
    assert report.startswith("no rank made progress for 60 s (parallel.stall_timeout_s = 60): ")
    assert re.search(
        r"rank 1 is not running \(no heartbeat for \d+ s, last in 'rl step 3 on 1'\)", report
    )
    assert "ranks 0, 2 wait in all_gather" in report
    assert report.endswith("; stopping every rank")


def test_a_rank_stuck_in_its_work_is_told_from_one_that_stopped():
    dogs, progress, clock = _ranks(2)
    progress[1].phase = "rl step 3: training"
    progress[0].waiting = "all_sum"
    _round(dogs, clock, 0)
    _round(dogs, clock, 0)
    # Rank 1's thread beats, its main thread does nothing.
    took, (report, _) = _until_stalled(dogs, clock)
    assert took == STALL_S
    assert "rank 1 runs but made no progress for 60 s (in 'rl step 3: training')" in report
    assert "rank 0 waits in all_sum" in report


def test_progress_on_any_rank_puts_the_stall_off():
    dogs, progress, clock = _ranks(2)
    progress[0].waiting = "all_sum"
    _round(dogs, clock, 0)
    _round(dogs, clock, 0)
    _round(dogs, clock, STALL_S / 2)
    progress[1].marks += 1  # rank 1's work goes on, then stops
    took, _ = _until_stalled(dogs, clock)
    # Seen one round after it happened, a mark moves the bound from there.
    assert took == STALL_S + 10


def test_ranks_waiting_in_different_collectives_are_a_deadlock():
    dogs, progress, clock = _ranks(2)
    progress[0].waiting, progress[1].waiting = "barrier", "all_gather"
    _round(dogs, clock, 0)
    _round(dogs, clock, 0)
    _, (report, _) = _until_stalled(dogs, clock)
    assert "every rank waits, in different collectives" in report
    assert "rank 0 waits in barrier" in report and "rank 1 waits in all_gather" in report


def test_no_verdict_before_every_rank_reports_nor_on_ranks_that_ended():
    dogs, progress, clock = _ranks(3)
    for _ in range(10):  # rank 2 is still starting: it may be working
        assert _round(dogs, clock, STALL_S, ranks={0, 1}) == [None, None]
    _round(dogs, clock, 0)
    # Rank 2 ends its run (done); the two left wait in a barrier.
    dogs[2].end()
    progress[0].waiting = progress[1].waiting = "barrier"
    _, verdicts = _until_stalled(dogs, clock, ranks={0, 1})
    report = next(v for v in verdicts if v)
    assert "rank 2" not in report and "ranks 0, 1 wait in barrier" in report


def test_a_stall_is_said_once_by_the_first_rank_to_see_it():
    said: list[str] = []
    store = dist.HashStore()
    dogs = [Watchdog(store, r, 2, STALL_S, on_stall=said.append) for r in range(2)]
    assert [dog._said_first(f"stalled, as rank {dog.rank} sees it") for dog in dogs] == [
        "stalled, as rank 0 sees it",
        "",
    ]


def test_a_world_of_one_watches_itself_and_refuses_nonsense():
    progress = Progress(phase="rl step 0: rollout")
    clock = Clock()
    dog = Watchdog(None, 0, 1, STALL_S, progress=progress, clock=clock)
    assert dog.check() is None
    clock.now += STALL_S
    report = dog.check()
    assert "rank 0 runs but made no progress for 60 s (in 'rl step 0: rollout')" in report
    with pytest.raises(ValueError, match="need a store"):
        Watchdog(None, 0, 2, STALL_S)
    with pytest.raises(ValueError, match="stall_s must be > 0"):
        Watchdog(None, 0, 1, 0)


def test_waiting_nests_and_counts_its_ends_as_progress():
    before = watchdog.HERE.marks
    with watchdog.waiting("barrier"):
        with watchdog.waiting("all_gather"):
            assert watchdog.HERE.waiting == "all_gather"
        assert watchdog.HERE.waiting == "barrier"
    assert watchdog.HERE.waiting == ""
    assert watchdog.HERE.marks == before + 4


def _stalling(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """A process of one rank watched with a 1.5 s bound, running `body` without progress."""
    code = textwrap.dedent(
        """
        import logging, subprocess, sys, time
        from rlmtrain import watchdog
        from rlmtrain.stops import Terminated, stop_on_sigterm
        logging.basicConfig(level="INFO", format="%(message)s")
        watchdog.phase("a step that hangs")
        child = subprocess.Popen(["sleep", "600"])
        open(sys.argv[1], "w").write(str(child.pid))
        try:
            with stop_on_sigterm(), watchdog.Watchdog(None, 0, 1, 1.5):
        {body}
        except Terminated:
            child.terminate()
            print("unwound", flush=True)
            sys.exit(143)
        """
    ).replace("{body}", textwrap.indent(textwrap.dedent(body), " " * 8))
    pid_file = tmp_path / "child.pid"
    done = subprocess.run(
        [sys.executable, "-c", code, str(pid_file)],
        capture_output=True, text=True, timeout=HANG_S, cwd=ROOT,
    )  # fmt: skip
    child = int(pid_file.read_text())
    give_up = time.monotonic() + HANG_S
    while Path(f"/proc/{child}").exists() and _state(child) != "Z":
        assert time.monotonic() < give_up, "the child process was left running"
        time.sleep(0.05)
    return done


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_stalled_rank_in_python_unwinds_on_its_own_sigterm(tmp_path):
    done = _stalling("time.sleep(600)", tmp_path)
    assert done.returncode == 143, done.stderr
    assert done.stdout.strip() == "unwound", done.stdout + done.stderr  # its cleanup ran
    assert "rank 0 runs but made no progress for " in done.stderr, done.stderr
    assert "(in 'a step that hangs')" in done.stderr, done.stderr


def test_a_stalled_rank_blocked_in_a_collective_exits_and_ends_its_children(tmp_path):
    # In a collective no signal handler runs; the rank exits by force at once, its child
    # processes (an engine's) sent SIGTERM first.
    done = _stalling(
        """
        with watchdog.waiting("all_gather"):
            time.sleep(600)
        """,
        tmp_path,
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "unwound" not in done.stdout
    assert "rank 0 waits in all_gather" in done.stderr, done.stderr


# -- under torchrun ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sigstopped_rank_stops_the_run_and_is_named(tmp_path):
    """Rank 1 SIGSTOPped mid-RL (as a hung device would leave it): rank 0 names it and stops in
    about `parallel.stall_timeout_s`, not the process group's 30 minutes; torchrun ends the job;
    no process the run started is left."""
    import psutil

    run = tmp_path / "run"
    port = str(29400 + os.getpid() % 100)
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    job = long_run.start(run, [*head, "--master_port", port], "--parallel.stall_timeout_s=30")
    below: list[psutil.Process] = []
    try:
        long_run.until_checkpoint(job, run, "rl-000001")
        below = psutil.Process(job.pid).children(recursive=True)
        ranks = psutil.Process(job.pid).children()
        (rank1,) = [p for p in ranks if p.environ().get("RANK") == "1"]
        stopped_at = time.monotonic()
        rank1.send_signal(signal.SIGSTOP)
        _, stderr = job.communicate(timeout=RUN_HANG_S)
        took = time.monotonic() - stopped_at
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0, stderr[-3000:]
    reports = [line for line in stderr.splitlines() if "no rank made progress for" in line]
    assert len(reports) == 1, stderr[-3000:]  # said once, by rank 0
    assert "rank 1 is not running (no heartbeat for" in reports[0], reports[0]
    assert "parallel.stall_timeout_s = 30" in reports[0], reports[0]
    assert took < RUN_HANG_S / 2, took  # far inside the process group's 30 minutes
    _, alive = psutil.wait_procs(below, timeout=HANG_S)
    assert alive == [], f"left running: {[(p.pid, p.name()) for p in alive]}"
