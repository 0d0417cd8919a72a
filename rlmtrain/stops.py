"""Stopping a command on a signal: a SIGTERM (a plain `kill`, a scheduler's cancel, torchrun
stopping the ranks after one failed) unwinds it wherever it is, inside a train step too, so its
cleanup runs (engines closed: vLLM's engine processes would otherwise outlive it, orphaned and
polling a core; REPL zygotes killed and their folders removed; logs and partial files closed).
`rlmtrain.cli` stops every command so; one that can say more (what the same command does next)
catches `Terminated` itself.

Where the signal lands decides how it unwinds:
- outside an event loop, or in the code of the command's main task (a train step): `Terminated`
  is raised right there, and goes up, every `finally` on the way running (on the live loop);
- anywhere else in the loop: in one of its own callbacks (where it processes signals whenever it
  is idle, waiting on engines and REPLs: most of a rollout), an exception would go to the loop's
  exception handler and the command would go on (it did: 2 of 3 SIGTERMed RL runs trained to
  the end and exited 0); in another task, to whoever awaits that task, if anyone does. So the
  main task is cancelled instead: it unwinds from its await, cancelling what it waits on, and
  `run` turns the cancellation into `Terminated` once its cleanup is done.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import uvloop

__all__ = ["Terminated", "run", "stop_on_sigterm", "stopped_by"]

T = TypeVar("T")


class Terminated(BaseException):
    """A SIGTERM: a BaseException, like KeyboardInterrupt, so no `except Exception` on the way
    swallows it."""


class _Main:
    """The main task of the command's event loop (`run`), and whether a SIGTERM stopped it."""

    task: asyncio.Task | None = None
    stopped = False


def _on_sigterm(signum: int, frame: object) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise Terminated from None  # no event loop: plain code, unwound by the exception
    main = _Main.task
    if main is None or main.done() or asyncio.current_task(loop) is main:
        raise Terminated  # the main task's own code (a train step): unwound where it runs
    # A loop callback, or another task (one nobody may await: the exception would be lost in
    # it): the main task unwinds from its await, cancelling the tasks it waits on.
    _Main.stopped = True
    main.cancel()


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """A SIGTERM stops the command while inside (see the module's docstring)."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(main: Coroutine[Any, Any, T]) -> T:
    """`main` to its end on a fresh uvloop event loop; a SIGTERM that cancelled it (from one
    of the loop's callbacks or another task) raises `Terminated` here, after its cleanup."""

    async def marked() -> T:
        _Main.task = asyncio.current_task()
        return await main

    _Main.stopped = False
    try:
        result = uvloop.run(marked())
    except asyncio.CancelledError:
        if _Main.stopped:
            raise Terminated from None
        raise
    except BaseExceptionGroup as group:
        # Raised in the main task inside a TaskGroup (the scheduler's), it may come wrapped.
        if group.subgroup(Terminated) is None and not _Main.stopped:
            raise
        raise Terminated from None
    finally:
        _Main.task = None
    if _Main.stopped:  # the cancellation met an await that took its result instead
        raise Terminated
    return result


def stopped_by(stop: BaseException) -> signal.Signals:
    """The signal behind a `Terminated` (SIGTERM) or a KeyboardInterrupt (SIGINT, Ctrl-C)."""
    return signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT
