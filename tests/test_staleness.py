"""Per-token staleness: the updates between the weights that sampled a token and those trained."""

from collections import Counter

import pytest

from rlmtrain.algo.staleness import summarise, token_staleness
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn


def group(*turn_versions: list[int]) -> RolloutGroup:
    turns = [
        Turn(prompt_ids=[1], completion_ids=[2] * len(v), sampler_logprobs=[0.0] * len(v),
             weight_versions=v)
        for v in turn_versions
    ]  # fmt: skip
    root = Trajectory(
        id="t/0", root_id="t/0", parent_id=None, depth=0, task_id="t", sample_idx=0, prompt="q",
        turns=turns,
    )  # fmt: skip
    return RolloutGroup(task={"id": "t"}, trajectories=[root])


def test_a_turn_across_an_update_counts_both_versions():
    ages = token_staleness([group([3, 3, 4], [4, 5]), group([5, 5])], version=5)
    assert ages == Counter({2: 2, 1: 2, 0: 3})
    s = summarise(ages)
    assert s.tokens == 7 and s.max == 2
    assert s.mean == pytest.approx(6 / 7)
    assert s.fresh_frac == pytest.approx(3 / 7)


def test_turns_without_versions_are_not_counted():
    # A teacher's turn (no versions) beside an engine's.
    ages = token_staleness([group([], [2, 2])], version=2)
    assert ages == Counter({0: 2})
    assert summarise(Counter()).row() == {
        "staleness_mean": 0.0, "staleness_max": 0, "staleness_fresh_frac": 1.0,
    }  # fmt: skip


def test_a_token_newer_than_the_trained_weights_is_refused():
    with pytest.raises(ValueError, match="1 update\\(s\\) newer than the version being trained"):
        token_staleness([group([3, 4])], version=3)
