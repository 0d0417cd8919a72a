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


async def _no_processes_left(cls, **kwargs):
    raise BlockingIOError(11, "Resource temporarily unavailable")


if __name__ == "__main__":
    failing = {int(rank) for rank in sys.argv[1].split(",")}
    if int(os.environ.get("RANK", "0")) in failing:
        repl.Zygote.start = classmethod(_no_processes_left)
    sys.exit(main(sys.argv[2:]))
