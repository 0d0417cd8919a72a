"""A run in which no rank makes progress is stopped, naming the rank that holds it up.

A rank that hangs (its process stopped, a device kernel that never returns, a deadlock among its
threads) leaves every other rank waiting in its next collective, where the process group's
timeout (30 minutes) would end the run with an error naming a rank that waits, not the one that
hangs; a one-process run would hang for good.

So each rank says what it is doing: `phase` names the work (an RL step's rollout), `mark` counts
a piece of it done (an engine's completion, a micro-batch, a parameter gathered), and `waiting`
brackets a wait for the other ranks on purpose (`parallel`'s collectives, an inference rank's
wait for RL to begin). A `Watchdog` thread on each rank publishes that with a heartbeat to the
launch's store, reads every rank's, and times each change it sees on its own clock (nodes'
clocks need not agree). While any rank marks progress the run goes on: one rank's long phase
with the others waiting for it is no stall as long as it marks its work. When no rank has marked
for `parallel.stall_timeout_s`, the run is stalled: the first rank to see it logs one line
saying which ranks wait and in what, and which do not (no heartbeat: a process stopped or gone;
a heartbeat but no progress: stuck inside its work), and each rank stops itself. A rank whose
main thread can run Python is sent SIGTERM and unwinds with its cleanup (`stops`); one blocked
where no handler runs (in a collective, or still there after a grace) sends its child processes
SIGTERM and exits, 128 + SIGTERM as a SIGTERM's stop would.

No rank is quiet longer than the longest time a rank works without a mark (outside its waits),
which the step rows log, as the largest over the ranks (`progress_gap_s`): the bound's margin
is measured on every run, not guessed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Progress", "Watchdog", "longest_unmarked", "mark", "phase", "waiting"]

log = logging.getLogger("rlmtrain.watchdog")

_STALLED = "stalled"
_MAX_INTERVAL_S = 10.0
"""How often a rank publishes and reads at most: a stall is seen within this of its bound."""
_GRACE_S = 15.0
"""How long a rank sent SIGTERM by its own watchdog has to unwind before it exits by force."""
_NO_HEARTBEAT_BEATS = 5
"""Heartbeats missed before a rank is said not to run: a busy interpreter delays a few."""


@dataclass
class Progress:
    """What a rank is doing: the phase, the pieces of work done, the collective it waits in,
    and the longest it has worked without marking a piece done (a wait does not count: that
    is another rank's work)."""

    phase: str = "starting"
    marks: int = 0
    waiting: str = ""
    clock: Callable[[], float] = time.monotonic
    last_at: float = 0.0
    longest_s: float = 0.0

    def begin(self, what: str) -> None:
        self.mark()
        self.phase = what

    def mark(self) -> None:
        now = self.clock()
        if not self.waiting:
            self.longest_s = max(self.longest_s, now - self.last_at)
        self.last_at = now
        self.marks += 1

    @contextmanager
    def wait(self, what: str) -> Iterator[None]:
        self.mark()
        before, self.waiting = self.waiting, what
        try:
            yield
        finally:
            self.mark()  # the time waited is not counted, as `waiting` was still set
            self.waiting = before

    def take_longest(self) -> float:
        """The longest time worked without a mark since the last call (or the watch's start)."""
        longest, self.longest_s = self.longest_s, 0.0
        return longest

    def restart(self) -> None:
        self.last_at, self.longest_s = self.clock(), 0.0


HERE = Progress()
"""This process's progress, which `phase`, `mark` and `waiting` move."""


def phase(what: str) -> None:
    """This rank begins `what` (read in a stall's report as where it was)."""
    HERE.begin(what)


def mark() -> None:
    """A piece of this rank's work is done."""
    HERE.mark()


def waiting(what: str) -> AbstractContextManager[None]:
    """This rank waits for the others in `what` (a collective): reaching it and leaving it are
    progress, the wait itself is not."""
    return HERE.wait(what)


def longest_unmarked() -> float | None:
    """The longest time this rank worked without marking progress since the last call, in
    seconds; None when no watchdog runs here."""
    return HERE.take_longest() if _RUNNING else None


_RUNNING: list[Watchdog] = []


@dataclass
class _Seen:
    """A rank as this one has seen it: its last report and when its heartbeat and its progress
    last changed, on this rank's clock."""

    report: dict[str, Any]
    beat_at: float
    progress_at: float


class Watchdog:
    """Watches the progress of `size` ranks through `store` (None: a world of one, which watches
    itself) from a thread of its own; `on_stall(report)` is called once, from that thread, when
    no rank has marked for `stall_s` (by default it stops this rank)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        stall_s: float,
        *,
        progress: Progress = HERE,
        on_stall: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        if store is None and size != 1:
            raise ValueError(f"{size} ranks need a store to watch each other through")
        self.store, self.rank, self.size, self.stall_s = store, rank, size, stall_s
        self.progress = progress
        self.on_stall = on_stall or self._stop_this_rank
        self.clock = clock
        self.interval_s = min(_MAX_INTERVAL_S, stall_s / 30)
        self._beat = 0
        self._seen: dict[int, _Seen] = {}
        self._last_progress = clock()
        self._stop = threading.Event()
        self._stalled = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if _RUNNING:
            raise RuntimeError("a watchdog already runs in this process")
        self.progress.restart()
        self.check()  # published before the thread starts: the others may read it at once
        self._thread = threading.Thread(target=self._watch, name="rlmtrain-watchdog", daemon=True)
        self._thread.start()
        _RUNNING.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _RUNNING.remove(self)
        self._stop.set()
        if self._thread is not None and not self._stalled:
            self._thread.join()  # a stopping one is left to end the process if it must
        self.end()

    def end(self) -> None:
        """Tell the others this rank has ended: it holds nobody up, and its silence is no
        stall."""
        if self.store is not None:
            # A store gone means the launcher is ending the run: nobody is left to tell.
            with suppress(RuntimeError):
                self.store.set(self._key(self.rank), json.dumps({"done": True}))

    def check(self) -> str | None:
        """One round: publish this rank's report, read the others', and return the stall's
        report if no rank has marked for `stall_s` (the thread calls it every `interval_s`)."""
        now = self.clock()
        self._beat += 1
        mine = {
            "beat": self._beat,
            "phase": self.progress.phase,
            "marks": self.progress.marks,
            "waiting": self.progress.waiting,
        }
        reports = {self.rank: mine}
        if self.store is not None:
            self.store.set(self._key(self.rank), json.dumps(mine))
            reports.update(self._read_others())
        for rank, report in reports.items():
            seen = self._seen.get(rank)
            if seen is None:
                self._seen[rank] = _Seen(report, now, now)
                self._last_progress = now
                continue
            if report.get("beat") != seen.report.get("beat"):
                seen.beat_at = now
            if (report.get("marks"), report.get("waiting")) != (
                seen.report.get("marks"),
                seen.report.get("waiting"),
            ):
                seen.progress_at = now
                self._last_progress = now
            seen.report = report
        if len(self._seen) < self.size:
            # A rank not watched yet (its start is slower) may be working: nothing to judge.
            self._last_progress = now
        quiet = now - self._last_progress
        if quiet < self.stall_s:
            return None
        return self._report(now, quiet)

    def _read_others(self) -> dict[int, dict[str, Any]]:
        others = [r for r in range(self.size) if r != self.rank]
        keys = [self._key(r) for r in others]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
            return {r: json.loads(v) for r, v in zip(others, values, strict=True)}
        # Not every rank has published yet: a get would wait for the missing ones.
        present = [(r, k) for r, k in zip(others, keys, strict=True) if self.store.check([k])]
        return {r: json.loads(self.store.get(k)) for r, k in present}

    def _report(self, now: float, quiet: float) -> str:
        """Which ranks wait in what, which do not and why, as this rank sees them (a verdict
        needs every rank seen)."""
        no_heartbeat_s = _NO_HEARTBEAT_BEATS * self.interval_s
        running = [r for r in range(self.size) if not self._seen[r].report.get("done")]
        waits: dict[str, list[int]] = {}
        holding: list[str] = []
        for rank in running:
            seen = self._seen[rank]
            where = f"'{seen.report['phase']}'"
            if now - seen.beat_at >= no_heartbeat_s:
                holding.append(
                    f"rank {rank} is not running (no heartbeat for {now - seen.beat_at:.0f} s, "
                    f"last in {where})"
                )
            elif seen.report["waiting"]:
                waits.setdefault(seen.report["waiting"], []).append(rank)
            else:
                holding.append(
                    f"rank {rank} runs but made no progress for {now - seen.progress_at:.0f} s "
                    f"(in {where})"
                )
        waited = [
            f"{_ranks(ranks)} wait{'s' if len(ranks) == 1 else ''} in {what}"
            for what, ranks in waits.items()
        ]
        if not holding and len(waits) > 1:
            holding.append("every rank waits, in different collectives")
        return (
            f"no rank made progress for {quiet:.0f} s (parallel.stall_timeout_s = "
            f"{self.stall_s:g}): " + "; ".join(holding + waited) + "; stopping every rank"
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                report = self.check()
            except Exception as exc:  # the store gone: the launcher is ending the run
                log.warning("the watchdog stopped watching: %s", exc)
                return
            if report is not None:
                self._stalled = True
                self.on_stall(self._said_first(report))
                return

    def _said_first(self, report: str) -> str:
        """`report` on the first rank to see the stall, "" on the others: it is said once."""
        if self.store is None:
            return report
        return report if self.store.compare_set(_STALLED, "", report) == report.encode() else ""

    def _stop_this_rank(self, report: str) -> None:
        if report:
            log.error(report)
        if not self.progress.waiting:
            # Its main thread may be in Python, where the SIGTERM unwinds it with its cleanup.
            # If it does, the process ends before the grace does.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
            time.sleep(_GRACE_S)
        # Blocked where no signal handler runs (in a collective, stuck inside its work), or its
        # cleanup waits on a rank that will not come.
        for child in _children():  # an engine's processes shut down their own on SIGTERM
            with suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)
        logging.shutdown()
        os._exit(128 + signal.SIGTERM)

    def _key(self, rank: int) -> str:
        return f"rank/{rank}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _children() -> list[int]:
    """This process's child processes (an engine's, the REPL zygotes)."""
    found: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        with suppress(OSError):  # a thread that ended meanwhile
            found += [int(pid) for pid in (task / "children").read_text().split()]
    return found
