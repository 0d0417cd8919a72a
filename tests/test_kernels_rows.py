"""Ignored rows never reach the LM head: whatever they hold (inf, nan) changes no log-prob, loss,
metric or gradient of any op, and each op's results match a run on the trained rows alone. A
trained row's target outside the head's vocabulary is an error naming the row."""

import pytest
import torch
from rlmtrain_kernels import fused_linear_grpo_loss, fused_linear_logprob, fused_linear_nll
from rlmtrain_kernels.rows import TrainedRows

IGNORE = -100
IMPLS = ["torch", "triton"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
N, H, V = 37, 16, 1001


def packed_batch(device, seed=0):
    """A packed batch as training builds it: prompt spans (ignored) between trained spans; the
    ignored rows' hidden states are poisoned with inf and nan."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)
    targets = torch.randint(0, V, (N,), generator=gen)
    ignored = torch.zeros(N, dtype=torch.bool)
    ignored[:9] = ignored[15:24] = ignored[30:33] = True
    targets[ignored] = IGNORE
    hidden[ignored] = torch.tensor([float("inf"), float("nan")]).repeat(H // 2)
    per_token = dict(
        old_logp=-torch.rand(N, generator=gen) * 6,
        advantages=torch.randn(N, generator=gen),
        weights=torch.rand(N, generator=gen),
    )
    per_token["ref_logp"] = per_token["old_logp"] + 0.3 * torch.randn(N, generator=gen)
    moved = {k: t.to(device) for k, t in per_token.items()}
    return hidden.to(device), weight.to(device), targets.to(device), ~ignored.to(device), moved


def logprob_op(impl):
    def run(x, w, t, tok):
        logp, entropy = fused_linear_logprob(x, w, t, return_entropy=True, impl=impl)
        loss = (logp * tok["advantages"]).sum() + (entropy * tok["weights"]).sum()
        return loss, [logp, entropy]

    return run


def grpo_op(impl):
    def run(x, w, t, tok):
        loss, metrics, entropy = fused_linear_grpo_loss(
            x, w, t, tok["old_logp"], tok["advantages"], tok["weights"], ref_logp=tok["ref_logp"],
            beta=0.05, clip_low=0.2, clip_high=0.28, dual_clip=3.0, return_entropy=True,
            impl=impl,
        )  # fmt: skip
        return loss, [entropy, torch.stack(list(metrics))]

    return run


def nll_op(impl):
    def run(x, w, t, tok):
        loss, entropy = fused_linear_nll(x, w, t, tok["weights"], return_entropy=True, impl=impl)
        return loss, [entropy]

    return run


OPS = {"logprob": logprob_op, "grpo": grpo_op, "nll": nll_op}


def outputs_and_grads(run, x, w, t, tok):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss, outs = run(x, w, t, tok)
    dx, dw = torch.autograd.grad(loss, (x, w))
    return loss, outs, dx, dw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPS))
def test_poisoned_ignored_rows_change_nothing(op, impl, device):
    hidden, weight, targets, trained, tok = packed_batch(device)
    run = OPS[op](impl)
    loss, outs, dx, dw = outputs_and_grads(run, hidden, weight, targets, tok)
    assert torch.isfinite(loss) and torch.isfinite(dw).all() and torch.isfinite(dx).all()
    assert torch.all(dx[~trained] == 0)

    # The same op on the trained rows alone: same loss and dW, same per-row outputs there.
    only = {k: v[trained] for k, v in tok.items()}
    loss_t, outs_t, dx_t, dw_t = outputs_and_grads(
        run, hidden[trained], weight, targets[trained], only
    )
    torch.testing.assert_close(dw, dw_t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx[trained], dx_t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, loss_t, rtol=1e-5, atol=1e-6)
    for full, subset in zip(outs, outs_t, strict=True):
        if full.shape[0] == N:  # per-row outputs: 0 on ignored rows
            assert torch.all(full[~trained] == 0)
            full = full[trained]
        torch.testing.assert_close(full, subset, rtol=1e-5, atol=1e-6)


def test_trained_rows_gather_and_scatter():
    targets = torch.tensor([5, IGNORE, 7, IGNORE, IGNORE, 2])
    rows = TrainedRows("test", targets, IGNORE, 8)
    assert rows.count == 3 and rows.index.tolist() == [0, 2, 5]
    values = torch.arange(12.0).view(6, 2)
    assert rows.take(values).tolist() == [[0, 1], [4, 5], [10, 11]]
    assert rows.put(torch.ones(3)).tolist() == [1, 0, 1, 0, 0, 1]
    assert rows.take(None) is None

    every = TrainedRows("test", torch.tensor([1, 2, 3]), IGNORE, 8)
    assert every.index is None and every.count == 3
    assert every.take(values) is values  # nothing ignored: no copies

    none = TrainedRows("test", torch.full((4,), IGNORE), IGNORE, 8)
    assert none.count == 0 and none.put(torch.empty(0, 3)).shape == (4, 3)


@pytest.mark.parametrize("bad", [V, V + 50, -1])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPS))
def test_target_outside_the_vocabulary_is_named(op, impl, bad):
    hidden, weight, targets, trained, tok = packed_batch("cpu")
    row = int(trained.nonzero()[3, 0])
    targets[row] = bad
    public = {"logprob": "fused_linear_logprob", "grpo": "fused_linear_grpo_loss"}
    named = public.get(op, "fused_linear_nll")
    with pytest.raises(ValueError, match=rf"^{named}: targets .*\[0, {V}\).*row {row} holds {bad}"):
        OPS[op](impl)(hidden, weight, targets, tok)
