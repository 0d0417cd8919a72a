"""Samples -> packed micro-batches under a token budget, balanced over data-parallel ranks.

0. Shared prefixes (prefixes.py): samples that begin with the same tokens, typically every turn
   behind one system prompt, are grouped into segments that lay the prefix out once. The items
   planned below are segments; with `shared_prefix_tokens = 0` each sample is its own.
1. First-fit-decreasing into bins of `budget` tokens (first_fit.py).
2. An even bin count: while the count is not a multiple of `world_size`, the bin holding the most
   items is split in two. Only when no bin has two items left are empty micro-batches added
   (counted), since an empty micro-batch still costs every rank a forward/backward round; before
   that, `pack` splits the largest segment in two (its prefix then laid out twice).
3. Balance: bins are dealt to ranks in rounds of `world_size`, largest cost first, each round's
   largest bin to the currently lightest rank (LPT with equal counts). A rank's j-th micro-batch
   comes from round j, so micro-batches at the same index cost about the same on every rank,
   which matters when gradients are reduced per micro-batch.

Cost of a sample of L tokens is a·L + b·L². Training FLOPs of a decoder are about 72·h²·L per
layer for the matmuls and 6·h·L² for causal attention (forward + backward), a ratio a/b = 12·h.
The defaults (a, b) = (24576, 1) are 12·h for h = 2048 (Qwen3-1.7B); for other widths pass
cost_linear = 12·hidden_size (Qwen3-4B: 30720). A segment costs its prefix once plus each
member's own tokens attending to the prefix (`prefixes.segment_cost`).

Materialisation is lazy: `PackedBatches.micro_batches(rank)` collates one micro-batch at a time
into packed tensors, so planning 100k samples never holds their tokens twice. Every per-token
tensor is aligned to `targets` (position i predicts input_ids[i + 1], see samples.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec
import numpy as np
import torch

from rlmtrain.algo.first_fit import first_fit_decreasing
from rlmtrain.algo.prefixes import Segment, prefix_segments, segment_cost, segment_tokens
from rlmtrain.algo.samples import IGNORE_INDEX, Sample

__all__ = [
    "DEFAULT_COST_LINEAR",
    "DEFAULT_COST_QUADRATIC",
    "MicroBatch",
    "PackedBatches",
    "PackingPlan",
    "PackingStats",
    "Segment",
    "collate",
    "first_fit_decreasing",
    "pack",
    "plan_packing",
    "truncate_sample",
]

DEFAULT_COST_LINEAR = 24576.0
DEFAULT_COST_QUADRATIC = 1.0


class MicroBatch(msgspec.Struct, kw_only=True):
    """B samples packed into T tokens in R rows, no padding. A plain sample is one row; a
    segment's shared prefix is one row and each member's remainder a row continuing it
    (`prefix_of`). Per-token tensors are aligned to targets."""

    input_ids: torch.Tensor
    """int64 [T]"""
    position_ids: torch.Tensor
    """int64 [T]: each token's position in its own sample (a continuation starts at the
    length of its prefix)."""
    cu_seqlens: torch.Tensor
    """int32 [R + 1], row r spans input_ids[cu_seqlens[r] : cu_seqlens[r + 1]]."""
    prefix_of: torch.Tensor
    """int32 [R]: the prefix row that row r continues, -1 where it continues none."""
    max_seqlen: int
    """Longest row (flash-attn varlen wants it); 0 for an empty micro-batch."""
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
    sample_rows: np.ndarray
    """int64 [B]: the row holding each sample's own (last) tokens."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def placeholder(cls) -> MicroBatch:
        """One token that trains nothing (IGNORE target, zero weight): what a data-parallel
        rank with an empty micro-batch forwards so that it joins the others' collectives."""
        zero = torch.zeros(1)
        return cls(
            input_ids=torch.zeros(1, dtype=torch.int64),
            position_ids=torch.zeros(1, dtype=torch.int64),
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            prefix_of=torch.full((1,), -1, dtype=torch.int32),
            max_seqlen=1,
            targets=torch.full((1,), IGNORE_INDEX, dtype=torch.int64),
            weights=zero,
            advantages=zero.clone(),
            sampler_logp=zero.clone(),
            sample_indices=np.empty(0, dtype=np.int64),
            sample_rows=np.empty(0, dtype=np.int64),
        )

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device` (cu_seqlens stays int32)."""
        tensors = {
            name: getattr(self, name).to(device, non_blocking=True)
            for name in (
                "input_ids",
                "position_ids",
                "cu_seqlens",
                "prefix_of",
                "targets",
                "weights",
                "advantages",
                "sampler_logp",
            )
        }
        return MicroBatch(
            max_seqlen=self.max_seqlen,
            sample_indices=self.sample_indices,
            sample_rows=self.sample_rows,
            **tensors,
        )


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
    shared_tokens: int = 0
    """Prefix tokens not laid out again because segments share them (prefixes.py)."""


class PackingPlan(msgspec.Struct, kw_only=True):
    ranks: list[list[np.ndarray]]
    """ranks[r][j]: int64 indices of the items in rank r's j-th micro-batch (samples, once
    `pack` has mapped its segments back)."""
    stats: PackingStats
    segments: list[list[list[Segment]]] | None = None
    """segments[r][j]: how rank r's j-th micro-batch lays its samples out; None: one plain
    row per sample."""


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
        layouts = self.plan.segments[rank] if self.plan.segments is not None else None
        for j, indices in enumerate(self.plan.ranks[rank]):
            yield collate(self.samples, indices, None if layouts is None else layouts[j])


def plan_packing(
    lengths: np.ndarray,
    budget: int,
    *,
    world_size: int = 1,
    cost_linear: float = DEFAULT_COST_LINEAR,
    cost_quadratic: float = DEFAULT_COST_QUADRATIC,
    costs: np.ndarray | None = None,
) -> PackingPlan:
    """Micro-batches of item indices for each rank; see the module note for the method. Items
    cost a·L + b·L² unless `costs` gives each one's."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    lengths = np.asarray(lengths, dtype=np.int64)
    bins = _bins_from_labels(first_fit_decreasing(lengths, budget))
    bins, splits = _split_to_multiple(bins, lengths, world_size)
    empty = -len(bins) % world_size
    bins += [np.empty(0, dtype=np.int64)] * empty
    if costs is None:
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
    shared_prefix_tokens: int = 0,
    cost_linear: float = DEFAULT_COST_LINEAR,
    cost_quadratic: float = DEFAULT_COST_QUADRATIC,
) -> PackedBatches:
    """Plan micro-batches for `samples`. A sample longer than `budget` raises ValueError naming
    it, or with `truncate` is cut to `budget` tokens (counted; dropped if nothing is left to
    train). Samples sharing at least `shared_prefix_tokens` leading tokens lay them out once
    (0: never)."""
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
    kept = [s for s in kept if s is not None]
    dropped = len(samples) - len(kept)
    segments = prefix_segments(kept, budget, shared_prefix_tokens)
    while True:
        sizes = np.array([segment_tokens(kept, g) for g in segments], dtype=np.int64)
        costs = np.array(
            [segment_cost(kept, g, cost_linear, cost_quadratic) for g in segments], np.float64
        )
        plan = plan_packing(sizes, budget, world_size=world_size, costs=costs)
        splittable = [j for j, g in enumerate(segments) if g.members.shape[0] > 1]
        if not (plan.stats.empty_micro_batches and splittable):
            break
        largest = max(splittable, key=lambda j: sizes[j])
        segments[largest : largest + 1] = _halves(segments[largest])
    layouts = [[[segments[j] for j in items.tolist()] for items in rank] for rank in plan.ranks]
    plan.ranks = [[_members(layout) for layout in rank_layouts] for rank_layouts in layouts]
    plan.segments = layouts
    plan.stats.samples = len(kept)
    plan.stats.truncated_samples = int(too_long.size)
    plan.stats.dropped_samples = dropped
    plan.stats.shared_tokens = int(sum(s.length for s in kept)) - int(sizes.sum())
    return PackedBatches(samples=kept, plan=plan)


def _halves(segment: Segment) -> list[Segment]:
    members = segment.members
    half = members.shape[0] // 2
    return [
        Segment(segment.prefix_len if part.shape[0] > 1 else 0, part)
        for part in (members[:half], members[half:])
    ]


def _members(layout: list[Segment]) -> np.ndarray:
    if not layout:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([g.members for g in layout]).astype(np.int64, copy=False)


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


def collate(
    samples: Sequence[Sample],
    indices: Sequence[int] | None = None,
    segments: Sequence[Segment] | None = None,
) -> MicroBatch:
    """Pack `samples[indices]` (all of them when indices is None) into one MicroBatch, laid out
    as `segments` (whose members must be exactly `indices`, in order) or one plain row each."""
    if indices is None:
        indices = np.arange(len(samples), dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    if segments is None:
        segments = [Segment(0, indices[i : i + 1]) for i in range(indices.shape[0])]
    elif not np.array_equal(_members(list(segments)), indices):
        raise ValueError("collate: the segments' members are not the micro-batch's samples")
    rows: list[np.ndarray] = []  # token ids of each row
    starts: list[int] = []  # position of each row's first token in its sample
    prefix_of: list[int] = []
    sample_rows: list[int] = []
    trained_in_row: list[np.ndarray] = []  # per sample: in-row offsets of trained positions
    for segment in segments:
        shared = segment.prefix_len
        parent = -1
        if shared:
            parent = len(rows)
            rows.append(samples[int(segment.members[0])].input_ids[:shared])
            starts.append(0)
            prefix_of.append(-1)
        for index in segment.members.tolist():
            sample = samples[index]
            if shared and not np.array_equal(sample.input_ids[:shared], rows[parent]):
                raise ValueError(f"{sample.label}: does not begin with its segment's prefix")
            sample_rows.append(len(rows))
            rows.append(sample.input_ids[shared:])
            starts.append(shared)
            prefix_of.append(parent)
            # Completion token j is predicted at sample position P - 1 + j (samples.py).
            first = sample.prompt_len - 1 - shared
            trained_in_row.append(np.arange(first, first + sample.completion_len))
    lengths = np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=len(rows))
    ends = np.cumsum(lengths)
    row_offsets = ends - lengths
    total = int(ends[-1]) if rows else 0
    input_ids = _concat(rows, np.int64)
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(
        row_offsets - np.asarray(starts, dtype=np.int64), lengths
    )
    chosen = [samples[i] for i in indices.tolist()]
    placed = zip(sample_rows, trained_in_row, strict=True)
    trained = _concat([row_offsets[row] + offsets for row, offsets in placed], np.int64)
    targets = np.full(total, IGNORE_INDEX, dtype=np.int64)
    targets[trained] = input_ids[trained + 1]
    per_token = {}
    for name in ("weights", "advantages", "sampler_logp"):
        values = np.zeros(total, dtype=np.float32)
        values[trained] = _concat([getattr(s, name) for s in chosen], np.float32)
        per_token[name] = torch.from_numpy(values)
    cu_seqlens = np.zeros(len(rows) + 1, dtype=np.int32)
    cu_seqlens[1:] = ends
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(cu_seqlens),
        prefix_of=torch.tensor(prefix_of, dtype=torch.int32),
        max_seqlen=int(lengths.max()) if rows else 0,
        targets=torch.from_numpy(targets),
        sample_indices=indices,
        sample_rows=np.asarray(sample_rows, dtype=np.int64),
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
