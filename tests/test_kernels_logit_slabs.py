"""The fused losses' stored-logits path (logit_slabs.py) against float64 truth and against the
recompute path, across 16-bit dtypes, several slabs with a partial last one, a vocabulary that
is no multiple of the row kernels' block, and rows that must not overflow."""

import pytest
import torch
from rlmtrain_kernels import Variants, fused_linear_grpo_loss, fused_linear_nll, logit_slabs

from tests.test_kernels_fused import train_lm_head

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.bfloat16, torch.float16]
IGNORE = -100
GRPO_OPTIONS = dict(beta=0.05, clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=1.5)


def rel_err(ours: torch.Tensor, truth: torch.Tensor) -> float:
    return ((ours.double() - truth.double()).norm() / truth.double().norm()).item()


def batch(n: int, h: int, v: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) * (2.0 / h**0.5)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[3::7] = IGNORE
    old = -torch.rand(n, generator=gen) * 6
    tok = dict(
        old_logp=old,
        advantages=torch.randn(n, generator=gen),
        weights=torch.rand(n, generator=gen) / n,
        ref_logp=old + 0.3 * torch.randn(n, generator=gen),
        sampler_logp=old + 0.3 * torch.randn(n, generator=gen),
    )
    tok = {k: t.to(device) for k, t in tok.items()}
    return hidden.to(device), weight.to(device), targets.to(device), tok


def grpo_truth(hidden, weight, targets, tok, temperature):
    """The GRPO loss of full float64 logits, and its gradients, by autograd."""
    x, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logsm = torch.log_softmax((x @ w.T) / temperature, dim=-1)
    valid = targets != IGNORE
    logp = torch.where(valid, logsm.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    ratio = torch.exp(logp - tok["old_logp"].double())
    adv = tok["advantages"].double()
    clipped = torch.clamp(ratio, 1 - GRPO_OPTIONS["clip_low"], 1 + GRPO_OPTIONS["clip_high"])
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    surrogate = torch.where(
        adv < 0, torch.maximum(surrogate, GRPO_OPTIONS["dual_clip"] * adv), surrogate
    )
    tis = torch.clamp(
        torch.exp(tok["old_logp"].double() - tok["sampler_logp"].double()),
        max=GRPO_OPTIONS["tis_cap"],
    )
    delta = tok["ref_logp"].double() - logp
    kl = torch.exp(delta) - delta - 1
    per_token = -tis * surrogate + GRPO_OPTIONS["beta"] * kl
    weights = torch.where(valid, tok["weights"].double(), 0.0)
    loss = (weights * per_token).sum()
    return loss, *torch.autograd.grad(loss, (x, w))


def fused_grpo(hidden, weight, targets, tok, temperature, variants):
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics, entropy = fused_linear_grpo_loss(
        x, w, targets, tok["old_logp"], tok["advantages"], tok["weights"],
        ref_logp=tok["ref_logp"], sampler_logp=tok["sampler_logp"], temperature=temperature,
        return_entropy=True, impl="triton", variants=variants, **GRPO_OPTIONS,
    )  # fmt: skip
    return loss, *torch.autograd.grad(loss, (x, w)), entropy, metrics


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_logits_grpo_matches_fp64_truth_and_the_recompute_path(
    monkeypatch, uninitialised_is_nan, dtype, device
):
    # 2 500 columns: the interpreter's 1 024-column blocks end in a partial one (the compiled
    # kernels' 2 048 likewise). Slabs of 7 rows: 31 trained rows make 5 slabs, the last partial.
    hidden, weight, targets, tok = batch(36, 40, 2500, dtype, device)
    slab_bytes = 7 * 4 * 2500
    original, ran = logit_slabs.row_grads, []

    def spy(*args, **kwargs):
        ran.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(logit_slabs, "row_grads", spy)
    stored = Variants(row_grads="stored", logit_slab_bytes=slab_bytes)
    loss, dx, dw, entropy, metrics = fused_grpo(hidden, weight, targets, tok, 0.8, stored)
    assert ran, "the stored-logits path did not run"
    recompute = Variants(row_grads="recompute", logit_slab_bytes=slab_bytes)
    loss_r, dx_r, dw_r, entropy_r, metrics_r = fused_grpo(
        hidden, weight, targets, tok, 0.8, recompute
    )
    assert len(ran) == 1

    loss_t, dx_t, dw_t = grpo_truth(hidden, weight, targets, tok, temperature=0.8)
    assert abs(loss.item() - loss_t.item()) <= 1e-5 * max(1.0, abs(loss_t.item()))
    # dz is rounded to the input dtype before the two products, on both paths.
    assert rel_err(dx, dx_t) < 1e-2 and rel_err(dw, dw_t) < 1e-2
    assert rel_err(dx, dx_r) < 5e-3 and rel_err(dw, dw_r) < 5e-3
    torch.testing.assert_close(entropy, entropy_r, rtol=1e-4, atol=1e-4)
    for name, a, b in zip(metrics._fields, metrics, metrics_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert dx.dtype == dw.dtype == dtype
    assert torch.all(dx[targets == IGNORE] == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_logits_nll_matches_fp64_truth(uninitialised_is_nan, dtype, device):
    hidden, weight, targets, tok = batch(19, 33, 1500, dtype, device, seed=2)
    stored = Variants(row_grads="stored", logit_slab_bytes=5 * 4 * 1500)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_nll(
        x, w, targets, tok["weights"], temperature=1.3, impl="triton", variants=stored
    )
    dx, dw = torch.autograd.grad(loss, (x, w))

    x2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logsm = torch.log_softmax((x2 @ w2.T) / 1.3, dim=-1)
    valid = targets != IGNORE
    picked = logsm.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    loss2 = -(torch.where(valid, tok["weights"].double(), 0.0) * picked).sum()
    dx2, dw2 = torch.autograd.grad(loss2, (x2, w2))
    assert abs(loss.item() - loss2.item()) <= 1e-5 * abs(loss2.item())
    assert rel_err(dx, dx2) < 1e-2 and rel_err(dw, dw2) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_row_kernels_write_every_entry_and_survive_huge_logits(device, with_entropy):
    """The row passes over poisoned outputs, on logits far beyond exp's range, a row whose maximum
    sits in the partial last block and an ignored row: lse, log-probs, entropy and every gradient
    entry (with the entropy's term, g_H * p * (E_p[z] - z)) against float64."""
    gen = torch.Generator().manual_seed(3)
    rows, v = 6, 2500
    z = (torch.randn(rows, v, generator=gen, dtype=torch.float64) * 30).to(device)
    z[0] += 5000.0
    z[1] -= 8000.0
    z[2, -1] = 900.0
    targets = torch.tensor([0, v - 1, v - 1, 17, 1234, IGNORE], device=device)
    trained = targets != IGNORE
    g = torch.where(trained, torch.randn(rows, generator=gen).to(device), 0.0)
    ge = torch.where(trained, torch.randn(rows, generator=gen).to(device), 0.0)
    inv_t = 1 / 0.7
    zs = z * inv_t
    lse_t = torch.logsumexp(zs, dim=1)
    p = torch.exp(zs - lse_t[:, None])
    mean_z = (p * zs).sum(1)
    onehot = torch.nn.functional.one_hot(targets.clamp(min=0), v).double() * trained[:, None]
    dz_t = g.double()[:, None] * (onehot - p)
    if with_entropy:
        dz_t += ge.double()[:, None] * p * (mean_z[:, None] - zs)
    dz_t *= inv_t

    z32 = z.float()
    logp = torch.full((rows,), float("nan"), device=device)
    lse, entropy = logp.clone(), logp.clone()
    dz = torch.full((rows, v), float("nan"), device=device, dtype=torch.bfloat16)
    block = dict(BLOCK_V=1024, num_warps=logit_slabs.ROW_WARPS)
    logit_slabs._row_stats_kernel[(rows,)](
        z32, targets, logp, lse, entropy, v, 0, v, z32.stride(0), inv_t, WITH_ENTROPY=True,
        **block,
    )  # fmt: skip
    logit_slabs._row_dlogits_kernel[(rows,)](
        z32, dz, targets, lse, (lse - entropy).contiguous() if with_entropy else lse, g, ge, v,
        0, z32.stride(0), dz.stride(0), inv_t, WITH_ENTROPY=with_entropy, **block,
    )  # fmt: skip
    torch.testing.assert_close(lse.double(), lse_t, rtol=1e-6, atol=1e-3)
    logp_t = torch.where(trained, zs.gather(1, targets.clamp(min=0)[:, None])[:, 0] - lse_t, 0.0)
    torch.testing.assert_close(logp.double(), logp_t, rtol=1e-5, atol=2e-3)
    entropy_t = torch.where(trained, lse_t - mean_z, 0.0)
    torch.testing.assert_close(entropy.double(), entropy_t, rtol=1e-4, atol=2e-3)
    assert not torch.isnan(dz).any()
    scale = dz_t.abs().max().item()
    torch.testing.assert_close(dz.double(), dz_t, rtol=1e-2, atol=1e-3 * scale)


def test_fp32_inputs_keep_the_exact_kernels():
    for stage in ("forward", "backward", "row_grads"):
        assert not Variants().stores_logits(stage, torch.float32)
        assert Variants().stores_logits(stage, torch.bfloat16)
    assert not Variants(row_grads="recompute").stores_logits("row_grads", torch.bfloat16)
    assert not Variants(forward="kernel").stores_logits("forward", torch.float16)


def test_bf16_training_loop_stored_equals_recompute_step_for_step():
    """Six AdamW steps of a bf16 head (fp32 master weights, cast for the loss, as FSDP2's mixed
    precision does) under each row-gradient variant: the same losses and weights, step for step,
    to bf16's rounding of the logit gradients."""

    def train(variant: str) -> tuple[list[float], list[torch.Tensor]]:
        def bf16_grpo(hidden, head, targets, old_logp, advantages, weights):
            loss, _ = fused_linear_grpo_loss(
                hidden.to(torch.bfloat16), head.to(torch.bfloat16), targets, old_logp,
                advantages, weights, clip_high=0.28, impl="triton",
                variants=Variants(row_grads=variant),
            )  # fmt: skip
            return loss

        return train_lm_head(bf16_grpo, v=1100)

    stored, stored_params = train("stored")
    recomputed, recomputed_params = train("recompute")
    assert stored[-1] < stored[0]  # the loop does train
    assert stored == pytest.approx(recomputed, rel=1e-3, abs=1e-5)
    for a, b in zip(stored_params, recomputed_params, strict=True):
        assert rel_err(a, b) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("frozen", ["head", "trunk"])
def test_stored_logits_with_one_gradient_wanted(uninitialised_is_nan, frozen, device):
    """A frozen head (no dW) or frozen hidden states (no dX): the other gradient alone, the same
    as the chunked torch backend's."""
    hidden, weight, targets, tok = batch(29, 24, 1300, torch.bfloat16, device, seed=4)
    stored = Variants(row_grads="stored", logit_slab_bytes=6 * 4 * 1300)

    def grad(impl: str) -> torch.Tensor:
        x = hidden.clone().requires_grad_(frozen == "head")
        w = weight.clone().requires_grad_(frozen == "trunk")
        loss, _ = fused_linear_grpo_loss(
            x, w, targets, None, tok["advantages"], tok["weights"], impl=impl, variants=stored
        )
        (out,) = torch.autograd.grad(loss, (x if frozen == "head" else w,))
        return out

    assert rel_err(grad("triton"), grad("torch")) < 1e-2
