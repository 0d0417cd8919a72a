"""GRPO policy loss over per-token log-probs: one elementwise pass gives the loss, its gradient
and the metrics.

Per token t with ratio rho = exp(logp - old_logp):
    pg   = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)
    pg   = min(pg, -dual_clip * A)            for A < 0 when dual_clip is set (Ye et al. 2020)
    tis  = min(exp(old_logp - sampler_logp), tis_cap)     1 when sampler_logp is None
    kl   = exp(ref - logp) - (ref - logp) - 1             k3 (Schulman, "Approximating KL")
    l    = tis * pg + beta * kl
    loss = sum_t weights_t * l_t
`old_logp=None` makes pi_old the detached current policy, for one optimizer update per rollout
batch (TRL's GRPO does the same with `per_token_logps.detach()` when num_iterations == 1): rho is
exactly 1 in value while drho/dlogp = 1, so pg = -A with dpg/dlogp = -A (no clip or dual clip
binds; the clip metrics read 0), tis = exp(logp - sampler_logp) carries no gradient, and the
trainer needs no second forward for old_logp.
The truncated importance-sampling factor corrects for the engine's sampler differing from the
trainer; it scales the policy term only (as verl and Liger do) and carries no gradient. All the
trajectory-tree normalisation lives in `weights` (one fp32 weight per token, docs/algorithm.md
§4), so the loss is a plain weighted sum and needs no knowledge of sequences.

Metrics (`GRPOMetrics`) are fp32 0-dim tensors computed in the same pass, without host syncs.
They are unweighted averages over the counted tokens, those with weight != 0:
    clip_low_frac     A < 0 and rho < 1 - clip_low     (the clipped branch is the one taken)
    clip_high_frac    A > 0 and rho > 1 + clip_high
    dual_clip_frac    the dual clip replaced the loss
    tis_clipped_frac  exp(old_logp - sampler_logp) > tis_cap
    kl_mean           mean k3 KL (0 without ref_logp; reported even when beta is 0)
    ratio_mean, ratio_max
    tokens            the number of counted tokens
    sampler_logp_gap  mean |old_logp - sampler_logp| (0 without sampler_logp): the trainer's
                      pi_old against the engine's log-probs, what TIS corrects for
    tis_weight_mean   mean truncated-IS factor (1 without sampler_logp)
    tis_weight_sq_mean  mean of its square: mean^2 / this is the effective sample size of the
                      tokens as a share of their count (Kish), how far the sampler's tokens
                      still speak for the policy being trained
With no counted token every average is 0.

The Triton kernel processes BLOCK tokens per program and writes per-program partial sums that a
torch reduction folds (deterministic, no atomics).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import reference, second_order
from ._backend import resolve_impl, tl, triton
from .head_checks import check_real, check_tensor

__all__ = ["GRPOMetrics", "grpo_loss"]

METRIC_NAMES = (
    "clip_low_frac",
    "clip_high_frac",
    "dual_clip_frac",
    "tis_clipped_frac",
    "kl_mean",
    "ratio_mean",
    "ratio_max",
    "tokens",
    "sampler_logp_gap",
    "tis_weight_mean",
    "tis_weight_sq_mean",
)
NUM_METRIC_SUMS = len(METRIC_NAMES)
# Tokens per program of the elementwise kernel (launched with Triton's default 4 warps).
BLOCK = 1024
_MAX_SLOT = METRIC_NAMES.index("ratio_max")
_COUNT_SLOT = METRIC_NAMES.index("tokens")


class GRPOMetrics(NamedTuple):
    """Averages over tokens with weight != 0; each an fp32 0-dim tensor on the loss's device."""

    clip_low_frac: torch.Tensor
    clip_high_frac: torch.Tensor
    dual_clip_frac: torch.Tensor
    tis_clipped_frac: torch.Tensor
    kl_mean: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    tokens: torch.Tensor
    sampler_logp_gap: torch.Tensor
    """mean |old_logp - sampler_logp|: how far the trainer's pi_old is from the engine's."""
    tis_weight_mean: torch.Tensor
    tis_weight_sq_mean: torch.Tensor


def finalize_metrics(sums: torch.Tensor) -> GRPOMetrics:
    """Metric sums [NUM_METRIC_SUMS] (as `reference.grpo_forward` returns them) -> averages."""
    count = sums[_COUNT_SLOT]
    denom = count.clamp(min=1.0)
    averages = sums / denom
    ratio_max = torch.where(count > 0, sums[_MAX_SLOT], 0.0)
    values = [averages[i] for i in range(NUM_METRIC_SUMS)]
    values[_MAX_SLOT] = ratio_max
    values[_COUNT_SLOT] = count
    return GRPOMetrics(*values)


@triton.jit
def _grpo_loss_kernel(
    LOGP_ptr,
    OLD_ptr,
    ADV_ptr,
    WEIGHT_ptr,
    REF_ptr,
    SAMPLER_ptr,
    GRAD_ptr,
    LOSS_PARTIAL_ptr,
    METRIC_PARTIAL_ptr,
    N,
    beta,
    clip_low,
    clip_high,
    dual_clip,
    tis_cap,
    HAS_REF: tl.constexpr,
    KL_IN_LOSS: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_SAMPLER: tl.constexpr,
    HAS_CAP: tl.constexpr,
    NUM_SUMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    # With old_logp=None the host passes LOGP_ptr here too: ratio = exp(0) = 1 exactly.
    logp = tl.load(LOGP_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    old = tl.load(OLD_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    adv = tl.load(ADV_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(WEIGHT_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    ratio = tl.exp(logp - old)
    low = 1.0 - clip_low
    high = 1.0 + clip_high
    unclipped = -adv * ratio
    # NaN propagates as through torch.clamp: a poisoned token must poison the loss, not clip.
    kept = tl.maximum(ratio, low, propagate_nan=tl.PropagateNan.ALL)
    clipped = -adv * tl.minimum(kept, high, propagate_nan=tl.PropagateNan.ALL)
    # And its gradient: a NaN advantage or old log-prob takes the unclipped branch, whose
    # derivative carries the NaN (`>=` alone is False for NaN and gave a gradient of 0).
    take_unclipped = (unclipped >= clipped) | (unclipped != unclipped)
    pg = tl.where(take_unclipped, unclipped, clipped)
    dpg = tl.where(take_unclipped, unclipped, 0.0)
    dual_active = tl.zeros([BLOCK], dtype=tl.int1)
    if HAS_DUAL:
        dual_active = (adv < 0) & (pg > -adv * dual_clip)
        pg = tl.where(dual_active, -adv * dual_clip, pg)
        dpg = tl.where(dual_active, 0.0, dpg)
    tis_clipped = tl.zeros([BLOCK], dtype=tl.int1)
    gap = tl.zeros([BLOCK], dtype=tl.float32)
    tis_weight = tl.full([BLOCK], 1.0, dtype=tl.float32)
    if HAS_SAMPLER:
        sampler = tl.load(SAMPLER_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gap = tl.abs(old - sampler)
        tis = tl.exp(old - sampler)
        if HAS_CAP:
            tis_clipped = tis > tis_cap
            tis = tl.minimum(tis, tis_cap, propagate_nan=tl.PropagateNan.ALL)
        pg = pg * tis
        dpg = dpg * tis
        tis_weight = tis
    kl = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_REF:
        ref = tl.load(REF_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        delta = ref - logp
        kl = tl.exp(delta) - delta - 1.0
        if KL_IN_LOSS:
            pg = pg + beta * kl
            dpg = dpg + beta * (1.0 - tl.exp(delta))

    # Weight-0 tokens are dropped with `where`, not multiplied by 0: their log-probs may be
    # padding (an old_logp of -inf would make 0 * inf = nan).
    counted = mask & (w != 0.0)
    tl.store(GRAD_ptr + offs, tl.where(counted, w * dpg, 0.0), mask=mask)
    tl.store(LOSS_PARTIAL_ptr + pid, tl.sum(tl.where(counted, w * pg, 0.0), axis=0))
    cnt = counted.to(tl.float32)
    out = METRIC_PARTIAL_ptr + pid * NUM_SUMS
    tl.store(out + 0, tl.sum(cnt * ((adv < 0) & (ratio < low)).to(tl.float32), axis=0))
    tl.store(out + 1, tl.sum(cnt * ((adv > 0) & (ratio > high)).to(tl.float32), axis=0))
    tl.store(out + 2, tl.sum(cnt * dual_active.to(tl.float32), axis=0))
    tl.store(out + 3, tl.sum(cnt * tis_clipped.to(tl.float32), axis=0))
    tl.store(out + 4, tl.sum(tl.where(counted, kl, 0.0), axis=0))
    tl.store(out + 5, tl.sum(tl.where(counted, ratio, 0.0), axis=0))
    # tl.max skips NaN; torch's max, which the torch path takes, returns it.
    ratio_max = tl.max(tl.where(counted, ratio, float("-inf")), axis=0)
    any_nan = tl.sum((counted & (ratio != ratio)).to(tl.int32), axis=0) > 0
    tl.store(out + 6, tl.where(any_nan, float("nan"), ratio_max))
    tl.store(out + 7, tl.sum(cnt, axis=0))
    tl.store(out + 8, tl.sum(tl.where(counted, gap, 0.0), axis=0))
    tl.store(out + 9, tl.sum(tl.where(counted, tis_weight, 0.0), axis=0))
    tl.store(out + 10, tl.sum(tl.where(counted, tis_weight * tis_weight, 0.0), axis=0))


def _grpo_forward_triton(
    logp, old_logp, advantages, weights, ref_logp, sampler_logp, *, beta, clip_low, clip_high,
    dual_clip, tis_cap,
):  # fmt: skip
    n = logp.shape[0]
    block = BLOCK
    programs = max(1, triton.cdiv(n, block))
    grad = torch.empty(n, dtype=torch.float32, device=logp.device)
    loss_partial = torch.empty(programs, dtype=torch.float32, device=logp.device)
    metric_partial = torch.empty(programs, NUM_METRIC_SUMS, dtype=torch.float32, device=logp.device)
    _grpo_loss_kernel[(programs,)](
        logp.contiguous(),
        old_logp.contiguous() if old_logp is not None else logp,
        advantages.contiguous(),
        weights.contiguous(),
        ref_logp.contiguous() if ref_logp is not None else logp,
        sampler_logp.contiguous() if sampler_logp is not None else logp,
        grad,
        loss_partial,
        metric_partial,
        n,
        float(beta),
        float(clip_low),
        float(clip_high),
        float(dual_clip) if dual_clip is not None else 0.0,
        float(tis_cap) if tis_cap is not None else 0.0,
        HAS_REF=ref_logp is not None,
        KL_IN_LOSS=ref_logp is not None and beta != 0.0,
        HAS_DUAL=dual_clip is not None,
        HAS_SAMPLER=sampler_logp is not None,
        HAS_CAP=tis_cap is not None,
        NUM_SUMS=NUM_METRIC_SUMS,
        BLOCK=block,
    )
    sums = metric_partial.sum(dim=0)
    sums[_MAX_SLOT] = metric_partial[:, _MAX_SLOT].amax()
    return loss_partial.sum(), grad, sums


def grpo_forward(
    logp, old_logp, advantages, weights, ref_logp, sampler_logp, *, beta, clip_low, clip_high,
    dual_clip, tis_cap, impl,
):  # fmt: skip
    """(loss [], dLoss/dlogp [N], metric sums) by the chosen backend; used by the fused op too.

    old_logp=None: pi_old is the detached current policy (old = logp, the ratio exactly 1).
    """
    backend = reference.grpo_forward if impl == "torch" else _grpo_forward_triton
    return backend(
        logp,
        old_logp,
        advantages,
        weights,
        ref_logp,
        sampler_logp,
        beta=beta,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        tis_cap=tis_cap,
    )


@torch.library.custom_op("rlmtrain_kernels::grpo_loss_fwd", mutates_args=())
def _grpo_loss_op(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logp: torch.Tensor | None,
    sampler_logp: torch.Tensor | None,
    beta: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    tis_cap: float | None,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grpo_forward(
        logp,
        old_logp,
        advantages,
        weights,
        ref_logp,
        sampler_logp,
        beta=beta,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        tis_cap=tis_cap,
        impl=impl,
    )


@_grpo_loss_op.register_fake
def _(logp, old_logp, advantages, weights, ref_logp, sampler_logp, *args):
    f32 = dict(dtype=torch.float32, device=logp.device)
    return (
        logp.new_empty((), **f32),
        logp.new_empty(logp.shape, **f32),
        logp.new_empty(NUM_METRIC_SUMS, **f32),
    )


class GRPOLossFunction(torch.autograd.Function):
    """Gradient flows to `logp` only; the gradient was computed by the forward pass (and by
    autograd over the torch formula when the backward is itself differentiated:
    `second_order`)."""

    @staticmethod
    def forward(ctx, logp, old_logp, advantages, weights, ref_logp, sampler_logp, options):
        loss, grad_logp, sums = _grpo_loss_op(
            logp, old_logp, advantages, weights, ref_logp, sampler_logp, *options
        )
        ctx.save_for_backward(
            grad_logp, logp, old_logp, advantages, weights, ref_logp, sampler_logp
        )
        ctx.options = options
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, grad_sums):
        grad_logp, logp, *tokens = ctx.saved_tensors
        if second_order.wanted():
            loss = token_loss(logp, *tokens, ctx.options)
            grad_logp = torch.autograd.grad(loss, logp, create_graph=True)[0]
        return (grad_logp * grad_loss).to(logp.dtype), None, None, None, None, None, None


def token_loss(logp, old_logp, advantages, weights, ref_logp, sampler_logp, options):
    """The GRPO loss by torch operations that autograd differentiates at any order: its value's
    derivative is the gradient `reference.grpo_forward` writes out. old_logp None is the detached
    logp, as in the forward."""
    beta, clip_low, clip_high, dual_clip, tis_cap, _ = options
    # A weight-0 token's inputs may be padding (an old_logp of -inf): the loss drops it with
    # `where`, but autograd would still multiply through its inf. Each is made the detached
    # logp there, so nothing but finite zeros flows back from it.
    counted = weights != 0
    held = logp.detach()
    logp = torch.where(counted, logp, held)
    old_logp, ref_logp, sampler_logp = (
        None if t is None else torch.where(counted, t, held)
        for t in (old_logp, ref_logp, sampler_logp)
    )
    old = held if old_logp is None else old_logp
    loss, _, _ = reference.grpo_forward(
        logp, old, advantages, weights, ref_logp, sampler_logp, beta=beta, clip_low=clip_low,
        clip_high=clip_high, dual_clip=dual_clip, tis_cap=tis_cap,
    )  # fmt: skip
    return loss


def check_grpo_options(
    op: str,
    beta: float,
    ref_logp: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    sampler_logp: torch.Tensor | None,
    tis_cap: float | None,
) -> None:
    named = {"beta": beta, "clip_low": clip_low, "clip_high": clip_high}
    named.update({"dual_clip": dual_clip, "tis_cap": tis_cap})
    for name, value in named.items():
        if value is not None:
            check_real(op, name, value)
    # Each test is written so that NaN fails it: every comparison with NaN is False.
    if not 0.0 <= beta < math.inf:
        raise ValueError(
            f"{op}: beta must be finite and >= 0 (a negative one rewards leaving the "
            f"reference), got {beta}"
        )
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"{op}: beta={beta} needs ref_logp")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"{op}: clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0.0:
        raise ValueError(f"{op}: clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"{op}: dual_clip must be > 1 (a ratio cap), got {dual_clip}")
    if tis_cap is not None and sampler_logp is None:
        raise ValueError(f"{op}: tis_cap needs sampler_logp")
    if tis_cap is not None and not tis_cap > 0.0:
        raise ValueError(f"{op}: tis_cap must be > 0, got {tis_cap}")


RATIO_LOGPROBS = ("old_logp", "ref_logp", "sampler_logp")
"""The log-probs a ratio is taken against: in bf16 a log-prob of -20 is off by up to 0.06, a 6%
error in a ratio that should read 1, enough to clip on-policy tokens. They must be fp32 or fp64,
or of the policy's own log-probs' dtype (both sides rounded alike: an on-policy ratio is 1)."""


def check_token_tensors(
    op: str, n: int, device: torch.device, *, logp_dtype: torch.dtype = torch.float32, **tensors
) -> None:
    for name, t in tensors.items():
        if t is None:
            continue
        check_tensor(op, name, t)
        if t.shape != (n,):
            raise ValueError(f"{op}: {name} must have shape [{n}], got {list(t.shape)}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating tensor, got {t.dtype}")
        if name in RATIO_LOGPROBS and t.dtype not in (torch.float32, torch.float64, logp_dtype):
            raise ValueError(
                f"{op}: {name} is {t.dtype} against log-probs in {logp_dtype}; a ratio's "
                "log-probs must be float32 or float64 (bf16 rounds a log-prob of -20 by up to "
                "0.06, a 6% ratio error): keep them in fp32 where they are made"
            )


def grpo_loss(
    logp: torch.Tensor,
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
    impl: str = "auto",
) -> tuple[torch.Tensor, GRPOMetrics]:
    """GRPO loss over tokens: sum(weights * (tis * pg + beta * kl)); see the module docstring.

    Args:
        logp: [N] log-probs under the current policy (any float dtype); the only input that
            receives a gradient.
        old_logp: [N] log-probs of the policy that produced the rollouts (trainer-side), or
            None for the detached current policy (`logp.detach()`, one update per rollout
            batch): the ratio is then 1 and the clip metrics read 0.
        advantages: [N] per-token advantages.
        weights: [N] fp32 per-token loss weights (0 drops a token, also from the metrics).
        ref_logp: [N] reference-policy log-probs for the k3 KL; required when beta != 0.
        sampler_logp: [N] the inference engine's log-probs; enables truncated IS.
        tis_cap: cap on exp(old_logp - sampler_logp); None leaves the factor untruncated.
        dual_clip: ratio cap (> 1) for tokens with negative advantage.
        impl: "triton" | "torch" | "auto" (Triton on CUDA, torch elsewhere).

    Returns:
        (loss: fp32 0-dim, metrics: GRPOMetrics of fp32 0-dim tensors).
    """
    check_tensor("grpo_loss", "logp", logp)
    if logp.dim() != 1:
        raise ValueError(f"grpo_loss: logp must be 1-D [N], got shape {list(logp.shape)}")
    check_token_tensors(
        "grpo_loss",
        logp.shape[0],
        logp.device,
        logp_dtype=logp.dtype,
        logp=logp,
        old_logp=old_logp,
        advantages=advantages,
        weights=weights,
        ref_logp=ref_logp,
        sampler_logp=sampler_logp,
    )
    check_grpo_options(
        "grpo_loss", beta, ref_logp, clip_low, clip_high, dual_clip, sampler_logp, tis_cap
    )
    backend = resolve_impl(impl, logp.device, "grpo_loss")
    options = (beta, clip_low, clip_high, dual_clip, tis_cap, backend)
    detached = [t.detach() if t is not None else None for t in (ref_logp, sampler_logp)]
    old = old_logp.detach() if old_logp is not None else None
    loss, sums = GRPOLossFunction.apply(
        logp, old, advantages.detach(), weights.detach(), *detached, options
    )
    return loss, finalize_metrics(sums)
