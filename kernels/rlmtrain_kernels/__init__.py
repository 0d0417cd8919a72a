"""Fused log-prob and GRPO-loss kernels for linear LM heads (Triton, with a chunked torch backend).

Embeddable on its own: the distribution `rlmtrain-kernels` (this folder's `pyproject.toml`)
installs it without the trainer, and it imports only torch and triton; the trainer reaches it as
`rlmtrain.kernels`. None of these ops allocates an [N, V] logits tensor. Shapes: hidden [N, H]
(packed tokens, no batch dim), weight [V, H] (the LM head, same dtype as hidden: bf16, fp16 or
fp32), targets [N] int token ids; every per-token tensor is [N]; log-probs, entropies, losses and
metrics come back in fp32. The head is bias-free and unscaled: logits = hidden @ weight.T /
temperature (a head with a bias or a logit soft-cap is another function). The log-probs a ratio
is taken against (old_logp, ref_logp, sampler_logp) must be fp32 or fp64 (or grpo_loss's logp
dtype): in bf16 a log-prob of -20 is off by up to 0.06, a 6% ratio. A NaN in a counted token
reaches the loss and the gradient alike. Autograd only: torch.func's transforms (grad, vmap,
jacrev) are not supported.

    fused_linear_logprob(hidden, weight, targets, *, temperature=1.0, return_entropy=False,
                         ignore_index=-100, impl="auto", variants=None) -> logp [N] (, entropy [N])
    grpo_loss(logp, old_logp | None, advantages, weights, *, ref_logp=None, beta=0.0,
              clip_low=0.2, clip_high=0.2, dual_clip=None, sampler_logp=None, tis_cap=None,
              impl="auto") -> (loss [], GRPOMetrics)
    fused_linear_grpo_loss(hidden, weight, targets, old_logp | None, advantages, weights, *,
              <grpo options>, temperature=1.0, ignore_index=-100, return_entropy=False,
              impl="auto", variants=None) -> (loss [], GRPOMetrics (, entropy [N]))
    fused_linear_nll(hidden, weight, targets, weights, *, temperature=1.0, ignore_index=-100,
                     return_entropy=False, impl="auto", variants=None) -> loss [] (, entropy [N])

impl: "triton" runs the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1) and raises
`KernelBackendUnavailable` where it cannot; "torch" runs the chunked torch backend; "auto" picks
Triton on CUDA and torch elsewhere. variants: which Triton path each stage takes and how large
its slabs are (`Variants`; None takes the measured winners), chosen per call like impl and
passed to the custom ops as an argument, so no call's choice reaches another's and
torch.compile sees it. All ops are torch.library custom ops, so torch.compile traces callers
without graph breaks. old_logp=None means pi_old is the detached current policy (one update per
rollout batch; the ratio is 1, its gradient the policy gradient). Rows whose target is
`ignore_index` never reach the head (`rows.TrainedRows`). The Triton tile shapes live in
`tiles`; by default the log-prob op and the fused losses on 16-bit inputs form each slab's fp32
logits with a matrix product and read them with Triton passes per row (`logit_slabs`).
"""

from ._backend import KernelBackendUnavailable, triton_unusable_reason
from .fused_grpo import fused_linear_grpo_loss
from .fused_nll import fused_linear_nll
from .grpo_loss import GRPOMetrics, grpo_loss
from .logprob import fused_linear_logprob
from .variants import Variants

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
