"""The LM-head losses computed the plain way, over full [N, V] logits: the unfused baseline.

`train.loss_impl = "unfused"` trains through these instead of the fused kernels, so a run's
curve can be checked step for step against the fused one (a fused kernel that drifts shows up
there, not only in its unit tests). They materialise the logits of every row, ignored rows
included, and cost memory accordingly: a check, not a way to train.

Same signatures and results as `kernels.fused_linear_logprob`, `fused_linear_nll` and
`fused_linear_grpo_loss` for what the trainer passes (the clipped objective itself is
`kernels.grpo_loss` on the log-probs, the one piece that holds no [N, V] tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlmtrain.kernels import GRPOMetrics, grpo_loss

__all__ = ["unfused_grpo_loss", "unfused_logprob", "unfused_nll"]


def unfused_logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """logp [N] fp32 of `targets` under softmax(hidden @ weight.T / temperature); 0 on ignored
    rows (and the entropy [N], detached, when asked)."""
    logits = (hidden.float() @ weight.float().T) / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    trained = targets != ignore_index
    logp = log_probs.gather(1, targets.clamp(min=0)[:, None])[:, 0] * trained
    if not return_entropy:
        return logp
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1) * trained
    return logp, entropy


def unfused_nll(
    hidden: Tensor, weight: Tensor, targets: Tensor, weights: Tensor, *, return_entropy=False
) -> Tensor | tuple[Tensor, Tensor]:
    """sum(weights * -logp): the weighted NLL `fused_linear_nll` computes."""
    logp, entropy = unfused_logprob(hidden, weight, targets, return_entropy=True)
    loss = -(weights.float() * logp).sum()
    return (loss, entropy) if return_entropy else loss


def unfused_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    weights: Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    **objective,
) -> tuple[Tensor, GRPOMetrics] | tuple[Tensor, GRPOMetrics, Tensor]:
    """The clipped GRPO objective of `fused_linear_grpo_loss`, over full logits; `objective`
    holds grpo_loss's keywords (ref_logp, beta, clips, sampler_logp, tis_cap)."""
    logp, entropy = unfused_logprob(
        hidden, weight, targets, temperature=temperature, return_entropy=True
    )
    loss, metrics = grpo_loss(logp, old_logp, advantages, weights, impl="torch", **objective)
    return (loss, metrics, entropy) if return_entropy else (loss, metrics)
