"""Linear log-probs over stored logit slabs: the logits of a slab of rows formed once by a matrix
product, in fp32, then read by Triton passes per row.

The fused losses (GRPO, NLL) know dLoss/dlogp of a token as soon as its log-prob is known, so
their logits need not be formed twice (forward kernel, then the backward's recompute: 8·N·H·V).
`row_grads` takes the rows a slab at a time (6·N·H·V):

1. one matrix product writes the slab's logits in fp32 (cuBLAS on CUDA: 16-bit operands, fp32
   accumulation and result, the precision of the Triton kernels' dots);
2. a Triton pass per row takes the log-sum-exp, the target's log-prob and the entropy;
3. the loss turns the slab's log-probs into its per-token gradients;
4. a second pass per row writes dLoss/dlogits in the input dtype;
5. two more products give dX of the slab and add dZ^T X into the fp32 dW
   (`logprob_slabs.slab_products`).

The price of the saved quarter of the arithmetic is memory traffic, about 18·V bytes a row (the
fp32 logits written and read twice, the 16-bit gradients written and read twice); on an H200 the
row passes took 6 of the fused GRPO loss's 60 ms (bench/gpu/NOTES.md). Memory is bounded by
`LOGIT_SLAB_BYTES` of fp32 logits and half that of gradients, whatever N is; no [N, V] tensor
exists.

The log-prob op itself runs its forward (`log_probs`: steps 1-2) and its backward
(`accumulate_grads`: steps 1, 4 and 5, with the entropy's gradient) the same way, in place of the
Triton GEMM kernels (`tiles.FORWARD_VARIANT`, `tiles.BACKWARD_VARIANT` = "stored", the defaults):
on an H200 cuBLAS formed a slab's logits at 720 TFLOP/s where the Triton forward kernel reached
500.

Only 16-bit inputs take these paths (`tiles.STORED_LOGITS_DTYPES`): fp32 inputs keep the Triton
kernels' exact ("ieee") dots. bench/gpu/sweep_tiles.py times every variant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._backend import tl, triton, triton_interpreting
from .logprob_slabs import slab_products

__all__ = ["LOGIT_SLAB_BYTES", "accumulate_grads", "log_probs", "row_grads"]

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
        # A lane that has seen only padding stays at -inf; subtracting 0 there instead keeps
        # -inf - -inf (nan) out of the arithmetic, and its exp(-inf) terms are 0 as they must be.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(lane_max - shift)
        e = tl.exp(z - shift)
        lane_sum = lane_sum * rescale + e
        if WITH_ENTROPY:
            lane_sum_z = lane_sum_z * rescale + e * tl.where(in_vocab, z, 0.0)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    to_row = tl.exp(lane_max - row_max)  # lanes that saw no column: exp(-inf) = 0
    total = tl.sum(lane_sum * to_row, axis=0)
    lse = row_max + tl.log(total)
    target = tl.load(T_ptr + row)
    trained = (target >= 0) & (target < V)  # ignore_index rows: log-prob and entropy 0
    target_z = tl.load(z_row + target, mask=trained, other=0.0) * inv_t
    tl.store(LSE_ptr + row, lse)
    tl.store(LOGP_ptr + row, tl.where(trained, target_z - lse, 0.0))
    if WITH_ENTROPY:
        mean_z = tl.sum(lane_sum_z * to_row, axis=0) / total
        tl.store(ENT_ptr + row, tl.where(trained, lse - mean_z, 0.0))


@triton.jit
def _row_dlogits_kernel(
    Z_ptr,
    DZ_ptr,
    T_ptr,
    LSE_ptr,
    MEANZ_ptr,
    G_ptr,
    GE_ptr,
    V,
    stride_z,
    stride_dz,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row's dLoss/d(logits before the temperature), in DZ's dtype:
    (g * (onehot - p) + g_H * p * (E_p[z] - z)) / T, the second term with WITH_ENTROPY."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(T_ptr + row)
    lse = tl.load(LSE_ptr + row)
    g = tl.load(G_ptr + row)
    if WITH_ENTROPY:
        ge = tl.load(GE_ptr + row)
        mean_z = tl.load(MEANZ_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        in_vocab = cols < V
        z = tl.load(Z_ptr + row * stride_z + cols, mask=in_vocab, other=float("-inf")) * inv_t
        p = tl.exp(z - lse)
        dz = tl.where(cols == target, g, 0.0) - g * p
        if WITH_ENTROPY:
            dz += ge * p * (mean_z - tl.where(in_vocab, z, 0.0))
        tl.store(
            DZ_ptr + row * stride_dz + cols, (dz * inv_t).to(DZ_ptr.dtype.element_ty), mask=in_vocab
        )


def _slabs(n: int, most_rows: int) -> list[slice]:
    """Rows [0, n) in as few slabs of at most `most_rows` as there can be, as even as they can be
    (no thin last slab paying a whole dW read-modify-write for a few rows), the larger ones last:
    a buffer that holds the last slab holds every other."""
    if n == 0:
        return []
    count = -(-n // most_rows)
    small, larger = divmod(n, count)
    bounds, start = [], 0
    for i in range(count):
        rows = small + (i >= count - larger)
        bounds.append(slice(start, start + rows))
        start += rows
    return bounds


def _slab_cap(v: int) -> int:
    return max(1, LOGIT_SLAB_BYTES // (4 * v))


def slab_buffer_rows(n: int, v: int) -> int:
    """Rows of the fp32 logit buffer `log_probs` and `accumulate_grads` use over n rows: their
    largest slab (0 for no rows). A buffer of exactly these rows, passed to `log_probs`, is
    split into the same slabs and has no row left unused."""
    return _most_rows(_slabs(n, _slab_cap(v)))


def _most_rows(slabs: list[slice]) -> int:
    return max((s.stop - s.start for s in slabs), default=0)


def _row_launch(v: int) -> dict[str, int]:
    # The interpreter's cost is per operation, so it takes fewer, wider steps; 1024 columns still
    # leave the tests' vocabularies (1000-2500) a partial last block.
    block_v = 1024 if triton_interpreting() else min(ROW_BLOCK_V, triton.next_power_of_2(v))
    return dict(BLOCK_V=block_v, num_warps=ROW_WARPS)


def _slab_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows, V] fp32 = x @ weight^T, 16-bit operands with fp32 accumulation."""
    if x.device.type == "cuda":
        torch.mm(x, weight.T, out_dtype=torch.float32, out=out)
    else:  # the interpreter's tests: a 16-bit product is exact in fp32, as on the tensor cores
        torch.mm(x.float(), weight.float().T, out=out)


def _slab_stats(
    z: torch.Tensor,
    targets: torch.Tensor,
    logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    inv_t: float,
    with_entropy: bool,
) -> None:
    """Fill logp, lse [rows] (and entropy [rows]) from the slab's fp32 logits z [rows, V]."""
    v = z.shape[1]
    _row_stats_kernel[(z.shape[0],)](
        z, targets, logp, lse, entropy if with_entropy else logp, v, z.stride(0), inv_t,
        WITH_ENTROPY=with_entropy, **_row_launch(v),
    )  # fmt: skip


def log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [N], entropy [N] or [0], lse [N]), fp32; rows whose target is outside [0, V) (an
    ignore_index) get log-prob and entropy 0.

    `logits` [R, V] fp32, if given, is the slab buffer (slabs of at most R rows; R is
    `slab_buffer_rows(N, V)`): on return it holds the last slab's logits, for
    `accumulate_grads(kept_logits=logits)`."""
    n, v = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n if with_entropy else 0, **f32)
    slabs = _slabs(n, _slab_cap(v) if logits is None else logits.shape[0])
    if logits is None:
        logits = torch.empty(_most_rows(slabs), v, **f32)
    for rows in slabs:
        z = logits[: rows.stop - rows.start]
        _slab_logits(hidden[rows], weight, z)
        _slab_stats(
            z, targets[rows], logp[rows], lse[rows], entropy[rows] if with_entropy else None,
            1.0 / temperature, with_entropy,
        )  # fmt: skip
    return logp, entropy, lse


def _slab_dlogits(
    z: torch.Tensor,
    dz: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    g: torch.Tensor,
    ge: torch.Tensor | None,
    inv_t: float,
    with_entropy: bool,
) -> None:
    """Write dz [rows, V] (input dtype) = dLoss/dlogits from the slab's fp32 logits z [rows, V]
    and the per-row coefficients [rows]: g, and with the entropy's gradient g_H and E_p[z]."""
    v = z.shape[1]
    _row_dlogits_kernel[(z.shape[0],)](
        z, dz, targets, lse, mean_z if with_entropy else lse, g, ge if with_entropy else g, v,
        z.stride(0), dz.stride(0), inv_t, WITH_ENTROPY=with_entropy, **_row_launch(v),
    )  # fmt: skip


def accumulate_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    g: torch.Tensor,
    ge: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    *,
    inv_t: float,
    with_entropy: bool,
    kept_logits: torch.Tensor | None = None,
) -> None:
    """The log-prob op's backward, `logprob_slabs.accumulate_grads`'s contract: fill grad_hidden
    [N, H] fp32 and add into grad_weight [V, H] fp32 (either may be None) from the per-row
    upstream coefficients (g, g_H, lse, E_p[z]; g and g_H already 0 on ignored rows).

    `kept_logits` is the buffer a `log_probs(logits=...)` over these rows filled: it holds the
    logits of their last slab, which goes first and skips its matrix product; the other slabs'
    logits then overwrite it."""
    n, v = hidden.shape[0], weight.shape[0]
    if kept_logits is not None and n:
        kept = _slabs(n, kept_logits.shape[0])[-1]
        slabs = [kept, *_slabs(kept.start, kept_logits.shape[0])]
        logits = kept_logits
    else:
        kept, slabs = None, _slabs(n, _slab_cap(v))
        logits = torch.empty(_most_rows(slabs), v, dtype=torch.float32, device=hidden.device)
    dlogits = torch.empty(_most_rows(slabs), v, dtype=hidden.dtype, device=hidden.device)
    for rows in slabs:
        x = hidden[rows]
        z, dz = logits[: x.shape[0]], dlogits[: x.shape[0]]
        if rows is not kept:
            _slab_logits(x, weight, z)
        _slab_dlogits(
            z, dz, targets[rows], lse[rows], mean_z[rows], g[rows], ge[rows], inv_t, with_entropy
        )
        slab_products(
            dz, x, weight, grad_hidden[rows] if grad_hidden is not None else None, grad_weight
        )


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
    f32 = dict(dtype=torch.float32, device=hidden.device)
    inv_t = 1.0 / temperature
    slabs = _slabs(n, _slab_cap(v))
    slab_rows = _most_rows(slabs)
    logits = torch.empty(slab_rows, v, **f32)
    dlogits = torch.empty(slab_rows, v, dtype=hidden.dtype, device=hidden.device)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n if with_entropy else 0, **f32)
    grad_hidden = torch.empty(n, h, **f32) if need_grad_hidden else None
    grad_weight = torch.zeros(v, h, **f32) if need_grad_weight else None
    for rows in slabs:
        x = hidden[rows]
        z, dz = logits[: x.shape[0]], dlogits[: x.shape[0]]
        _slab_logits(x, weight, z)
        _slab_stats(
            z, targets[rows], logp[rows], lse[rows], entropy[rows] if with_entropy else None,
            inv_t, with_entropy,
        )  # fmt: skip
        g = row_grad(rows, logp[rows]).float().contiguous()
        _slab_dlogits(z, dz, targets[rows], lse[rows], None, g, None, inv_t, False)
        slab_products(
            dz, x, weight, grad_hidden[rows] if grad_hidden is not None else None, grad_weight
        )
    return logp, entropy, grad_hidden, grad_weight
