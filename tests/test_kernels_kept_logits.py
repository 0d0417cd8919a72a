"""The log-prob op's forward keeps its last slab of stored logits for the backward: one matrix
product fewer, the same gradients, a buffer of that slab's rows and no more, nothing kept where
no backward can come or under torch.compile, nothing held after the backward, and a retained
graph's second backward forming every slab again."""

import weakref

import pytest
import torch
from rlmtrain_kernels import fused_linear_logprob, logit_slabs, tiles
from rlmtrain_kernels.logit_slabs import _slabs
from rlmtrain_kernels.logprob import _linear_logprob_bwd, _linear_logprob_fwd

IGNORE = -100
N, H, V = 150, 24, 1100
SLAB_ROWS = 40  # 135 trained rows: slabs of 33, 34, 34 and 34, and a kept buffer of 34


@pytest.fixture
def stored(monkeypatch):
    """The stored forward and backward, small slabs, and a log of the slab products formed."""
    monkeypatch.setattr(tiles, "FORWARD_VARIANT", "stored")
    monkeypatch.setattr(tiles, "BACKWARD_VARIANT", "stored")
    monkeypatch.setattr(logit_slabs, "LOGIT_SLAB_BYTES", SLAB_ROWS * V * 4)
    formed, kept = [], []
    slab_logits, log_probs = logit_slabs._slab_logits, logit_slabs.log_probs

    def count_products(x, weight, out):
        formed.append(x.shape[0])
        slab_logits(x, weight, out)

    def watch_kept(*args, logits=None, **kwargs):
        kept.append(None if logits is None else weakref.ref(logits))
        return log_probs(*args, logits=logits, **kwargs)

    monkeypatch.setattr(logit_slabs, "_slab_logits", count_products)
    monkeypatch.setattr(logit_slabs, "log_probs", watch_kept)
    return formed, kept


def inputs(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * H**-0.5).to(device, torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::10] = IGNORE
    upstream = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    return hidden, weight.requires_grad_(), targets.to(device), [u.to(device) for u in upstream]


def test_slabs_are_even_the_larger_last_and_as_few_as_the_cap_allows():
    for n in (0, 1, 39, 40, 41, 130, 1000):
        for most in (1, 7, 40):
            bounds = _slabs(n, most)
            sizes = [b.stop - b.start for b in bounds]
            assert [r for b in bounds for r in range(b.start, b.stop)] == list(range(n))
            assert len(bounds) == -(-n // most)
            assert all(0 < s <= most for s in sizes)
            assert sizes == sorted(sizes) and (not sizes or sizes[-1] - sizes[0] <= 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backward_takes_the_kept_slab_and_a_second_backward_forms_it_again(stored, device):
    formed, kept = stored
    hidden, weight, targets, (g, g_entropy) = inputs(device)
    logp, entropy = fused_linear_logprob(
        hidden, weight, targets, return_entropy=True, impl="triton"
    )
    assert formed == [33, 34, 34, 34]
    assert kept[0]() is not None and kept[0]().shape == (34, V)
    formed.clear()
    first = torch.autograd.grad(
        (logp, entropy), (hidden, weight), (g, g_entropy), retain_graph=True
    )
    assert formed == [33, 34, 34]  # the kept slab (the last 34 rows) formed no product
    assert kept[0]() is None  # and the backward let it go
    formed.clear()
    second = torch.autograd.grad((logp, entropy), (hidden, weight), (g, g_entropy))
    assert formed == [33, 34, 34, 34]
    # The two backwards add the slabs' dW in different orders: equal to the bit on the CPU, to
    # fp32 rounding before the bf16 cast on a GPU. A slab's logits taken for another's would
    # be wrong by whole units.
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, **({} if device == "cuda" else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("why", ["no_grad", "frozen"])
def test_a_forward_with_no_backward_to_come_keeps_nothing(stored, why):
    _, kept = stored
    hidden, weight, targets, _ = inputs()
    if why == "no_grad":
        with torch.no_grad():
            fused_linear_logprob(hidden, weight, targets, impl="triton")
    else:
        fused_linear_logprob(hidden.detach(), weight.detach(), targets, impl="triton")
    assert kept == [None]


def test_no_trained_row_keeps_an_empty_buffer(stored):
    hidden, weight, targets, _ = inputs()
    targets = torch.full_like(targets, IGNORE)
    _, _, _, kept = _linear_logprob_fwd(
        hidden.detach(), weight.detach(), targets, 1.0, IGNORE, False, True, "triton"
    )
    assert kept.shape == (0, V)
    logp = fused_linear_logprob(hidden, weight, targets, impl="triton")
    grads = torch.autograd.grad(logp.sum(), (hidden, weight))
    assert all(not g.any() for g in grads)


def test_ops_schemas_fakes_and_the_declared_mutation(stored):
    hidden, weight, targets, (g, _) = inputs()
    hidden, weight = hidden.detach(), weight.detach()
    torch.library.opcheck(
        _linear_logprob_fwd, (hidden, weight, targets, 1.0, IGNORE, True, True, "triton")
    )
    _, _, lse, kept = _linear_logprob_fwd(
        hidden, weight, targets, 1.0, IGNORE, False, True, "triton"
    )
    assert kept.shape == (34, V)
    torch.library.opcheck(
        _linear_logprob_bwd,
        (
            hidden,
            weight,
            targets,
            lse,
            torch.empty(0),
            kept,
            g,
            None,
            1.0,
            IGNORE,
            True,
            True,
            "triton",
        ),
    )


def test_compiled_step_keeps_nothing_and_equals_eager(stored):
    """A compiled graph would copy the kept slab (the backward writes into it), so it keeps none
    and forms every slab in the backward."""
    formed, kept = stored
    hidden, weight, targets, (g, g_entropy) = inputs()

    def step(x, w):
        logp, entropy = fused_linear_logprob(x, w, targets, return_entropy=True, impl="triton")
        return (logp * g).sum() + (entropy * g_entropy).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (step, compiled):
        x, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        formed.clear()
        out = fn(x, w)
        results.append((out, *torch.autograd.grad(out, (x, w))))
    assert kept[-1] is None and formed == [33, 34, 34, 34] * 2
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
