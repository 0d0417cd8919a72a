"""Second derivatives through the fused ops, exact.

The ops' backwards hand autograd gradients formed without it (in the forward, or by a Triton
backward): to autograd those are constants. A backward that is itself differentiated
(create_graph=True: a gradient penalty, a Hessian-vector product, a loss scaled by a learned
factor) would then drop every term that comes through the gradient's own dependence on hidden,
weight or logp, and give a wrong answer without a word. Such a backward takes this path instead:
the same loss formed again by plain torch operations (full logits, in fp32, or fp64 for fp64
inputs) and differentiated by autograd with its graph, which is exact at any order. It costs an
[N, V] tensor and its graph, which first-order training never pays: `wanted()` is false there.
What every backward does pay is that the fused losses keep their inputs from the forward (hidden,
weight, the per-token tensors: references, not copies; hidden [N, H] stays alive until the
backward where the forward's stored gradients alone would have let it go).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import reference

__all__ = ["grads", "head_logprobs", "wanted"]


def wanted() -> bool:
    """Whether the running backward records its own graph (autograd's create_graph=True)."""
    return torch.is_grad_enabled()


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [N], entropy [N] or None) of the linear head by full logits, differentiable at any
    order; rows whose target is `ignore_index` get 0."""
    dtype = reference.accumulation_dtype(hidden.dtype)
    trained = targets != ignore_index
    # An ignored row holds anything (padding, inf): zeroed before the head, it reaches no
    # gradient, as on the first-order path, which never reads it.
    hidden = torch.where(trained[:, None], hidden, 0)
    logits = (hidden.to(dtype) @ weight.to(dtype).T) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(1, torch.where(trained, targets, 0)[:, None])[:, 0]
    logp = torch.where(trained, picked, 0.0)
    if not with_entropy:
        return logp, None
    return logp, torch.where(trained, -(log_probs.exp() * log_probs).sum(dim=-1), 0.0)


def grads(
    outputs: Sequence[torch.Tensor | None],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    needed: Sequence[bool],
) -> list[torch.Tensor | None]:
    """The gradients of `outputs` (weighted by `grad_outputs`; pairs with a None skipped) with
    respect to the `needed` inputs, with their graph; None for the others, in the inputs'
    dtypes."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if g is not None]
    pairs = [(o, g) for o, g in pairs if o is not None]
    wanted_inputs = [t for t, need in zip(inputs, needed, strict=True) if need]
    if pairs and wanted_inputs:
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted_inputs, [g for _, g in pairs], create_graph=True,
            allow_unused=True, materialize_grads=True,
        )  # fmt: skip
    else:  # no upstream gradient at all: zeros
        found = [torch.zeros_like(t) for t in wanted_inputs]
    by_input = iter(found)
    pairs_in = zip(inputs, needed, strict=True)
    return [next(by_input).to(t.dtype) if need else None for t, need in pairs_in]
