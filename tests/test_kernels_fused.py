"""The fused ops: against their own composition, against Liger's fused GRPO loss, inside a plain
training loop against full-logits autograd, and under torch.compile."""

import pytest
import torch
from rlmtrain_kernels import (
    fused_linear_grpo_loss,
    fused_linear_logprob,
    fused_linear_nll,
    grpo_loss,
)

IMPLS = ["torch", "triton"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
IGNORE = -100


def make_batch(n, h, v, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / h**0.5)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[2::5] = IGNORE
    old = -torch.rand(n, generator=gen) * 6
    per_token = dict(
        old_logp=old,
        advantages=torch.randn(n, generator=gen),
        weights=torch.rand(n, generator=gen),
        ref_logp=old + 0.3 * torch.randn(n, generator=gen),
        sampler_logp=old + 0.3 * torch.randn(n, generator=gen),
    )
    moved = {k: t.to(device) for k, t in per_token.items()}
    return hidden.to(device), weight.to(device), targets.to(device), moved


def assert_grads_close(ours, theirs):
    """fp32 sums over V cancel; judge the error against the gradient's scale."""
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-5 * scale)


GRPO_OPTIONS = dict(beta=0.05, clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=1.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_grpo_equals_logprob_then_grpo_loss(impl, device):
    hidden, weight, targets, tok = make_batch(37, 16, 1001, device)
    x1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics, entropy = fused_linear_grpo_loss(
        x1, w1, targets, tok["old_logp"], tok["advantages"], tok["weights"],
        ref_logp=tok["ref_logp"], sampler_logp=tok["sampler_logp"], temperature=0.8,
        return_entropy=True, impl=impl, **GRPO_OPTIONS,
    )  # fmt: skip
    dx1, dw1 = torch.autograd.grad(loss * 2.5, (x1, w1))

    x2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy2 = fused_linear_logprob(
        x2, w2, targets, temperature=0.8, return_entropy=True, impl="torch"
    )
    valid_weights = torch.where(targets != IGNORE, tok["weights"], 0.0)
    loss2, metrics2 = grpo_loss(
        logp, tok["old_logp"], tok["advantages"], valid_weights, ref_logp=tok["ref_logp"],
        sampler_logp=tok["sampler_logp"], impl="torch", **GRPO_OPTIONS,
    )  # fmt: skip
    dx2, dw2 = torch.autograd.grad(loss2 * 2.5, (x2, w2))

    torch.testing.assert_close(loss, loss2, rtol=1e-5, atol=1e-6)
    assert_grads_close(dx1, dx2)
    assert_grads_close(dw1, dw2)
    torch.testing.assert_close(entropy, entropy2.detach(), rtol=1e-5, atol=1e-5)
    for name, a, b in zip(metrics._fields, metrics, metrics2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert metrics.tokens.item() == (valid_weights != 0).sum().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_nll_equals_weighted_full_logits_nll(impl, dtype, device):
    hidden, weight, targets, tok = make_batch(23, 67, 1000, device, seed=1)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    x1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_nll(x1, w1, targets, tok["weights"], temperature=1.3, impl=impl)
    dx1, dw1 = torch.autograd.grad(loss, (x1, w1))

    x2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logsm = torch.log_softmax((x2 @ w2.T) / 1.3, dim=-1)
    valid = targets != IGNORE
    picked = logsm.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    loss2 = -(torch.where(valid, tok["weights"].double(), 0.0) * picked).sum()
    dx2, dw2 = torch.autograd.grad(loss2, (x2, w2))

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    assert loss.dtype == torch.float32 and dx1.dtype == dw1.dtype == dtype
    torch.testing.assert_close(loss.double(), loss2, **tol)
    torch.testing.assert_close(dx1.double(), dx2, **tol)
    torch.testing.assert_close(dw1.double(), dw2, **tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_head_and_no_grad(impl):
    hidden, weight, targets, tok = make_batch(9, 16, 300)
    x = hidden.clone().requires_grad_()
    args = (targets, tok["old_logp"], tok["advantages"], tok["weights"])
    loss, _ = fused_linear_grpo_loss(x, weight, *args, impl=impl)
    (dx,) = torch.autograd.grad(loss, (x,))
    x2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss2, _ = fused_linear_grpo_loss(x2, w2, *args, impl="torch")
    torch.testing.assert_close(dx, torch.autograd.grad(loss2, (x2,))[0], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        loss3, _ = fused_linear_grpo_loss(x2, w2, *args, impl=impl)
    assert not loss3.requires_grad
    torch.testing.assert_close(loss3, loss.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["grpo", "nll"])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_differentiable_upstream_scale_keeps_its_gradient(impl, op):
    """The fused losses' backward scales the stored gradients by the upstream gradient; when
    that is itself differentiable (a loss scaled by a learned factor, differentiated with
    create_graph), the scaled gradient must carry its graph: d(dLoss*s/dx)/ds = dLoss/dx."""
    hidden, weight, targets, tok = make_batch(9, 16, 300)
    x, s = hidden.clone().requires_grad_(), torch.tensor(1.5, requires_grad=True)
    if op == "grpo":
        args = (targets, tok["old_logp"], tok["advantages"], tok["weights"])
        loss, _ = fused_linear_grpo_loss(x, weight, *args, impl=impl)
    else:
        loss = fused_linear_nll(x, weight, targets, tok["weights"], impl=impl)
    (dx,) = torch.autograd.grad(loss * s, (x,), create_graph=True)
    (ds,) = torch.autograd.grad(dx.sum(), (s,))
    torch.testing.assert_close(ds, (dx / s).sum().detach(), rtol=1e-5, atol=1e-6)


# --- Peer check: Liger-Kernel's LigerFusedLinearGRPOLoss ----------------------------------------
#
# Liger takes padded [B, T] inputs and one advantage per sequence; we take packed [N] tokens and
# one weight per token. The aggregations both support: Liger's "bnpo" (sum over unmasked tokens /
# number of unmasked tokens) is our weights = mask / mask.sum(); its "grpo" (mean over each
# sequence's tokens, then / B) is weights = mask / (len_b * B). Its `vllm_is_ratio` is our
# min(exp(old - sampler), tis_cap), multiplying the policy term before the KL is added, as ours.
# Its `delta` clamps the ratio from above for both advantage signs; for A > 0 the upper clip
# already binds below delta, so with delta >= 1 + clip_high it equals our dual clip.
# Liger's chunked path is plain torch (compiled=False keeps torch.compile out of it on CPU).


def liger_batch(b, t, h, v, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / h**0.5)
    ids = torch.randint(0, v, (b, t), generator=gen)
    lengths = torch.tensor([t, t - 3, 2])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    old = -torch.rand(b, t, generator=gen) * 6
    # Spread the policy around old so every clipping regime is visited.
    with torch.no_grad():
        logits = (hidden @ weight.T) / 0.9
        cur = torch.log_softmax(logits, -1).gather(2, ids.unsqueeze(2)).squeeze(2)
    old = cur + 0.4 * torch.randn(b, t, generator=gen)
    old[1, 0] = cur[1, 0] - 1.5  # A < 0, ratio e^1.5 beyond the dual clip
    old[1, 1] = cur[1, 1] + 0.5  # A < 0, ratio e^-0.5 below the lower clip
    ref = cur + 0.3 * torch.randn(b, t, generator=gen)
    sampler = old + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.tensor([1.0, -1.5, 0.7])
    return hidden, weight, ids, mask, old, ref, sampler, adv


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", ["bnpo", "grpo"])
def test_matches_liger_fused_linear_grpo_loss(loss_type, impl):
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    b, t, h, v = 3, 9, 16, 300
    beta, clip_low, clip_high, delta, cap, temperature = 0.05, 0.2, 0.28, 2.5, 1.2, 0.9
    hidden, weight, ids, mask, old, ref, sampler, adv = liger_batch(b, t, h, v)
    tis = torch.exp(old - sampler).clamp(max=cap)

    peer = liger.LigerFusedLinearGRPOLoss(
        beta=beta, compiled=False, use_ref_model=True, chunk_size=1, epsilon_low=clip_low,
        epsilon_high=clip_high, loss_type=loss_type, temperature=temperature, delta=delta,
    )  # fmt: skip
    x1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    peer_loss, (peer_kl, peer_clip) = peer(
        x1, w1, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old, vllm_is_ratio=tis
    )
    peer_dx, peer_dw = torch.autograd.grad(peer_loss, (x1, w1))

    m = mask.float()
    weights = m / m.sum() if loss_type == "bnpo" else m / (m.sum(1, keepdim=True) * b)
    x2, w2 = hidden.reshape(b * t, h).clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = fused_linear_grpo_loss(
        x2, w2, ids.reshape(-1), old.reshape(-1), adv[:, None].expand(b, t).reshape(-1),
        weights.reshape(-1), ref_logp=ref.reshape(-1), beta=beta, clip_low=clip_low,
        clip_high=clip_high, dual_clip=delta, sampler_logp=sampler.reshape(-1), tis_cap=cap,
        temperature=temperature, impl=impl,
    )  # fmt: skip
    dx, dw = torch.autograd.grad(loss, (x2, w2))

    torch.testing.assert_close(loss, peer_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(dx, peer_dx.reshape(b * t, h))
    assert_grads_close(dw, peer_dw)
    torch.testing.assert_close(metrics.kl_mean, peer_kl, rtol=1e-5, atol=1e-6)
    ours_clip = metrics.clip_low_frac + metrics.clip_high_frac
    torch.testing.assert_close(ours_clip, peer_clip, rtol=1e-5, atol=1e-6)
    assert metrics.clip_low_frac.item() > 0 and metrics.clip_high_frac.item() > 0
    assert metrics.dual_clip_frac.item() > 0 and metrics.tis_clipped_frac.item() > 0


# --- Drop-in: a plain training loop, fused loss against full-logits autograd ---------------------


def train_lm_head(loss_fn, steps=6, n=48, h=16, v=257):
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(n, h, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    advantages = torch.randn(n, generator=gen)
    weights = torch.full((n,), 1.0 / n)
    trunk = torch.nn.Linear(h, h)
    head = torch.nn.Parameter(torch.randn(v, h, generator=gen) * 0.3)
    with torch.no_grad():
        trunk.weight.copy_(torch.randn(h, h, generator=gen) * 0.3)
        trunk.bias.zero_()
        old_logp = torch.log_softmax(torch.tanh(trunk(features)) @ head.T, -1)
        old_logp = old_logp.gather(1, targets[:, None]).squeeze(1)
    opt = torch.optim.AdamW([*trunk.parameters(), head], lr=3e-2)
    losses = []
    for _ in range(steps):
        hidden = torch.tanh(trunk(features))
        loss = loss_fn(hidden, head, targets, old_logp, advantages, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in (*trunk.parameters(), head)]


def naive_grpo(hidden, head, targets, old_logp, advantages, weights):
    logp = torch.log_softmax(hidden @ head.T, -1).gather(1, targets[:, None]).squeeze(1)
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
    return (weights * per_token).sum()


@pytest.mark.parametrize("impl", IMPLS)
def test_training_loop_matches_full_logits_step_for_step(impl):
    def fused(hidden, head, targets, old_logp, advantages, weights):
        loss, _ = fused_linear_grpo_loss(
            hidden, head, targets, old_logp, advantages, weights, clip_high=0.28, impl=impl
        )
        return loss

    ref_losses, ref_params = train_lm_head(naive_grpo)
    losses, params = train_lm_head(fused)
    assert ref_losses[-1] < ref_losses[1]  # the loop does train
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), f"step {step}"
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- torch.compile -------------------------------------------------------------------------------


def test_compile_traces_every_op_without_graph_breaks():
    hidden, weight, targets, tok = make_batch(11, 16, 300)

    def step(x, w):
        logp, entropy = fused_linear_logprob(x, w, targets, return_entropy=True, impl="torch")
        rl, m = grpo_loss(
            logp, tok["old_logp"], tok["advantages"], tok["weights"], ref_logp=tok["ref_logp"],
            beta=0.1, impl="torch",
        )  # fmt: skip
        fused, m2 = fused_linear_grpo_loss(
            x, w, targets, tok["old_logp"], tok["advantages"], tok["weights"], impl="auto"
        )
        nll = fused_linear_nll(x, w, targets, tok["weights"], impl="torch")
        return rl + fused + nll + 0.01 * entropy.sum() + m.kl_mean + m2.ratio_mean

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (step, compiled):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(x, w)
        results.append((out, *torch.autograd.grad(out, (x, w))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
