"""The start's shared-folder check (`launch.check_shared_folder`) on the ranks torchrun starts,
each rank seeing the run folder where it is told:

    torchrun --nproc_per_node 2 tests/shared_folder_ranks.py BASE OUT shared|unshared

`shared`: every rank's folder is BASE. `unshared`: rank r's is BASE/rank<r>, as ranks on nodes
with their own disks see one path and two folders. Each rank writes what the check raised into
OUT/rank<r>.json and exits 0, so torchrun stops no rank (as it does once one fails) before it
has written. `tests/test_launch.py` runs it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlmtrain import parallel
from rlmtrain.launch import LaunchError, check_shared_folder
from rlmtrain.run_folder import RunFolder


def main() -> None:
    base, out, layout = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    world, _ = parallel.start("cpu")
    try:
        folder = RunFolder(base / f"rank{world.rank}" if layout == "unshared" else base).make()
        try:
            check_shared_folder(folder, world)
            error = None
        except LaunchError as exc:
            error = str(exc)
        (out / f"rank{world.rank}.json").write_text(json.dumps({"error": error}))
    finally:
        parallel.stop()


if __name__ == "__main__":
    main()
