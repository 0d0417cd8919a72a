"""Packing: FFD as defined, every token exactly once, consistent layout, efficiency, balance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlmtrain.algo import IGNORE_INDEX, Sample, collate, pack, plan_packing
from rlmtrain.algo.packing import first_fit_decreasing


def _sample(i: int, prompt_len: int, completion_len: int, rng: np.random.Generator) -> Sample:
    return Sample(
        task_id=f"task{i % 5}",
        root_id=f"r{i}",
        trajectory_id=f"traj{i}",
        depth=i % 3,
        turn=i % 4,
        input_ids=rng.integers(0, 1000, prompt_len + completion_len),
        prompt_len=prompt_len,
        sampler_logp=-rng.random(completion_len, dtype=np.float32),
        advantages=np.full(completion_len, (i % 7) - 3, dtype=np.float32),
        weights=rng.random(completion_len, dtype=np.float32),
    )


def realistic_lengths(n: int, budget: int, rng: np.random.Generator) -> np.ndarray:
    """Many short child turns, few long root turns (roots carry the long history prompt)."""
    n_root = n // 10
    child = np.exp(rng.normal(np.log(budget / 12), 0.5, n - n_root))
    root = rng.uniform(0.35 * budget, budget, n_root)
    lengths = np.clip(np.r_[child, root], 16, budget).astype(np.int64)
    return rng.permutation(lengths)


def _naive_ffd(lengths: list[int], budget: int) -> list[int]:
    """Item by item: decreasing length (ties by index), each into the first bin with room."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    room: list[int] = []
    bin_of = [0] * len(lengths)
    for i in order:
        for b, free in enumerate(room):
            if free >= lengths[i]:
                room[b] -= lengths[i]
                bin_of[i] = b
                break
        else:
            room.append(budget - lengths[i])
            bin_of[i] = len(room) - 1
    return bin_of


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_decreasing_matches_item_by_item(seed):
    rng = np.random.default_rng(seed)
    budget = 100
    lengths = rng.choice([1, 3, 17, 33, 34, 50, 51, 99, 100], size=300)  # many ties
    if seed % 2:
        lengths = rng.integers(1, budget + 1, 300)
    assert first_fit_decreasing(lengths, budget).tolist() == _naive_ffd(lengths.tolist(), budget)


def test_every_token_exactly_once_and_layout_consistent():
    rng = np.random.default_rng(0)
    budget = 512
    lengths = realistic_lengths(400, budget, rng)
    prompt_lens = np.maximum(1, (lengths * rng.uniform(0.3, 0.95, lengths.size)).astype(int))
    samples = [
        _sample(i, int(p), int(n - p), rng)
        for i, (n, p) in enumerate(zip(lengths, prompt_lens, strict=True))
    ]
    packed = pack(samples, budget, world_size=3)
    assert packed.samples == samples  # nothing truncated, same indexing
    per_rank = [list(packed.micro_batches(rank)) for rank in range(3)]
    assert len({len(batches) for batches in per_rank}) == 1  # same count on every rank

    seen = []
    for batch in (b for batches in per_rank for b in batches):
        assert batch.input_ids.dtype == torch.int64 and batch.cu_seqlens.dtype == torch.int32
        for name in ("weights", "advantages", "sampler_logp"):
            assert getattr(batch, name).dtype == torch.float32
        assert batch.num_tokens <= budget
        cu = batch.cu_seqlens.tolist()
        assert len(cu) == len(batch.sample_indices) + 1
        assert cu[0] == 0 and cu[-1] == batch.num_tokens
        assert batch.max_seqlen == max(np.diff(cu))
        for b, index in enumerate(batch.sample_indices.tolist()):
            s, span = samples[index], slice(cu[b], cu[b + 1])
            seen.append(index)
            np.testing.assert_array_equal(batch.input_ids[span].numpy(), s.input_ids)
            np.testing.assert_array_equal(batch.position_ids[span].numpy(), np.arange(s.length))
            np.testing.assert_array_equal(batch.targets[span].numpy(), s.targets())
            trained = s.loss_mask()
            for name in ("weights", "advantages", "sampler_logp"):
                values = getattr(batch, name)[span].numpy()
                np.testing.assert_array_equal(values[trained], getattr(s, name))
                assert (values[~trained] == 0).all()
    assert sorted(seen) == list(range(len(samples)))


def test_targets_are_the_next_token_and_never_cross_samples():
    rng = np.random.default_rng(1)
    samples = [_sample(i, p, c, rng) for i, (p, c) in enumerate([(1, 1), (4, 2), (2, 5)])]
    batch = collate(samples)
    ids, targets = batch.input_ids, batch.targets
    trained = targets != IGNORE_INDEX
    assert int(trained.sum()) == 1 + 2 + 5
    positions = torch.nonzero(trained)[:, 0]
    assert torch.equal(targets[positions], ids[positions + 1])
    last = batch.cu_seqlens[1:].long() - 1  # each sample's last position predicts nothing
    assert (targets[last] == IGNORE_INDEX).all()


def test_efficiency_and_rank_balance_on_a_realistic_mix():
    rng = np.random.default_rng(2)
    budget = 8192
    lengths = realistic_lengths(6000, budget, rng)
    for world_size in (1, 2, 8):
        stats = plan_packing(lengths, budget, world_size=world_size).stats
        capacity = stats.micro_batches * budget
        assert stats.tokens == int(lengths.sum())
        assert stats.efficiency == stats.tokens / capacity >= 0.98, world_size
        costs = np.array(stats.rank_costs)
        assert costs.max() / costs.min() - 1 <= 0.05, world_size
        assert stats.rank_imbalance == pytest.approx(costs.max() / costs.min() - 1)
        expected = 24576.0 * lengths.sum() + (lengths.astype(float) ** 2).sum()
        assert costs.sum() == pytest.approx(expected, rel=1e-12)


def test_bins_are_split_before_empty_micro_batches_are_added():
    split = plan_packing(np.array([6, 3, 3, 3, 3]), 10, world_size=3)
    assert (split.stats.split_micro_batches, split.stats.empty_micro_batches) == (1, 0)
    assert [len(r) for r in split.ranks] == [1, 1, 1]
    assert sorted(np.concatenate([b for r in split.ranks for b in r]).tolist()) == list(range(5))

    padded = plan_packing(np.array([6, 6, 6]), 10, world_size=2)
    assert (padded.stats.split_micro_batches, padded.stats.empty_micro_batches) == (0, 1)
    assert [len(r) for r in padded.ranks] == [2, 2]
    empty = collate([], np.array([], dtype=np.int64))
    assert empty.num_tokens == 0 and empty.cu_seqlens.tolist() == [0] and empty.max_seqlen == 0


def test_long_sample_raises_naming_it_or_is_truncated_and_counted():
    rng = np.random.default_rng(3)
    fits, too_long = _sample(0, 4, 4, rng), _sample(1, 6, 10, rng)
    all_prompt = _sample(2, 12, 3, rng)  # cut at 12, nothing left to train
    with pytest.raises(ValueError, match="task task1 trajectory traj1 turn 1: 16 tokens exceed"):
        pack([fits, too_long], 12)

    packed = pack([fits, too_long, all_prompt], 12, truncate=True)
    assert (packed.stats.truncated_samples, packed.stats.dropped_samples) == (2, 1)
    assert len(packed.samples) == 2
    cut = packed.samples[1]
    assert cut.length == 12 and cut.completion_len == 6
    np.testing.assert_array_equal(cut.input_ids, too_long.input_ids[:12])
    np.testing.assert_array_equal(cut.weights, too_long.weights[:6])
    # The kept completion tokens 6..11 are predicted at positions 5..10; all of them train.
    trained = sum(int((b.targets != IGNORE_INDEX).sum()) for b in packed.micro_batches(0))
    assert trained == 4 + 6
