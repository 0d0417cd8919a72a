"""Log-probs and a per-token loss's gradients in one pass over stored logit slabs: 6·N·H·V FLOPs.

The fused losses (GRPO, NLL) know dLoss/dlogp of a token as soon as its log-prob is known, so
their logits need not be formed twice (forward kernel, then the backward's recompute: 8·N·H·V).
Here the rows go a slab at a time:

1. one matrix product writes the slab's logits in fp32 (cuBLAS on CUDA: 16-bit operands, fp32
   accumulation and result, the precision of the Triton kernels' dots);
2. a Triton pass per row takes the log-sum-exp, the target's log-prob and the entropy;
3. the loss turns the slab's log-probs into its per-token gradients;
4. a second pass per row writes dLoss/dlogits in the input dtype;
5. two more products give dX of the slab and add dZ^T X into the fp32 dW
   (`logprob_slabs.slab_products`).

The price of the saved third of the arithmetic is memory traffic, about 18·V bytes a row (the fp32
logits written and read twice, the 16-bit gradients written and read twice), which on an H200 is
a few percent of the products' time. Memory is bounded by `LOGIT_SLAB_BYTES` of fp32 logits and
half that of gradients, whatever N is; no [N, V] tensor exists.

Only 16-bit inputs take this path: fp32 inputs keep the Triton kernels' exact ("ieee") dots, which
a cuBLAS product would not promise (it may use TF32 where the caller allowed it). Whether it runs
at all is `tiles.ROW_GRADS_VARIANT` ("stored" or "recompute"); bench/gpu/sweep_tiles.py times both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import tiles
from ._backend import tl, triton, triton_interpreting
from .logprob_slabs import slab_products

__all__ = ["LOGIT_SLAB_BYTES", "applies", "row_grads"]

# fp32 logits of one slab: 3,533 rows at V = 151936. Each slab reads and writes the fp32 dW once
# (about 3 GB at H = 2560), so fewer, larger slabs save that traffic.
LOGIT_SLAB_BYTES = 2 << 30
# Vocabulary columns a row program handles per step of its loop (a multiple of the warps' width).
ROW_BLOCK_V = 2048
ROW_WARPS = 8

RowGrad = Callable[[slice, torch.Tensor], torch.Tensor]


@triton.jit
def _row_stats_kernel(
    Z_ptr,
    T_ptr,
    LOGP_ptr,
    LSE_ptr,
    ENT_ptr,
    V,
    stride_z,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row of the slab: its log-sum-exp, the target's log-prob and (optionally) the entropy.
    Each lane keeps its own running max, sum of exp and sum of exp * z (an online log-sum-exp
    per lane), merged once at the end; padded columns are -inf and add nothing."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z_ptr + row * stride_z
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_sum_z = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        in_vocab = cols < V
        z = tl.load(z_row + cols, mask=in_vocab, other=float("-inf")) * inv_t
        new_max = tl.maximum(lane_max, z)
        # Equal maxima rescale by 1 (this also covers a lane still at -inf on both sides).
        rescale = tl.where(lane_max == new_max, 1.0, tl.exp(lane_max - new_max))
        e = tl.where(in_vocab, tl.exp(z - new_max), 0.0)
        lane_sum = lane_sum * rescale + e
        if WITH_ENTROPY:
            lane_sum_z = lane_sum_z * rescale + e * tl.where(in_vocab, z, 0.0)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    to_row = tl.exp(lane_max - row_max)  # lanes that saw no column: exp(-inf) = 0
    total = tl.sum(lane_sum * to_row, axis=0)
    lse = row_max + tl.log(total)
    target = tl.load(T_ptr + row)
    target_z = tl.load(z_row + target) * inv_t
    tl.store(LSE_ptr + row, lse)
    tl.store(LOGP_ptr + row, target_z - lse)
    if WITH_ENTROPY:
        mean_z = tl.sum(lane_sum_z * to_row, axis=0) / total
        tl.store(ENT_ptr + row, lse - mean_z)


@triton.jit
def _row_dlogits_kernel(
    Z_ptr,
    DZ_ptr,
    T_ptr,
    LSE_ptr,
    G_ptr,
    V,
    stride_z,
    stride_dz,
    inv_t,
    BLOCK_V: tl.constexpr,
):
    """One row's dLoss/d(logits before the temperature): g * (onehot - p) / T, in DZ's dtype."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(T_ptr + row)
    lse = tl.load(LSE_ptr + row)
    g = tl.load(G_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        in_vocab = cols < V
        z = tl.load(Z_ptr + row * stride_z + cols, mask=in_vocab, other=float("-inf")) * inv_t
        dz = (tl.where(cols == target, g, 0.0) - g * tl.exp(z - lse)) * inv_t
        tl.store(DZ_ptr + row * stride_dz + cols, dz.to(DZ_ptr.dtype.element_ty), mask=in_vocab)


def applies(hidden: torch.Tensor) -> bool:
    """Whether the fused losses take this path for these inputs (see the module's docstring)."""
    return tiles.ROW_GRADS_VARIANT == "stored" and hidden.dtype in (torch.bfloat16, torch.float16)


def _slab_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows, V] fp32 = x @ weight^T, 16-bit operands with fp32 accumulation."""
    if x.device.type == "cuda":
        torch.mm(x, weight.T, out_dtype=torch.float32, out=out)
    else:  # the interpreter's tests: a 16-bit product is exact in fp32, as on the tensor cores
        torch.mm(x.float(), weight.float().T, out=out)


def row_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_grad: RowGrad,
    *,
    temperature: float,
    with_entropy: bool,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs and, in the same pass, the gradients of a per-token loss, for trained rows only
    (every target a token id; `rows.TrainedRows` drops the ignored ones before).

    `row_grad(rows, logp[rows])` returns dLoss/dlogp for those rows. Returns (logp [N] fp32,
    entropy [N] or [0] fp32, dHidden [N, H] fp32 or None, dWeight [V, H] fp32 or None).
    """
    n, h = hidden.shape
    v = weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / temperature
    slab_rows = max(1, min(n, LOGIT_SLAB_BYTES // (4 * v)))
    logits = torch.empty(slab_rows, v, dtype=torch.float32, device=device)
    dlogits = torch.empty(slab_rows, v, dtype=hidden.dtype, device=device)
    logp = torch.empty(n, dtype=torch.float32, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=device)
    grad_hidden = torch.empty(n, h, device=device) if need_grad_hidden else None
    grad_weight = torch.zeros(v, h, device=device) if need_grad_weight else None
    block_v = min(ROW_BLOCK_V, triton.next_power_of_2(v)) if not triton_interpreting() else 1024
    launch = dict(BLOCK_V=block_v, num_warps=ROW_WARPS)
    for r0 in range(0, n, slab_rows):
        rows = slice(r0, min(r0 + slab_rows, n))
        x = hidden[rows]
        count = x.shape[0]
        z, dz = logits[:count], dlogits[:count]
        _slab_logits(x, weight, z)
        _row_stats_kernel[(count,)](
            z, targets[rows], logp[rows], lse[rows], entropy[rows] if with_entropy else logp,
            v, z.stride(0), inv_t, WITH_ENTROPY=with_entropy, **launch,
        )  # fmt: skip
        if grad_hidden is None and grad_weight is None:
            continue
        g = row_grad(rows, logp[rows]).float().contiguous()
        _row_dlogits_kernel[(count,)](
            z, dz, targets[rows], lse[rows], g, v, z.stride(0), dz.stride(0), inv_t, **launch
        )
        slab_products(
            dz, x, weight, grad_hidden[rows] if grad_hidden is not None else None, grad_weight
        )
    return logp, entropy, grad_hidden, grad_weight
