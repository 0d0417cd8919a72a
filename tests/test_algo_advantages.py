"""GRPO statistics, unscored roots, uniform groups, tool credit and step rewards, by hand."""

from __future__ import annotations

import math
from fractions import Fraction as F

import numpy as np
import pytest

from rlmtrain.algo import build_samples, compute_advantages, group_advantages
from rlmtrain.config import AlgoConfig
from rlmtrain.rewards.step_rewards import StepRewards
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn


def _turn(n_completion: int) -> Turn:
    return Turn(
        prompt_ids=[1, 2, 3],
        completion_ids=list(range(10, 10 + n_completion)),
        sampler_logprobs=[-1.0] * n_completion,
    )


def _group(task: str, roots: list[list[int]], children: dict | None = None) -> RolloutGroup:
    """roots[g]: completion lengths of root g's turns; children[g]: those of its children."""
    children = children or {}
    trajectories = []
    for g, lengths in enumerate(roots):
        root_id = f"{task}/r{g}"
        kids = [f"{root_id}/c{i}" for i in range(len(children.get(g, [])))]
        trajectories.append(
            Trajectory(id=root_id, root_id=root_id, parent_id=None, depth=0, task_id=task,
                       sample_idx=g, prompt="q", turns=[_turn(n) for n in lengths], children=kids)
        )  # fmt: skip
        for kid, kid_lengths in zip(kids, children.get(g, []), strict=True):
            trajectories.append(
                Trajectory(id=kid, root_id=root_id, parent_id=root_id, depth=1, task_id=task,
                           sample_idx=g, prompt="sub", turns=[_turn(n) for n in kid_lengths])
            )  # fmt: skip
    return RolloutGroup(task={"id": task}, trajectories=trajectories)


def _by_turn(samples):
    return {(s.trajectory_id, s.turn): s for s in samples}


def test_population_std():
    assert group_advantages([1.0, 0.0], eps=0.0) == [1.0, -1.0]
    # mean 1/4, variance (9/16 + 3/16) / 4 = 3/16: A = (3/4) / (√3/4) = √3 and -(1/4)/(√3/4).
    a = group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0)
    assert a == pytest.approx(
        [math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]
    )


def test_without_std_normalisation_only_centres():
    assert group_advantages([1.0, 0.0, 0.5], std_normalize=False) == [0.5, -0.5, 0.0]


def test_unscored_roots_are_excluded_not_zero():
    group = _group("t", [[2], [3], [4]], children={1: [[5]]})
    cfg = AlgoConfig()
    advantages, stats = compute_advantages(
        [group], StepRewards(roots=[[1.0, None, 0.0]]), cfg, eps=0.0
    )
    # Statistics over (1, 0) only: mean 1/2, std 1/2. Had None counted as 0, A(r0) would be √2.
    assert advantages[0].roots == {"t/r0": 1.0, "t/r2": -1.0}
    assert (stats.roots_scored, stats.roots_unscored) == (2, 1)
    samples = _by_turn(build_samples([group], advantages, cfg))
    assert set(samples) == {("t/r0", 0), ("t/r2", 0)}  # nothing from r1 nor its child
    # G counts scored roots: each root's share is 1/2, spread over its tokens.
    np.testing.assert_allclose(samples[("t/r0", 0)].weights, float(F(1, 2) / 2), rtol=6e-8)
    np.testing.assert_allclose(samples[("t/r2", 0)].weights, float(F(1, 2) / 4), rtol=6e-8)


@pytest.mark.parametrize("rewards", [[0.5, 0.5, 0.5], [1.0, None, 1.0]])
def test_uniform_group_dropped(rewards):
    group = _group("t", [[2], [3], [4]])
    advantages, stats = compute_advantages([group], StepRewards(roots=[rewards]), AlgoConfig())
    assert advantages == []
    assert (stats.groups, stats.groups_used, stats.groups_dropped_uniform) == (1, 0, 1)


def test_uniform_group_kept_has_zero_advantage_and_still_counts():
    uniform = _group("u", [[2], [3], [4]])
    varied = _group("v", [[2], [2]])
    cfg = AlgoConfig(drop_uniform_groups=False)
    advantages, stats = compute_advantages(
        [uniform, varied], StepRewards(roots=[[0.5] * 3, [1.0, 0.0]]), cfg
    )
    assert (stats.groups_used, stats.groups_kept_uniform, stats.groups_dropped_uniform) == (2, 1, 0)
    samples = _by_turn(build_samples([uniform, varied], advantages, cfg))
    for g, n in enumerate([2, 3, 4]):
        s = samples[(f"u/r{g}", 0)]
        assert (s.advantages == 0.0).all()
        # 1/G = 1/3, over n tokens, over 2 groups in the batch.
        np.testing.assert_allclose(s.weights, float(F(1, 3) / n / 2), rtol=6e-8)


def test_group_without_any_score_is_dropped_and_counted():
    advantages, stats = compute_advantages(
        [_group("a", [[1], [1]]), _group("b", [[1], [1]])],
        StepRewards(roots=[[None, None], [1.0, 0.0]]),
        AlgoConfig(),
    )
    assert [a.group_index for a in advantages] == [1]
    assert (stats.groups_unscored, stats.roots_unscored, stats.groups_used) == (1, 2, 1)


def test_tool_credit_refines_each_turn():
    # Rewards (1, 0): A = +1, -1 (eps = 0). alpha = 1/2.
    group = _group("t", [[2, 2, 2], [3, 1]], children={0: [[1, 1, 1]]})
    labels = {"t/r0": [1, 0, -1], "t/r1": [-1, 1], "t/r0/c0": [1, 0, 0]}
    cfg = AlgoConfig(tool_credit_alpha=0.5)
    advantages, _ = compute_advantages(
        [group], StepRewards(roots=[[1.0, 0.0]], tool_credit=labels), cfg, eps=0.0
    )
    expected = {
        "t/r0": [1 + F(1, 2) * 1, 1 + 0, 1 - F(1, 2)],  # c̄ = 0
        "t/r1": [-1 + F(1, 2) * (-1), -1 + F(1, 2) * 1],  # c̄ = 0, |A| = 1
        "t/r0/c0": [1 + F(1, 2) * F(2, 3), 1 - F(1, 2) * F(1, 3), 1 - F(1, 2) * F(1, 3)],  # c̄ = 1/3
    }
    turns = advantages[0].turns
    for traj_id, values in expected.items():
        assert turns[traj_id] == pytest.approx([float(v) for v in values], rel=1e-15)
    samples = _by_turn(build_samples([group], advantages, cfg))
    for (traj_id, turn), s in samples.items():
        np.testing.assert_array_equal(s.advantages, np.float32(float(expected[traj_id][turn])))


def test_step_rewards_add_per_turn_after_tool_credit():
    group = _group("t", [[2, 2, 2], [3, 1]])
    cfg = AlgoConfig(tool_credit_alpha=0.5)
    steps = {"t/r0": [0.25, -0.5, 0.0]}
    labels = {"t/r0": [1, 0, -1]}
    advantages, _ = compute_advantages(
        [group],
        StepRewards(roots=[[1.0, 0.0]], tool_credit=labels, turn_rewards=steps),
        cfg,
        eps=0.0,
    )
    assert advantages[0].turns["t/r0"] == [1.5 + 0.25, 1.0 - 0.5, 0.5 + 0.0]
    assert advantages[0].turns["t/r1"] == [-1.0, -1.0]  # neither labelled nor scored per step

    only_steps, _ = compute_advantages(
        [group], StepRewards(roots=[[1.0, 0.0]], turn_rewards=steps), AlgoConfig(), eps=0.0
    )
    assert only_steps[0].turns["t/r0"] == [1.25, 0.5, 1.0]


def test_group_baseline_centres_step_rewards_over_the_group_trees():
    """Every turn of the group's scored trees, children too, counts once in the mean; a
    trajectory without step rewards is neither counted nor shifted, and other groups are apart."""
    group = _group("t", [[2, 2], [3], [1]], children={0: [[1, 1]]})
    other = _group("u", [[1], [1]])
    steps = {"t/r0": [0.5, 0.25], "t/r0/c0": [1.0, 0.0], "t/r1": [0.75], "u/r0": [0.3]}
    rewards = StepRewards(roots=[[1.0, 0.0, 0.0], [1.0, 0.0]], turn_rewards=steps)
    cfg = AlgoConfig(step_reward_baseline="group", std_normalize=False)
    (t, u), _ = compute_advantages([group, other], rewards, cfg, eps=0.0)
    baseline = (0.5 + 0.25 + 1.0 + 0.0 + 0.75) / 5
    assert t.turns["t/r0"] == pytest.approx([2 / 3 + 0.5 - baseline, 2 / 3 + 0.25 - baseline])
    assert t.turns["t/r0/c0"] == pytest.approx([2 / 3 + 1.0 - baseline, 2 / 3 - baseline])
    assert t.turns["t/r1"] == pytest.approx([-1 / 3 + 0.75 - baseline])
    assert t.turns["t/r2"] == pytest.approx([-1 / 3])
    assert u.turns["u/r0"] == pytest.approx([0.5])  # its only scored turn is its own mean
    plain, _ = compute_advantages([group, other], rewards, AlgoConfig(std_normalize=False))
    assert plain[0].turns["t/r1"] == pytest.approx([-1 / 3 + 0.75])


def test_answered_child_credit_keeps_unanswered_children_out_of_their_root_success():
    group = _group("t", [[2], [2]], children={0: [[1], [1, 1]], 1: [[1]]})
    by_id = {t.id: t for t in group.trajectories}
    for traj in group.trajectories:
        traj.finish_reason = "final"
    by_id["t/r0/c1"].finish_reason = "max_turns"
    by_id["t/r1/c0"].finish_reason = "error"
    rewards = StepRewards(roots=[[1.0, 0.0]])
    inherit, _ = compute_advantages([group], rewards, AlgoConfig(), eps=0.0)
    answered, _ = compute_advantages([group], rewards, AlgoConfig(child_credit="answered"), eps=0.0)
    assert inherit[0].turns["t/r0/c1"] == [1.0, 1.0] and inherit[0].turns["t/r1/c0"] == [-1.0]
    assert answered[0].turns["t/r0/c1"] == [-1.0, -1.0]  # ran out of turns under a good root
    assert answered[0].turns["t/r1/c0"] == [-1.0]  # a failed root's children stay negative
    for kept in ("t/r0", "t/r0/c0", "t/r1"):
        assert answered[0].turns[kept] == inherit[0].turns[kept]


def test_a_child_the_scheduler_could_not_run_trains_nothing():
    """Its end (no REPL, an engine error) is the machine's; one whose own code killed its REPL
    worker ends "error" without a failure and trains as it ended."""
    group = _group("t", [[2], [2]], children={0: [[1], [1]]})
    by_id = {t.id: t for t in group.trajectories}
    by_id["t/r0/c0"].finish_reason = "error"
    by_id["t/r0/c0"].failure = "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    by_id["t/r0/c1"].finish_reason = "error"  # its code killed the worker
    for cfg in (AlgoConfig(), AlgoConfig(child_credit="answered")):
        advantages, _ = compute_advantages([group], StepRewards(roots=[[1.0, 0.0]]), cfg, eps=0.0)
        assert set(advantages[0].turns) == {"t/r0", "t/r0/c1", "t/r1"}
        samples = _by_turn(build_samples([group], advantages, cfg))
        assert ("t/r0/c0", 0) not in samples and ("t/r0/c1", 0) in samples
        # The sibling keeps its share (1/G halved over the two children, on its one token), as
        # when both children train.
        assert samples[("t/r0/c1", 0)].weights[0] == pytest.approx(float(F(1, 2) / 2))


def test_bad_inputs_name_what_is_wrong():
    group = _group("t", [[2, 2], [3]])
    with pytest.raises(ValueError, match="task t: 3 rewards for 2 roots"):
        compute_advantages([group], StepRewards(roots=[[1.0, 0.0, 1.0]]), AlgoConfig())
    with pytest.raises(ValueError, match="reward of root 1 is nan"):
        compute_advantages([group], StepRewards(roots=[[1.0, float("nan")]]), AlgoConfig())
    with pytest.raises(ValueError, match="tool_credit_alpha=0.5 but no tool-credit labels"):
        compute_advantages(
            [group], StepRewards(roots=[[1.0, 0.0]]), AlgoConfig(tool_credit_alpha=0.5)
        )
    with pytest.raises(ValueError, match="trajectory t/r0: 1 tool-credit labels for 2 turns"):
        compute_advantages(
            [group],
            StepRewards(roots=[[1.0, 0.0]], tool_credit={"t/r0": [1]}),
            AlgoConfig(tool_credit_alpha=0.5),
        )
    with pytest.raises(ValueError, match="trajectory t/r1: tool-credit labels must be -1, 0 or 1"):
        compute_advantages(
            [group],
            StepRewards(roots=[[1.0, 0.0]], tool_credit={"t/r1": [2]}),
            AlgoConfig(tool_credit_alpha=0.5),
        )
    broken = _group("b", [[1], [1]], children={0: [[1]]})
    broken.trajectories = [t for t in broken.trajectories if t.parent_id is None]
    with pytest.raises(ValueError, match="task b: child b/r0/c0 of b/r0 is not in the group"):
        compute_advantages([broken], StepRewards(roots=[[1.0, 0.0]]), AlgoConfig())


@pytest.mark.parametrize("adjust", ["both", "credit", "steps"])
def test_turn_adjustments_reach_every_token_through_samples_and_packing(adjust):
    from rlmtrain.algo.packing import pack

    # Two roots of three turns, root 0 with a child of three turns; rewards (1, 0): A = +1, -1
    # (eps = 0); the child inherits A = +1. alpha = 1/2.
    group = _group("t", [[2, 3, 1], [1, 2, 2]], children={0: [[2, 1, 3]]})
    labels = {"t/r0": [1, 1, -1], "t/r1": [0, -1, -1], "t/r0/c0": [1, 0, 0]}
    steps = {"t/r0": [0.25, -0.125, 0.5], "t/r1": [0.0, 0.375, -0.25], "t/r0/c0": [-0.5, 0, 0.125]}
    credit = {  # alpha * |A| * (c_t - mean c): 1/2 * (c_t - mean)
        "t/r0": [F(1, 2) * (c - F(1, 3)) for c in labels["t/r0"]],
        "t/r1": [F(1, 2) * (c + F(2, 3)) for c in labels["t/r1"]],
        "t/r0/c0": [F(1, 2) * (c - F(1, 3)) for c in labels["t/r0/c0"]],
    }
    base = {"t/r0": 1, "t/r1": -1, "t/r0/c0": 1}
    expected = {
        traj: [
            base[traj]
            + (credit[traj][t] if adjust in ("both", "credit") else 0)
            + (F(steps[traj][t]) if adjust in ("both", "steps") else 0)
            for t in range(3)
        ]
        for traj in base
    }
    cfg = AlgoConfig(tool_credit_alpha=0.5 if adjust != "steps" else 0.0)
    advantages, _ = compute_advantages(
        [group],
        StepRewards(
            roots=[[1.0, 0.0]],
            tool_credit=labels if adjust != "steps" else None,
            turn_rewards=steps if adjust != "credit" else None,
        ),
        cfg,
        eps=0.0,
    )
    samples = build_samples([group], advantages, cfg)
    assert len(samples) == 9
    batches = pack(samples, 64, shared_prefix_tokens=0)
    seen = 0
    for mb in batches.micro_batches():
        for index, row in zip(mb.sample_indices, mb.sample_rows, strict=True):
            sample = batches.samples[index]
            span = slice(int(mb.cu_seqlens[row]), int(mb.cu_seqlens[row + 1]))
            trained = mb.targets[span] != -100
            want = np.float32(float(expected[sample.trajectory_id][sample.turn]))
            assert int(trained.sum()) == sample.completion_len
            np.testing.assert_array_equal(mb.advantages[span][trained].numpy(), want)
            assert not mb.advantages[span][~trained].any()
            seen += 1
    assert seen == 9
