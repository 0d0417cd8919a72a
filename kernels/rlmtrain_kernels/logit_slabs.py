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
5. two more products give dX of the slab and add dZ^T X into the fp32 dW (the first slab writes
   it: `logprob_slabs.slab_products`).

The price of the saved quarter of the arithmetic is memory traffic, about 18·V bytes a row (the
fp32 logits written and read twice, the 16-bit gradients written and read twice); on an H200 the
row passes took 6 of the fused GRPO loss's 60 ms (bench/gpu/NOTES.md). Memory is bounded by
`Variants.logit_slab_bytes` of fp32 logits and half that of gradients, whatever N is; no [N, V]
tensor exists.

The log-prob op itself runs its forward (`log_probs`: steps 1-2) and its backward
(`accumulate_grads`: steps 1, 4 and 5, with the entropy's gradient) the same way, in place of the
Triton GEMM kernels (`Variants.forward`, `Variants.backward` = "stored", the defaults):
on an H200 cuBLAS formed a slab's logits at 720 TFLOP/s where the Triton forward kernel reached
500. Since a backward already knows each row's log-sum-exp, the op may instead cut slabs of
vocabulary columns (`Variants.logprob_slabs`): the forward merges the slabs' log-sum-exps, and the
backward writes each slab's rows of dW once, accumulating the smaller [N, H] dX instead.

Only 16-bit inputs take these paths (`variants.STORED_LOGITS_DTYPES`): fp32 inputs keep the Triton
kernels' exact ("ieee") dots. bench/gpu/sweep_tiles.py times every variant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._backend import tl, triton, triton_interpreting
from .logprob_slabs import slab_products
from .variants import Variants

__all__ = ["accumulate_grads", "log_probs", "row_grads", "slab_buffer_shape"]

# Slabs of vocabulary columns (`Variants.logprob_slabs`) start at multiples of this: each row of a
# slab's fp32 logits and 16-bit gradients then starts 256- and 128-byte aligned, as the row
# passes' vector loads and cuBLAS's leading dimensions want.
COLUMN_ALIGN = 64
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
    col0,
    vocab,
    stride_z,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row of the slab (its V columns are vocabulary columns col0 .. col0 + V - 1 of
    `vocab`): the slab's log-sum-exp, the target's log-prob within it (0 for a target in another
    slab) and (optionally) its entropy. Each lane keeps its own running max, sum of exp and sum
    of exp * z (an online log-sum-exp per lane), merged once at the end; padded columns are -inf
    and add nothing. Rows whose target is outside [0, vocab) get log-prob and entropy 0."""
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
    trained = (target >= 0) & (target < vocab)  # ignore_index rows: log-prob and entropy 0
    in_slab = trained & (target >= col0) & (target < col0 + V)
    target_z = tl.load(z_row + (target - col0), mask=in_slab, other=0.0) * inv_t
    tl.store(LSE_ptr + row, lse)
    tl.store(LOGP_ptr + row, tl.where(in_slab, target_z - lse, 0.0))
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
    col0,
    stride_z,
    stride_dz,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row's dLoss/d(logits before the temperature) over the slab's V columns (vocabulary
    columns col0 onwards), in DZ's dtype: (g * (onehot - p) + g_H * p * (E_p[z] - z)) / T, the
    second term with WITH_ENTROPY; lse and E_p[z] are the whole row's."""
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
        dz = tl.where(cols + col0 == target, g, 0.0) - g * p
        if WITH_ENTROPY:
            dz += ge * p * (mean_z - tl.where(in_vocab, z, 0.0))
        tl.store(
            DZ_ptr + row * stride_dz + cols, (dz * inv_t).to(DZ_ptr.dtype.element_ty), mask=in_vocab
        )


def _slabs(n: int, most: int) -> list[slice]:
    """Rows [0, n) in as few slabs of at most `most` as there can be, as even as they can be (no
    thin last slab paying a whole dW read-modify-write for a few rows), the larger ones last: a
    buffer that holds the last slab holds every other."""
    if n == 0:
        return []
    count = -(-n // most)
    small, larger = divmod(n, count)
    bounds, start = [], 0
    for i in range(count):
        rows = small + (i >= count - larger)
        bounds.append(slice(start, start + rows))
        start += rows
    return bounds


def _row_slabs(n: int, v: int, slab_bytes: int) -> list[slice]:
    return _slabs(n, max(1, slab_bytes // (4 * v)))


def _column_width(n: int, v: int, slab_bytes: int) -> int:
    """The width of the op's slabs of columns over n rows: as few slabs as the slab bytes allow,
    each a multiple of COLUMN_ALIGN wide and as near the same width as that leaves."""
    units = -(-v // COLUMN_ALIGN)
    most_units = max(1, slab_bytes // (4 * max(n, 1) * COLUMN_ALIGN))
    count = -(-units // most_units)
    return -(-units // count) * COLUMN_ALIGN


def _columns(v: int, width: int) -> list[slice]:
    """Columns [0, v) in slabs of `width`, the last one up to v: a width is all it takes to cut
    the same slabs again."""
    return [slice(c, min(c + width, v)) for c in range(0, v, width)]


def _largest(slabs: list[slice]) -> int:
    return max((s.stop - s.start for s in slabs), default=0)


def slab_buffer_shape(n: int, v: int, variants: Variants) -> tuple[int, int]:
    """The fp32 logit buffer `log_probs` and `accumulate_grads` use over n rows, in the call's
    orientation (`variants.logprob_slabs`): [largest row slab, V] or [n, column slab width]. A
    buffer of this shape, passed to `log_probs`, is cut into the same slabs as without it, and
    its shape tells `accumulate_grads` which orientation filled it and how."""
    if n == 0:
        return 0, v
    if variants.logprob_slabs == "columns":
        return n, _column_width(n, v, variants.logit_slab_bytes)
    return _largest(_row_slabs(n, v, variants.logit_slab_bytes)), v


def _by_columns(buffer: torch.Tensor | None, v: int, variants: Variants) -> bool:
    """Whether the op's stored path cuts the vocabulary (else the rows): as the buffer a forward
    filled was cut, if there is one (a buffer of all V columns is one slab either way)."""
    if buffer is None:
        return variants.logprob_slabs == "columns"
    return buffer.shape[1] != v


def _leading(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The first rows * cols elements of a contiguous buffer, as a contiguous [rows, cols]."""
    return buffer.view(-1)[: rows * cols].view(rows, cols)


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
    cols: slice | None = None,
    vocab: int = 0,
) -> None:
    """Fill logp, lse [rows] (and entropy [rows]) from the slab's fp32 logits z [rows, C]: all
    V columns, or the vocabulary columns `cols` of `vocab`."""
    c = z.shape[1]
    col0, vocab = (0, c) if cols is None else (cols.start, vocab)
    _row_stats_kernel[(z.shape[0],)](
        z, targets, logp, lse, entropy if with_entropy else logp, c, col0, vocab, z.stride(0),
        inv_t, WITH_ENTROPY=with_entropy, **_row_launch(c),
    )  # fmt: skip


def log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    variants: Variants,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [N], entropy [N] or [0], lse [N]), fp32; rows whose target is outside [0, V) (an
    ignore_index) get log-prob and entropy 0.

    `logits` fp32, if given, is the slab buffer, of `slab_buffer_shape(N, V, variants)`: on
    return it holds the last slab's logits, for `accumulate_grads(kept_logits=logits)`."""
    n, v = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    inv_t = 1.0 / temperature
    slab_bytes = variants.logit_slab_bytes
    if _by_columns(logits, v, variants):
        return _column_log_probs(hidden, weight, targets, inv_t, with_entropy, logits, slab_bytes)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n if with_entropy else 0, **f32)
    slabs = _row_slabs(n, v, slab_bytes) if logits is None else _slabs(n, logits.shape[0])
    if logits is None:
        logits = torch.empty(_largest(slabs), v, **f32)
    for rows in slabs:
        z = logits[: rows.stop - rows.start]
        _slab_logits(hidden[rows], weight, z)
        _slab_stats(
            z, targets[rows], logp[rows], lse[rows], entropy[rows] if with_entropy else None,
            inv_t, with_entropy,
        )  # fmt: skip
    return logp, entropy, lse


def _column_log_probs(hidden, weight, targets, inv_t, with_entropy, logits, slab_bytes):
    """`log_probs` a slab of vocabulary columns at a time: each slab's row pass gives its own
    log-sum-exp, entropy, and the target's log-prob within it where the target is in it; the
    slabs' figures are merged after, a few [slabs, N] operations."""
    n, v = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    width = _column_width(n, v, slab_bytes) if logits is None else logits.shape[1]
    slabs = _columns(v, width)
    if logits is None:
        logits = torch.empty(n, width, **f32)
    part_logp, part_lse = torch.empty(2, len(slabs), n, **f32)
    part_entropy = torch.empty(len(slabs), n, **f32) if with_entropy else None
    for i, cols in enumerate(slabs):
        z = _leading(logits, n, cols.stop - cols.start)
        _slab_logits(hidden, weight[cols], z)
        _slab_stats(
            z, targets, part_logp[i], part_lse[i], part_entropy[i] if with_entropy else None,
            inv_t, with_entropy, cols, v,
        )  # fmt: skip
    lse = torch.logsumexp(part_lse, dim=0)
    # A slab's share of the row's probability, and its log-sum-exp relative to the row's: the
    # target's log-prob is its slab's plus that offset, the entropy the shares' mean of each
    # slab's entropy less its offset.
    offset = part_lse - lse
    first = torch.tensor([c.start for c in slabs], device=hidden.device)
    slab_of_target = (torch.searchsorted(first, targets, right=True) - 1).clamp(min=0)
    from_target_slab = (part_logp + offset).gather(0, slab_of_target[None])[0]
    trained = (targets >= 0) & (targets < v)
    logp = torch.where(trained, from_target_slab, 0.0)
    entropy = torch.empty(0, **f32)
    if with_entropy:
        entropy = torch.where(trained, (offset.exp() * (part_entropy - offset)).sum(dim=0), 0.0)
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
    col0: int = 0,
) -> None:
    """Write dz [rows, C] (input dtype) = dLoss/dlogits from the slab's fp32 logits z [rows, C]
    (vocabulary columns col0 onwards) and the per-row coefficients [rows]: g, and with the
    entropy's gradient g_H and E_p[z]."""
    c = z.shape[1]
    _row_dlogits_kernel[(z.shape[0],)](
        z, dz, targets, lse, mean_z if with_entropy else lse, g, ge if with_entropy else g, c,
        col0, z.stride(0), dz.stride(0), inv_t, WITH_ENTROPY=with_entropy, **_row_launch(c),
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
    kept_logits: torch.Tensor | None = None,
) -> None:
    """The log-prob op's backward, `logprob_slabs.accumulate_grads`'s contract: fill grad_hidden
    [N, H] fp32 and grad_weight [V, H] fp32 (either may be None) from the per-row upstream
    coefficients (g, g_H, lse, E_p[z]; g and g_H already 0 on ignored rows).

    `kept_logits` is the buffer a `log_probs(logits=...)` over these rows filled: it holds the
    logits of their last slab, which goes first and skips its matrix product; the other slabs'
    logits then overwrite it. The slabs are cut as that forward cut them."""
    n, v = hidden.shape[0], weight.shape[0]
    slab_bytes = variants.logit_slab_bytes
    if _by_columns(kept_logits, v, variants):
        _column_grads(
            hidden, weight, targets, lse, mean_z, g, ge, grad_hidden, grad_weight, inv_t,
            with_entropy, kept_logits, slab_bytes,
        )  # fmt: skip
        return
    if kept_logits is not None:
        kept = _slabs(n, kept_logits.shape[0])[-1]
        slabs = [kept, *_slabs(kept.start, kept_logits.shape[0])]
        logits = kept_logits
    else:
        kept, slabs = None, _row_slabs(n, v, slab_bytes)
        logits = torch.empty(_largest(slabs), v, dtype=torch.float32, device=hidden.device)
    dlogits = torch.empty(_largest(slabs), v, dtype=hidden.dtype, device=hidden.device)
    for i, rows in enumerate(slabs):
        x = hidden[rows]
        z, dz = logits[: x.shape[0]], dlogits[: x.shape[0]]
        if rows is not kept:
            _slab_logits(x, weight, z)
        _slab_dlogits(
            z, dz, targets[rows], lse[rows], mean_z[rows], g[rows], ge[rows], inv_t, with_entropy
        )
        slab_products(
            dz, x, weight, grad_hidden[rows] if grad_hidden is not None else None, grad_weight,
            add_hidden=False, add_weight=i > 0,
        )  # fmt: skip


def _column_grads(
    hidden, weight, targets, lse, mean_z, g, ge, grad_hidden, grad_weight, inv_t, with_entropy,
    kept_logits, slab_bytes,
):  # fmt: skip
    """`accumulate_grads` a slab of vocabulary columns at a time: each slab writes its own rows
    of dW once and adds into dX, an [N, H] read-modify-write a slab in place of a [V, H] one."""
    n, v = hidden.shape[0], weight.shape[0]
    width = _column_width(n, v, slab_bytes) if kept_logits is None else kept_logits.shape[1]
    slabs = _columns(v, width)
    kept = slabs[-1] if kept_logits is not None else None
    logits = kept_logits
    if logits is None:
        logits = torch.empty(n, width, dtype=torch.float32, device=hidden.device)
    dlogits = torch.empty(n, width, dtype=hidden.dtype, device=hidden.device)
    order = slabs if kept is None else [kept, *slabs[:-1]]
    for i, cols in enumerate(order):
        z, dz = (_leading(buffer, n, cols.stop - cols.start) for buffer in (logits, dlogits))
        if cols is not kept:
            _slab_logits(hidden, weight[cols], z)
        _slab_dlogits(z, dz, targets, lse, mean_z, g, ge, inv_t, with_entropy, cols.start)
        slab_products(
            dz, hidden, weight[cols], grad_hidden,
            grad_weight[cols] if grad_weight is not None else None,
            add_hidden=i > 0, add_weight=False,
        )  # fmt: skip


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
    slab_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs and, in the same pass, the gradients of a per-token loss, for trained rows only
    (every target a token id; `rows.TrainedRows` drops the ignored ones before), in slabs of at
    most `slab_bytes` of fp32 logits.

    `row_grad(rows, logp[rows])` returns dLoss/dlogp for those rows. Returns (logp [N] fp32,
    entropy [N] or [0] fp32, dHidden [N, H] fp32 or None, dWeight [V, H] fp32 or None).
    """
    n, h = hidden.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    inv_t = 1.0 / temperature
    slabs = _row_slabs(n, v, slab_bytes)
    slab_rows = _largest(slabs)
    logits = torch.empty(slab_rows, v, **f32)
    dlogits = torch.empty(slab_rows, v, dtype=hidden.dtype, device=hidden.device)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n if with_entropy else 0, **f32)
    grad_hidden = torch.empty(n, h, **f32) if need_grad_hidden else None
    grad_weight = torch.empty(v, h, **f32) if need_grad_weight else None
    if not slabs and need_grad_weight:
        grad_weight.zero_()
    for i, rows in enumerate(slabs):
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
            dz, x, weight, grad_hidden[rows] if grad_hidden is not None else None, grad_weight,
            add_hidden=False, add_weight=i > 0,
        )  # fmt: skip
    return logp, entropy, grad_hidden, grad_weight
