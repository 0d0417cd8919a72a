"""The estimate of a tree's remaining critical path: turns left, by depth, along a chain."""

import pytest

from rlmtrain.rlm.records import Trajectory, Turn
from rlmtrain.rollout.critical_path import TurnCounts, chain_turns


def _trajectory(tid: str, parent: str | None, depth: int, turns: int) -> Trajectory:
    played = [Turn(prompt_ids=[1], completion_ids=[2], sampler_logprobs=[0.0])] * turns
    return Trajectory(
        id=tid, root_id="r", parent_id=parent, depth=depth, task_id="t", sample_idx=0,
        prompt="q", turns=played,
    )  # fmt: skip


def test_the_prior_spreads_one_trajectory_over_each_count():
    counts = TurnCounts(max_turns=3)
    assert counts.left_after(0, 0) == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert counts.left_after(0, 1) == pytest.approx(1.5)  # (1 + 2) / 2
    assert counts.left_after(0, 2) == pytest.approx(1.0)


def test_ended_trajectories_move_the_estimate_of_their_depth_alone():
    counts = TurnCounts(max_turns=3)
    for _ in range(7):
        counts.record(1, 1)
    counts.record(1, 0)  # never generated: no count
    # depth 1: counts 1:8, 2:1, 3:1 -> (8*1 + 2 + 3) / 10
    assert counts.left_after(1, 0) == pytest.approx(1.3)
    assert counts.left_after(1, 1) == pytest.approx(1.5)
    assert counts.left_after(0, 0) == pytest.approx(2.0)
    counts.record(0, 9)  # beyond the limit counts as the limit
    assert counts.left_after(0, 2) == pytest.approx(1.0)
    assert counts.left_after(0, 0) == pytest.approx((1 + 2 + 2 * 3) / 4)


def test_a_chain_adds_each_blocked_ancestors_turns_after_the_one_it_waits_in():
    counts = TurnCounts(max_turns=3)
    root = _trajectory("r", None, 0, turns=1)  # blocked in its first turn
    child = _trajectory("r.0", "r", 1, turns=1)  # blocked in its first turn
    leaf = _trajectory("r.0.0", "r.0", 2, turns=0)  # about to play its first
    live = {t.id: t for t in (root, child, leaf)}
    # leaf: 2 turns expected; child and root: E[T - 1 | T >= 1] = 2 - 1 after the turn they
    # wait in
    assert chain_turns(leaf, live, counts) == pytest.approx(4.0)
    # a root about to play its second turn: E[T - 1 | T > 1]
    assert chain_turns(root, {"r": root}, counts) == pytest.approx(1.5)
    last = _trajectory("r", None, 0, turns=3)  # waiting in its last turn: nothing after it
    assert chain_turns(leaf, {"r": last, "r.0": child, "r.0.0": leaf}, counts) == pytest.approx(3.0)


def test_a_limit_below_one_turn_is_refused():
    with pytest.raises(ValueError, match="max_turns"):
        TurnCounts(0)
