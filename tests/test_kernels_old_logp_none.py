"""old_logp=None: pi_old is the detached current policy.

Every result (loss, gradients w.r.t. hidden and weight or logp, metrics) must equal that of passing
the explicit detached log-probs of the same policy -- for the fused op the no-grad
`fused_linear_logprob` of the same inputs, for `grpo_loss` `logp.detach()` -- with the KL, the
truncated IS and the dual clip all on, on both backends, with and without ignored rows.
"""

import pytest
import torch
from rlmtrain_kernels import Variants, fused_linear_grpo_loss, fused_linear_logprob, grpo_loss

IMPLS = ["torch", "triton"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
IGNORE = -100
N, H, V = 37, 67, 300
TEMPERATURE = 0.8
# tis_cap sits inside the spread of exp(logp - sampler_logp), so some tokens are truncated.
OPTIONS = dict(beta=0.05, clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=1.1)


def batch(device, ignored, seed=0):
    """hidden [N, H], weight [V, H], targets [N]; ref and sampler log-probs near the policy's."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)
    targets = torch.randint(0, V, (N,), generator=gen)
    if ignored:
        targets[:6] = targets[15:21] = targets[33:] = IGNORE
    with torch.no_grad():
        logits = (hidden @ weight.T) / TEMPERATURE
        cur = torch.log_softmax(logits, -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    tok = dict(
        advantages=torch.randn(N, generator=gen),
        weights=torch.rand(N, generator=gen),
        ref_logp=cur + 0.3 * torch.randn(N, generator=gen),
        sampler_logp=cur + 0.3 * torch.randn(N, generator=gen),
    )
    tok["weights"][::9] = 0.0
    moved = {k: t.to(device) for k, t in tok.items()}
    return hidden.to(device), weight.to(device), targets.to(device), moved


def assert_grads_close(ours, theirs):
    scale = theirs.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6 * scale)


def assert_same_metrics(ours, theirs):
    for name, a, b in zip(ours._fields, ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    # pi_old = pi: the ratio is 1, nothing is clipped; the IS truncation still binds somewhere.
    assert ours.ratio_mean.item() == pytest.approx(1.0, abs=1e-6)
    assert ours.ratio_max.item() == pytest.approx(1.0, abs=1e-6)
    assert ours.clip_low_frac.item() == ours.clip_high_frac.item() == 0.0
    assert ours.dual_clip_frac.item() == 0.0
    assert 0.0 < ours.tis_clipped_frac.item() < 1.0
    assert ours.kl_mean.item() > 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ignored", [False, True], ids=["all_trained", "ignored_rows"])
def test_fused_none_equals_detached_current_logp(impl, ignored, device):
    hidden, weight, targets, tok = batch(device, ignored)
    per_token = (tok["advantages"], tok["weights"])
    kwargs = dict(
        ref_logp=tok["ref_logp"], sampler_logp=tok["sampler_logp"], temperature=TEMPERATURE,
        return_entropy=True, impl=impl, **OPTIONS,
    )  # fmt: skip
    with torch.no_grad():
        old = fused_linear_logprob(hidden, weight, targets, temperature=TEMPERATURE, impl=impl)

    results = []
    for old_logp in (None, old):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, metrics, entropy = fused_linear_grpo_loss(
            x, w, targets, old_logp, *per_token, **kwargs
        )
        dx, dw = torch.autograd.grad(loss * 2.5, (x, w))  # a non-unit upstream gradient
        results.append((loss, metrics, entropy, dx, dw))
    (loss, metrics, entropy, dx, dw), (loss2, metrics2, entropy2, dx2, dw2) = results

    torch.testing.assert_close(loss, loss2, rtol=1e-6, atol=1e-6)
    assert_grads_close(dx, dx2)
    assert_grads_close(dw, dw2)
    torch.testing.assert_close(entropy, entropy2, rtol=0, atol=0)
    assert_same_metrics(metrics, metrics2)
    if ignored:
        assert (dx[targets == IGNORE] == 0).all()
        assert metrics.tokens.item() == ((targets != IGNORE) & (tok["weights"] != 0)).sum().item()

    with torch.no_grad():
        loss3, metrics3, _ = fused_linear_grpo_loss(
            hidden, weight, targets, None, *per_token, **kwargs
        )
    torch.testing.assert_close(loss3, loss.detach(), rtol=1e-6, atol=1e-6)
    assert_same_metrics(metrics3, metrics2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_loss_none_equals_detached_logp(impl, dtype, device):
    _, _, _, tok = batch(device, ignored=False)
    gen = torch.Generator().manual_seed(1)
    logp = (-torch.rand(N, generator=gen) * 4).to(device, dtype)
    tok["ref_logp"] = logp.float() + 0.3 * torch.randn(N, generator=gen).to(device)
    tok["sampler_logp"] = logp.float() + 0.3 * torch.randn(N, generator=gen).to(device)
    results = []
    for old in (None, logp.detach()):
        x = logp.clone().requires_grad_()
        loss, metrics = grpo_loss(
            x, old, tok["advantages"], tok["weights"], ref_logp=tok["ref_logp"],
            sampler_logp=tok["sampler_logp"], impl=impl, **OPTIONS,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss * 2.5, (x,))
        results.append((loss, metrics, grad))
    (loss, metrics, grad), (loss2, metrics2, grad2) = results

    assert grad.dtype == dtype
    torch.testing.assert_close(loss, loss2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad2, rtol=1e-6, atol=1e-6)
    assert_same_metrics(metrics, metrics2)
    assert grad.abs().max() > 0


def test_compile_traces_old_logp_none_without_graph_breaks():
    hidden, weight, targets, tok = batch("cpu", ignored=True)
    adv, w_tok = tok["advantages"], tok["weights"]

    def step(x, w):
        logp = fused_linear_logprob(x, w, targets, impl="torch")
        rl, m = grpo_loss(logp, None, adv, w_tok, ref_logp=tok["ref_logp"], beta=0.1)
        fused, m2 = fused_linear_grpo_loss(
            x, w, targets, None, adv, w_tok, sampler_logp=tok["sampler_logp"], tis_cap=1.1
        )
        return rl + fused + m.kl_mean + m2.tis_clipped_frac

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (step, compiled):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(x, w)
        results.append((out, *torch.autograd.grad(out, (x, w))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_opcheck_accepts_old_logp_none():
    """The custom ops' schemas, fake kernels and dispatch hold with the None argument."""
    hidden, weight, targets, tok = batch("cpu", ignored=True)
    adv, w_tok, ref, sampler = (
        tok[k] for k in ("advantages", "weights", "ref_logp", "sampler_logp")
    )
    logp = fused_linear_logprob(hidden, weight, targets, impl="torch")
    grpo = (0.05, 0.2, 0.28, 3.0, 1.1)
    torch.library.opcheck(
        torch.ops.rlmtrain_kernels.grpo_loss_fwd,
        (logp, None, adv, w_tok, ref, sampler, *grpo, "torch"),
    )
    torch.library.opcheck(
        torch.ops.rlmtrain_kernels.linear_grpo_fwd,
        (hidden, weight, targets, None, adv, w_tok, ref, sampler, TEMPERATURE, IGNORE, *grpo,
         True, True, True, "torch", Variants().spec),
    )  # fmt: skip
