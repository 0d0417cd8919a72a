"""grpo_loss against values worked by hand and against the formula written out with autograd."""

import math

import pytest
import torch
from rlmtrain_kernels import grpo_loss

IMPLS = ["torch", "triton"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# Ten tokens: each (ratio, advantage) sits in one regime of the clipped objective.
RATIOS = [0.5, 0.9, 1.1, 1.5, 0.5, 0.9, 1.1, 1.5, 4.0, 1.0]
ADVANTAGES = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -2.0, 0.5]
WEIGHTS = [0.5, 1.0, 1.0, 2.0, 1.0, 1.0, 0.25, 1.0, 1.0, 0.0]  # the last token is not counted
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # asymmetric: ratio bounds 0.8 and 1.28
# Per-token loss -min(r*A, clip(r)*A) and its derivative w.r.t. logp (d r / d logp = r), by hand:
#   A > 0: r=0.5 -> -0.5 (unclipped, d=-0.5); 0.9 -> -0.9; 1.1 -> -1.1; 1.5 -> -1.28 (clipped, d=0)
#   A < 0: r=0.5 -> 0.8 (clipped, d=0); 0.9 -> 0.9 (d=0.9); 1.1 -> 1.1; 1.5 -> 1.5 (d=1.5)
#   A=-2, r=4 -> 8 (d=8); with dual_clip=3 it is capped at 3*2 = 6 (d=0)
HAND_LOSS = [-0.5, -0.9, -1.1, -1.28, 0.8, 0.9, 1.1, 1.5, 8.0, -0.5]
HAND_GRAD = [-0.5, -0.9, -1.1, 0.0, 0.0, 0.9, 1.1, 1.5, 8.0, -0.5]


def hand_inputs(device):
    old = torch.linspace(-3.0, -1.0, len(RATIOS), device=device)
    logp = old + torch.tensor(RATIOS, device=device).log()
    adv = torch.tensor(ADVANTAGES, device=device)
    w = torch.tensor(WEIGHTS, device=device)
    return logp, old, adv, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_hand_worked_tokens(impl, dual_clip, device):
    logp, old, adv, w = hand_inputs(device)
    logp.requires_grad_()
    loss, m = grpo_loss(
        logp, old, adv, w, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=dual_clip, impl=impl
    )
    (grad,) = torch.autograd.grad(loss, logp)
    per_token, d = list(HAND_LOSS), list(HAND_GRAD)
    if dual_clip is not None:
        per_token[8], d[8] = 6.0, 0.0
    expected_loss = sum(wi * li for wi, li in zip(WEIGHTS, per_token, strict=True))
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    expected_grad = torch.tensor([wi * di for wi, di in zip(WEIGHTS, d, strict=True)])
    torch.testing.assert_close(grad.cpu(), expected_grad, rtol=1e-5, atol=1e-6)

    assert m.tokens.item() == 9
    assert m.clip_low_frac.item() == pytest.approx(1 / 9)  # token 4
    assert m.clip_high_frac.item() == pytest.approx(1 / 9)  # token 3
    assert m.dual_clip_frac.item() == pytest.approx(1 / 9 if dual_clip else 0.0)
    assert m.ratio_mean.item() == pytest.approx(sum(RATIOS[:9]) / 9, rel=1e-5)
    assert m.ratio_max.item() == pytest.approx(4.0, rel=1e-5)
    assert m.kl_mean.item() == 0.0 and m.tis_clipped_frac.item() == 0.0


def direct_grpo(logp, old, adv, w, ref, sampler, beta, dual_clip, tis_cap):
    """The objective as a reader would write it, differentiated by autograd."""
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)
    if sampler is not None:
        tis = torch.exp(old - sampler)
        if tis_cap is not None:
            tis = tis.clamp(max=tis_cap)
        pg = pg * tis
    if beta:
        delta = ref - logp
        pg = pg + beta * (torch.exp(delta) - delta - 1)
    return (w * pg).sum()


def random_tokens(n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 4
    logp = old + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    w = torch.rand(n, generator=gen, dtype=torch.float64)
    w[::7] = 0
    ref = logp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    sampler = old + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    return [t.to(device) for t in (logp, old, adv, w, ref, sampler)]


OPTIONS = {
    "plain": dict(),
    "dual_clip": dict(dual_clip=2.0),
    "tis_capped": dict(sampler=True, tis_cap=1.1),
    "tis_uncapped": dict(sampler=True),
    "kl": dict(ref=True, beta=0.1),
    "all": dict(ref=True, beta=0.05, dual_clip=2.5, sampler=True, tis_cap=1.2),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_direct_formula(option, impl, device):
    o = OPTIONS[option]
    logp, old, adv, w, ref, sampler = random_tokens(300, device)
    ref = ref if o.get("ref") else None
    sampler = sampler if o.get("sampler") else None
    beta, dual, cap = o.get("beta", 0.0), o.get("dual_clip"), o.get("tis_cap")

    logp64 = logp.clone().requires_grad_()
    expected = direct_grpo(logp64, old, adv, w, ref, sampler, beta, dual, cap)
    (expected_grad,) = torch.autograd.grad(expected, logp64)

    f32 = [t.float() if t is not None else None for t in (logp, old, adv, w, ref, sampler)]
    logp32 = f32[0].requires_grad_()
    loss, m = grpo_loss(
        logp32, f32[1], f32[2], f32[3], ref_logp=f32[4], sampler_logp=f32[5], beta=beta,
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=dual, tis_cap=cap, impl=impl,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp32)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)

    counted = w != 0
    ratio = torch.exp(logp - old)[counted]
    a = adv[counted]
    assert m.tokens.item() == counted.sum().item()
    assert m.clip_low_frac.item() == pytest.approx(
        ((a < 0) & (ratio < 1 - CLIP_LOW)).double().mean().item()
    )
    assert m.clip_high_frac.item() == pytest.approx(
        ((a > 0) & (ratio > 1 + CLIP_HIGH)).double().mean().item()
    )
    assert m.ratio_mean.item() == pytest.approx(ratio.mean().item(), rel=1e-5)
    assert m.ratio_max.item() == pytest.approx(ratio.max().item(), rel=1e-5)
    if ref is not None:
        delta = (ref - logp)[counted]
        kl = torch.exp(delta) - delta - 1
        assert m.kl_mean.item() == pytest.approx(kl.mean().item(), rel=1e-5)
    if sampler is not None:
        gap = (old - sampler).abs()[counted]
        assert m.sampler_logp_gap.item() == pytest.approx(gap.mean().item(), rel=1e-5)
        tis = torch.exp(old - sampler)[counted]
        tis = tis.clamp(max=cap) if cap is not None else tis
        assert m.tis_weight_mean.item() == pytest.approx(tis.mean().item(), rel=1e-5)
        assert m.tis_weight_sq_mean.item() == pytest.approx((tis * tis).mean().item(), rel=1e-5)
    else:
        assert m.sampler_logp_gap.item() == 0.0
        assert m.tis_weight_mean.item() == m.tis_weight_sq_mean.item() == 1.0
    if cap is not None:
        tis = torch.exp(old - sampler)[counted]
        assert m.tis_clipped_frac.item() == pytest.approx((tis > cap).double().mean().item())
        assert 0 < m.tis_clipped_frac.item() < 1
    if dual is not None:
        capped = (a < 0) & (torch.maximum(ratio, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)) > dual)
        assert m.dual_clip_frac.item() == pytest.approx(capped.double().mean().item())
        assert m.dual_clip_frac.item() > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_no_counted_tokens_gives_zero_metrics(impl):
    logp, old, adv, _ = hand_inputs("cpu")
    loss, m = grpo_loss(logp, old, adv, torch.zeros_like(logp), impl=impl)
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in m)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_logp_gets_a_bf16_gradient_and_an_fp32_loss(impl):
    logp, old, adv, w = hand_inputs("cpu")
    logp = logp.bfloat16().requires_grad_()
    loss, _ = grpo_loss(logp, old, adv, w, impl=impl)
    (grad,) = torch.autograd.grad(loss * 3.0, logp)  # a non-unit upstream gradient
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    ratio = torch.exp(logp.float() - old)
    expected = 3.0 * torch.where(
        torch.tensor([i not in (3, 4) for i in range(10)]), -adv * ratio, 0.0
    ) * w  # fmt: skip
    torch.testing.assert_close(grad.float(), expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_values_on_weight_zero_tokens_do_not_leak(impl):
    """Dropped tokens may carry padding (-inf, huge values); nothing of them may reach the loss,
    the gradient or the metrics (0 * inf would be nan)."""
    logp, old, adv, w = hand_inputs("cpu")
    w[[2, 5]] = 0.0
    old[[2, 5]] = torch.tensor([-float("inf"), 1e6])
    sampler, ref = old.clone(), logp - 0.1
    sampler[2] = float("inf")
    logp.requires_grad_()
    loss, m = grpo_loss(
        logp, old, adv, w, ref_logp=ref, beta=0.1, sampler_logp=sampler, tis_cap=2.0, impl=impl
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in m)
    assert grad[2].item() == 0.0 and grad[5].item() == 0.0


def test_bad_options_are_named():
    logp, old, adv, w = hand_inputs("cpu")
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo_loss(logp, old, adv, w, beta=0.1)
    with pytest.raises(ValueError, match="tis_cap needs sampler_logp"):
        grpo_loss(logp, old, adv, w, tis_cap=2.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        grpo_loss(logp, old, adv, w, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"advantages must have shape \[10\]"):
        grpo_loss(logp, old, adv[:3], w)
    with pytest.raises(ValueError, match="clip_low"):
        grpo_loss(logp, old, adv, w, clip_low=1.5)
    sampler = old.clone()
    for option, value in [("clip_high", -0.1), ("dual_clip", 0.5), ("tis_cap", 0.0)]:
        for bad in (value, math.nan):  # NaN fails every comparison, so every check must see it
            with pytest.raises(ValueError, match=f"{option} must be"):
                grpo_loss(logp, old, adv, w, sampler_logp=sampler, **{option: bad})
    with pytest.raises(ValueError, match="beta must be finite"):
        grpo_loss(logp, old, adv, w, ref_logp=old, beta=math.inf)
    with pytest.raises(ValueError, match="logp must be a floating tensor"):
        grpo_loss(logp.long(), old, adv, w)
    with pytest.raises(ValueError, match=r"beta must be finite and >= 0 .* got -0.1"):
        grpo_loss(logp, old, adv, w, ref_logp=old, beta=-0.1)
    # A string (YAML reads 1e-3 as one) or a bool is no option value; a list or an array no
    # per-token tensor (numpy's `.device` is the string 'cpu': "on cpu, expected cpu").
    for option, bad in [("beta", "1e-3"), ("clip_low", "0.2"), ("clip_high", True)]:
        with pytest.raises(TypeError, match=f"grpo_loss: {option} must be a real number"):
            grpo_loss(logp, old, adv, w, ref_logp=old, **{option: bad})
    for name, bad in [("advantages", adv.numpy()), ("weights", w.tolist())]:
        given = {"advantages": adv, "weights": w, name: bad}
        with pytest.raises(TypeError, match=f"grpo_loss: {name} must be a torch.Tensor"):
            grpo_loss(logp, old, **given)
    with pytest.raises(TypeError, match="grpo_loss: logp must be a torch.Tensor, got float"):
        grpo_loss(-3.0, old, adv, w)
    # The log-probs a ratio is taken against, in 16 bits, would clip on-policy tokens.
    for name in ("old_logp", "ref_logp", "sampler_logp"):
        given = {"ref_logp": old, "sampler_logp": old, name: old.bfloat16()}
        with pytest.raises(ValueError, match=f"grpo_loss: {name} is torch.bfloat16 against"):
            grpo_loss(logp, given.pop("old_logp", old), adv, w, beta=0.1, **given)
    assert math.isfinite(grpo_loss(logp, old, adv, w)[0].item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("poisoned", ["logp", "old", "sampler", "advantages"])
def test_nan_in_a_counted_token_reaches_the_loss_on_every_backend(poisoned, device):
    """A NaN log-prob or advantage must show in the loss, the ratio metrics and the token's
    gradient, as torch's clamp and max propagate it, never be clipped or capped into a finite
    value (a gradient of 0 there would pass a trainer's finite-norm guard and drop the token
    unseen); both backends agree on every gradient."""
    logp, old, adv, w, ref, sampler = random_tokens(64, device)
    {"logp": logp, "old": old, "sampler": sampler, "advantages": adv}[poisoned][3] = math.nan
    assert w[3] != 0
    results = {}
    for impl in IMPLS:
        x = logp.float().clone().requires_grad_()
        loss, m = grpo_loss(
            x, old.float(), adv.float(), w.float(), sampler_logp=sampler.float(), tis_cap=1.2,
            dual_clip=2.0, impl=impl,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, x)
        results[impl] = loss, grad, m
        assert torch.isnan(loss) and torch.isnan(grad[3]), (impl, grad[3])
    ratio_max = [results[impl][2].ratio_max for impl in IMPLS]
    assert torch.isnan(ratio_max[0]) == torch.isnan(ratio_max[1])
    torch.testing.assert_close(*(r[1] for r in results.values()), equal_nan=True)
