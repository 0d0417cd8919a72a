"""Fused linear + log-softmax + gather: per-token log-probs (and entropy) of a linear LM head
without ever holding the [N, V] logits.

Forward kernel: programs tile (row block, vocabulary split). Each recomputes its logit tiles from
hidden and weight (tl.dot, fp32 accumulation, operands never rounded) and keeps an online
log-sum-exp per row: running max from -inf, padded vocabulary columns masked to -inf so they add
exp(-inf) = 0, never exp(0). Splitting the vocabulary keeps the GPU busy when N is small; the
per-split (max, sum, sum of e*z) triples are merged by a tiny torch epilogue.

Backward, three variants (`Variants.backward`). Each forms the logits again (but for the
slab a stored forward kept: `LinearLogprobFunction`) and from them
dL/dz = g * (onehot - p) + g_H * p * (E_p[z] - z), rounded to the input dtype for the two
products; no entry is dropped (Cut Cross-Entropy's filter of small gradient blocks is not used).
"stored", the default for 16-bit inputs (logit_slabs.py), forms a slab's logits with a matrix
product in fp32 and dz in a pass per row, then finishes dX and dW with two matrix products.
"slabs" (logprob_slabs.py; fp32 inputs take it) writes dz for a bounded slab of rows with a
Triton GEMM kernel instead. "atomic" (the kernel here) scatters dX = dz @ W and dW = dz^T @ X
into fp32 buffers with atomic adds, the Cut Cross-Entropy layout, and stores nothing of size V;
on an H200 it ran 2.5x slower than the slabs at training shapes. The forward has a "stored"
variant too (`Variants.forward`), the default for 16-bit inputs; the kernel above serves fp32
inputs.

Grids are one-dimensional so no axis meets the 65,535 limit of axes 1 and 2; the kernels walk
them in grouped order (`tiles.grouped_tile`), so that the programs resident at once share a few
row tiles of hidden states and a run of weight tiles in L2 instead of each streaming its own.
Tile shapes come from `tiles.tiles_for`: the default tables, or a call's `Variants.tiles`.

The op is registered with torch.library (opaque to torch.compile, with fake kernels for shapes)
and differentiated by `LinearLogprobFunction`.
"""

from __future__ import annotations

import torch

from . import logit_slabs, logprob_slabs, reference, second_order, tiles
from ._backend import resolve_impl, tl, triton
from .head_checks import check_backend_dtype, check_linear_inputs
from .rows import TrainedRows
from .tiles import grad_logit_tile, grouped_tile, logit_tile
from .variants import Variants, resolve

__all__ = ["fused_linear_logprob"]


@triton.jit
def _logprob_fwd_kernel(
    X_ptr,
    W_ptr,
    T_ptr,
    MAX_ptr,
    SUM_ptr,
    SUMZ_ptr,
    TZ_ptr,
    N,
    V,
    H,
    stride_xn,
    stride_xh,
    stride_wv,
    stride_wh,
    inv_t,
    n_row_tiles,
    n_splits,
    tiles_per_split,
    WITH_ENTROPY: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid_n, pid_s = grouped_tile(tl.program_id(0), n_row_tiles, n_splits, GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    t = tl.load(T_ptr + rows, mask=row_mask, other=-1)

    running_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    sum_exp = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_exp_z = tl.zeros([BLOCK_N], dtype=tl.float32)
    tile_lo = pid_s * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(V, BLOCK_V))
    for vt in range(tile_lo, tile_hi):
        cols = (vt * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_mask = cols < V
        z = logit_tile(
            X_ptr, W_ptr, rows, cols, row_mask, col_mask, H, stride_xn, stride_xh, stride_wv,
            stride_wh, inv_t, UPCAST_DOT, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        z = tl.where(col_mask[None, :], z, 0.0)
        masked_z = tl.where(col_mask[None, :], z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(masked_z, axis=1))
        rescale = tl.exp(running_max - new_max)
        e = tl.exp(masked_z - new_max[:, None])
        sum_exp = sum_exp * rescale + tl.sum(e, axis=1)
        if WITH_ENTROPY:
            sum_exp_z = sum_exp_z * rescale + tl.sum(e * z, axis=1)
        running_max = new_max
        hit = cols[None, :] == t[:, None]
        in_tile = (t >= vt * BLOCK_V) & (t < vt * BLOCK_V + BLOCK_V)
        tl.store(TZ_ptr + rows, tl.sum(tl.where(hit, z, 0.0), axis=1), mask=row_mask & in_tile)

    out = pid_s.to(tl.int64) * N + rows
    tl.store(MAX_ptr + out, running_max, mask=row_mask)
    tl.store(SUM_ptr + out, sum_exp, mask=row_mask)
    if WITH_ENTROPY:
        tl.store(SUMZ_ptr + out, sum_exp_z, mask=row_mask)


@triton.jit
def _logprob_bwd_kernel(
    X_ptr,
    W_ptr,
    T_ptr,
    LSE_ptr,
    MEANZ_ptr,
    G_ptr,
    GE_ptr,
    DX_ptr,
    DW_ptr,
    N,
    V,
    H,
    stride_xn,
    stride_xh,
    stride_wv,
    stride_wh,
    inv_t,
    n_row_tiles,
    n_vocab_tiles,
    WITH_ENTROPY: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_H_OUT: tl.constexpr,
):
    rows, cols, row_mask, col_mask, dz = grad_logit_tile(
        X_ptr, W_ptr, T_ptr, LSE_ptr, MEANZ_ptr, G_ptr, GE_ptr, N, V, H, stride_xn, stride_xh,
        stride_wv, stride_wh, inv_t, n_row_tiles, n_vocab_tiles, WITH_ENTROPY, UPCAST_DOT,
        DOT_PRECISION, GROUP_N, BLOCK_N, BLOCK_V, BLOCK_H,
    )  # fmt: skip
    dz = dz.to(X_ptr.dtype.element_ty)
    if UPCAST_DOT:
        dz = dz.to(tl.float32)

    for h0 in range(0, H, BLOCK_H_OUT):
        hs = h0 + tl.arange(0, BLOCK_H_OUT)
        h_mask = hs < H
        if NEED_DX:
            w = tl.load(
                W_ptr + cols[:, None] * stride_wv + hs[None, :] * stride_wh,
                mask=col_mask[:, None] & h_mask[None, :],
                other=0.0,
            )
            if UPCAST_DOT:
                w = w.to(tl.float32)
            dx = tl.dot(dz, w, input_precision=DOT_PRECISION)
            tl.atomic_add(
                DX_ptr + rows[:, None] * H + hs[None, :],
                dx,
                mask=row_mask[:, None] & h_mask[None, :],
                sem="relaxed",
            )
        if NEED_DW:
            x = tl.load(
                X_ptr + rows[:, None] * stride_xn + hs[None, :] * stride_xh,
                mask=row_mask[:, None] & h_mask[None, :],
                other=0.0,
            )
            if UPCAST_DOT:
                x = x.to(tl.float32)
            dw = tl.dot(tl.trans(dz), x, input_precision=DOT_PRECISION)
            tl.atomic_add(
                DW_ptr + cols[:, None] * H + hs[None, :],
                dw,
                mask=col_mask[:, None] & h_mask[None, :],
                sem="relaxed",
            )


def _vocab_splits(device: torch.device, n_row_tiles: int, n_vocab_tiles: int) -> int:
    """Vocabulary splits so that small N still launches enough programs to fill the device."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # the interpreter: still exercise the cross-split merge
    return max(1, min(n_vocab_tiles, triton.cdiv(target, n_row_tiles)))


def logprob_forward_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    variants: Variants,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [N], entropy [N] or [0], lse [N]), fp32, by the Triton forward kernel, or from
    stored logit slabs (`variants.forward`). `logits` is the stored path's slab buffer, if
    the caller keeps it for the backward (`logit_slabs.log_probs`); the kernel leaves it unread."""
    n, h = hidden.shape
    v = weight.shape[0]
    if n == 0:  # three tensors: a custom op's outputs may not alias one another
        return tuple(hidden.new_empty(0, dtype=torch.float32) for _ in range(3))
    if variants.stores_logits("forward", hidden.dtype):
        return logit_slabs.log_probs(
            hidden, weight, targets, temperature=temperature, with_entropy=with_entropy,
            variants=variants, logits=logits,
        )  # fmt: skip
    cfg = tiles.tiles_for(hidden.device, "forward", hidden.dtype, variants)
    n_row_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    n_vocab_tiles = triton.cdiv(v, cfg["BLOCK_V"])
    splits = _vocab_splits(hidden.device, n_row_tiles, n_vocab_tiles)
    tiles_per_split = triton.cdiv(n_vocab_tiles, splits)
    splits = triton.cdiv(n_vocab_tiles, tiles_per_split)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    part_max = torch.empty(splits, n, **f32)
    part_sum = torch.empty(splits, n, **f32)
    part_sum_z = torch.empty(splits, n, **f32) if with_entropy else part_sum
    target_z = torch.zeros(n, **f32)
    _logprob_fwd_kernel[(n_row_tiles * splits,)](
        hidden,
        weight,
        targets,
        part_max,
        part_sum,
        part_sum_z,
        target_z,
        n,
        v,
        h,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        1.0 / temperature,
        n_row_tiles,
        splits,
        tiles_per_split,
        WITH_ENTROPY=with_entropy,
        UPCAST_DOT=tiles.upcast_dot_operands(hidden.device, hidden.dtype),
        DOT_PRECISION=tiles.dot_precision(hidden.dtype),
        GROUP_N=tiles.GROUP_N,
        **cfg,
    )
    row_max = part_max.amax(dim=0)
    scale = torch.exp(part_max - row_max)
    sum_exp = (part_sum * scale).sum(dim=0)
    lse = row_max + torch.log(sum_exp)
    valid = targets != ignore_index
    logp = torch.where(valid, target_z - lse, 0.0)
    entropy = torch.empty(0, **f32)
    if with_entropy:
        mean_z = (part_sum_z * scale).sum(dim=0) / sum_exp
        entropy = torch.where(valid, lse - mean_z, 0.0)
    return logp, entropy, lse


def logprob_backward_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    *,
    temperature: float,
    ignore_index: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    variants: Variants,
    kept_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dHidden [N, H] fp32 or None, dWeight [V, H] fp32 or None) by the Triton backward
    (`variants.backward`: logit-gradient slabs, the atomic tile kernel, or slabs from
    stored logits, which take the forward's `kept_logits` in place of forming those again and
    overwrite them; the other variants leave them unread)."""
    n, h = hidden.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    valid = targets != ignore_index
    g = torch.zeros(n, **f32) if grad_logp is None else torch.where(valid, grad_logp.float(), 0.0)
    with_entropy = grad_entropy is not None
    ge = torch.where(valid, grad_entropy.float(), 0.0) if with_entropy else g
    mean_z = lse - entropy if with_entropy else lse
    # The slab variants write every element; the atomic kernel adds into zeros.
    blank = torch.zeros if n == 0 or variants.backward == "atomic" else torch.empty
    grad_hidden = blank(n, h, **f32) if need_grad_hidden else None
    grad_weight = blank(v, h, **f32) if need_grad_weight else None
    if n == 0 or not (need_grad_hidden or need_grad_weight):
        return grad_hidden, grad_weight
    upstream = (lse.contiguous(), mean_z.contiguous(), g.contiguous(), ge.contiguous())
    if variants.backward in ("slabs", "stored"):  # fp32 inputs asking "stored" take "slabs"
        inv_t = 1.0 / temperature
        if variants.stores_logits("backward", hidden.dtype):
            logit_slabs.accumulate_grads(
                hidden, weight, targets, *upstream, grad_hidden, grad_weight,
                inv_t=inv_t, with_entropy=with_entropy, variants=variants,
                kept_logits=kept_logits,
            )  # fmt: skip
        else:
            logprob_slabs.accumulate_grads(
                hidden, weight, targets, *upstream, grad_hidden, grad_weight,
                inv_t=inv_t, with_entropy=with_entropy, variants=variants,
            )  # fmt: skip
        return grad_hidden, grad_weight
    cfg = tiles.tiles_for(hidden.device, "backward", hidden.dtype, variants)
    n_row_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    n_vocab_tiles = triton.cdiv(v, cfg["BLOCK_V"])
    _logprob_bwd_kernel[(n_row_tiles * n_vocab_tiles,)](
        hidden,
        weight,
        targets,
        *upstream,
        grad_hidden if grad_hidden is not None else g,
        grad_weight if grad_weight is not None else g,
        n,
        v,
        h,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        1.0 / temperature,
        n_row_tiles,
        n_vocab_tiles,
        WITH_ENTROPY=with_entropy,
        NEED_DX=need_grad_hidden,
        NEED_DW=need_grad_weight,
        UPCAST_DOT=tiles.upcast_dot_operands(hidden.device, hidden.dtype),
        DOT_PRECISION=tiles.dot_precision(hidden.dtype),
        GROUP_N=tiles.GROUP_N,
        **cfg,
    )
    return grad_hidden, grad_weight


@torch.library.custom_op("rlmtrain_kernels::linear_logprob_fwd", mutates_args=())
def _linear_logprob_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    keep_logits: bool,
    impl: str,
    variants: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse, kept): `kept` fp32 is the stored path's slab buffer, left holding
    the logits of the last slab of trained rows for the backward ([0, V]: nothing kept, which is
    also what a forward without `keep_logits` or without stored slabs returns). `variants` is a
    `Variants.spec`."""
    v = weight.shape[0]
    chosen = Variants.from_spec(variants)
    rows = TrainedRows("fused_linear_logprob", targets, ignore_index, v)
    keeps = _keeps(hidden, keep_logits, impl, chosen)
    kept_shape = logit_slabs.slab_buffer_shape(rows.count, v, chosen) if keeps else (0, v)
    kept = hidden.new_empty(kept_shape, dtype=torch.float32)
    trained = (rows.take(hidden), weight, rows.take(targets))
    options = dict(temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy)
    if impl == "triton":
        logp, entropy, lse = logprob_forward_triton(
            *trained, **options, variants=chosen, logits=kept if kept.numel() else None
        )
    else:
        logp, entropy, lse = reference.linear_logprob_forward(*trained, **options)
    return rows.put(logp), rows.put(entropy) if with_entropy else entropy, rows.put(lse), kept


def _keeps(hidden: torch.Tensor, keep_logits: bool, impl: str, variants: Variants) -> bool:
    """Whether the forward keeps a logit slab: asked to, and its forward stores slabs."""
    return keep_logits and impl == "triton" and variants.stores_logits("forward", hidden.dtype)


@_linear_logprob_fwd.register_fake
def _(hidden, weight, targets, temperature, ignore_index, with_entropy, keep_logits, impl,
      variants):  # fmt: skip
    n, v = hidden.shape[0], weight.shape[0]
    # The torch path computes fp64 inputs in fp64 (for gradcheck); every other input in fp32.
    out = dict(dtype=reference.accumulation_dtype(hidden.dtype), device=hidden.device)
    # The kept slab follows the count of trained rows, a data-dependent size: its rows, and
    # with slabs of columns its columns too.
    kept_shape = (0, v)
    chosen = Variants.from_spec(variants)
    if _keeps(hidden, keep_logits, impl, chosen):
        ctx = torch.library.get_ctx()
        columns = chosen.logprob_slabs == "columns"
        kept_shape = (ctx.new_dynamic_size(), ctx.new_dynamic_size() if columns else v)
    return (
        hidden.new_empty(n, **out),
        hidden.new_empty(n if with_entropy else 0, **out),
        hidden.new_empty(n, **out),
        hidden.new_empty(kept_shape, dtype=torch.float32, device=hidden.device),
    )


@torch.library.custom_op("rlmtrain_kernels::linear_logprob_bwd", mutates_args=("kept_logits",))
def _linear_logprob_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    kept_logits: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    impl: str,
    variants: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = TrainedRows("fused_linear_logprob", targets, ignore_index, weight.shape[0])
    trained = (
        rows.take(hidden),
        weight,
        rows.take(targets),
        rows.take(lse),
        rows.take(entropy) if grad_entropy is not None else entropy,
        rows.take(grad_logp),
        rows.take(grad_entropy),
    )
    if impl == "triton":
        grad_hidden, grad_weight = logprob_backward_triton(
            *trained, temperature=temperature, ignore_index=ignore_index,
            need_grad_hidden=need_grad_hidden, need_grad_weight=need_grad_weight,
            variants=Variants.from_spec(variants),
            kept_logits=kept_logits if kept_logits.numel() else None,
        )  # fmt: skip
    else:
        grad_hidden, grad_weight = reference.linear_logprob_backward(
            *trained, temperature=temperature, ignore_index=ignore_index,
            need_grad_weight=need_grad_weight,
        )  # fmt: skip
    grad_hidden = rows.put(grad_hidden) if need_grad_hidden else None
    # Custom ops return tensors only, none aliasing another: a fresh empty one means "not needed".
    return (
        grad_hidden.to(hidden.dtype) if need_grad_hidden else hidden.new_empty(0),
        grad_weight.to(weight.dtype) if need_grad_weight else weight.new_empty(0),
    )


@_linear_logprob_bwd.register_fake
def _(hidden, weight, targets, lse, entropy, kept_logits, grad_logp, grad_entropy, temperature,
      ignore_index, need_grad_hidden, need_grad_weight, impl, variants):  # fmt: skip
    return (
        hidden.new_empty(hidden.shape if need_grad_hidden else (0,)),
        weight.new_empty(weight.shape if need_grad_weight else (0,)),
    )


class LinearLogprobFunction(torch.autograd.Function):
    """Differentiates (logp, entropy) w.r.t. hidden and weight, forming the logits again in the
    backward, slab by slab.

    With `keep_logits` (`fused_linear_logprob` sets it when a backward can come: grad mode on,
    an input that requires grad, not under torch.compile) a forward that stores logit slabs
    keeps its last one, at most `Variants.logit_slab_bytes` of fp32 logits, for the first
    backward: that backward takes it in place of the slab's matrix product and then uses it as
    its working buffer, the one it would otherwise allocate. The slab is held from the forward
    to the backward (or until the graph is freed without one); being a ctx attribute and not a
    saved tensor, it is neither freed by activation checkpointing nor moved by saved-tensor
    hooks. A second backward through a retained graph forms every slab again. A backward that
    is itself differentiated takes full logits and autograd instead (`second_order`)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, temperature, ignore_index, with_entropy, keep_logits, impl,
        variants,
    ):  # fmt: skip
        logp, entropy, lse, kept = _linear_logprob_fwd(
            hidden, weight, targets, temperature, ignore_index, with_entropy, keep_logits, impl,
            variants,
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        # Not a saved tensor: the backward overwrites it, and a retained graph must then not
        # hand it to a second backward as if it still held logits.
        ctx.kept_logits = kept
        ctx.options = (temperature, ignore_index, impl, variants)
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        kept = ctx.kept_logits
        ctx.kept_logits = kept.new_empty(0, kept.shape[1])
        temperature, ignore_index, impl, variants = ctx.options
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if second_order.wanted():
            outputs = second_order.head_logprobs(
                hidden, weight, targets, temperature, ignore_index, ctx.with_entropy
            )
            grads = second_order.grads(
                outputs, (grad_logp, grad_entropy), (hidden, weight), (need_hidden, need_weight)
            )
            return *grads, *[None] * 7
        grad_hidden, grad_weight = _linear_logprob_bwd(
            hidden,
            weight,
            targets,
            lse,
            entropy,
            kept,
            grad_logp,
            grad_entropy if ctx.with_entropy else None,
            temperature,
            ignore_index,
            need_hidden,
            need_weight,
            impl,
            variants,
        )
        return (
            grad_hidden if need_hidden else None,
            grad_weight if need_weight else None,
            *[None] * 7,
        )


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    impl: str = "auto",
    variants: Variants | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[i, targets[i]] without the [N, V] logits.

    Args:
        hidden: [N, H] bf16, fp16 or fp32 (the last hidden states, packed, no batch dim);
            fp64 runs on impl="torch" only and then computes and returns fp64 (for gradcheck).
        weight: [V, H] same dtype as hidden (the LM head).
        targets: [N] int32/int64 token ids in [0, V), or `ignore_index`.
        temperature: divides the logits (sampling temperature of the rollouts).
        return_entropy: also return the entropy of softmax(logits / temperature).
        ignore_index: rows with this target get logp 0, entropy 0 and no gradient.
        impl: "triton" | "torch" | "auto" (Triton on CUDA, the chunked torch backend elsewhere).
        variants: the Triton paths this call takes (`Variants`; None: the measured winners).

    Returns:
        logp [N] fp32, or (logp [N] fp32, entropy [N] fp32); both differentiable w.r.t. hidden
        and weight (gradients come back in their dtypes; dW is accumulated in fp32).
    """
    check_linear_inputs("fused_linear_logprob", hidden, weight, targets, temperature, ignore_index)
    backend = resolve_impl(impl, hidden.device, "fused_linear_logprob")
    check_backend_dtype("fused_linear_logprob", backend, hidden.dtype)
    spec = resolve(variants).spec
    logp, entropy = LinearLogprobFunction.apply(
        hidden.contiguous(),
        weight.contiguous(),
        targets.contiguous(),
        float(temperature),
        int(ignore_index),
        bool(return_entropy),
        # A forward whose backward can come keeps one slab of logits for it (the Function's
        # docstring); needs_input_grad cannot tell, being set under no_grad too. Compiled
        # graphs keep none: they would copy the slab to honour the backward's write into it.
        torch.is_grad_enabled()
        and (hidden.requires_grad or weight.requires_grad)
        and not torch.compiler.is_compiling(),
        backend,
        spec,
    )
    return (logp, entropy) if return_entropy else logp
