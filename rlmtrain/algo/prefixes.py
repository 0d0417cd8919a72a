"""Shared prompt prefixes: which samples of a batch are laid out once behind a common prefix.

Every turn of every trajectory is its own sample (samples.py), and each one begins with the
system prompt; a batch of per-turn samples is therefore mostly copies of the same few hundred to
few thousand tokens. A causal LM's hidden states over a prefix do not depend on what follows it,
so those tokens need to be forwarded once: a *segment* lays the prefix out as one row and each
member's remaining tokens as rows that continue it (attention.py), with exactly the log-probs,
losses and gradients of the copied layout.

Grouping works on token ids alone. Sorted by their bytes, samples sharing a prefix are adjacent,
and the common prefix of any run is the smallest common prefix of neighbours in it. Runs are
grown greedily while what they save, (members - 1) x shared, does not shrink, and never below
`min_tokens`; a member's shared part stops short of its last prompt token, so every trained
position (which predicts a completion token) lies in its own row. Each run is then cut by first
fit decreasing into segments that fit a micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from rlmtrain.algo.first_fit import first_fit_decreasing
from rlmtrain.algo.samples import Sample

__all__ = ["Segment", "prefix_segments", "segment_cost", "segment_tokens"]


class Segment(msgspec.Struct, frozen=True):
    """Samples laid out behind one shared prefix: `prefix_len` tokens (0: none) taken from the
    first member, then each member's tokens from `prefix_len` on."""

    prefix_len: int
    members: np.ndarray
    """int64 sample indices."""


def prefix_segments(samples: Sequence[Sample], budget: int, min_tokens: int) -> list[Segment]:
    """Segments covering every sample once, each of at most `budget` tokens; `min_tokens` <= 0
    shares nothing (one plain segment per sample)."""
    if min_tokens <= 0 or len(samples) < 2:
        return [Segment(0, np.array([i], dtype=np.int64)) for i in range(len(samples))]
    order = sorted(range(len(samples)), key=lambda i: samples[i].input_ids.tobytes())
    segments: list[Segment] = []
    for shared, run in _runs(samples, order, min_tokens):
        segments.extend(_fit(samples, run, shared, budget))
    return segments


def segment_cost(
    samples: Sequence[Sample], segment: Segment, cost_linear: float, cost_quadratic: float
) -> float:
    """Training cost of a segment in packing.py's model (a*L + b*L^2 for a plain sample): the
    prefix once, each member's own tokens attending to the prefix and causally to themselves."""
    shared = segment.prefix_len
    own = np.array([samples[i].length - shared for i in segment.members.tolist()], np.float64)
    tokens = shared + own.sum()
    quadratic = shared**2 + (own**2 + 2.0 * shared * own).sum()
    return float(cost_linear * tokens + cost_quadratic * quadratic)


def segment_tokens(samples: Sequence[Sample], segment: Segment) -> int:
    """Tokens the segment lays out: the prefix once, then each member's remainder."""
    lengths = sum(samples[i].length for i in segment.members.tolist())
    return lengths - (len(segment.members) - 1) * segment.prefix_len


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _runs(
    samples: Sequence[Sample], order: list[int], min_tokens: int
) -> list[tuple[int, list[int]]]:
    """Greedy runs over the sorted order: (shared tokens, members); shared is 0 for a run of
    one."""
    runs: list[tuple[int, list[int]]] = []
    run = [order[0]]
    shared = samples[order[0]].prompt_len - 1
    for prev, index in zip(order, order[1:], strict=False):
        candidate = min(
            shared,
            _common_prefix(samples[prev].input_ids, samples[index].input_ids),
            samples[index].prompt_len - 1,
        )
        if candidate >= min_tokens and len(run) * candidate >= (len(run) - 1) * shared:
            run.append(index)
            shared = candidate
            continue
        runs.append((shared if len(run) > 1 else 0, run))
        run, shared = [index], samples[index].prompt_len - 1
    runs.append((shared if len(run) > 1 else 0, run))
    return runs


def _fit(samples: Sequence[Sample], run: list[int], shared: int, budget: int) -> list[Segment]:
    """Cut a run into segments of at most `budget` tokens (first fit decreasing over the
    members' own lengths in bins of budget - shared); a member left alone shares nothing."""
    members = np.array(run, dtype=np.int64)
    if shared == 0:
        return [Segment(0, members[i : i + 1]) for i in range(members.shape[0])]
    own = np.array([samples[i].length - shared for i in run], dtype=np.int64)
    bins = first_fit_decreasing(own, budget - shared)
    segments = []
    for label in np.unique(bins).tolist():
        chosen = members[bins == label]
        segments.append(Segment(shared if chosen.shape[0] > 1 else 0, chosen))
    return segments
