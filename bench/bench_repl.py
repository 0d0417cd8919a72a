"""REPL workers: session start, exec round trip, memory per idle worker, sessions per 8 GiB;
the start of a zygote's process beside a large trainer.

One zygote holds a 100 MB context (a str, as an environment's document would be). Figures:
- session start = `await zygote.session()`: fork from the zygote, jail, first `Ready` frame;
- exec round trip = `await session.exec("x = 1")`: frame out, exec, frame back;
- memory per idle worker from /proc/<pid>/smaps_rollup of 200 live workers that have each run
  one exec: USS (private clean + dirty) is what a worker adds, PSS its fair share of pages
  shared with the zygote and its siblings;
- sessions per 8 GiB: extrapolated as (8 GiB - zygote RSS) / mean USS; 200 are started, not
  thousands, to stay polite on a shared machine.
- a child's start beside a 1.5 GB trainer under uvloop: the REPL's `Child.start` (vfork)
  against the loop's own subprocess start (fork), start to exit of `/bin/true`.
Targets: start p50 <= 10 ms, round trip p50 <= 1 ms, >= 500 sessions in 8 GiB.

    python -m pytest bench/bench_repl.py --benchmark-only -s
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest
import torch
import uvloop

from rlmtrain.rlm.repl import ReplLimits, Zygote
from rlmtrain.rlm.spawn import Child

CONTEXT_BYTES = 100 << 20
IDLE_WORKERS = 200
START_ROUNDS = 200
EXEC_ROUNDS = 2000
BUDGET_BYTES = 8 << 30


def smaps_rollup_kib(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


@pytest.fixture(scope="module")
def loop_and_zygote():
    loop = asyncio.new_event_loop()
    zygote = loop.run_until_complete(
        Zygote.start(
            context="x" * CONTEXT_BYTES,
            tool_modules=["textwrap"],
            limits=ReplLimits(memory_mb=1024),
        )
    )
    yield loop, zygote
    loop.run_until_complete(zygote.close())
    loop.close()


def test_session_start(benchmark, loop_and_zygote):
    loop, zygote = loop_and_zygote
    open_sessions = []
    samples = []

    def close_previous():
        while open_sessions:
            loop.run_until_complete(open_sessions.pop().close())

    def start():
        started = time.perf_counter()
        open_sessions.append(loop.run_until_complete(zygote.session()))
        samples.append(time.perf_counter() - started)

    benchmark.pedantic(start, setup=close_previous, rounds=START_ROUNDS, iterations=1)
    close_previous()
    figures = {
        "context_mb": CONTEXT_BYTES >> 20,
        "start_p50_ms": np.percentile(samples, 50) * 1e3,
        "start_p99_ms": np.percentile(samples, 99) * 1e3,
        "starts_per_s": 1 / statistics.mean(samples),
    }
    benchmark.extra_info.update(figures)
    print(
        f"\nsession start (fork from a zygote holding {figures['context_mb']} MB, jail, ready): "
        f"p50 {figures['start_p50_ms']:.2f} ms, p99 {figures['start_p99_ms']:.2f} ms "
        f"(target p50 <= 10 ms)"
    )


def test_exec_round_trip(benchmark, loop_and_zygote):
    loop, zygote = loop_and_zygote
    session = loop.run_until_complete(zygote.session())
    samples = []

    def round_trip():
        started = time.perf_counter()
        result = loop.run_until_complete(session.exec("x = 1"))
        samples.append(time.perf_counter() - started)
        assert not result.error

    benchmark.pedantic(round_trip, rounds=EXEC_ROUNDS, iterations=1, warmup_rounds=20)
    loop.run_until_complete(session.close())
    figures = {
        "round_trip_p50_us": np.percentile(samples, 50) * 1e6,
        "round_trip_p99_us": np.percentile(samples, 99) * 1e6,
        "execs_per_s": 1 / statistics.mean(samples),
    }
    benchmark.extra_info.update(figures)
    print(
        f"\nexec round trip of 'x = 1': p50 {figures['round_trip_p50_us']:.0f} us, "
        f"p99 {figures['round_trip_p99_us']:.0f} us, {figures['execs_per_s']:.0f} execs/s "
        f"(target p50 <= 1 ms)"
    )


def test_memory_per_idle_worker(benchmark, loop_and_zygote):
    loop, zygote = loop_and_zygote

    async def start_idle_workers():
        sessions = [await zygote.session() for _ in range(IDLE_WORKERS)]
        for session in sessions:
            assert not (await session.exec("x = len(context)")).error
        return sessions

    sessions = benchmark.pedantic(
        lambda: loop.run_until_complete(start_idle_workers()), rounds=1, iterations=1
    )
    rollups = [smaps_rollup_kib(s.pid) for s in sessions]
    zygote_rss_kib = smaps_rollup_kib(zygote._process.pid)["Rss"]
    for session in sessions:
        loop.run_until_complete(session.close())
    uss = [r["Private_Clean"] + r["Private_Dirty"] for r in rollups]
    pss = [r["Pss"] for r in rollups]
    mean_uss_bytes = statistics.mean(uss) * 1024
    fit = int((BUDGET_BYTES - zygote_rss_kib * 1024) / mean_uss_bytes)
    figures = {
        "workers": IDLE_WORKERS,
        "context_mb": CONTEXT_BYTES >> 20,
        "zygote_rss_mib": zygote_rss_kib / 1024,
        "uss_mean_mib": statistics.mean(uss) / 1024,
        "uss_max_mib": max(uss) / 1024,
        "pss_mean_mib": statistics.mean(pss) / 1024,
        "sessions_in_8gib_from_uss": fit,
    }
    benchmark.extra_info.update(figures)
    print(
        f"\n{IDLE_WORKERS} idle workers beside a zygote of {figures['zygote_rss_mib']:.0f} MiB RSS "
        f"({figures['context_mb']} MB context): USS mean {figures['uss_mean_mib']:.2f} MiB "
        f"(max {figures['uss_max_mib']:.2f}), PSS mean {figures['pss_mean_mib']:.2f} MiB; "
        f"sessions in 8 GiB, extrapolated from USS: {fit} (target >= 500)"
    )


TRAINER_BYTES = 3 << 29
SPAWN_ROUNDS = 20


def test_child_start_beside_a_large_trainer(benchmark):
    """A child's start from a process holding 1.5 GB (a trainer with its model and KV cache),
    under uvloop as the trainer runs: `Child.start` (Popen, vfork) against uvloop's own
    subprocess start (libuv, fork), each to the exit of `/bin/true`."""
    # Written, so resident; a torch tensor as the trainer's memory is: numpy's large arrays ask
    # for huge pages, whose page tables a fork copies in a tenth of the time.
    held = torch.ones(TRAINER_BYTES // 4)
    loop = uvloop.new_event_loop()

    async def through_child():
        await Child.start(["/bin/true"]).wait()

    async def through_the_loop():
        await (await asyncio.create_subprocess_exec("/bin/true")).wait()

    def timed(start) -> list[float]:
        samples = []
        for _ in range(SPAWN_ROUNDS):
            began = time.perf_counter()
            loop.run_until_complete(start())
            samples.append(time.perf_counter() - began)
        return samples

    try:
        forked = timed(through_the_loop)
        vforked = benchmark.pedantic(lambda: timed(through_child), rounds=1, iterations=1)
    finally:
        loop.close()
    figures = {
        "resident_mb": held.numel() * 4 >> 20,
        "child_start_p50_ms": np.percentile(vforked, 50) * 1e3,
        "uvloop_start_p50_ms": np.percentile(forked, 50) * 1e3,
    }
    benchmark.extra_info.update(figures)
    print(
        f"\nstart to exit of /bin/true from a process holding {figures['resident_mb']} MB, "
        f"under uvloop: Child.start (vfork) p50 {figures['child_start_p50_ms']:.1f} ms, "
        f"uvloop's subprocess (fork) p50 {figures['uvloop_start_p50_ms']:.1f} ms"
    )
