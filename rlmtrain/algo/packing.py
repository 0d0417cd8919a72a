"""Samples -> packed micro-batches under a token budget, balanced over data-parallel ranks.

Planning works on sample lengths only and is all numpy:

1. First-fit-decreasing into bins of `budget` tokens. Samples longer than budget/2 each open a
   bin (no two fit together), all at once. Shorter samples of equal length are placed as one
   run: first fit puts such a run into the open bins in index order, each taking
   floor(room / L), then into new bins; that is what item-by-item FFD does, in one vectorised
   step per distinct length (at most budget/2 steps, not one per sample).
2. An even bin count: while the count is not a multiple of `world_size`, the bin holding the most
   samples is split in two. Only when no bin has two samples left are empty micro-batches added
   (counted), since an empty micro-batch still costs every rank a forward/backward round.
3. Balance: bins are dealt to ranks in rounds of `world_size`, largest cost first, each round's
   largest bin to the currently lightest rank (LPT with equal counts). A rank's j-th micro-batch
   comes from round j, so micro-batches at the same index cost about the same on every rank,
   which matters when gradients are reduced per micro-batch.

Cost of a sample of L tokens is a·L + b·L². Training FLOPs of a decoder are about 72·h²·L per
layer for the matmuls and 6·h·L² for causal attention (forward + backward), a ratio a/b = 12·h.
The defaults (a, b) = (24576, 1) are 12·h for h = 2048 (Qwen3-1.7B); for other widths pass
cost_linear = 12·hidden_size (Qwen3-4B: 30720).

Materialisation is lazy: `PackedBatches.micro_batches(rank)` collates one micro-batch at a time
into packed tensors, so planning 100k samples never holds their tokens twice. Every per-token
tensor is aligned to `targets` (position i predicts input_ids[i + 1], see samples.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec
import numpy as np
import torch

from rlmtrain.algo.samples import IGNORE_INDEX, Sample

__all__ = [
    "DEFAULT_COST_LINEAR",
    "DEFAULT_COST_QUADRATIC",
    "MicroBatch",
    "PackedBatches",
    "PackingPlan",
    "PackingStats",
    "collate",
    "first_fit_decreasing",
    "pack",
    "plan_packing",
    "truncate_sample",
]

DEFAULT_COST_LINEAR = 24576.0
DEFAULT_COST_QUADRATIC = 1.0


class MicroBatch(msgspec.Struct, kw_only=True):
    """B samples packed into T tokens, no padding. Per-token tensors are aligned to targets."""

    input_ids: torch.Tensor
    """int64 [T]"""
    position_ids: torch.Tensor
    """int64 [T], restarting at 0 for each sample."""
    cu_seqlens: torch.Tensor
    """int32 [B + 1], sample b spans input_ids[cu_seqlens[b] : cu_seqlens[b + 1]]."""
    max_seqlen: int
    """Longest sample (flash-attn varlen wants it); 0 for an empty micro-batch."""
    targets: torch.Tensor
    """int64 [T]: input_ids[i + 1] at trained positions, IGNORE_INDEX (-100) elsewhere."""
    weights: torch.Tensor
    """float32 [T]: loss weight, 0 where not trained."""
    advantages: torch.Tensor
    """float32 [T]: advantage, 0 where not trained."""
    sampler_logp: torch.Tensor
    """float32 [T]: the engine's log-prob of the target, 0 where not trained."""
    sample_indices: np.ndarray
    """int64 [B]: which samples of the packed list, in order."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device` (cu_seqlens stays int32)."""
        tensors = {
            name: getattr(self, name).to(device, non_blocking=True)
            for name in (
                "input_ids",
                "position_ids",
                "cu_seqlens",
                "targets",
                "weights",
                "advantages",
                "sampler_logp",
            )
        }
        return MicroBatch(max_seqlen=self.max_seqlen, sample_indices=self.sample_indices, **tensors)


class PackingStats(msgspec.Struct, kw_only=True):
    budget: int
    samples: int
    """Samples packed (after truncation drops)."""
    tokens: int
    micro_batches: int
    """Over all ranks, empty ones included."""
    micro_batches_per_rank: int
    empty_micro_batches: int
    """Added because the bins could not be split into a multiple of world_size."""
    split_micro_batches: int
    """Bins split in two to reach a multiple of world_size."""
    efficiency: float
    """tokens / (micro_batches * budget)."""
    rank_costs: list[float]
    rank_imbalance: float
    """max(rank_costs) / min(rank_costs) - 1."""
    truncated_samples: int = 0
    dropped_samples: int = 0
    """Samples that truncation left with no trained token."""


class PackingPlan(msgspec.Struct, kw_only=True):
    ranks: list[list[np.ndarray]]
    """ranks[r][j]: int64 indices of the samples in rank r's j-th micro-batch."""
    stats: PackingStats


class PackedBatches(msgspec.Struct, kw_only=True):
    samples: list[Sample]
    """The samples the plan indexes (long ones truncated, emptied ones gone)."""
    plan: PackingPlan

    @property
    def stats(self) -> PackingStats:
        return self.plan.stats

    def micro_batches(self, rank: int = 0) -> Iterator[MicroBatch]:
        """Collate rank `rank`'s micro-batches one at a time, in plan order."""
        if not 0 <= rank < len(self.plan.ranks):
            raise ValueError(f"rank {rank} out of range for world_size {len(self.plan.ranks)}")
        for indices in self.plan.ranks[rank]:
            yield collate(self.samples, indices)


def first_fit_decreasing(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Bin of each item (int64 [n], bins numbered in opening order) under FFD with capacity
    `budget`. Every length must be in 1..budget."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if lengths.min() < 1 or lengths.max() > budget:
        bad = int(np.flatnonzero((lengths < 1) | (lengths > budget))[0])
        raise ValueError(f"item {bad} has length {int(lengths[bad])}, outside 1..{budget}")
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    room = np.empty(n, dtype=np.int64)
    sorted_bins = np.empty(n, dtype=np.int64)
    # Items over half the budget never fit beside an earlier (longer) one: one new bin each.
    n_bins = int(np.count_nonzero(2 * sorted_lengths > budget))
    sorted_bins[:n_bins] = np.arange(n_bins)
    room[:n_bins] = budget - sorted_lengths[:n_bins]
    rest_lengths = sorted_lengths[n_bins:]
    run_bounds = np.r_[n_bins + np.flatnonzero(np.diff(rest_lengths, prepend=-1)), n].tolist()
    for start, end in zip(run_bounds[:-1], run_bounds[1:], strict=True):
        length = int(sorted_lengths[start])
        count = end - start
        open_bins = np.flatnonzero(room[:n_bins] >= length)
        fits = room[open_bins] // length
        filled = np.cumsum(fits)
        last = int(np.searchsorted(filled, count))
        if last < open_bins.shape[0]:
            bins, takes = open_bins[: last + 1], fits[: last + 1].copy()
            takes[-1] -= filled[last] - count
        else:
            bins, takes = open_bins, fits
        room[bins] -= takes * length
        rest = count - int(takes.sum())
        if rest:
            per_bin = budget // length
            new = -(-rest // per_bin)
            new_takes = np.full(new, per_bin, dtype=np.int64)
            new_takes[-1] = rest - per_bin * (new - 1)
            new_bins = np.arange(n_bins, n_bins + new)
            room[n_bins : n_bins + new] = budget - new_takes * length
            n_bins += new
            bins, takes = np.r_[bins, new_bins], np.r_[takes, new_takes]
        sorted_bins[start:end] = np.repeat(bins, takes)
    bin_of = np.empty(n, dtype=np.int64)
    bin_of[order] = sorted_bins
    return bin_of


def plan_packing(
    lengths: np.ndarray,
    budget: int,
    *,
    world_size: int = 1,
    cost_linear: float = DEFAULT_COST_LINEAR,
    cost_quadratic: float = DEFAULT_COST_QUADRATIC,
) -> PackingPlan:
    """Micro-batches of sample indices for each rank; see the module note for the method."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    lengths = np.asarray(lengths, dtype=np.int64)
    bins = _bins_from_labels(first_fit_decreasing(lengths, budget))
    bins, splits = _split_to_multiple(bins, lengths, world_size)
    empty = -len(bins) % world_size
    bins += [np.empty(0, dtype=np.int64)] * empty
    as_float = lengths.astype(np.float64)
    costs = cost_linear * as_float + cost_quadratic * as_float**2
    sizes = np.fromiter((b.shape[0] for b in bins), dtype=np.int64, count=len(bins))
    members = np.concatenate(bins) if bins else np.empty(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(bins)), sizes)
    bin_costs = np.bincount(owner, weights=costs[members], minlength=len(bins))
    ranks, rank_costs = _deal(bin_costs, world_size)
    tokens = int(lengths.sum())
    stats = PackingStats(
        budget=budget,
        samples=int(lengths.shape[0]),
        tokens=tokens,
        micro_batches=len(bins),
        micro_batches_per_rank=len(bins) // world_size,
        empty_micro_batches=empty,
        split_micro_batches=splits,
        efficiency=tokens / (len(bins) * budget) if bins else 1.0,
        rank_costs=rank_costs.tolist(),
        rank_imbalance=_imbalance(rank_costs),
    )
    return PackingPlan(ranks=[[bins[j] for j in rank] for rank in ranks], stats=stats)


def pack(
    samples: Sequence[Sample],
    budget: int,
    *,
    world_size: int = 1,
    truncate: bool = False,
    cost_linear: float = DEFAULT_COST_LINEAR,
    cost_quadratic: float = DEFAULT_COST_QUADRATIC,
) -> PackedBatches:
    """Plan micro-batches for `samples`. A sample longer than `budget` raises ValueError naming
    it, or with `truncate` is cut to `budget` tokens (counted; dropped if nothing is left to
    train)."""
    kept = list(samples)
    lengths = np.fromiter((s.input_ids.shape[0] for s in kept), dtype=np.int64, count=len(kept))
    too_long = np.flatnonzero(lengths > budget)
    if too_long.size and not truncate:
        sample = kept[int(too_long[0])]
        raise ValueError(
            f"{sample.label}: {sample.length} tokens exceed the micro-batch budget of "
            f"{budget} (raise algo.micro_batch_tokens or set algo.truncate_long_samples)"
        )
    for i in too_long.tolist():
        kept[i] = truncate_sample(kept[i], budget)
    emptied = [i for i in too_long.tolist() if kept[i] is None]
    if emptied:
        kept = [s for s in kept if s is not None]
        lengths = np.delete(lengths, emptied)
    np.minimum(lengths, budget, out=lengths)  # a truncated sample is now exactly budget long
    plan = plan_packing(
        lengths,
        budget,
        world_size=world_size,
        cost_linear=cost_linear,
        cost_quadratic=cost_quadratic,
    )
    plan.stats.truncated_samples = int(too_long.size)
    plan.stats.dropped_samples = len(emptied)
    return PackedBatches(samples=kept, plan=plan)


def truncate_sample(sample: Sample, max_len: int) -> Sample | None:
    """The first `max_len` tokens of `sample`, or None when no completion token is left to
    train. Cutting the tail keeps every remaining token's context, hence its log-probs, exact;
    the cut tokens' share of the loss is lost, not moved elsewhere."""
    if sample.length <= max_len:
        return sample
    kept_completion = max_len - sample.prompt_len
    if kept_completion < 1:
        return None
    return msgspec.structs.replace(
        sample,
        input_ids=sample.input_ids[:max_len],
        sampler_logp=sample.sampler_logp[:kept_completion],
        advantages=sample.advantages[:kept_completion],
        weights=sample.weights[:kept_completion],
    )


def collate(samples: Sequence[Sample], indices: Sequence[int] | None = None) -> MicroBatch:
    """Pack `samples[indices]` (all of them when indices is None) into one MicroBatch."""
    if indices is None:
        indices = np.arange(len(samples), dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    chosen = [samples[i] for i in indices.tolist()]
    count = len(chosen)
    lengths = np.fromiter((s.length for s in chosen), dtype=np.int64, count=count)
    prompt_lens = np.fromiter((s.prompt_len for s in chosen), dtype=np.int64, count=count)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1]) if count else 0
    input_ids = _concat([s.input_ids for s in chosen], np.int64)
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)

    # Completion token j of sample b is predicted at position starts[b] + prompt_lens[b] - 1 + j.
    completion_lens = lengths - prompt_lens
    completion_starts = np.cumsum(completion_lens) - completion_lens
    trained = np.repeat(starts + prompt_lens - 1 - completion_starts, completion_lens)
    trained += np.arange(trained.shape[0], dtype=np.int64)

    targets = np.full(total, IGNORE_INDEX, dtype=np.int64)
    targets[trained] = input_ids[trained + 1]
    per_token = {}
    for name in ("weights", "advantages", "sampler_logp"):
        values = np.zeros(total, dtype=np.float32)
        values[trained] = _concat([getattr(s, name) for s in chosen], np.float32)
        per_token[name] = torch.from_numpy(values)
    cu_seqlens = np.zeros(count + 1, dtype=np.int32)
    cu_seqlens[1:] = ends
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(cu_seqlens),
        max_seqlen=int(lengths.max()) if count else 0,
        targets=torch.from_numpy(targets),
        sample_indices=indices,
        **per_token,
    )


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)


def _bins_from_labels(bin_of: np.ndarray) -> list[np.ndarray]:
    """Item indices of each bin, in bin order and, within a bin, in item order."""
    if bin_of.shape[0] == 0:
        return []
    order = np.argsort(bin_of, kind="stable")
    bounds = np.flatnonzero(np.diff(bin_of[order])) + 1
    return np.split(order, bounds)


def _split_to_multiple(
    bins: list[np.ndarray], lengths: np.ndarray, world_size: int
) -> tuple[list[np.ndarray], int]:
    """Split the most populous bin in two until the count is a multiple of world_size or no
    bin has two samples. Each half gets samples in decreasing length to the lighter side."""
    splits = 0
    while len(bins) % world_size:
        fullest = max(range(len(bins)), key=lambda j: bins[j].shape[0])
        items = bins[fullest]
        if items.shape[0] < 2:
            break
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0, 0]
        for item in items[np.argsort(-lengths[items], kind="stable")].tolist():
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(item)
            loads[side] += int(lengths[item])
        bins[fullest] = np.sort(np.array(halves[0], dtype=np.int64))
        bins.append(np.sort(np.array(halves[1], dtype=np.int64)))
        splits += 1
    return bins, splits


def _deal(bin_costs: np.ndarray, world_size: int) -> tuple[list[list[int]], np.ndarray]:
    """Deal bins to ranks in rounds, largest first to the lightest rank; equal counts."""
    order = np.argsort(-bin_costs, kind="stable")
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = np.zeros(world_size, dtype=np.float64)
    for round_start in range(0, order.shape[0], world_size):
        round_bins = order[round_start : round_start + world_size]
        lightest_first = np.argsort(loads, kind="stable")
        for rank, j in zip(lightest_first.tolist(), round_bins.tolist(), strict=True):
            ranks[rank].append(j)
            loads[rank] += bin_costs[j]
    return ranks, loads


def _imbalance(rank_costs: np.ndarray) -> float:
    high, low = float(rank_costs.max()), float(rank_costs.min())
    if high == 0.0:
        return 0.0
    return high / low - 1.0 if low > 0 else float("inf")
