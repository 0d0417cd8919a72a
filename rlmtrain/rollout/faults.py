"""Injected faults, for tests and soak runs: what the world throws at a rollout, on purpose.

    engine = FaultyEngine(SimEngine(...), FaultPlan(engine_error=0.01, engine_hang=0.01))
    scheduler = Scheduler(engine, tokenizer, config,
                          start_zygote=killing_workers(default_start, FaultPlan(worker_kill=0.01)))

`FaultyEngine` wraps any engine: a `generate` call raises `InjectedFault` with probability
`engine_error`, or never returns (until cancelled, as a lost request does) with probability
`engine_hang`. `killing_workers` wraps a zygote starter: an exec's worker is killed with SIGKILL
from outside, while the exec runs, with probability `worker_kill`. Each fault must cost only the
trajectory it hits and the trees above it: an error or timeout finish reason, counted in
`InjectedFaults`, and the rollout goes on. Draws come from one seeded generator per wrapper.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections import Counter
from collections.abc import Iterable
from typing import Any

import msgspec
from torch import Tensor

from rlmtrain.rlm.generation import Completion, SamplingParams
from rlmtrain.rlm.repl import ExecResult, QueryHandler
from rlmtrain.rollout.engine import Engine, EngineStats
from rlmtrain.rollout.scheduler import ReplHost, ReplSession, StartZygote

__all__ = ["FaultPlan", "FaultyEngine", "InjectedFault", "killing_workers"]

_KILL_DELAY_S = (0.0, 0.05)
"""When, after an exec is sent, its worker is killed: while it runs, not before it starts."""


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True):
    engine_error: float = 0.0
    """P(a generate call raises)."""
    engine_hang: float = 0.0
    """P(a generate call never returns)."""
    worker_kill: float = 0.0
    """P(an exec's worker is killed while the exec runs)."""
    seed: int = 0


class InjectedFault(RuntimeError):
    pass


class FaultyEngine:
    """An engine whose `generate` fails as `plan` says; `injected` counts what it did."""

    def __init__(self, engine: Engine, plan: FaultPlan):
        self.engine = engine
        self.plan = plan
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(plan.seed)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        draw = self._rng.random()
        if draw < self.plan.engine_error:
            self.injected["engine_error"] += 1
            raise InjectedFault("injected engine error")
        if draw < self.plan.engine_error + self.plan.engine_hang:
            self.injected["engine_hang"] += 1
            await asyncio.Event().wait()
        return await self.engine.generate(prompt_ids, params)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        await self.engine.update_weights(named_tensors)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def close(self) -> None:
        await self.engine.close()


def killing_workers(
    start_zygote: StartZygote, plan: FaultPlan, injected: Counter[str] | None = None
) -> StartZygote:
    """`start_zygote` whose sessions lose their worker to SIGKILL as `plan` says; kills are
    counted in `injected` under "worker_kill"."""
    rng = random.Random(plan.seed + 1)
    counts = injected if injected is not None else Counter()

    async def start(**kwargs: Any) -> ReplHost:
        return _KillingHost(await start_zygote(**kwargs), plan, rng, counts)

    return start


class _KillingHost:
    def __init__(self, host: ReplHost, plan: FaultPlan, rng: random.Random, counts: Counter[str]):
        self._host, self._plan, self._rng, self._counts = host, plan, rng, counts

    async def session(self, *, context: Any | None = None) -> ReplSession:
        return _KillingSession(await self._host.session(context=context), self)

    def live_workers(self) -> int:
        return self._host.live_workers()

    async def close(self) -> None:
        await self._host.close()


class _KillingSession:
    def __init__(self, session: ReplSession, host: _KillingHost):
        self._session, self._host = session, host

    async def exec(self, code: str, on_query: QueryHandler | None = None) -> ExecResult:
        host = self._host
        if host._rng.random() >= host._plan.worker_kill:
            return await self._session.exec(code, on_query)
        killer = asyncio.create_task(self._kill_soon(host._rng.uniform(*_KILL_DELAY_S)))
        try:
            return await self._session.exec(code, on_query)
        finally:
            # Only while the exec runs: its worker is alive then, so its pid is still its own.
            killer.cancel()

    async def _kill_soon(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._session.pid, signal.SIGKILL)  # from outside, as the OOM killer would
            self._host._counts["worker_kill"] += 1

    async def close(self) -> None:
        await self._session.close()
