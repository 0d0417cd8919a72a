"""One training sample per turn (docs/algorithm.md §1: turn t+1's prompt does not extend turn t's).

A sample's `input_ids` are the turn's `prompt_ids + completion_ids` exactly as the engine saw
and produced them; nothing is re-tokenised. Per-token values follow the next-token alignment of a
causal LM: position i predicts input_ids[i + 1]. With P prompt tokens and C completion tokens,
completion token j sits at input position P + j and is predicted at position P - 1 + j; so the
trained positions are P - 1 .. P + C - 2 and the last position (L - 1) predicts nothing.
`sampler_logp`, `advantages` and `weights` hold one value per completion token j, i.e. for the
positions P - 1 + j; `targets()` and `loss_mask()` expand them to all L positions. Packing lays
them out the same way, so everything a loss reads is indexed by the position that predicts.

The per-token weights come from `weights.py` (the tree objective), the advantages from
`advantages.py`; a sample only carries them, it decides nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

from rlmtrain.algo.advantages import GroupAdvantages
from rlmtrain.algo.weights import group_token_weights
from rlmtrain.config import AlgoConfig
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn

__all__ = ["IGNORE_INDEX", "Sample", "build_samples"]

IGNORE_INDEX = -100
"""Target of a position that is not trained (prompt tokens, each sample's last position)."""


class Sample(msgspec.Struct, kw_only=True):
    """One turn as a training sample. Arrays are numpy; C = completion tokens, L = P + C."""

    task_id: str
    root_id: str
    trajectory_id: str
    depth: int
    turn: int
    """Index of the turn within its trajectory."""
    input_ids: np.ndarray
    """int64 [L]: prompt_ids + completion_ids."""
    prompt_len: int
    """P: the number of prompt tokens at the start of input_ids (>= 1)."""
    sampler_logp: np.ndarray
    """float32 [C]: the engine's log-prob of completion token j (NaN where the record had none)."""
    advantages: np.ndarray
    """float32 [C]: the advantage of completion token j."""
    weights: np.ndarray
    """float32 [C]: the loss weight of completion token j (module note of weights.py)."""

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def completion_len(self) -> int:
        return self.length - self.prompt_len

    @property
    def label(self) -> str:
        """Names the sample in error messages."""
        return f"task {self.task_id} trajectory {self.trajectory_id} turn {self.turn}"

    def loss_mask(self) -> np.ndarray:
        """bool [L]: True at the positions whose target is a completion token."""
        mask = np.zeros(self.length, dtype=bool)
        mask[self.prompt_len - 1 : self.length - 1] = True
        return mask

    def targets(self) -> np.ndarray:
        """int64 [L]: input_ids[i + 1] where trained, IGNORE_INDEX elsewhere."""
        targets = np.full(self.length, IGNORE_INDEX, dtype=np.int64)
        targets[self.prompt_len - 1 : self.length - 1] = self.input_ids[self.prompt_len :]
        return targets


def build_samples(
    groups: Sequence[RolloutGroup],
    advantages: Sequence[GroupAdvantages],
    config: AlgoConfig,
    *,
    num_groups: int | None = None,
    require_sampler_logprobs: bool = True,
) -> list[Sample]:
    """Samples of every turn that has completion tokens, of every trajectory in `advantages`.

    num_groups: groups in the global batch, the divisor of every weight; None = len(advantages),
        right when this call sees the whole batch. A data-parallel rank that builds samples for
        its share of the groups passes the global count.
    require_sampler_logprobs: False for teacher data (SFT) whose turns may carry no log-probs;
        those samples get NaN so that a loss which reads them fails loudly.
    """
    num_groups = len(advantages) if num_groups is None else num_groups
    samples: list[Sample] = []
    for group_adv in advantages:
        group = groups[group_adv.group_index]
        weights = group_token_weights(group, list(group_adv.roots), config, num_groups=num_groups)
        by_id = group.by_id()
        for traj_id, turn_advantages in group_adv.turns.items():
            traj = by_id[traj_id]
            turn_weights = weights[traj_id]
            for index, turn in enumerate(traj.turns):
                if not turn.completion_ids:
                    continue
                samples.append(
                    _turn_sample(
                        traj,
                        index,
                        turn,
                        turn_advantages[index],
                        turn_weights[index],
                        require_sampler_logprobs,
                    )
                )
    return samples


def _turn_sample(
    traj: Trajectory,
    index: int,
    turn: Turn,
    advantage: float,
    weight: float,
    require_sampler_logprobs: bool,
) -> Sample:
    where = f"task {traj.task_id} trajectory {traj.id} turn {index}"
    n_completion = len(turn.completion_ids)
    if not turn.prompt_ids:
        raise ValueError(f"{where}: empty prompt; no position predicts the first completion token")
    if not math.isfinite(advantage):
        raise ValueError(f"{where}: advantage is {advantage}")
    if len(turn.sampler_logprobs) == n_completion:
        sampler_logp = np.asarray(turn.sampler_logprobs, dtype=np.float32)
    elif not turn.sampler_logprobs and not require_sampler_logprobs:
        sampler_logp = np.full(n_completion, np.nan, dtype=np.float32)
    else:
        raise ValueError(
            f"{where}: {len(turn.sampler_logprobs)} sampler log-probs "
            f"for {n_completion} completion tokens"
        )
    return Sample(
        task_id=traj.task_id,
        root_id=traj.root_id,
        trajectory_id=traj.id,
        depth=traj.depth,
        turn=index,
        input_ids=np.asarray(turn.prompt_ids + turn.completion_ids, dtype=np.int64),
        prompt_len=len(turn.prompt_ids),
        sampler_logp=sampler_logp,
        advantages=np.full(n_completion, advantage, dtype=np.float32),
        weights=np.full(n_completion, weight, dtype=np.float32),
    )
