"""The log-prob backward as logit-gradient slabs and two matrix products.

The atomic backward (logprob.py) adds every logit tile's dX and dW products into fp32 buffers
with atomics: (BLOCK_N + BLOCK_V) * H atomic adds per tile, hundreds of GB of L2 traffic at
training shapes. This variant takes the rows a slab at a time instead: one Triton kernel (a GEMM
whose epilogue turns the recomputed logit tile into dLoss/dlogits) writes the slab's logit
gradients in the input dtype, then dX[slab] = dZ @ W and dW += dZ^T @ X[slab] run as plain
matrix products with fp32 accumulation and fp32 results. The slab is bounded by
`Variants.grad_slab_bytes` whatever N is, so memory stays O(slab * V + V * H); the logits
themselves are never stored.

Which variant runs is `Variants.backward` ("slabs" is this module; "atomic" the kernel in
logprob.py; "stored" logit_slabs.py); bench/gpu/sweep_tiles.py times all three.
"""

from __future__ import annotations

import functools

import torch

from . import tiles
from ._backend import tl, triton
from .tiles import grad_logit_tile
from .variants import Variants

__all__ = ["accumulate_grads", "slab_products"]


@triton.jit
def _dlogits_kernel(
    X_ptr,
    W_ptr,
    T_ptr,
    LSE_ptr,
    MEANZ_ptr,
    G_ptr,
    GE_ptr,
    DZ_ptr,
    N,
    V,
    H,
    stride_xn,
    stride_xh,
    stride_wv,
    stride_wh,
    stride_dz,
    inv_t,
    n_row_tiles,
    n_vocab_tiles,
    WITH_ENTROPY: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows, cols, row_mask, col_mask, dz = grad_logit_tile(
        X_ptr, W_ptr, T_ptr, LSE_ptr, MEANZ_ptr, G_ptr, GE_ptr, N, V, H, stride_xn, stride_xh,
        stride_wv, stride_wh, inv_t, n_row_tiles, n_vocab_tiles, WITH_ENTROPY, UPCAST_DOT,
        DOT_PRECISION, GROUP_N, BLOCK_N, BLOCK_V, BLOCK_H,
    )  # fmt: skip
    tl.store(
        DZ_ptr + rows[:, None] * stride_dz + cols[None, :],
        dz.to(DZ_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@functools.cache
def _addmm_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether this torch takes an fp32 `self` in addmm(out_dtype=float32) with 16-bit operands
    (added late in torch 2.x; earlier ones refuse the mixed dtypes)."""
    a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    acc = torch.ones(16, 16, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except RuntimeError:
        return False
    return bool(torch.all(acc == 17))


def _fp32_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's matrix products take `out_dtype=float32` for these operands (cuBLAS on
    CUDA, bf16/fp16 in, fp32 accumulated and returned); elsewhere the operands are upcast."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _write_slab(hidden, weight, targets, lse, mean_z, g, ge, dz, inv_t, with_entropy, cfg) -> None:
    n, h = hidden.shape
    v = weight.shape[0]
    n_row_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    n_vocab_tiles = triton.cdiv(v, cfg["BLOCK_V"])
    _dlogits_kernel[(n_row_tiles * n_vocab_tiles,)](
        hidden, weight, targets, lse, mean_z, g, ge, dz, n, v, h, hidden.stride(0),
        hidden.stride(1), weight.stride(0), weight.stride(1), dz.stride(0), inv_t, n_row_tiles,
        n_vocab_tiles, WITH_ENTROPY=with_entropy,
        UPCAST_DOT=tiles.upcast_dot_operands(hidden.device, hidden.dtype),
        DOT_PRECISION=tiles.dot_precision(hidden.dtype), GROUP_N=tiles.GROUP_N, **cfg,
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
    variants: Variants,
) -> None:
    """Fill grad_hidden [N, H] fp32 and grad_weight [V, H] fp32 (either may be None; N > 0),
    given the upstream per-row coefficients the atomic kernel takes (g, g_H, lse, E_p[z]). A
    slab holds at most `variants.grad_slab_bytes` of logit gradients (but one row tile)."""
    n = hidden.shape[0]
    v = weight.shape[0]
    cfg = tiles.tiles_for(hidden.device, "dlogits", hidden.dtype, variants)
    block_n = cfg["BLOCK_N"]
    per_slab = variants.grad_slab_bytes // (v * hidden.element_size())
    slab_rows = max(block_n, per_slab // block_n * block_n)
    slab_rows = min(slab_rows, n)
    dz = torch.empty(slab_rows, v, dtype=hidden.dtype, device=hidden.device)
    for r0 in range(0, n, slab_rows):
        rows = slice(r0, min(r0 + slab_rows, n))
        x = hidden[rows]
        slab = dz[: x.shape[0]]
        _write_slab(
            x, weight, targets[rows], lse[rows], mean_z[rows], g[rows], ge[rows], slab, inv_t,
            with_entropy, cfg,
        )  # fmt: skip
        slab_products(
            slab, x, weight, grad_hidden[rows] if grad_hidden is not None else None, grad_weight,
            add_hidden=False, add_weight=r0 > 0,
        )  # fmt: skip


def slab_products(
    dz: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    *,
    add_hidden: bool,
    add_weight: bool,
) -> None:
    """grad_hidden [N, H] fp32 (=, or += with add_hidden) dz @ weight and grad_weight [V, H] fp32
    (=, or += with add_weight) dz^T @ x, for one slab of logit gradients dz [N, V] in the input
    dtype (either output may be None). A slab of rows writes its rows of dX and adds into dW; a
    slab of vocabulary columns writes its rows of dW and adds into dX; the first slab of either
    writes both, so neither output needs zeroing first."""
    if grad_hidden is not None:
        _product(dz, weight, grad_hidden, add_hidden)
    if grad_weight is not None:
        _product(dz.T, x, grad_weight, add_weight)


def _product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, add: bool) -> None:
    """out (fp32) = a @ b, or += a @ b, accumulated in fp32."""
    if not _fp32_products(a.device, a.dtype):
        a, b = a.float(), b.float()
        if add:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif not add:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif _addmm_accumulates_in_fp32(a.device):
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out += torch.mm(a, b, out_dtype=torch.float32)
