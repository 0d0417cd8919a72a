"""A progress bar over a rollout's trees, for the commands that roll out at a terminal
(`rlmtrain rollout`, `rlmtrain eval`): trees done, and the engine's tokens/s and occupancy since
the bar began."""

from __future__ import annotations

import sys
import time
from typing import Any

import msgspec

from rlmtrain.rlm.records import Trajectory
from rlmtrain.rollout.metrics import occupancy_between


class RolloutProgress:
    """A tqdm bar over trees; its postfix reads the engine's counters."""

    def __init__(self, total: int, engine: Any) -> None:
        from tqdm import tqdm

        self.engine = engine
        # A copy: engines hand out their live counters.
        self.start = msgspec.structs.replace(engine.stats())
        self.began = time.perf_counter()
        self.bar = tqdm(total=total, desc="rollout", unit="tree", file=sys.stderr)

    def tree_done(self, root: Trajectory) -> None:
        stats = self.engine.stats()
        elapsed = time.perf_counter() - self.began
        occupancy, _ = occupancy_between(self.start, stats)
        self.bar.set_postfix(
            tok_s=f"{(stats.generated_tokens - self.start.generated_tokens) / elapsed:.0f}",
            occupancy=f"{occupancy:.0%}",
        )
        self.bar.update()

    def close(self) -> None:
        self.bar.close()
