"""Tile shapes, program order and the Triton pieces the log-prob kernels share.

The tables here are the defaults, read-only; a call that wants other shapes (a tuning sweep:
bench/gpu/sweep_tiles.py) names them in its `Variants.tiles`, and `tiles_for` takes them from
there.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from ._backend import tl, triton, triton_interpreting
from .variants import Variants


def _frozen(table: dict[str, dict[str, int]]) -> Mapping[str, Mapping[str, int]]:
    return MappingProxyType({kernel: MappingProxyType(shape) for kernel, shape in table.items()})


# Tile shapes and launch options per kernel on CUDA, for 16-bit inputs. The forward and the slab
# backward's kernel are the winners of bench/gpu/sweep_tiles.py on an H200 at N = 16384,
# H = 2560 (bench/gpu/NOTES.md): 128 x 256 x 64 tiles beat 128 x 128 x 64 by 9% and 10% although
# their sm_90 build spills about 850 bytes a thread (bench/gpu/compile_check.py). The forward is
# a GEMM tile with an online log-sum-exp epilogue; the atomic backward recomputes a logit tile and
# then streams H in slices of BLOCK_H_OUT for its two output products (its best shape measured,
# 128 x 128 x 64, still ran 2.5x slower than the slabs); the slab backward's kernel is a GEMM tile
# with an elementwise epilogue and a 16-bit store.
CUDA_TILES = _frozen({
    "forward": dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
    "backward": dict(
        BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, BLOCK_H_OUT=64, num_warps=8, num_stages=3
    ),
    "dlogits": dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
})  # fmt: skip
# fp32 inputs: their exact ("ieee") dots run on the CUDA cores, whose accumulators take far more
# registers than a tensor-core tile's; these smaller shapes build without spilling and within a
# Hopper block's 227 KB of shared memory (the 16-bit shapes spill 13-17 KB a thread in fp32).
CUDA_TILES_FP32 = _frozen({
    "forward": dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=2),
    "backward": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=32, BLOCK_H_OUT=32, num_warps=4, num_stages=2),
    "dlogits": dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=2),
})  # fmt: skip
# The interpreter's cost is per operation, not per element, so fewer, larger tiles run faster;
# these still leave partial row, vocabulary and hidden tiles at the test shapes.
INTERPRETER_TILES = _frozen({
    "forward": dict(BLOCK_N=32, BLOCK_V=128, BLOCK_H=32),
    "backward": dict(BLOCK_N=32, BLOCK_V=128, BLOCK_H=32, BLOCK_H_OUT=32),
    "dlogits": dict(BLOCK_N=32, BLOCK_V=128, BLOCK_H=32),
})  # fmt: skip
# Row tiles per group in the program order: the programs running at once share a few row tiles'
# hidden states and a run of vocabulary tiles, so both stay in L2 (the grouped order of tiled
# matrix products).
GROUP_N = 8


def tiles_for(
    device: torch.device, kernel: str, dtype: torch.dtype, variants: Variants
) -> dict[str, int]:
    """The tile shape and launch options of `kernel` for this call: the caller's
    (`variants.tiles`), else the interpreter's on the CPU, else the CUDA table for the dtype."""
    chosen = variants.tile_shape(kernel)
    if chosen is not None:
        return chosen
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
