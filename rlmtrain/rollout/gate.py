"""A counting limit whose waiters are served by priority, with a reserve per waiter.

The scheduler puts one in front of the engine (in-flight requests) and one in front of the REPL
(live workers). A waiter asks for a slot with a priority (lower first; the scheduler uses
(batch, -depth, tree order), so an earlier batch's calls go first, deeper calls unblock their
parents first and older trees finish first)
and a reserve: it is granted only if at least `reserve` slots stay free afterwards.

The reserve is what keeps the worker limit free of deadlock. A parent holds its worker while it
waits for its children, so if parents could take every slot, the children they wait for would
never start (the starvation of a fixed thread pool that public RLM code has). A trajectory at
depth d reserves `max_depth - d` slots: whenever all workers are held by waiting parents, at
least one slot is free for the deepest level that has a waiting parent, whose children either
finish (the deepest REPL level spawns no REPL children) or, by the same rule, find a slot.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

__all__ = ["PriorityGate"]


class PriorityGate:
    """`capacity` slots; `async with gate.slot(priority, reserve=0): ...` holds one."""

    def __init__(self, capacity: int, name: str) -> None:
        if capacity < 1:
            raise ValueError(f"{name}: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.name = name
        self.held = 0
        self._waiters: list[tuple[Any, int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(not future.done() for *_, future in self._waiters)

    @asynccontextmanager
    async def slot(self, priority: Any, *, reserve: int = 0) -> AsyncIterator[None]:
        if reserve >= self.capacity:
            raise ValueError(
                f"{self.name}: a reserve of {reserve} slots leaves none of {self.capacity} to take"
            )
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), reserve, future))
        self._grant()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as we were cancelled
                self._release()
            else:
                future.cancel()
                self._grant()  # a cancelled head may have blocked others
            raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self.held -= 1
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            _, _, reserve, future = self._waiters[0]
            if future.done():
                heapq.heappop(self._waiters)
                continue
            if self.capacity - self.held - 1 < reserve:
                return
            heapq.heappop(self._waiters)
            self.held += 1
            future.set_result(None)
