"""`rlmtrain train` on a rank whose REPLs cannot start (the machine out of processes): every
tree that rank's scheduler runs fails, as when a node's process table is full.

    torchrun --nproc_per_node 2 tests/failing_repl_train.py RANKS train --config ...

RANKS: the comma-separated ranks whose REPLs fail. `tests/test_distributed.py` runs it.
"""

from __future__ import annotations

import os
import sys

from rlmtrain.cli import main
from rlmtrain.rlm import repl

REFUSED: list[bool] = []
"""The starts refused on this rank: none means the run never reached a REPL here, and whatever
the test then sees of failed trees is not this script's doing."""


async def _no_processes_left(cls, **kwargs):
    REFUSED.append(True)
    raise BlockingIOError(11, "Resource temporarily unavailable")


if __name__ == "__main__":
    failing = int(os.environ.get("RANK", "0")) in {int(r) for r in sys.argv[1].split(",")}
    if failing:
        repl.Zygote.start = classmethod(_no_processes_left)
    code = main(sys.argv[2:])
    if failing and not REFUSED:
        sys.exit("failing_repl_train: no REPL start was refused on this rank")
    sys.exit(code)
