"""The algorithm between rollout and training step: GRPO advantages over trajectory trees,
per-turn samples with exact per-token loss weights, and token-budget packing.

    groups + root rewards --compute_advantages--> GroupAdvantages --build_samples--> Samples
    Samples --pack--> PackedBatches --micro_batches(rank)--> MicroBatch (packed tensors)

No engine, no model, no kernel is imported here; torch appears only in the packed tensors.
"""

from rlmtrain.algo.advantages import (
    AdvantageStats,
    GroupAdvantages,
    compute_advantages,
    group_advantages,
)
from rlmtrain.algo.packing import (
    MicroBatch,
    PackedBatches,
    PackingPlan,
    PackingStats,
    collate,
    pack,
    plan_packing,
)
from rlmtrain.algo.samples import IGNORE_INDEX, Sample, build_samples
from rlmtrain.algo.sft import SftFilterStats, build_sft_samples, filter_teacher
from rlmtrain.algo.weights import group_token_weights

__all__ = [
    "IGNORE_INDEX",
    "AdvantageStats",
    "GroupAdvantages",
    "MicroBatch",
    "PackedBatches",
    "PackingPlan",
    "PackingStats",
    "Sample",
    "SftFilterStats",
    "build_samples",
    "build_sft_samples",
    "collate",
    "compute_advantages",
    "filter_teacher",
    "group_advantages",
    "group_token_weights",
    "pack",
    "plan_packing",
]
