"""Tile shapes, program order and the Triton pieces the log-prob kernels share.

`CUDA_TILES` is a module-level table (and `FORWARD_VARIANT`, `BACKWARD_VARIANT` and
`ROW_GRADS_VARIANT` module-level choices) so that a tuning sweep (bench/gpu/sweep_tiles.py) can
try others without touching the kernels; the launchers read them at each call.
"""

from __future__ import annotations

import torch

from ._backend import tl, triton, triton_interpreting

# Tile shapes and launch options per kernel on CUDA, for 16-bit inputs. The forward and the slab
# backward's kernel are the winners of bench/gpu/sweep_tiles.py on an H200 at N = 16384,
# H = 2560 (bench/gpu/NOTES.md): 128 x 256 x 64 tiles beat 128 x 128 x 64 by 9% and 10% although
# their sm_90 build spills about 850 bytes a thread (bench/gpu/compile_check.py). The forward is
# a GEMM tile with an online log-sum-exp epilogue; the atomic backward recomputes a logit tile and
# then streams H in slices of BLOCK_H_OUT for its two output products (its best shape measured,
# 128 x 128 x 64, still ran 2.5x slower than the slabs); the slab backward's kernel is a GEMM tile
# with an elementwise epilogue and a 16-bit store.
CUDA_TILES: dict[str, dict[str, int]] = {
    "forward": dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
    "backward": dict(
        BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, BLOCK_H_OUT=64, num_warps=8, num_stages=3
    ),
    "dlogits": dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
}
# fp32 inputs: their exact ("ieee") dots run on the CUDA cores, whose accumulators take far more
# registers than a tensor-core tile's; these smaller shapes build without spilling and within a
# Hopper block's 227 KB of shared memory (the 16-bit shapes spill 13-17 KB a thread in fp32).
CUDA_TILES_FP32: dict[str, dict[str, int]] = {
    "forward": dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=2),
    "backward": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=32, BLOCK_H_OUT=32, num_warps=4, num_stages=2),
    "dlogits": dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=2),
}
# The interpreter's cost is per operation, not per element, so fewer, larger tiles run faster;
# these still leave partial row, vocabulary and hidden tiles at the test shapes.
INTERPRETER_TILES: dict[str, dict[str, int]] = {
    "forward": dict(BLOCK_N=32, BLOCK_V=128, BLOCK_H=32),
    "backward": dict(BLOCK_N=32, BLOCK_V=128, BLOCK_H=32, BLOCK_H_OUT=32),
    "dlogits": dict(BLOCK_N=32, BLOCK_V=128, BLOCK_H=32),
}
# Row tiles per group in the program order: the programs running at once share a few row tiles'
# hidden states and a run of vocabulary tiles, so both stay in L2 (the grouped order of tiled
# matrix products).
GROUP_N = 8
# How the log-prob forward forms its logits: "kernel" (the Triton GEMM tile with an online
# log-sum-exp, nothing of size V stored) or, for 16-bit inputs, "stored" (a slab's fp32 logits by
# a matrix product, then a Triton pass per row; logit_slabs.py). On an H200 at N = 16384,
# H = 2560 "stored" took 21.9 ms against the kernel's 25.5 (bench/gpu/NOTES.md, run 3).
FORWARD_VARIANT = "stored"
# The "stored" variants take 16-bit inputs only: fp32 inputs keep the kernels' exact ("ieee") dots,
# which a cuBLAS product does not promise (it may use TF32 where the caller allowed it).
STORED_LOGITS_DTYPES = (torch.bfloat16, torch.float16)
# How the backward forms dX and dW: "slabs" (a Triton GEMM writes the logit gradients of a slab of
# rows, bounded by logprob_slabs.SLAB_BYTES, then two matrix products finish dX and dW),
# "atomic" (each logit tile adds its products into fp32 buffers with atomics; nothing of size V
# is stored) or, for 16-bit inputs, "stored" (the slab's fp32 logits by a matrix product and its
# gradients by a Triton pass per row, in place of the GEMM kernel; logit_slabs.py). On an H200 at
# N = 16384, H = 2560: stored 60.6 ms, slabs 62.1-63.4, atomic 153.7-155.6; the atomics' L2
# read-modify-write traffic, not the arithmetic, bounds that kernel. fp32 inputs asking for
# "stored" take "slabs".
BACKWARD_VARIANT = "stored"
# How the log-prob op's stored forward and backward cut the [N, V] logits into slabs of at most
# `logit_slabs.LOGIT_SLAB_BYTES`: "rows" (each slab all V columns of some rows; its backward
# adds every slab's dz^T X into the fp32 dW, a [V, H] read-modify-write per slab) or "columns"
# (each slab all N rows of some vocabulary columns, merged by log-sum-exp; its backward writes
# each slab's rows of dW once and adds into the fp32 dX instead, an [N, H] read-modify-write per
# slab). Columns move less memory while N < V. The fused losses need whole rows (a token's
# gradient needs its log-prob) and always cut rows. bench/gpu/profile_head.py times both.
LOGPROB_SLABS = "rows"
# How the fused losses (GRPO, NLL) get their gradients for 16-bit inputs: "stored" (each slab's
# logits formed once, kept in fp32 and reused for the gradients: 6·N·H·V; logit_slabs.py) or
# "recompute" (the log-prob forward, then the backward recomputing the logits: 8·N·H·V). On an
# H200 the fused GRPO loss took 63.4 ms stored against 90.4 recomputed (N = 16384, H = 2560).
ROW_GRADS_VARIANT = "stored"


def stores_logits(variant: str, dtype: torch.dtype) -> bool:
    """Whether a variant choice (FORWARD_VARIANT, BACKWARD_VARIANT, ROW_GRADS_VARIANT) takes the
    stored-logits path for inputs of this dtype: it asks for "stored" and the dtype is 16-bit."""
    return variant == "stored" and dtype in STORED_LOGITS_DTYPES


def tiles_for(device: torch.device, kernel: str, dtype: torch.dtype) -> dict[str, int]:
    if device.type == "cpu" and triton_interpreting():
        return dict(INTERPRETER_TILES[kernel])
    return dict((CUDA_TILES_FP32 if dtype == torch.float32 else CUDA_TILES)[kernel])


def upcast_dot_operands(device: torch.device, dtype: torch.dtype) -> bool:
    # Triton 3.9's interpreter returns garbage from tl.dot on bf16 operands (their bits are
    # multiplied as if they were another type). Upcasting there is exact: a bf16 product fits
    # fp32, and the accumulator is fp32 either way. Compiled kernels keep bf16 tensor-core dots.
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently become tf32 products; bf16/fp16 products are exact in fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def grouped_tile(pid, n_row_tiles, n_col_tiles, GROUP_N: tl.constexpr):
    """Program id -> (row tile, column tile), GROUP_N row tiles at a time, rows fastest."""
    per_group = GROUP_N * n_col_tiles
    first_row = (pid // per_group) * GROUP_N
    rows_here = tl.minimum(n_row_tiles - first_row, GROUP_N)
    in_group = pid % per_group
    return first_row + in_group % rows_here, in_group // rows_here


@triton.jit
def logit_tile(
    X_ptr,
    W_ptr,
    rows,
    cols,
    row_mask,
    col_mask,
    H,
    stride_xn,
    stride_xh,
    stride_wv,
    stride_wh,
    inv_t,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs < H
        x = tl.load(
            X_ptr + rows[:, None] * stride_xn + hs[None, :] * stride_xh,
            mask=row_mask[:, None] & h_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            W_ptr + cols[:, None] * stride_wv + hs[None, :] * stride_wh,
            mask=col_mask[:, None] & h_mask[None, :],
            other=0.0,
        )
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc * inv_t


@triton.jit
def grad_logit_tile(
    X_ptr, W_ptr, T_ptr, LSE_ptr, MEANZ_ptr, G_ptr, GE_ptr, N, V, H, stride_xn, stride_xh,
    stride_wv, stride_wh, inv_t, n_row_tiles, n_vocab_tiles,
    WITH_ENTROPY: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """This program's (row tile, vocabulary tile) of dLoss/d(logits before the temperature),
    recomputed from hidden and weight: (g * (onehot - p) + g_H * p * (E_p[z] - z)) / T in fp32.
    Both backward variants start here. Returns (rows, cols, row_mask, col_mask, dz)."""
    pid_n, pid_v = grouped_tile(tl.program_id(0), n_row_tiles, n_vocab_tiles, GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < V
    z = logit_tile(
        X_ptr, W_ptr, rows, cols, row_mask, col_mask, H, stride_xn, stride_xh, stride_wv,
        stride_wh, inv_t, UPCAST_DOT, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_H,
    )  # fmt: skip
    t = tl.load(T_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(LSE_ptr + rows, mask=row_mask, other=0.0)
    g = tl.load(G_ptr + rows, mask=row_mask, other=0.0)
    p = tl.where(col_mask[None, :], tl.exp(z - lse[:, None]), 0.0)
    dz = tl.where(cols[None, :] == t[:, None], g[:, None], 0.0) - g[:, None] * p
    if WITH_ENTROPY:
        ge = tl.load(GE_ptr + rows, mask=row_mask, other=0.0)
        mean_z = tl.load(MEANZ_ptr + rows, mask=row_mask, other=0.0)
        dz += ge[:, None] * p * (mean_z[:, None] - z)
    return rows, cols, row_mask, col_mask, dz * inv_t
