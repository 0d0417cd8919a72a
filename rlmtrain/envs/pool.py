"""The process pool envs render and parse PDFs in.

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
from concurrent.futures import ProcessPoolExecutor


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of `workers` forks of this process, which holds no garbage when they fork (they
    do at the pool's first task)."""
    gc.collect()
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
