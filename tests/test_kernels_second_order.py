"""Second derivatives through every fused op equal autograd's over plain float64 formulas: a
backward that is itself differentiated (create_graph=True) must keep the terms that come through
the gradient's own dependence on its inputs, not treat the stored gradient as a constant.

Each case differentiates loss**2, whose gradient 2 * loss * dloss depends on the inputs both
through the upstream factor and through dloss, then takes a Hessian-vector product."""

import pytest
import torch
from rlmtrain_kernels import (
    fused_linear_grpo_loss,
    fused_linear_logprob,
    fused_linear_nll,
    grpo_loss,
)

from tests.test_kernels_grpo import CLIP_HIGH, CLIP_LOW, direct_grpo, random_tokens

IGNORE = -100
N, H, V = 13, 8, 70
TEMPERATURE = 1.3
GRPO = dict(beta=0.05, dual_clip=2.5, tis_cap=1.2)


def head_inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::4] = IGNORE
    logp, old, adv, w, ref, sampler = random_tokens(N, "cpu", seed=1)
    return hidden, weight, targets, dict(old=old, adv=adv, w=w, ref=ref, sampler=sampler)


def truth_logp(x, w, targets):
    log_probs = torch.log_softmax(x @ w.T / TEMPERATURE, dim=-1)
    trained = targets != IGNORE
    picked = log_probs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return torch.where(trained, picked, 0.0), torch.where(trained, entropy, 0.0)


def squared_losses(impl):
    """(op name, ours(x, w) -> scalar, truth(x, w) -> scalar) for each op."""
    hidden, weight, targets, tok = head_inputs()
    trained = targets != IGNORE
    g_logp = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)
    g_entropy = torch.linspace(0.5, -0.5, N, dtype=torch.float64)
    counted = torch.where(trained, tok["w"], 0.0)

    def logprob(x, w):
        logp, entropy = fused_linear_logprob(
            x, w, targets, temperature=TEMPERATURE, return_entropy=True, impl=impl
        )
        return ((logp * g_logp).sum() + (entropy * g_entropy).sum()) ** 2

    def logprob_truth(x, w):
        logp, entropy = truth_logp(x, w, targets)
        return ((logp * g_logp).sum() + (entropy * g_entropy).sum()) ** 2

    def nll(x, w):
        return fused_linear_nll(x, w, targets, tok["w"], temperature=TEMPERATURE, impl=impl) ** 2

    def nll_truth(x, w):
        return (-(counted * truth_logp(x, w, targets)[0]).sum()) ** 2

    def grpo(x, w):
        loss, _ = fused_linear_grpo_loss(
            x, w, targets, tok["old"], tok["adv"], tok["w"], ref_logp=tok["ref"],
            sampler_logp=tok["sampler"], temperature=TEMPERATURE, clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH, impl=impl, **GRPO,
        )  # fmt: skip
        return loss**2

    def grpo_truth(x, w):
        logp = truth_logp(x, w, targets)[0]
        return (
            direct_grpo(logp, tok["old"], tok["adv"], counted, tok["ref"], tok["sampler"], **GRPO)
            ** 2
        )

    return hidden, weight, [("logprob", logprob, logprob_truth), ("nll", nll, nll_truth),
                            ("grpo", grpo, grpo_truth)]  # fmt: skip


def hessian_vector(loss_fn, x, w, directions):
    """(d loss / d(x, w), the Hessian of loss applied to `directions`), both by autograd."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    grads = torch.autograd.grad(loss_fn(x, w), (x, w), create_graph=True)
    along = sum((g * d).sum() for g, d in zip(grads, directions, strict=True))
    return grads, torch.autograd.grad(along, (x, w))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("op", ["logprob", "nll", "grpo"])
def test_hessian_vector_products_match_float64_truth(impl, op):
    hidden, weight, cases = squared_losses(impl)
    _, ours, truth = next(c for c in cases if c[0] == op)
    gen = torch.Generator().manual_seed(2)
    directions = (torch.randn(N, H, generator=gen, dtype=torch.float64),
                  torch.randn(V, H, generator=gen, dtype=torch.float64))  # fmt: skip
    # The Triton impl takes fp32 (float64 inputs run on the torch impl only).
    dtype = torch.float64 if impl == "torch" else torch.float32
    got = hessian_vector(
        ours, hidden.to(dtype), weight.to(dtype), [d.to(dtype) for d in directions]
    )
    want = hessian_vector(truth, hidden, weight, directions)
    # The losses are fp32 whatever their inputs, and the GRPO formula runs in fp32
    # (`reference.grpo_forward`): only the log-prob op is float64 throughout.
    tol = dict(rtol=2e-4, atol=2e-4)
    if dtype == torch.float64:
        tol = dict(rtol=1e-9, atol=1e-9) if op == "logprob" else dict(rtol=2e-5, atol=2e-5)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
        torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_grpo_loss_alone_second_derivative(impl):
    logp, old, adv, w, ref, sampler = random_tokens(40, "cpu")
    dtype = torch.float64 if impl == "torch" else torch.float32
    options = dict(ref_logp=ref.to(dtype), sampler_logp=sampler.to(dtype), clip_low=CLIP_LOW,
                   clip_high=CLIP_HIGH, **GRPO)  # fmt: skip

    def ours(x):
        return grpo_loss(x, old.to(dtype), adv.to(dtype), w.to(dtype), impl=impl, **options)[0] ** 2

    def truth(x):
        return direct_grpo(x, old, adv, w, ref, sampler, **GRPO) ** 2

    results = []
    for fn, x in ((ours, logp.to(dtype)), (truth, logp)):
        x = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(x), x, create_graph=True)
        results.append((g, *torch.autograd.grad(g.sum(), x)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_padding_reaches_no_second_order_gradient(impl):
    """What the first-order path never reads (an ignored row's hidden state, a weight-0 token's
    old/ref/sampler log-probs) may be padding, inf included: differentiated with its graph, the
    loss must give the first-order gradients, finite, not NaN through 0 * inf."""
    hidden, weight, targets, tok = head_inputs()
    hidden, weight = hidden.float(), weight.float()
    hidden[0] = float("inf")  # row 0 is ignored
    w = tok["w"].clone()
    w[1] = 0.0
    padded = {k: tok[k].clone() for k in ("old", "ref", "sampler")}
    for t in padded.values():
        t[1] = float("-inf")

    def gradients(create_graph):
        x, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = fused_linear_grpo_loss(
            x, wt, targets, padded["old"], tok["adv"], w, ref_logp=padded["ref"],
            sampler_logp=padded["sampler"], impl=impl, **GRPO,
        )  # fmt: skip
        nll = fused_linear_nll(x, wt, targets, w, impl=impl)
        logp = fused_linear_logprob(x, wt, targets, impl=impl)
        alone, _ = grpo_loss(logp, padded["old"], tok["adv"], w, impl=impl, clip_low=CLIP_LOW)
        return torch.autograd.grad(loss + nll + alone, (x, wt), create_graph=create_graph)

    first, second = gradients(False), gradients(True)
    for a, b in zip(first, second, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(b.detach(), a, rtol=1e-5, atol=1e-5)
