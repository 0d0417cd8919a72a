"""sum(weight · ℓ) is J(θ), whatever the micro-batching, order or data-parallel split.

Random trees (several groups, unscored roots, grandchildren) go through advantages, samples and
packing; a small fp64 model reads the packed tensors the way the trainer will (token and position
embeddings, a causal prefix mean inside each cu_seqlens segment, a linear head), and the
per-token loss is ℓ = -exp(logp - sampler_logp) · A. The gradient of Σ weight·ℓ must agree to
1e-10 between one micro-batch, seven, a shuffled order, a packed plan and two simulated ranks,
and Σ weight·ℓ itself must equal J computed straight from docs/algorithm.md §4's recursion.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from rlmtrain.algo import build_samples, collate, compute_advantages, pack
from rlmtrain.config import AlgoConfig
from rlmtrain.rewards.step_rewards import StepRewards
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn

VOCAB = 37
HIDDEN = 8
MAX_POS = 64


def _grow(rng, trajectories, task, traj_id, root_id, parent_id, depth, g):
    n_children = rng.choice([0, 0, 1, 2, 3]) if depth < 2 else 0
    children = [f"{traj_id}.{i}" for i in range(n_children)]
    turns = []
    for _ in range(rng.randint(1, 3)):
        n_prompt, n_completion = rng.randint(2, 30), rng.randint(1, 20)
        turns.append(
            Turn(
                prompt_ids=[rng.randrange(VOCAB) for _ in range(n_prompt)],
                completion_ids=[rng.randrange(VOCAB) for _ in range(n_completion)],
                sampler_logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n_completion)],
            )
        )
    trajectories.append(
        Trajectory(
            id=traj_id,
            root_id=root_id,
            parent_id=parent_id,
            depth=depth,
            task_id=task,
            sample_idx=g,
            prompt="q",
            turns=turns,
            children=children,
        )
    )
    for child in children:
        _grow(rng, trajectories, task, child, root_id, traj_id, depth + 1, g)


def _random_groups(seed: int) -> tuple[list[RolloutGroup], list[list[float | None]]]:
    """Three groups of 3-4 roots, up to 3 children each, grandchildren, 1-3 turns each."""
    rng = random.Random(seed)
    groups, rewards = [], []
    for task in range(3):
        trajectories: list[Trajectory] = []
        n_roots = rng.randint(3, 4)
        for g in range(n_roots):
            root = f"t{task}r{g}"
            _grow(rng, trajectories, f"task{task}", root, root, None, 0, g)
        groups.append(RolloutGroup(task={"id": task}, trajectories=trajectories))
        group_rewards = [rng.choice([0.0, 0.25, 1.0]) for _ in range(n_roots)]
        group_rewards[0], group_rewards[1] = 1.0, 0.0  # never uniform
        if task == 1:
            group_rewards[-1] = None
        rewards.append(group_rewards)
    return groups, rewards


class PackedModel(torch.nn.Module):
    """Per-token log-probs over packed sequences; tokens see their own sequence's prefix only."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.pos = torch.nn.Embedding(MAX_POS, HIDDEN, dtype=torch.float64)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)

    def forward(self, input_ids, position_ids, cu_seqlens, targets):
        x = self.tok(input_ids) + self.pos(position_ids)
        csum = torch.cumsum(x, dim=0)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
        before = torch.where(
            (starts > 0)[:, None], csum[(starts - 1).clamp(min=0)], torch.zeros_like(x)
        )
        prefix_mean = (csum - before) / (position_ids[:, None] + 1).to(x.dtype)
        logits = self.head(torch.tanh(x + prefix_mean))
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(1, targets.clamp(min=0)[:, None])[:, 0]


def _objective(model, batch):
    logp = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.targets)
    ratio = torch.exp(logp - batch.sampler_logp.double())
    loss = -ratio * batch.advantages.double()
    return (batch.weights.double() * loss).sum()


def _gradient(model, batches) -> torch.Tensor:
    model.zero_grad()
    for batch in batches:
        _objective(model, batch).backward()  # gradient accumulation over micro-batches
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return PackedModel()


@pytest.mark.parametrize("aggregation", ["token_mean", "turn_mean", "constant_sum"])
def test_gradient_is_the_same_however_the_batch_is_cut(model, aggregation):
    groups, rewards = _random_groups(seed=1)
    cfg = AlgoConfig(token_aggregation=aggregation, constant_sum_divisor=16.0)
    advantages, _ = compute_advantages(groups, StepRewards(roots=rewards), cfg)
    samples = build_samples(groups, advantages, cfg)
    assert len(samples) > 40 and max(s.length for s in samples) <= MAX_POS

    reference = _gradient(model, [collate(samples)])
    assert reference.abs().max() > 0

    seven = np.array_split(np.arange(len(samples)), 7)
    shuffled = np.random.default_rng(3).permutation(len(samples))
    plan = pack(samples, budget=96)
    two_ranks = pack(samples, budget=80, world_size=2)
    assert plan.stats.micro_batches > 7
    assert two_ranks.stats.micro_batches_per_rank > 3

    cuts = {
        "seven": [collate(samples, idx) for idx in seven],
        "shuffled": [collate(samples, shuffled)],
        "packed": list(plan.micro_batches(0)),
        "one at a time": [collate(samples, np.array([i])) for i in range(len(samples))],
    }
    for name, batches in cuts.items():
        assert _relative(_gradient(model, batches), reference) <= 1e-10, name

    # Each rank accumulates its own micro-batches; the all-reduce sums the ranks.
    per_rank = [_gradient(model, two_ranks.micro_batches(rank)) for rank in range(2)]
    assert _relative(per_rank[0] + per_rank[1], reference) <= 1e-10


def test_weighted_sum_is_the_tree_objective(model):
    """J = (1/n_groups) Σ_groups (1/G) Σ_roots L(root), L(y) = mean ℓ over y's tokens
    + (1/k) Σ_children L(child), computed here recursively from per-token losses."""
    groups, rewards = _random_groups(seed=2)
    cfg = AlgoConfig()
    advantages, _ = compute_advantages(groups, StepRewards(roots=rewards), cfg)
    samples = build_samples(groups, advantages, cfg)
    with torch.no_grad():
        weighted = float(_objective(model, collate(samples)))

        token_losses: dict[str, list[float]] = {}
        for s in samples:
            batch = collate([s])
            logp = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.targets)
            mask = batch.targets != -100
            ratio = torch.exp(logp[mask] - batch.sampler_logp.double()[mask])
            losses = (-ratio * batch.advantages.double()[mask]).tolist()
            token_losses.setdefault(s.trajectory_id, []).extend(losses)

    def tree_loss(traj, by_id):
        own = math.fsum(token_losses[traj.id]) / len(token_losses[traj.id])
        if not traj.children:
            return own
        kids = [tree_loss(by_id[c], by_id) for c in traj.children]
        return own + math.fsum(kids) / len(kids)

    per_group = []
    for group_adv in advantages:
        group = groups[group_adv.group_index]
        by_id = group.by_id()
        roots = list(group_adv.roots)
        per_group.append(math.fsum(tree_loss(by_id[r], by_id) for r in roots) / len(roots))
    expected = math.fsum(per_group) / len(per_group)
    assert weighted == pytest.approx(expected, rel=1e-6)  # weights are stored in fp32
