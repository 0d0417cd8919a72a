"""A child process started at a cost that does not grow with the trainer, its exit awaited on a
pidfd.

The trainer's event loop is uvloop, whose subprocesses start with libuv's plain fork(): the
kernel copies the page tables of the whole trainer before the child execs, about 90 ms a start
at 1.7 GB resident on a 2-core machine, where the start itself takes 1 ms. The REPL starts a
zygote per task (a default run plays 323 tasks for the SFT teacher and about 200 more in its
rollouts and evaluations), and those copies took 47 s of its 377 s (and 54 of its 89 s of system
time). `subprocess.Popen` starts its child with vfork() whenever it may (no preexec_fn, no change
of uid or gid), which shares the parent's memory until the exec and costs the same at any size;
a pidfd then tells the loop when the child has exited, with no watcher thread or signal handler,
as the REPL's workers are awaited.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess


class Child:
    """A started process: `pid`, `await wait()` for its exit status, `kill()`."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen
        self.pid = popen.pid
        # Its pid stays ours until it is reaped here, so the pidfd names this process alone.
        self._pidfd: int | None = os.pidfd_open(popen.pid)
        self._exited: asyncio.Future[None] | None = None

    @classmethod
    def start(cls, args: list[str], **popen_kwargs) -> Child:
        """Start `args` as `subprocess.Popen(args, **popen_kwargs)`; a preexec_fn, user, group
        or extra_groups among them would make Popen fork() the whole trainer again."""
        return cls(subprocess.Popen(args, **popen_kwargs))

    async def wait(self) -> int:
        """The exit status (negative: the signal that ended it), once the process has exited.
        Waiters share one watch of the pidfd: cancelling one leaves the others waiting."""
        if self._exited is None:
            loop = asyncio.get_running_loop()
            self._exited = loop.create_future()
            if self._pidfd is None:  # kill_now reaped it
                self._exited.set_result(None)
            else:
                loop.add_reader(self._pidfd, self._reap)
        await asyncio.shield(self._exited)
        return self._popen.returncode

    def kill(self) -> None:
        """SIGKILL through the pidfd; ProcessLookupError once it has been reaped."""
        if self._pidfd is None:
            raise ProcessLookupError(f"process {self.pid} has already been reaped")
        signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def kill_now(self) -> None:
        """SIGKILL and reap at once, for a start given up before anything waited on it."""
        if self._pidfd is None:
            return
        if self._exited is not None:
            raise RuntimeError("kill_now on a child being waited for: kill() and await wait()")
        signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self._release()

    def _reap(self) -> None:
        # The pidfd turned readable: the process has exited, so the wait in _release does not
        # block.
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._release()
        if not self._exited.done():
            self._exited.set_result(None)

    def _release(self) -> None:
        """Reap the process and close its pidfd; its pid may be reused from here on."""
        self._popen.wait()
        os.close(self._pidfd)
        self._pidfd = None
