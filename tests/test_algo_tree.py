"""A hand-worked tree: every advantage and every token weight against numbers worked out here.

Task "t", G = 3 roots with rewards (1, 0, 0.5):

    r1 (turns of 3, 5 completion tokens)      children c11 [2], c12 [4, 1]
    r2 (turn of 6)                            children c21 [2, 2, 3], c22 [5], c23 [4]
                                              c22 has one child c221 [1, 3]
    r3 (turns of 2, 7)                        no children

mean = 1/2, population variance = (1/4 + 1/4 + 0) / 3 = 1/6, so with eps = 0
A(r1) = (1/2)·√6 = √6/2, A(r2) = -√6/2, A(r3) = 0, and every descendant inherits its root's A.

Tree shares with 1/k averaging: roots 1/3; c11, c12: 1/3 · 1/2 = 1/6; c21, c22, c23: 1/3 · 1/3 =
1/9; c221: 1/9 · 1/1 = 1/9. Flat variant: every trajectory 1/3.
"""

from __future__ import annotations

import math
from fractions import Fraction as F

import numpy as np
import pytest

from rlmtrain.algo import build_samples, compute_advantages, group_token_weights
from rlmtrain.config import AlgoConfig
from rlmtrain.rewards.step_rewards import StepRewards
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn

COMPLETIONS = {
    "r1": [3, 5],
    "c11": [2],
    "c12": [4, 1],
    "r2": [6],
    "c21": [2, 2, 3],
    "c22": [5],
    "c221": [1, 3],
    "c23": [4],
    "r3": [2, 7],
}
PARENT = {"c11": "r1", "c12": "r1", "c21": "r2", "c22": "r2", "c23": "r2", "c221": "c22"}
DEPTH = {"r1": 0, "r2": 0, "r3": 0, "c11": 1, "c12": 1, "c21": 1, "c22": 1, "c23": 1, "c221": 2}
ROOT = {"c11": "r1", "c12": "r1", "c21": "r2", "c22": "r2", "c23": "r2", "c221": "r2"}
REWARDS = [1.0, 0.0, 0.5]

# Token weights per (trajectory, turn), one group in the batch, worked out by hand.
TOKEN_MEAN = {
    ("r1", 0): F(1, 3) / 8, ("r1", 1): F(1, 3) / 8,  # 1/24
    ("c11", 0): F(1, 6) / 2,  # 1/12
    ("c12", 0): F(1, 6) / 5, ("c12", 1): F(1, 6) / 5,  # 1/30
    ("r2", 0): F(1, 3) / 6,  # 1/18
    ("c21", 0): F(1, 9) / 7, ("c21", 1): F(1, 9) / 7, ("c21", 2): F(1, 9) / 7,  # 1/63
    ("c22", 0): F(1, 9) / 5,  # 1/45
    ("c221", 0): F(1, 9) / 4, ("c221", 1): F(1, 9) / 4,  # 1/36
    ("c23", 0): F(1, 9) / 4,  # 1/36
    ("r3", 0): F(1, 3) / 9, ("r3", 1): F(1, 3) / 9,  # 1/27
}  # fmt: skip
TURN_MEAN = {
    ("r1", 0): F(1, 3) / 2 / 3, ("r1", 1): F(1, 3) / 2 / 5,  # 1/18, 1/30
    ("c11", 0): F(1, 6) / 1 / 2,  # 1/12
    ("c12", 0): F(1, 6) / 2 / 4, ("c12", 1): F(1, 6) / 2 / 1,  # 1/48, 1/12
    ("r2", 0): F(1, 3) / 1 / 6,  # 1/18
    ("c21", 0): F(1, 9) / 3 / 2, ("c21", 1): F(1, 9) / 3 / 2, ("c21", 2): F(1, 9) / 3 / 3,
    ("c22", 0): F(1, 9) / 1 / 5,  # 1/45
    ("c221", 0): F(1, 9) / 2 / 1, ("c221", 1): F(1, 9) / 2 / 3,  # 1/18, 1/54
    ("c23", 0): F(1, 9) / 1 / 4,  # 1/36
    ("r3", 0): F(1, 3) / 2 / 2, ("r3", 1): F(1, 3) / 2 / 7,  # 1/12, 1/42
}  # fmt: skip
FLAT_TOKEN_MEAN = {
    ("r1", 0): F(1, 24), ("r1", 1): F(1, 24),
    ("c11", 0): F(1, 6),
    ("c12", 0): F(1, 15), ("c12", 1): F(1, 15),
    ("r2", 0): F(1, 18),
    ("c21", 0): F(1, 21), ("c21", 1): F(1, 21), ("c21", 2): F(1, 21),
    ("c22", 0): F(1, 15),
    ("c221", 0): F(1, 12), ("c221", 1): F(1, 12),
    ("c23", 0): F(1, 12),
    ("r3", 0): F(1, 27), ("r3", 1): F(1, 27),
}  # fmt: skip
CONSTANT_SUM_10 = {  # share / 10
    ("r1", 0): F(1, 30), ("r1", 1): F(1, 30),
    ("c11", 0): F(1, 60),
    ("c12", 0): F(1, 60), ("c12", 1): F(1, 60),
    ("r2", 0): F(1, 30),
    ("c21", 0): F(1, 90), ("c21", 1): F(1, 90), ("c21", 2): F(1, 90),
    ("c22", 0): F(1, 90),
    ("c221", 0): F(1, 90), ("c221", 1): F(1, 90),
    ("c23", 0): F(1, 90),
    ("r3", 0): F(1, 30), ("r3", 1): F(1, 30),
}  # fmt: skip
ADVANTAGE = {"r1": math.sqrt(6) / 2, "r2": -math.sqrt(6) / 2, "r3": 0.0}


def _trajectory(traj_id: str) -> Trajectory:
    root = ROOT.get(traj_id, traj_id)
    turns = []
    for t, n in enumerate(COMPLETIONS[traj_id]):
        prompt = [7 + t + i for i in range(3 + t)]  # prompts of different lengths too
        completion = [100 + 10 * t + i for i in range(n)]
        turns.append(
            Turn(
                prompt_ids=prompt,
                completion_ids=completion,
                sampler_logprobs=[-0.5 - 0.01 * i for i in range(n)],
            )
        )
    return Trajectory(
        id=traj_id,
        root_id=root,
        parent_id=PARENT.get(traj_id),
        depth=DEPTH[traj_id],
        task_id="t",
        sample_idx=int(root[1]) - 1,
        prompt=f"query of {traj_id}",
        turns=turns,
        children=[c for c, p in PARENT.items() if p == traj_id],
        finish_reason="final",
    )


def hand_tree() -> RolloutGroup:
    # Stored out of order on purpose: roots are found by sample_idx, children by id.
    order = ["c221", "r2", "c11", "r3", "c23", "r1", "c12", "c21", "c22"]
    return RolloutGroup(task={"id": "t"}, trajectories=[_trajectory(t) for t in order])


def _samples(**config):
    group = hand_tree()
    cfg = AlgoConfig(**config)
    advantages, stats = compute_advantages([group], StepRewards(roots=[REWARDS]), cfg, eps=0.0)
    return build_samples([group], advantages, cfg), advantages, stats


def test_advantages_broadcast_and_inherit():
    samples, advantages, stats = _samples()
    assert stats.groups_used == 1 and stats.roots_scored == 3
    (group,) = advantages
    assert group.roots == pytest.approx(ADVANTAGE, rel=1e-15, abs=1e-15)
    assert len(samples) == sum(len(v) for v in COMPLETIONS.values())
    for s in samples:
        expected = ADVANTAGE[ROOT.get(s.trajectory_id, s.trajectory_id)]
        np.testing.assert_allclose(s.advantages, np.float32(expected), rtol=0, atol=0)
        assert s.advantages.shape == (COMPLETIONS[s.trajectory_id][s.turn],)


def test_default_eps_only_nudges_the_advantage():
    group = hand_tree()
    advantages, _ = compute_advantages([group], StepRewards(roots=[REWARDS]), AlgoConfig())
    std = 1 / math.sqrt(6)
    assert advantages[0].roots["r1"] == pytest.approx(0.5 / (std + 1e-6), rel=1e-15)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"token_aggregation": "token_mean"}, TOKEN_MEAN),
        ({"token_aggregation": "turn_mean"}, TURN_MEAN),
        ({"token_aggregation": "token_mean", "child_averaging": False}, FLAT_TOKEN_MEAN),
        ({"token_aggregation": "constant_sum", "constant_sum_divisor": 10.0}, CONSTANT_SUM_10),
    ],
    ids=["token_mean", "turn_mean", "flat", "constant_sum"],
)
def test_every_token_weight(config, expected):
    samples, advantages, _ = _samples(**config)
    seen = {(s.trajectory_id, s.turn): s for s in samples}
    assert set(seen) == set(expected)
    for key, weight in expected.items():
        sample = seen[key]
        assert sample.weights.dtype == np.float32
        assert sample.weights.shape == (COMPLETIONS[key[0]][key[1]],)
        np.testing.assert_allclose(sample.weights, float(weight), rtol=6e-8)

    # The float64 values before rounding to fp32 are exact to double precision.
    cfg = AlgoConfig(**config)
    per_turn = group_token_weights(hand_tree(), ["r1", "r2", "r3"], cfg, num_groups=1)
    for (traj_id, turn), weight in expected.items():
        assert per_turn[traj_id][turn] == pytest.approx(float(weight), rel=1e-15)


def test_weights_divide_by_the_number_of_groups_in_the_global_batch():
    group = hand_tree()
    cfg = AlgoConfig()
    advantages, _ = compute_advantages([group], StepRewards(roots=[REWARDS]), cfg, eps=0.0)
    samples = build_samples([group], advantages, cfg, num_groups=4)
    for s in samples:
        np.testing.assert_allclose(
            s.weights, float(TOKEN_MEAN[(s.trajectory_id, s.turn)] / 4), rtol=6e-8
        )


def test_sample_layout_is_prompt_plus_completion_aligned_to_targets():
    samples, _, _ = _samples()
    group = hand_tree().by_id()
    for s in samples:
        turn = group[s.trajectory_id].turns[s.turn]
        assert s.input_ids.tolist() == turn.prompt_ids + turn.completion_ids
        assert s.prompt_len == len(turn.prompt_ids)
        root = ROOT.get(s.trajectory_id, s.trajectory_id)
        assert (s.task_id, s.root_id, s.depth) == ("t", root, DEPTH[s.trajectory_id])
        targets, mask = s.targets(), s.loss_mask()
        # Position i predicts input_ids[i + 1]: the completion tokens, and nothing after the last.
        assert targets[mask].tolist() == turn.completion_ids
        assert (targets[~mask] == -100).all() and not mask[-1]
        assert np.flatnonzero(mask)[0] == len(turn.prompt_ids) - 1
        np.testing.assert_array_equal(s.sampler_logp, np.float32(turn.sampler_logprobs))
