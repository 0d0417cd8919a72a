"""First-fit-decreasing bin packing of integer lengths, vectorised over runs of equal length.

Items longer than half the capacity each open a bin (no two fit together), all at once. Shorter
items of equal length are placed as one run: first fit puts such a run into the open bins in
index order, each taking floor(room / L), then into new bins; that is what item-by-item FFD
does, in one vectorised step per distinct length (at most capacity/2 steps, not one per item).
"""

from __future__ import annotations

import numpy as np

__all__ = ["first_fit_decreasing"]


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
