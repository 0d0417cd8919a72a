"""What the tests wait on in place of the wall clock.

`SkippingLoop` is an asyncio loop whose clock a test moves forward: a test of a timeout sets the
timeout long, as a bound on a hang, waits until the run has reached the point where the timeout
must fire, then skips past it, so it fires there whatever the machine's load and no other work
has to beat it. `until` polls for a state, its bound only turning a hang into a failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

HANG_S = 30.0
"""How long a test waits for something that takes milliseconds before calling it a hang."""

RUN_HANG_S = 1800
"""How long a test waits for a whole training or CLI run in a subprocess: a few minutes on two
idle cores, several times that on loaded ones; only a hang should reach this."""


class SkippingLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock a test moves forward (`skip`): the deadlines and timeouts that
    then fall due fire at once, since asyncio reads all of them from `time()`."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped_s = 0.0

    def time(self) -> float:
        return super().time() + self.skipped_s

    def skip(self, seconds: float) -> None:
        self.skipped_s += seconds


def skip(seconds: float) -> None:
    """Move the running `SkippingLoop`'s clock `seconds` forward."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, SkippingLoop), "run the test on clocks.run"
    loop.skip(seconds)


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a `SkippingLoop`."""
    with asyncio.Runner(loop_factory=SkippingLoop) as runner:
        return runner.run(main)


async def until(condition: Callable[[], bool], what: str, bound_s: float = HANG_S) -> None:
    """Poll `condition` until it holds; the bound only turns a hang into a failure."""
    give_up = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < give_up, f"still waiting for {what}"
        await asyncio.sleep(0.01)
