"""What one rollout measured: engine occupancy over time, throughput, tree latency, tree shape.

The scheduler samples the engine's counters (`EngineStats`) on a timer while a rollout runs;
occupancy over an interval is the share of the engine's batch slots its steps used
(d batch_slots_used / (d steps * max_batch_size)), and busy is the share of wall time it spent
inside steps. Both come from counters, so a sample interval never misses a step. Tree latency
runs from a root's admission to the end of its last trajectory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np

from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout.engine import EngineStats

__all__ = ["OccupancySample", "RolloutMetrics", "occupancy_between", "summarize"]


class OccupancySample(msgspec.Struct, kw_only=True, array_like=True):
    t: float
    """Seconds since the rollout started."""
    occupancy: float
    """Share of the batch slots used by the steps of the last interval (0..1)."""
    busy: float
    """Share of the last interval the engine spent stepping (0..1)."""
    running: int
    waiting: int
    """Requests queued inside the engine at the sample time."""


class RolloutMetrics(msgspec.Struct, kw_only=True):
    wall_s: float
    trees: int
    trajectories: int
    generated_tokens: int
    tokens_per_s: float
    engine_occupancy: float
    """Share of the batch slots used, over the whole rollout."""
    engine_busy: float
    """Share of the wall time the engine spent stepping."""
    tree_latency_p50_s: float
    tree_latency_p90_s: float
    tree_latency_max_s: float
    children_per_root_mean: float
    children_per_root_max: int
    finish_reasons: dict[str, int]
    """Over every trajectory, roots and descendants."""
    timeline: list[OccupancySample] = []

    def line(self) -> str:
        """A one-line summary for logs."""
        reasons = " ".join(f"{k}={v}" for k, v in sorted(self.finish_reasons.items()))
        return (
            f"{self.trees} trees, {self.trajectories} trajectories in {self.wall_s:.1f} s; "
            f"{self.tokens_per_s:.0f} tok/s; occupancy {self.engine_occupancy:.0%}, "
            f"busy {self.engine_busy:.0%}; tree latency p50 {self.tree_latency_p50_s:.2f} s, "
            f"p90 {self.tree_latency_p90_s:.2f} s, max {self.tree_latency_max_s:.2f} s; "
            f"children/root {self.children_per_root_mean:.1f} (max "
            f"{self.children_per_root_max}); {reasons}"
        )


def _percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated; 0.0 for no values."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def occupancy_between(before: EngineStats, after: EngineStats) -> tuple[float, float]:
    """(slot occupancy, seconds busy) of the steps between two samples of the counters."""
    steps = after.steps - before.steps
    slots = after.batch_slots_used - before.batch_slots_used
    occupancy = slots / (steps * after.max_batch_size) if steps and after.max_batch_size else 0.0
    return occupancy, after.busy_s - before.busy_s


def summarize(
    groups: Sequence[RolloutGroup],
    *,
    wall_s: float,
    tree_latencies_s: Sequence[float],
    start: EngineStats,
    end: EngineStats,
    timeline: list[OccupancySample],
) -> RolloutMetrics:
    trajectories = [t for g in groups for t in g.trajectories]
    roots = [t for t in trajectories if t.parent_id is None]
    descendants = Counter(t.root_id for t in trajectories if t.parent_id is not None)
    children = [descendants[r.id] for r in roots]
    generated = sum(len(turn.completion_ids) for t in trajectories for turn in t.turns)
    occupancy, busy_s = occupancy_between(start, end)
    return RolloutMetrics(
        wall_s=wall_s,
        trees=len(roots),
        trajectories=len(trajectories),
        generated_tokens=generated,
        tokens_per_s=generated / wall_s if wall_s > 0 else 0.0,
        engine_occupancy=occupancy,
        engine_busy=busy_s / wall_s if wall_s > 0 else 0.0,
        tree_latency_p50_s=_percentile(tree_latencies_s, 50),
        tree_latency_p90_s=_percentile(tree_latencies_s, 90),
        tree_latency_max_s=max(tree_latencies_s, default=0.0),
        children_per_root_mean=sum(children) / len(children) if children else 0.0,
        children_per_root_max=max(children, default=0),
        finish_reasons=dict(Counter(t.finish_reason for t in trajectories)),
        timeline=timeline,
    )
