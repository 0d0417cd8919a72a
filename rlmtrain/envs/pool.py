"""The process pool envs render and parse PDFs in.

Its workers are forked from a fork server, a small process started clean on first use, never
from the caller. A trainer's rank asks for a pool with threads running (the process group's,
the watchdog's, the progress bar's) and objects that only make sense beside them: a child forked
from it has the objects without the threads, and the first garbage collection in the child that
frees one (a destroyed gloo process group joins its worker threads) hangs or crashes that worker,
and with it the whole pool.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of `workers` processes forked from the fork server, not from this process."""
    return ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("forkserver")
    )
