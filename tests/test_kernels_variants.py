"""The kernels' variants are chosen per call: a bad choice is refused in one line, a call's
choice does not reach the next call, and torch.compile sees it as an argument of the ops it
records."""

import pytest
import torch
from rlmtrain_kernels import (
    Variants,
    fused_linear_grpo_loss,
    fused_linear_logprob,
    logit_slabs,
)

V, H, N = 300, 16, 24


def inputs(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * H**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, targets, torch.randn(N, generator=gen), torch.full((N,), 1.0 / N)


@pytest.fixture
def stored_row_grads(monkeypatch):
    """How many calls the fused losses' stored-logits path (`row_grads`) served."""
    calls, original = [], logit_slabs.row_grads

    def spy(*args, **kwargs):
        calls.append(kwargs["slab_bytes"])
        return original(*args, **kwargs)

    monkeypatch.setattr(logit_slabs, "row_grads", spy)
    return calls


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (dict(forward="fast"), "Variants.forward must be one of"),
        (dict(backward="stored "), "Variants.backward must be one of"),
        (dict(row_grads=None), "Variants.row_grads must be one of"),
        (dict(logprob_slabs="diagonal"), "Variants.logprob_slabs must be one of"),
        (dict(logit_slab_bytes=0), "Variants.logit_slab_bytes must be a positive int"),
        (dict(grad_slab_bytes=2.5), "Variants.grad_slab_bytes must be a positive int"),
        (dict(tiles={"lm_head": {"BLOCK_N": 16}}), "no kernel 'lm_head'"),
        (dict(tiles={"forward": {"BLOCK_N": 0}}), "every entry must be a positive int"),
        (dict(tiles={"backward": {"BLOCK_N": 16, "BLOCK_V": 16}}), "must give"),
        (dict(tiles={"dlogits": {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_H": 16, "G": 2}}), "got"),
        # What Triton would refuse deep inside a compile (tl.arange, tl.dot, the launch).
        (dict(tiles={"forward": {"BLOCK_N": 24, "BLOCK_V": 64, "BLOCK_H": 32}}), "'BLOCK_N': 24"),
        (dict(tiles={"forward": {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_H": 8}}), "'BLOCK_H': 8"),
        (
            dict(tiles={"dlogits": {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_H": 16, "num_warps": 6}}),
            "num_warps a power of two",
        ),
    ],
)
def test_a_bad_choice_is_refused_when_made(choice, message):
    with pytest.raises(ValueError, match=message):
        Variants(**choice)


def test_an_op_refuses_variants_of_another_type():
    hidden, weight, targets, _, _ = inputs()
    with pytest.raises(TypeError, match="variants must be a rlmtrain_kernels.Variants"):
        fused_linear_logprob(hidden, weight, targets, variants={"backward": "atomic"})


def test_the_ops_carry_one_spelling_of_each_choice():
    a = Variants(tiles={"forward": {"BLOCK_V": 64, "BLOCK_N": 16, "BLOCK_H": 16}})
    b = Variants(tiles={"forward": {"BLOCK_N": 16, "BLOCK_H": 16, "BLOCK_V": 64}})
    assert a == b and hash(a) == hash(b) and a.spec == b.spec
    assert Variants.from_spec(a.spec) == a
    assert a.tile_shape("forward") == {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_H": 16}
    assert a.tile_shape("dlogits") is None
    assert Variants().spec != a.spec


def test_a_calls_choice_does_not_reach_the_next_call(stored_row_grads):
    hidden, weight, targets, advantages, weights = inputs()
    recompute = Variants(row_grads="recompute")
    for variants in (recompute, None, recompute, Variants(logit_slab_bytes=8 * V * 4)):
        loss, _ = fused_linear_grpo_loss(
            hidden, weight, targets, None, advantages, weights, impl="triton", variants=variants
        )
        torch.autograd.grad(loss, (hidden, weight))
    # The default and the small-slab call took the stored path, each with its own slab bound.
    assert stored_row_grads == [Variants().logit_slab_bytes, 8 * V * 4]


def test_torch_compile_records_the_choice_as_an_argument(stored_row_grads):
    """A compiled step records its call's variants in the graph, made before the step or inside
    it; two compiled steps that differ only in their choice each run theirs."""
    hidden, weight, targets, advantages, weights = inputs()
    recorded = []

    def record(graph_module, example_inputs):
        for _, module in graph_module.named_modules():
            for node in module.graph.nodes:
                if "linear_grpo_fwd" in str(node.target):
                    recorded.append(node.args[-1])
        return graph_module.forward

    stored = Variants(logit_slab_bytes=6 * V * 4)

    def step_stored(x, w):
        loss, _ = fused_linear_grpo_loss(
            x, w, targets, None, advantages, weights, impl="triton", variants=stored
        )
        return loss

    def step_recompute(x, w):
        loss, _ = fused_linear_grpo_loss(
            x, w, targets, None, advantages, weights, impl="triton",
            variants=Variants(row_grads="recompute"),
        )  # fmt: skip
        return loss

    for step in (step_stored, step_recompute):
        loss = torch.compile(step, backend=record, fullgraph=True)(hidden, weight)
        torch.autograd.grad(loss, (hidden, weight))
    assert recorded == [stored.spec, Variants(row_grads="recompute").spec]
    assert stored_row_grads == [6 * V * 4]


def test_the_torch_backend_has_one_path_whatever_the_choice():
    hidden, weight, targets, _, _ = inputs(torch.float32)
    default = fused_linear_logprob(hidden, weight, targets, impl="torch")
    chosen = fused_linear_logprob(
        hidden, weight, targets, impl="torch", variants=Variants(forward="kernel")
    )
    torch.testing.assert_close(default, chosen, rtol=0, atol=0)
