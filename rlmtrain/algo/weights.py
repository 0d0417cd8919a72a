"""Per-token loss weights: the whole tree objective folded into one number per token.

docs/algorithm.md §4 averages a trajectory's tokens into its loss, averages a trajectory's
children's losses and adds them to its own (recursively), averages over the G roots of a group
and over the groups of the batch. Every step is linear, so J(θ) = Σ_tokens weight_t · ℓ_t with

    share(root)  = 1 / G                      G = scored roots of the group
    share(child) = share(parent) / k          k = the parent's number of children
    weight_t     = share(traj) · agg_t / n_groups

and agg_t from the trajectory's token aggregation: 1/N (token_mean, N = its completion tokens),
1/(n·N_turn) (turn_mean, n = its turns that have tokens), 1/D (constant_sum). n_groups is the
number of groups in the *global* batch. Because each weight is fixed before packing, summing
weight·ℓ over any split into micro-batches, ranks or orders gives the same J: there is no
per-micro-batch mean left to depend on how the tokens were cut.

`child_averaging=False` is the flat variant that peer trainers use (every descendant weighs like
its root; a root with many children then weighs more). Weights are computed in float64 and
rounded to float32 only when stored in a sample.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlmtrain.config import AlgoConfig
from rlmtrain.rlm.records import RolloutGroup, Trajectory

__all__ = ["group_token_weights", "tree_shares", "turn_token_weights"]


def tree_shares(
    group: RolloutGroup, root_ids: Sequence[str], *, child_averaging: bool = True
) -> dict[str, float]:
    """Trajectory id -> its share of the group's loss, for the given (scored) roots and all
    their descendants. Roots share 1/G equally; see the module note for children."""
    if not root_ids:
        return {}
    by_id = group.by_id()
    missing = [r for r in root_ids if r not in by_id]
    if missing:
        raise ValueError(f"root {missing[0]} is not in the group")
    root_share = 1.0 / len(root_ids)
    shares: dict[str, float] = {}
    for root_id in root_ids:
        for traj in group.tree(by_id[root_id]):
            share = shares.setdefault(traj.id, root_share)
            if traj.children:
                child_share = share / len(traj.children) if child_averaging else root_share
                for child_id in traj.children:
                    shares[child_id] = child_share
    return shares


def turn_token_weights(
    traj: Trajectory, share: float, *, aggregation: str, divisor: float = 1.0
) -> list[float]:
    """The weight of every completion token of each turn of `traj` (one value per turn: all
    tokens of a turn weigh the same under every aggregation). A turn without tokens gets 0."""
    lengths = [len(turn.completion_ids) for turn in traj.turns]
    if aggregation == "token_mean":
        total = sum(lengths)
        return [share / total if n else 0.0 for n in lengths]
    if aggregation == "turn_mean":
        turns = sum(1 for n in lengths if n)
        return [share / (turns * n) if n else 0.0 for n in lengths]
    if aggregation == "constant_sum":
        if not divisor > 0:
            raise ValueError(f"constant_sum_divisor must be > 0, got {divisor}")
        return [share / divisor if n else 0.0 for n in lengths]
    raise ValueError(
        f"unknown token_aggregation {aggregation!r}; use token_mean, turn_mean or constant_sum"
    )


def group_token_weights(
    group: RolloutGroup, root_ids: Sequence[str], config: AlgoConfig, *, num_groups: int
) -> dict[str, list[float]]:
    """Trajectory id -> per-turn token weight, already divided by the global number of groups."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    shares = tree_shares(group, root_ids, child_averaging=config.child_averaging)
    by_id = group.by_id()
    return {
        traj_id: [
            w / num_groups
            for w in turn_token_weights(
                by_id[traj_id],
                share,
                aggregation=config.token_aggregation,
                divisor=config.constant_sum_divisor,
            )
        ]
        for traj_id, share in shares.items()
    }
