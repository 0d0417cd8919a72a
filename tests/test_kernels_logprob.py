"""fused_linear_logprob against an fp64 full-logits ground truth, with tolerances set by torch's
own error at the same input dtype. The Triton cases run the real kernels (in the interpreter on
CPU, compiled on CUDA when a GPU is present)."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from rlmtrain_kernels import (
    KernelBackendUnavailable,
    Variants,
    fused_linear_logprob,
    logit_slabs,
    reference,
    tiles,
)
from rlmtrain_kernels._backend import resolve_impl

IGNORE = -100
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def full_logits_logprob(hidden, weight, targets, temperature):
    """What an unfused trainer computes: [N, V] logits in the input dtype, softmax in fp32 (fp64
    for fp64 inputs). Returns (logp, entropy) with ignored rows set to 0."""
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    logsm = torch.log_softmax(logits / temperature, dim=-1)
    valid = targets != IGNORE
    logp = logsm.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)


def make_inputs(n, h, v, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / h**0.5)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[1::3] = IGNORE  # partly ignored rows
    upstream = torch.randn(2, n, generator=gen)
    return (
        hidden.to(device, dtype),
        weight.to(device, dtype),
        targets.to(device),
        upstream[0].to(device),
        upstream[1].to(device),
    )


def value_and_grads(fn, hidden, weight, g_logp, g_ent):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    logp, entropy = fn(hidden, weight)
    dx, dw = torch.autograd.grad(
        (logp * g_logp.to(logp.dtype)).sum() + (entropy * g_ent.to(entropy.dtype)).sum(),
        (hidden, weight),
    )
    return [logp, entropy, dx, dw]


def max_err(a, truth):
    return (a.double() - truth).abs().max().item()


def assert_close_to_truth(ours, torch_same_dtype, truth, k, rel_atol, names):
    for name, o, t_same, t in zip(names, ours, torch_same_dtype, truth, strict=True):
        scale = t.abs().max().item() or 1.0
        bound = k * max_err(t_same, t) + rel_atol * scale
        assert max_err(o, t) <= bound, f"{name}: error {max_err(o, t):.3g} > bound {bound:.3g}"


NAMES = ("logp", "entropy", "d_hidden", "d_weight")
TEMPERATURE = 0.7
# Covers N in {1, 7, 123}, H in {16, 67}, V in {1000, 1001, 4099}, fp32 and bf16 without the full
# cross product (the interpreter is slow): every V leaves a partial vocabulary tile.
TRITON_CASES = [
    (1, 16, 1000, torch.float32),
    (7, 67, 1001, torch.float32),
    (123, 67, 4099, torch.float32),
    (1, 67, 1000, torch.bfloat16),
    (7, 67, 4099, torch.bfloat16),
    (123, 16, 1001, torch.bfloat16),
]


def check_against_truth(impl, n, h, v, dtype, device, variants=None):
    hidden, weight, targets, g_logp, g_ent = make_inputs(n, h, v, dtype, device)
    truth = value_and_grads(
        lambda x, w: full_logits_logprob(x, w, targets, TEMPERATURE),
        hidden.double(),
        weight.double(),
        g_logp,
        g_ent,
    )
    torch_same = value_and_grads(
        lambda x, w: full_logits_logprob(x, w, targets, TEMPERATURE),
        hidden,
        weight,
        g_logp,
        g_ent,
    )
    ours = value_and_grads(
        lambda x, w: fused_linear_logprob(
            x,
            w,
            targets,
            temperature=TEMPERATURE,
            return_entropy=True,
            impl=impl,
            variants=variants,
        ),
        hidden,
        weight,
        g_logp,
        g_ent,
    )
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert ours[2].dtype == ours[3].dtype == dtype
    assert torch.all(ours[0][targets == IGNORE] == 0)
    assert torch.all(ours[0] <= 0)
    assert_close_to_truth(ours, torch_same, truth, k=2.0, rel_atol=2e-6, names=NAMES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("n", "h", "v", "dtype"), TRITON_CASES)
def test_triton_matches_fp64_truth(n, h, v, dtype, device):
    check_against_truth("triton", n, h, v, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [1000, 1001, 4099])
@pytest.mark.parametrize(("n", "h"), [(1, 16), (7, 67), (123, 67)])
def test_torch_impl_matches_fp64_truth(n, h, v, dtype, device):
    check_against_truth("torch", n, h, v, dtype, device)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bf16_logits_are_not_rounded_before_softmax(impl):
    """With fp32 accumulation the only error left is fp32's; rounding logits to bf16 costs ~1e-2."""
    hidden, weight, targets, _, _ = make_inputs(7, 67, 1001, torch.bfloat16, "cpu")
    truth, _ = full_logits_logprob(hidden.double(), weight.double(), targets, 1.0)
    rounded, _ = full_logits_logprob(hidden, weight, targets, 1.0)
    ours = fused_linear_logprob(hidden, weight, targets, impl=impl)
    assert max_err(ours, truth) < 0.01 * max_err(rounded, truth)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_all_rows_ignored(impl):
    hidden, weight, targets, g_logp, g_ent = make_inputs(7, 16, 1001, torch.float32, "cpu")
    targets = torch.full_like(targets, IGNORE)
    logp, entropy, dx, dw = value_and_grads(
        lambda x, w: fused_linear_logprob(x, w, targets, return_entropy=True, impl=impl),
        hidden,
        weight,
        g_logp,
        g_ent,
    )
    for t in (logp, entropy, dx, dw):
        assert torch.all(t == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_rows_at_all(impl, dtype):
    """An empty batch (N = 0): empty log-probs and entropy, and zero gradients."""
    hidden, weight, targets, _, _ = make_inputs(1, 16, 1001, dtype, "cpu")
    hidden, targets = hidden[:0].clone().requires_grad_(), targets[:0]
    weight = weight.clone().requires_grad_()
    logp, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, impl=impl)
    assert logp.shape == entropy.shape == (0,) and logp.dtype == torch.float32
    dx, dw = torch.autograd.grad((logp.sum() + entropy.sum()), (hidden, weight))
    assert dx.shape == (0, 16) and not dw.any()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_very_negative_logits_with_a_padded_vocab_tile(impl):
    """All logits near -1000 and V = 1001 (a partial last tile): a running max starting at 0
    underflows every exp to 0 (logp = +inf), and padded columns adding exp(0) pull lse up to the
    padding; both bugs give the wrong answer here, the truth is logp ~ -log(V)."""
    n, h, v = 7, 16, 1001
    hidden = torch.ones(n, h)
    weight = torch.full((v, h), -1000.0 / h) + 0.01 * torch.randn(v, h)
    targets = torch.randint(0, v, (n,))
    truth, truth_entropy = full_logits_logprob(hidden.double(), weight.double(), targets, 1.0)
    logp, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, impl=impl)
    assert torch.isfinite(logp).all()
    torch.testing.assert_close(logp.double(), truth, atol=1e-3, rtol=0)
    torch.testing.assert_close(entropy.double(), truth_entropy, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    ("chunk_rows", "chunk_vocab"), [(5, 256), (3, 1001), (64, 1001), (2, 4099 // 3)]
)
def test_torch_backend_chunking(chunk_rows, chunk_vocab):
    """Row blocks and vocabulary tiles that do not divide N and V, the single-tile reuse path
    and the online log-sum-exp across tiles all agree with the full-logits truth."""
    n, h, v = 23, 16, 1001
    hidden, weight, targets, g_logp, g_ent = make_inputs(n, h, v, torch.float64, "cpu")
    chunks = dict(chunk_rows=chunk_rows, chunk_vocab=chunk_vocab)
    truth = value_and_grads(
        lambda x, w: full_logits_logprob(x, w, targets, TEMPERATURE), hidden, weight, g_logp, g_ent
    )
    logp, entropy, lse = reference.linear_logprob_forward(
        hidden, weight, targets, temperature=TEMPERATURE, ignore_index=IGNORE, with_entropy=True,
        **chunks,
    )  # fmt: skip
    dx, dw = reference.linear_logprob_backward(
        hidden, weight, targets, lse, entropy, g_logp.double(), g_ent.double(),
        temperature=TEMPERATURE, ignore_index=IGNORE, need_grad_weight=True, **chunks,
    )  # fmt: skip
    for name, ours, t in zip(NAMES, (logp, entropy, dx, dw), truth, strict=True):
        torch.testing.assert_close(ours, t, rtol=1e-10, atol=1e-10, msg=name)

    # The fused path: its per-token gradient is g_logp, known as soon as logp is.
    logp2, _, dx2, dw2 = reference.linear_logprob_row_grads(
        hidden, weight, targets, lambda rows, _: g_logp.double()[rows],
        temperature=TEMPERATURE, ignore_index=IGNORE, with_entropy=False,
        need_grads=True, need_grad_weight=True, **chunks,
    )  # fmt: skip
    truth_no_entropy = value_and_grads(
        lambda x, w: full_logits_logprob(x, w, targets, TEMPERATURE),
        hidden,
        weight,
        g_logp,
        torch.zeros_like(g_ent),
    )
    for name, ours, t in zip(NAMES, (logp2, None, dx2, dw2), truth_no_entropy, strict=True):
        if ours is not None:
            torch.testing.assert_close(ours, t, rtol=1e-10, atol=1e-10, msg=name)


def test_gradcheck_torch_impl():
    hidden, weight, targets, _, _ = make_inputs(4, 3, 11, torch.float64, "cpu")
    hidden.requires_grad_()
    weight.requires_grad_()

    def fn(x, w):
        return fused_linear_logprob(
            x, w, targets, temperature=TEMPERATURE, return_entropy=True, impl="torch"
        )

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_gradient_only_through_weight_or_hidden():
    """A frozen head (weight without grad) and frozen hidden states each get exactly the full
    gradient's part."""
    hidden, weight, targets, g_logp, _ = make_inputs(7, 16, 1001, torch.float32, "cpu")
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    dx_full, dw_full = torch.autograd.grad(
        (fused_linear_logprob(x, w, targets, impl="torch") * g_logp).sum(), (x, w)
    )
    for impl in ("torch", "triton"):
        (dx,) = torch.autograd.grad(
            (fused_linear_logprob(x, weight, targets, impl=impl) * g_logp).sum(), (x,)
        )
        (dw,) = torch.autograd.grad(
            (fused_linear_logprob(hidden, w, targets, impl=impl) * g_logp).sum(), (w,)
        )
        torch.testing.assert_close(dx, dx_full, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw, dw_full, rtol=1e-5, atol=1e-6)


def test_impl_selection(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu, "op") == "torch"
    assert resolve_impl("triton", cpu, "op") == "triton"  # the interpreter is on in tests
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("cuda", cpu, "op")
    monkeypatch.delenv("TRITON_INTERPRET")
    hidden, weight, targets, _, _ = make_inputs(3, 16, 40, torch.float32, "cpu")
    with pytest.raises(KernelBackendUnavailable, match="TRITON_INTERPRET=1 is not set"):
        fused_linear_logprob(hidden, weight, targets, impl="triton")
    assert fused_linear_logprob(hidden, weight, targets, impl="auto").shape == (3,)


def test_bad_inputs_are_named():
    hidden, weight, targets, _, _ = make_inputs(3, 16, 40, torch.float32, "cpu")
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_logprob(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match="targets must be"):
        fused_linear_logprob(hidden, weight, targets[:2])
    with pytest.raises(ValueError, match="share one of"):
        fused_linear_logprob(hidden, weight.bfloat16(), targets)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_linear_logprob(hidden, weight, targets.float())
    for temperature in (0.0, math.inf, math.nan, 1e-45):  # inf trains nothing, 1e-45 is NaN
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            fused_linear_logprob(hidden, weight, targets, temperature=temperature)
    with pytest.raises(TypeError, match="fused_linear_logprob: temperature must be a real"):
        fused_linear_logprob(hidden, weight, targets, temperature="1.0")
    with pytest.raises(TypeError, match="fused_linear_logprob: ignore_index must be an int"):
        fused_linear_logprob(hidden, weight, targets, ignore_index=None)
    with pytest.raises(TypeError, match="fused_linear_logprob: hidden must be a torch.Tensor"):
        fused_linear_logprob(hidden.numpy(), weight, targets)
    with pytest.raises(ValueError, match="impl='torch' only"):
        fused_linear_logprob(hidden.double(), weight.double(), targets, impl="triton")
    with pytest.raises(ValueError, match="weight has no rows"):
        fused_linear_logprob(hidden, weight[:0], targets, impl="torch")


def test_the_fake_declares_the_dtypes_the_op_returns():
    """fp64 inputs (the gradcheck path) give fp64 outputs; the fake, which torch.compile plans
    with, must say so."""
    hidden, weight, targets, _, _ = make_inputs(3, 16, 40, torch.float64, "cpu")
    ops, spec = torch.ops.rlmtrain_kernels, Variants().spec
    args = (hidden.detach(), weight.detach(), targets, 1.0, IGNORE, True, False, "torch", spec)
    assert [t.dtype for t in ops.linear_logprob_fwd(*args)][:3] == [torch.float64] * 3
    torch.library.opcheck(ops.linear_logprob_fwd, args)
    ones = torch.ones(3)
    # Each gradient wanted or not: an absent one is an empty tensor, of the same dtype too.
    for grads in [(True, True), (True, False), (False, True), (False, False)]:
        nll_args = (*args[:3], ones, 1.0, IGNORE, True, *grads, "torch", spec)
        assert {t.dtype for t in ops.linear_nll_fwd(*nll_args)} == {torch.float64}
        torch.library.opcheck(ops.linear_nll_fwd, nll_args)
        grpo_args = (*args[:3], torch.zeros(3), ones, ones, None, None, 1.0, IGNORE, 0.0, 0.2,
                     0.2, None, None, True, *grads, "torch", spec)  # fmt: skip
        torch.library.opcheck(ops.linear_grpo_fwd, grpo_args)


def test_imports_and_runs_without_triton():
    """Embedders without triton (CPU-only torch, macOS) get the torch backend and a clear error
    for impl="triton"; run in a fresh interpreter where importing triton fails."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from rlmtrain_kernels import KernelBackendUnavailable, fused_linear_grpo_loss
        from rlmtrain_kernels import fused_linear_logprob
        x, w, t = torch.randn(5, 8), torch.randn(50, 8), torch.randint(0, 50, (5,))
        assert fused_linear_logprob(x, w, t).shape == (5,)
        z = torch.zeros(5)
        fused_linear_grpo_loss(x, w, t, z, z, z)
        try:
            fused_linear_logprob(x, w, t, impl="triton")
        except KernelBackendUnavailable as e:
            assert "not installed" in str(e), e
        else:
            raise AssertionError("impl='triton' ran without triton")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("group_n", [1, 2])
def test_triton_grouped_program_order(monkeypatch, group_n):
    """Every (row tile, vocabulary tile) runs once whatever the grouping, a last group with fewer
    row tiles than GROUP_N included (82 trained rows: 3 row tiles of 32)."""
    monkeypatch.setattr(tiles, "GROUP_N", group_n)
    check_against_truth("triton", 123, 16, 4099, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", ["atomic", "slabs"])
def test_triton_cuda_tile_shapes(variant, dtype):
    """The CUDA tile tables' shapes, named per call, in the interpreter: partial row tiles and
    partial hidden slices at each width the tables use."""
    table = tiles.CUDA_TILES_FP32 if dtype == torch.float32 else tiles.CUDA_TILES
    variants = Variants(forward="kernel", backward=variant, tiles=table)
    check_against_truth("triton", 300, 67, 1001, dtype, "cpu", variants)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("n", "h", "v", "dtype"), TRITON_CASES)
@pytest.mark.parametrize("variant", ["atomic", "slabs"])
def test_triton_backward_variants_match_fp64_truth(
    uninitialised_is_nan, variant, n, h, v, dtype, device
):
    """Both Triton-GEMM backward variants, whichever is the default; the slabs cut small (32 rows
    in the interpreter, one row tile on CUDA) so that a call spans several and dW accumulates
    across them."""
    variants = Variants(backward=variant, grad_slab_bytes=40 * v * 2)
    check_against_truth("triton", n, h, v, dtype, device, variants)


STORED_CASES = [c for c in TRITON_CASES if c[3] != torch.float32] + [(37, 40, 2500, torch.float16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("n", "h", "v", "dtype"), STORED_CASES)
@pytest.mark.parametrize("stored", ["forward", "backward", "both"])
@pytest.mark.parametrize("slabs", ["rows", "columns"])
def test_triton_stored_variants_match_fp64_truth(
    monkeypatch, uninitialised_is_nan, slabs, stored, n, h, v, dtype, device
):
    """The log-prob op's forward and backward from stored fp32 logit slabs (40 rows, or about
    300 vocabulary columns, a slab: a call spans several, the last partial), alone and together,
    entropy gradient included."""
    calls = []
    for name in ("log_probs", "accumulate_grads"):
        original = getattr(logit_slabs, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(logit_slabs, name, spy)
    # The other half takes its Triton GEMM variant, whichever the defaults are.
    variants = Variants(
        forward="kernel" if stored == "backward" else "stored",
        backward="slabs" if stored == "forward" else "stored",
        logprob_slabs=slabs,
        logit_slab_bytes=(40 * v if slabs == "rows" else 300 * n) * 4,
    )
    check_against_truth("triton", n, h, v, dtype, device, variants)
    expected = {"forward": {"log_probs"}, "backward": {"accumulate_grads"}}
    assert set(calls) == expected.get(stored, {"log_probs", "accumulate_grads"})
