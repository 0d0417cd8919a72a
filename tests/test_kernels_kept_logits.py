"""The log-prob op's forward keeps its last slab of stored logits for the backward: one matrix
product fewer, the same gradients, a buffer of that slab's rows and no more, nothing kept where
no backward can come or under torch.compile, nothing held after the backward, and a retained
graph's second backward forming every slab again."""

import dataclasses
import math
import weakref

import pytest
import torch
from rlmtrain_kernels import Variants, fused_linear_logprob, logit_slabs
from rlmtrain_kernels.logit_slabs import _slabs

IGNORE = -100
OPS = torch.ops.rlmtrain_kernels  # the custom ops the public op calls
N, H, V = 150, 24, 1100
# 135 trained rows and 40 * V fp32 logits a slab. Slabs of rows: 33, 34, 34 and 34 rows, a kept
# buffer of 34. Slabs of columns (at most 325 for 135 rows, in steps of 64): 3 of 320 and the
# last 140, a kept buffer 320 wide.
SLAB_BYTES = 40 * V * 4
SLABS = {"rows": [(33, V), (34, V), (34, V), (34, V)], "columns": [(135, 320)] * 3 + [(135, 140)]}
KEPT = {"rows": (34, V), "columns": (135, 320)}


@pytest.fixture(params=["rows", "columns"])
def stored(monkeypatch, request, uninitialised_is_nan):
    """A log of the slab products formed (their shapes), carrying the variants to call with: the
    stored forward and backward cutting rows or columns into small slabs."""
    variants = Variants(
        forward="stored", backward="stored", logprob_slabs=request.param,
        logit_slab_bytes=SLAB_BYTES,
    )  # fmt: skip
    formed = SlabLog(SLABS[request.param], KEPT[request.param], variants)
    kept = []
    slab_logits, log_probs = logit_slabs._slab_logits, logit_slabs.log_probs

    def count_products(x, weight, out):
        formed.append((x.shape[0], weight.shape[0]))
        slab_logits(x, weight, out)

    def watch_kept(*args, logits=None, **kwargs):
        kept.append(None if logits is None else weakref.ref(logits))
        return log_probs(*args, logits=logits, **kwargs)

    monkeypatch.setattr(logit_slabs, "_slab_logits", count_products)
    monkeypatch.setattr(logit_slabs, "log_probs", watch_kept)
    return formed, kept


class SlabLog(list):
    """The shapes of the slab products formed, those the forward forms (`expected`), the buffer
    it keeps (`kept`) and the variants that cut them so."""

    def __init__(self, expected: list[tuple[int, int]], kept: tuple[int, int], variants) -> None:
        super().__init__()
        self.expected, self.kept, self.variants = expected, kept, variants


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


def test_column_slabs_are_aligned_as_few_as_the_cap_allows_and_cut_again_from_their_width():
    align = logit_slabs.COLUMN_ALIGN
    for n, v, slab_bytes in [(1, 1000, 10**9), (135, 1100, SLAB_BYTES), (16384, 151936, 2 << 30),
                             (7, 64, 4 * 7 * 64), (3, 4099, 4 * 3 * 64)]:  # fmt: skip
        width = logit_slabs._column_width(n, v, slab_bytes)
        cuts = logit_slabs._columns(v, width)
        assert [c for s in cuts for c in range(s.start, s.stop)] == list(range(v))
        assert width % align == 0 and all(s.start % align == 0 for s in cuts)
        cap_units = max(1, slab_bytes // (4 * n * align))
        units = math.ceil(v / align)
        assert len(cuts) == math.ceil(units / cap_units)  # no more slabs than the cap needs
        assert width <= cap_units * align  # and none past the cap
        assert logit_slabs._columns(v, width) == cuts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backward_takes_the_kept_slab_and_a_second_backward_forms_it_again(stored, device):
    formed, kept = stored
    hidden, weight, targets, (g, g_entropy) = inputs(device)
    logp, entropy = fused_linear_logprob(
        hidden, weight, targets, return_entropy=True, impl="triton", variants=formed.variants
    )
    assert formed == formed.expected
    assert kept[0]() is not None and kept[0]().shape == formed.kept
    formed.clear()
    first = torch.autograd.grad(
        (logp, entropy), (hidden, weight), (g, g_entropy), retain_graph=True
    )
    # The kept slab (the last rows, or the last columns) formed no product.
    assert sorted(formed) == sorted(formed.expected[:-1])
    assert kept[0]() is None  # and the backward let it go
    formed.clear()
    second = torch.autograd.grad((logp, entropy), (hidden, weight), (g, g_entropy))
    assert sorted(formed) == sorted(formed.expected)
    # The two backwards add the slabs' dW in different orders: equal to the bit on the CPU, to
    # fp32 rounding before the bf16 cast on a GPU. A slab's logits taken for another's would
    # be wrong by whole units.
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, **({} if device == "cuda" else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("why", ["no_grad", "frozen"])
def test_a_forward_with_no_backward_to_come_keeps_nothing(stored, why):
    formed, kept = stored
    hidden, weight, targets, _ = inputs()
    call = dict(impl="triton", variants=formed.variants)
    if why == "no_grad":
        with torch.no_grad():
            fused_linear_logprob(hidden, weight, targets, **call)
    else:
        fused_linear_logprob(hidden.detach(), weight.detach(), targets, **call)
    assert kept == [None]


def test_no_trained_row_keeps_an_empty_buffer(stored):
    variants = stored[0].variants
    hidden, weight, targets, _ = inputs()
    targets = torch.full_like(targets, IGNORE)
    _, _, _, kept = OPS.linear_logprob_fwd(
        hidden.detach(), weight.detach(), targets, 1.0, IGNORE, False, True, "triton",
        variants.spec,
    )  # fmt: skip
    assert kept.shape == (0, V)
    logp = fused_linear_logprob(hidden, weight, targets, impl="triton", variants=variants)
    grads = torch.autograd.grad(logp.sum(), (hidden, weight))
    assert all(not g.any() for g in grads)


def test_ops_schemas_fakes_and_the_declared_mutation(stored):
    spec = stored[0].variants.spec
    hidden, weight, targets, (g, _) = inputs()
    hidden, weight = hidden.detach(), weight.detach()
    torch.library.opcheck(
        OPS.linear_logprob_fwd, (hidden, weight, targets, 1.0, IGNORE, True, True, "triton", spec)
    )
    _, _, lse, kept = OPS.linear_logprob_fwd(
        hidden, weight, targets, 1.0, IGNORE, False, True, "triton", spec
    )
    assert kept.shape == stored[0].kept
    torch.library.opcheck(
        OPS.linear_logprob_bwd,
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
            spec,
        ),
    )


def test_compiled_step_keeps_nothing_and_equals_eager(stored):
    """A compiled graph would copy the kept slab (the backward writes into it), so it keeps none
    and forms every slab in the backward."""
    formed, kept = stored
    hidden, weight, targets, (g, g_entropy) = inputs()

    def step(x, w):
        logp, entropy = fused_linear_logprob(
            x, w, targets, return_entropy=True, impl="triton", variants=formed.variants
        )
        return (logp * g).sum() + (entropy * g_entropy).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (step, compiled):
        x, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        formed.clear()
        out = fn(x, w)
        results.append((out, *torch.autograd.grad(out, (x, w))))
    assert kept[-1] is None and formed == formed.expected * 2
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_interleaved_calls_each_cut_as_their_own_variants_say(stored):
    """Two calls with different slabs (rows and columns), both forwards before either backward:
    each backward cuts as its own forward did and gives what it gives alone; neither call's
    choice reaches the other."""
    formed, _ = stored
    mine = formed.variants
    other = dataclasses.replace(
        mine, logprob_slabs="rows" if mine.logprob_slabs == "columns" else "columns"
    )
    hidden, weight, targets, (g, g_entropy) = inputs()

    def grads_alone(variants):
        logp, entropy = fused_linear_logprob(
            hidden, weight, targets, return_entropy=True, impl="triton", variants=variants
        )
        return torch.autograd.grad((logp, entropy), (hidden, weight), (g, g_entropy))

    alone = [grads_alone(v) for v in (mine, other)]
    outputs = [
        fused_linear_logprob(
            hidden, weight, targets, return_entropy=True, impl="triton", variants=v
        )
        for v in (mine, other)
    ]
    formed.clear()
    together = [torch.autograd.grad(out, (hidden, weight), (g, g_entropy)) for out in outputs]
    # Each backward forms every slab but the one its forward kept, mine cut as `mine` says.
    assert sorted(formed[: len(formed.expected) - 1]) == sorted(formed.expected[:-1])
    for solo, interleaved in zip(alone, together, strict=True):
        for a, b in zip(solo, interleaved, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
