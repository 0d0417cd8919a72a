"""The process pool envs render and parse PDFs in, and the map over it their batch jobs share.

Its workers are forks of the caller, which is cheap (no interpreter to start, no main module
to import again: under `torchrun -m rlmtrain.train` that would be torch, in every worker) and
asks nothing of a script that calls it (no `if __name__ == "__main__"` guard). A fork also
carries the caller's garbage, and a garbage collection in the child frees it there: a gloo
process group that a rank (or a test) left behind joins its worker threads when freed, threads
a forked child does not have, and the worker hangs or crashes, and with it the whole pool. So the
caller's garbage is collected in the caller, where its threads are, before any fork.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def _process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of `workers` forks of this process, which holds no garbage when they fork (they
    do at the pool's first task)."""
    gc.collect()
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))


def map_in_processes(
    fn: Callable[[Item], Result],
    items: Sequence[Item],
    workers: int | None,
    done: Callable[[], None],
) -> list[Result]:
    """`fn` of each item, in order: on `workers` processes (None: one per CPU, never more than
    there are items; 1: in this process), the items dealt about eight chunks a worker; `done`
    called after each result (a progress bar's update)."""
    workers = min(workers or os.cpu_count() or 1, max(1, len(items)))
    results = []
    if workers == 1:
        for item in items:
            results.append(fn(item))
            done()
        return results
    with _process_pool(workers) as pool:
        for result in pool.map(fn, items, chunksize=max(1, len(items) // (workers * 8))):
            results.append(result)
            done()
    return results
