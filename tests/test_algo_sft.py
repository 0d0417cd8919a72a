"""SFT filter: drops counted by reason; kept trees weighted like RL trees with advantage 1."""

from __future__ import annotations

from fractions import Fraction as F

import numpy as np
import pytest

from rlmtrain.algo import build_sft_samples
from rlmtrain.config import AlgoConfig
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn


def _turn(n_completion: int, error: str = "") -> Turn:
    # Teacher records from an API often carry no sampler log-probs.
    return Turn(
        prompt_ids=[5, 6], completion_ids=[9] * n_completion, sampler_logprobs=[], error=error
    )


def _traj(traj_id, root_id, turns, *, g, children=(), answer=None, depth=0):
    return Trajectory(
        id=traj_id,
        root_id=root_id,
        parent_id=None if traj_id == root_id else root_id,
        depth=depth,
        task_id=root_id.split("/")[0],
        sample_idx=g,
        prompt="q",
        turns=turns,
        children=list(children),
        answer=answer,
        finish_reason="final",
    )


def teacher_groups() -> list[RolloutGroup]:
    a = [
        _traj("a/0", "a/0", [_turn(4), _turn(2)], g=0, children=["a/0/c"], answer="right"),
        _traj("a/0/c", "a/0", [_turn(3)], g=0, depth=1),
        _traj("a/1", "a/1", [_turn(2), _turn(2, error="NameError: x")], g=1, answer="right"),
        _traj("a/2", "a/2", [_turn(5)], g=2, answer="wrong"),
        _traj("a/3", "a/3", [_turn(1)], g=3, answer="right"),
    ]
    b = [
        _traj("b/0", "b/0", [_turn(2)], g=0, children=["b/0/c"], answer="right"),
        _traj("b/0/c", "b/0", [_turn(1, error="Timeout")], g=0, depth=1),  # a child's error
        _traj("b/1", "b/1", [_turn(1, error="SyntaxError")], g=1, answer="wrong"),
    ]
    c = [_traj("c/0", "c/0", [_turn(6)], g=0, answer="right")]
    return [
        RolloutGroup(task={"truth": "right"}, trajectories=a),
        RolloutGroup(task={"truth": "right"}, trajectories=b),
        RolloutGroup(task={"truth": "right"}, trajectories=c),
    ]


def test_filter_counts_by_reason_and_weights_kept_trees():
    scored = []

    def score(root: Trajectory, task) -> float:
        scored.append(root.id)
        return 1.0 if root.answer == task["truth"] else 0.0

    samples, stats = build_sft_samples(teacher_groups(), score, AlgoConfig())
    assert (stats.trees, stats.kept, stats.repl_error, stats.zero_score) == (7, 3, 3, 1)
    assert sorted(scored) == ["a/0", "a/2", "a/3", "c/0"]  # errors are checked first
    # Kept: a/0 (with its child) and a/3 in group a (G = 2), c/0 in group c; 2 groups.
    expected = {
        ("a/0", 0): F(1, 2) / 6 / 2,
        ("a/0", 1): F(1, 2) / 6 / 2,
        ("a/0/c", 0): F(1, 2) / 1 / 3 / 2,
        ("a/3", 0): F(1, 2) / 1 / 2,
        ("c/0", 0): F(1, 1) / 6 / 2,
    }
    got = {(s.trajectory_id, s.turn): s for s in samples}
    assert set(got) == set(expected)
    for key, weight in expected.items():
        np.testing.assert_allclose(got[key].weights, float(weight), rtol=6e-8)
        assert (got[key].advantages == 1.0).all()
        assert np.isnan(got[key].sampler_logp).all()


def test_non_finite_score_is_an_error():
    with pytest.raises(ValueError, match="task c root c/0: score is nan"):
        build_sft_samples(teacher_groups()[2:], lambda root, task: float("nan"), AlgoConfig())
