"""Which RL tasks each step trains: a function of the seed and the step alone, so that a
resumed run and every rank (an inference rank too) pick the same."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


def task_batches(items: list[T], size: int, seed: int) -> Iterator[list[T]]:
    """`size` items per step, endlessly: a window sliding over a shuffled order (wrapping at the
    end), reshuffled every len(items) // size steps by a generator of its own, so the k-th
    step's tasks depend on the seed alone (a resumed run skips k and is back in place)."""
    shuffle = random.Random(f"rl/{seed}").shuffle
    order = list(range(len(items)))
    per_pass = max(1, len(order) // size)
    for step in itertools.count():
        if step % per_pass == 0:
            shuffle(order)
        start = (step * size) % len(order)
        yield [items[order[(start + i) % len(order)]] for i in range(min(size, len(order)))]
