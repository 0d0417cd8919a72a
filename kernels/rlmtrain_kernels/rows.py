"""Only trained rows reach the LM head.

In packed RL and SFT batches most tokens are prompt: system prompt, REPL observations, earlier
turns. Their targets are `ignore_index` and their log-probs, entropies and gradients are defined to
be 0, so every op gathers the rows it trains on, runs the head over those alone and scatters the
per-row results back. The head's cost then follows the trained tokens, not the packed ones, and
whatever an ignored row holds (padding, garbage, inf) can never reach a result or a gradient.

Checking the ids and counting the rows take one host sync per op call on CUDA (the GPU idles
from it until the host launches again); inside a custom op it is invisible to torch.compile.
"""

from __future__ import annotations

import torch

__all__ = ["TrainedRows"]


class TrainedRows:
    """The rows of one call whose target is not `ignore_index`, and the gather/scatter to them."""

    def __init__(self, op: str, targets: torch.Tensor, ignore_index: int, vocab: int) -> None:
        """`op`: the public op the rows are for, which a bad id's error names."""
        trained = targets != ignore_index
        # An id past the head (a tokenizer larger than the model's vocabulary, say) would
        # otherwise get a log-prob of -lse, silently.
        outside = trained & ((targets < 0) | (targets >= vocab))
        # Both counts in one transfer: the op's only synchronisation.
        count, outside_count = torch.stack([trained.sum(), outside.sum()]).tolist()
        if outside_count:
            row = int(outside.nonzero()[0, 0])
            raise ValueError(
                f"{op}: targets must be token ids in [0, {vocab}) or ignore_index={ignore_index}; "
                f"row {row} holds {int(targets[row])}"
            )
        self.total = targets.shape[0]
        self.count = count
        # All rows trained (the common case of unpacked losses): no copies at all. Otherwise the
        # count is known, so finding the rows needs no second synchronisation.
        self.index = (
            None if count == self.total else torch.nonzero_static(trained, size=count).squeeze(1)
        )

    def take(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The trained rows of a per-row tensor [N, ...] (None passes through)."""
        if t is None or self.index is None:
            return t
        return t.index_select(0, self.index)

    def put(self, rows: torch.Tensor) -> torch.Tensor:
        """A per-row tensor [count, ...] of the trained rows back at [N, ...], 0 elsewhere."""
        if self.index is None:
            return rows
        out = rows.new_zeros((self.total, *rows.shape[1:]))
        return out.index_copy_(0, self.index, rows)
