"""Linear head + weighted NLL for SFT: loss = -sum(weights * logp), gradients computed in the
forward pass like `fused_linear_grpo_loss` (the per-token gradient is simply -weight).

Rows whose target is `ignore_index` contribute nothing and never reach the head
(`rows.TrainedRows`). No [N, V] tensor is ever allocated.
"""

from __future__ import annotations

import torch

from . import logit_slabs, reference, second_order
from ._backend import resolve_impl
from .grpo_loss import check_token_tensors
from .head_checks import check_backend_dtype, check_linear_inputs
from .logprob import logprob_backward_triton, logprob_forward_triton
from .rows import TrainedRows
from .stored_grads import scaled_grad
from .variants import Variants, resolve

__all__ = ["fused_linear_nll"]


@torch.library.custom_op("rlmtrain_kernels::linear_nll_fwd", mutates_args=())
def _linear_nll_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    impl: str,
    variants: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = Variants.from_spec(variants)
    rows = TrainedRows("fused_linear_nll", targets, ignore_index, weight.shape[0])
    hidden, targets = rows.take(hidden), rows.take(targets)
    grad_logp = -rows.take(weights).float()
    need_grads = need_grad_hidden or need_grad_weight
    if impl == "torch":
        logp, entropy, grad_hidden, grad_weight = reference.linear_logprob_row_grads(
            hidden, weight, targets, lambda rows, _: grad_logp[rows],
            temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy,
            need_grads=need_grads, need_grad_weight=need_grad_weight,
        )  # fmt: skip
    elif need_grads and chosen.stores_logits("row_grads", hidden.dtype):
        logp, entropy, grad_hidden, grad_weight = logit_slabs.row_grads(
            hidden, weight, targets, lambda rows, _: grad_logp[rows], temperature=temperature,
            with_entropy=with_entropy, need_grad_hidden=need_grad_hidden,
            need_grad_weight=need_grad_weight, slab_bytes=chosen.logit_slab_bytes,
        )  # fmt: skip
    else:
        logp, entropy, lse = logprob_forward_triton(
            hidden, weight, targets, temperature=temperature, ignore_index=ignore_index,
            with_entropy=with_entropy, variants=chosen,
        )  # fmt: skip
        grad_hidden, grad_weight = logprob_backward_triton(
            hidden, weight, targets, lse, None, grad_logp, None,
            temperature=temperature, ignore_index=ignore_index,
            need_grad_hidden=need_grad_hidden, need_grad_weight=need_grad_weight, variants=chosen,
        )  # fmt: skip

    # Custom ops return tensors only, none aliasing another: a fresh empty one means "not needed".
    # Of the dtype the present one would have, as the fake kernel says (fp64 for fp64 inputs).
    def absent():
        return hidden.new_empty(0, dtype=reference.accumulation_dtype(hidden.dtype))

    return (
        (grad_logp * logp).sum(),
        rows.put(entropy) if with_entropy else entropy,
        rows.put(grad_hidden) if need_grad_hidden else absent(),
        grad_weight if need_grad_weight else absent(),
    )


@_linear_nll_fwd.register_fake
def _(hidden, weight, targets, weights, temperature, ignore_index, with_entropy, need_grad_hidden,
      need_grad_weight, impl, variants):  # fmt: skip
    # fp64 inputs (the gradcheck path, torch only) give fp64 outputs; any other dtype fp32.
    out = dict(dtype=reference.accumulation_dtype(hidden.dtype), device=hidden.device)
    return (
        hidden.new_empty((), **out),
        hidden.new_empty(hidden.shape[0] if with_entropy else 0, **out),
        hidden.new_empty(hidden.shape if need_grad_hidden else (0,), **out),
        hidden.new_empty(weight.shape if need_grad_weight else (0,), **out),
    )


class LinearNLLFunction(torch.autograd.Function):
    """The forward already holds dLoss/dHidden and dLoss/dWeight; backward scales them. A
    backward that is itself differentiated forms them again by autograd (`second_order`), from
    the inputs kept for it."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, *options):
        loss, entropy, grad_hidden, grad_weight = _linear_nll_fwd(
            hidden, weight, targets, weights, *options
        )
        ctx.save_for_backward(grad_hidden, grad_weight, hidden, weight, targets, weights)
        ctx.options = options
        ctx.mark_non_differentiable(entropy)
        return loss, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_entropy):
        grad_hidden, grad_weight, hidden, weight, targets, weights = ctx.saved_tensors
        needed = ctx.needs_input_grad[:2]
        if second_order.wanted():
            temperature, ignore_index, *_ = ctx.options
            logp, _ = second_order.head_logprobs(
                hidden, weight, targets, temperature, ignore_index, with_entropy=False
            )
            loss = -(torch.where(targets != ignore_index, weights, 0.0) * logp).sum()
            grads = second_order.grads([loss], [grad_loss], (hidden, weight), needed)
        else:
            stored = zip((grad_hidden, grad_weight), (hidden, weight), needed, strict=True)
            grads = [scaled_grad(g, grad_loss, t.dtype) if need else None for g, t, need in stored]
        return *grads, None, None, *[None] * len(ctx.options)


def fused_linear_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    impl: str = "auto",
    variants: Variants | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Weighted negative log-likelihood of a linear LM head, -sum(weights * logp).

    Args:
        hidden: [N, H] bf16/fp16/fp32; weight: [V, H] same dtype; targets: [N] int ids or
            `ignore_index`; weights: [N] per-token fp32 loss weights (e.g. 1 / completion tokens).
        temperature: divides the logits before the softmax.
        return_entropy: also return the per-token entropy [N] fp32 (detached diagnostic).
        impl: "triton" | "torch" | "auto".
        variants: the Triton paths this call takes (`Variants`; None: the measured winners).

    Returns:
        loss fp32 0-dim (differentiable w.r.t. hidden and weight), or (loss, entropy [N]).
    """
    op = "fused_linear_nll"
    check_linear_inputs(op, hidden, weight, targets, temperature, ignore_index)
    check_token_tensors(op, hidden.shape[0], hidden.device, weights=weights)
    backend = resolve_impl(impl, hidden.device, op)
    check_backend_dtype(op, backend, hidden.dtype)
    spec = resolve(variants).spec
    grad_on = torch.is_grad_enabled()
    loss, entropy = LinearNLLFunction.apply(
        hidden.contiguous(),
        weight.contiguous(),
        targets.contiguous(),
        weights.detach(),
        float(temperature),
        int(ignore_index),
        bool(return_entropy),
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        backend,
        spec,
    )
    return (loss, entropy) if return_entropy else loss
