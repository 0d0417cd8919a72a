"""Linear head + log-prob + GRPO loss in one op, its gradients computed while the logits are hot.

A token's GRPO gradient dLoss/dlogp_t depends on that token alone, so the gradient w.r.t. the
logits is known as soon as a row's log-sum-exp is: the op computes dHidden and dWeight during the
forward (as Liger's chunked losses do) and the backward only scales them by the upstream scalar.
The torch backend thereby reuses each row block's logit tile (6·N·H·V FLOPs, as unfused autograd,
against 8·N·H·V for forward-then-recompute), and so does the Triton backend on 16-bit inputs: a
slab's logits are formed once in fp32 and kept for its gradients (logit_slabs.py). On fp32 inputs,
or with `Variants(row_grads="recompute")`, it runs the log-prob forward (its `Variants.forward`),
the elementwise GRPO kernel and the log-prob backward (which forms the logits again) back to
back.
No [N, V] tensor exists on any path. When no gradient is wanted (no_grad, frozen inputs) nothing
beyond the loss is computed.

`old_logp=None` (pi_old = the detached current policy) costs no second pass over the head: inside
the op, old_logp is the forward's own log-probs, which autograd never sees, so the ratio is exactly
1 in value and its gradient is the policy gradient.

Rows whose target is `ignore_index` count as weight 0 (no loss, no metric, no gradient) and never
reach the head (`rows.TrainedRows`).
"""

from __future__ import annotations

from functools import partial

import torch

from . import logit_slabs, reference, second_order
from ._backend import resolve_impl
from .grpo_loss import (
    NUM_METRIC_SUMS,
    GRPOMetrics,
    check_grpo_options,
    check_token_tensors,
    finalize_metrics,
    grpo_forward,
    token_loss,
)
from .head_checks import check_backend_dtype, check_linear_inputs
from .logprob import logprob_backward_triton, logprob_forward_triton
from .rows import TrainedRows
from .stored_grads import scaled_grad
from .variants import Variants, resolve

__all__ = ["fused_linear_grpo_loss"]


@torch.library.custom_op("rlmtrain_kernels::linear_grpo_fwd", mutates_args=())
def _linear_grpo_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logp: torch.Tensor | None,
    sampler_logp: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    beta: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    tis_cap: float | None,
    with_entropy: bool,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    impl: str,
    variants: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = Variants.from_spec(variants)
    grpo = dict(
        beta=beta, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, tis_cap=tis_cap
    )
    rows = TrainedRows("fused_linear_grpo_loss", targets, ignore_index, weight.shape[0])
    hidden, targets, old_logp, advantages, weights, ref_logp, sampler_logp = (
        rows.take(t)
        for t in (hidden, targets, old_logp, advantages, weights, ref_logp, sampler_logp)
    )
    weights = weights.float()
    need_grads = need_grad_hidden or need_grad_weight
    loss_forward = reference.grpo_forward if impl == "torch" else partial(grpo_forward, impl=impl)

    def token_grad(rows: slice, logp_rows: torch.Tensor) -> torch.Tensor:
        # old_logp None stays None: grpo_forward then reads old = logp_rows.
        old, ref, sampler = (
            t[rows] if t is not None else None for t in (old_logp, ref_logp, sampler_logp)
        )
        _, grad, _ = loss_forward(
            logp_rows, old, advantages[rows], weights[rows], ref, sampler, **grpo
        )
        return grad

    stored_logits = (
        impl != "torch" and need_grads and chosen.stores_logits("row_grads", hidden.dtype)
    )
    if impl == "torch":
        logp, entropy, grad_hidden, grad_weight = reference.linear_logprob_row_grads(
            hidden, weight, targets, token_grad,
            temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy,
            need_grads=need_grads, need_grad_weight=need_grad_weight,
        )  # fmt: skip
    elif stored_logits:
        logp, entropy, grad_hidden, grad_weight = logit_slabs.row_grads(
            hidden, weight, targets, token_grad, temperature=temperature,
            with_entropy=with_entropy, need_grad_hidden=need_grad_hidden,
            need_grad_weight=need_grad_weight, slab_bytes=chosen.logit_slab_bytes,
        )  # fmt: skip
    else:
        logp, entropy, lse = logprob_forward_triton(
            hidden, weight, targets, temperature=temperature, ignore_index=ignore_index,
            with_entropy=with_entropy, variants=chosen,
        )  # fmt: skip
    loss, grad_logp, sums = loss_forward(
        logp, old_logp, advantages, weights, ref_logp, sampler_logp, **grpo
    )
    if impl != "torch" and not stored_logits:
        # The recompute path: its backward forms the logits again from the forward's `lse`.
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
        loss,
        sums,
        rows.put(entropy) if with_entropy else entropy,
        rows.put(grad_hidden) if need_grad_hidden else absent(),
        grad_weight if need_grad_weight else absent(),
    )


@_linear_grpo_fwd.register_fake
def _(hidden, weight, targets, old_logp, advantages, weights, ref_logp, sampler_logp, temperature,
      ignore_index, beta, clip_low, clip_high, dual_clip, tis_cap, with_entropy, need_grad_hidden,
      need_grad_weight, impl, variants):  # fmt: skip
    f32 = dict(dtype=torch.float32, device=hidden.device)
    # The loss and its sums are fp32 always; the head's outputs fp64 for fp64 inputs (torch).
    head = dict(dtype=reference.accumulation_dtype(hidden.dtype), device=hidden.device)
    n = hidden.shape[0]
    return (
        hidden.new_empty((), **f32),
        hidden.new_empty(NUM_METRIC_SUMS, **f32),
        hidden.new_empty(n if with_entropy else 0, **head),
        hidden.new_empty(hidden.shape if need_grad_hidden else (0,), **head),
        hidden.new_empty(weight.shape if need_grad_weight else (0,), **head),
    )


class LinearGRPOLossFunction(torch.autograd.Function):
    """The forward already holds dLoss/dHidden and dLoss/dWeight; backward scales them. A
    backward that is itself differentiated forms them again by autograd (`second_order`), from
    the inputs kept for it."""

    @staticmethod
    def forward(ctx, hidden, weight, *args):
        loss, sums, entropy, grad_hidden, grad_weight = _linear_grpo_fwd(hidden, weight, *args)
        ctx.save_for_backward(grad_hidden, grad_weight, hidden, weight, *args[:6])
        ctx.options, ctx.num_args = args[6:], len(args)
        ctx.mark_non_differentiable(sums, entropy)
        return loss, sums, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_sums, grad_entropy):
        grad_hidden, grad_weight, hidden, weight, targets, *tokens = ctx.saved_tensors
        needed = ctx.needs_input_grad[:2]
        if second_order.wanted():
            loss = _loss_by_autograd(hidden, weight, targets, tokens, ctx.options)
            grads = second_order.grads([loss], [grad_loss], (hidden, weight), needed)
        else:
            stored = zip((grad_hidden, grad_weight), (hidden, weight), needed, strict=True)
            grads = [scaled_grad(g, grad_loss, t.dtype) if need else None for g, t, need in stored]
        return *grads, *[None] * ctx.num_args


def _loss_by_autograd(hidden, weight, targets, tokens, options) -> torch.Tensor:
    """The fused loss by torch operations, differentiable at any order (`second_order`)."""
    temperature, ignore_index, beta, clip_low, clip_high, dual_clip, tis_cap, *_ = options
    old_logp, advantages, weights, ref_logp, sampler_logp = tokens
    logp, _ = second_order.head_logprobs(
        hidden, weight, targets, temperature, ignore_index, with_entropy=False
    )
    weights = torch.where(targets != ignore_index, weights, 0.0)
    grpo = (beta, clip_low, clip_high, dual_clip, tis_cap, "torch")
    return token_loss(logp, old_logp, advantages, weights, ref_logp, sampler_logp, grpo)


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    sampler_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    impl: str = "auto",
    variants: Variants | None = None,
) -> tuple[torch.Tensor, GRPOMetrics] | tuple[torch.Tensor, GRPOMetrics, torch.Tensor]:
    """`grpo_loss(fused_linear_logprob(hidden, weight, targets), ...)` in one op.

    Args:
        hidden: [N, H] bf16/fp16/fp32; weight: [V, H] same dtype; targets: [N] int ids or
            `ignore_index` (such rows count as weight 0).
        old_logp, advantages, weights, ref_logp, sampler_logp: [N] per-token tensors, as in
            `grpo_loss`; options beta, clip_low, clip_high, dual_clip, tis_cap likewise.
            old_logp=None takes pi_old to be the detached current policy (one update per
            rollout batch): the same loss and gradients as passing the no-grad
            `fused_linear_logprob` of these inputs, without that second pass over the head.
        temperature: divides the logits before the softmax.
        return_entropy: also return the per-token entropy [N] fp32 (a diagnostic: detached).
        impl: "triton" | "torch" | "auto".
        variants: the Triton paths this call takes (`Variants`; None: the measured winners).

    Returns:
        (loss fp32 0-dim, GRPOMetrics) or (loss, GRPOMetrics, entropy [N]); the loss is
        differentiable w.r.t. hidden and weight.
    """
    op = "fused_linear_grpo_loss"
    check_linear_inputs(op, hidden, weight, targets, temperature, ignore_index)
    check_token_tensors(
        op,
        hidden.shape[0],
        hidden.device,
        old_logp=old_logp,
        advantages=advantages,
        weights=weights,
        ref_logp=ref_logp,
        sampler_logp=sampler_logp,
    )
    check_grpo_options(op, beta, ref_logp, clip_low, clip_high, dual_clip, sampler_logp, tis_cap)
    backend = resolve_impl(impl, hidden.device, op)
    check_backend_dtype(op, backend, hidden.dtype)
    spec = resolve(variants).spec
    grad_on = torch.is_grad_enabled()
    loss, sums, entropy = LinearGRPOLossFunction.apply(
        hidden.contiguous(),
        weight.contiguous(),
        targets.contiguous(),
        old_logp.detach() if old_logp is not None else None,
        advantages.detach(),
        weights.detach(),
        ref_logp.detach() if ref_logp is not None else None,
        sampler_logp.detach() if sampler_logp is not None else None,
        float(temperature),
        int(ignore_index),
        float(beta),
        float(clip_low),
        float(clip_high),
        dual_clip,
        tis_cap,
        bool(return_entropy),
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        backend,
        spec,
    )
    metrics = finalize_metrics(sums)
    return (loss, metrics, entropy) if return_entropy else (loss, metrics)
