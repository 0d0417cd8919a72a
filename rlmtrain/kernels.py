"""The fused kernels under the trainer's name: the public API of `rlmtrain_kernels` (the
distribution built from the top-level `kernels/` folder, installable without the trainer), so
`from rlmtrain.kernels import fused_linear_grpo_loss` is the same op object either way."""

from rlmtrain_kernels import (
    GRPOMetrics,
    KernelBackendUnavailable,
    Variants,
    fused_linear_grpo_loss,
    fused_linear_logprob,
    fused_linear_nll,
    grpo_loss,
    triton_unusable_reason,
)

__all__ = [
    "GRPOMetrics",
    "KernelBackendUnavailable",
    "Variants",
    "fused_linear_grpo_loss",
    "fused_linear_logprob",
    "fused_linear_nll",
    "grpo_loss",
    "triton_unusable_reason",
]
