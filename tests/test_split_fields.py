"""A split world's step row: the inference ranks' rollout figures merged into one."""

import math

from rlmtrain.training.split import merged_fields, rollout_fields


def test_the_slowest_rollout_every_rank_s_tokens_and_summed_counts():
    busy = {
        "rollout_s": 3.0, "generated_tokens": 120, "engine_tokens_per_s": 40.0,
        "engine_occupancy": 0.5, "finish_reasons": {"final": 3, "max_turns": 1},
        "children_per_root": 1.0, "spawn_rate": 0.5,
    }  # fmt: skip
    slower = {**busy, "rollout_s": 5.0, "generated_tokens": 80, "finish_reasons": {"final": 2}}
    idle = rollout_fields(None, [])  # an engine that drew no root this step
    row = merged_fields([busy, slower, idle])
    assert row["rollout_s"] == 5.0
    assert row["generated_tokens"] == 200
    assert row["generated_tokens_per_rank"] == [120, 80, 0]
    assert row["finish_reasons"] == {"final": 5, "max_turns": 1}
    assert row["engine_tokens_per_s"] == 80.0
    # Means over the engines that rolled out: the idle one does not pull them down.
    assert row["engine_occupancy"] == 0.5 and row["spawn_rate"] == 0.5


def test_no_engine_rolled_out():
    row = merged_fields([rollout_fields(None, [])])
    assert row["generated_tokens_per_rank"] == [0]
    assert math.isnan(row["engine_occupancy"])
