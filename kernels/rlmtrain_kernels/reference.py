"""The chunked torch backend: the CPU path, the oracle the Triton kernels are tested against, and
the benchmark baseline.

Log-probs of a linear head never need the [N, V] logits at once. Rows are processed in blocks of
`chunk_rows`; within a block the vocabulary is walked in tiles of `chunk_vocab` columns with an
online log-sum-exp in fp32 (running max starting at -inf), so peak extra memory is
O(chunk_rows * chunk_vocab + V * H): the fp32 logit tile plus an fp32 copy of a bf16 weight.
(fp64 inputs are computed in fp64 so that `torch.autograd.gradcheck` can check this backend.)
Logits are always formed from fp32 operands, so they are never rounded to bf16 before the softmax
(rounding them cost real runs 4-23% gradient error).

Two gradient paths:
- `linear_logprob_backward` recomputes each logit tile from the saved log-sum-exp; it serves an
  arbitrary upstream gradient (the generic autograd op).
- `linear_logprob_row_grads` serves fused losses whose gradient w.r.t. a token's log-prob depends
  only on that token (GRPO, NLL): it asks `row_grad(rows, logp)` for the coefficients as soon as a
  row block's log-probs are known and, when the whole vocabulary fits one tile, turns the tile of
  exponentials into dL/dz in place instead of recomputing logits. That is 6·N·H·V FLOPs and one
  exp per logit, as unfused autograd.

Gradient of logp_t = z_t - lse w.r.t. the tempered logits z is onehot(t) - p; of the entropy
H = lse - E_p[z] it is p * (E_p[z] - z). Rows whose target equals `ignore_index` get log-prob 0,
entropy 0 and no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "DEFAULT_TILE_ELEMENTS",
    "chunk_sizes",
    "grpo_forward",
    "linear_logprob_backward",
    "linear_logprob_forward",
    "linear_logprob_row_grads",
]

# Elements in one fp32 logit tile (256 MiB; 441 rows at V = 151936). Each row block streams the
# whole weight through two matmuls and dWeight through one, so blocks of a few hundred rows keep
# that traffic below the tile's own elementwise passes; still small next to N*V.
DEFAULT_TILE_ELEMENTS = 1 << 26

RowGrad = Callable[[slice, torch.Tensor], torch.Tensor]


def chunk_sizes(
    n_rows: int,
    vocab: int,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
    tile_elements: int = DEFAULT_TILE_ELEMENTS,
) -> tuple[int, int]:
    """Row block and vocabulary tile: the caller's where given, else a pair whose product stays
    within `tile_elements`."""
    default_vocab = min(vocab, tile_elements)
    default_rows = max(1, min(n_rows, tile_elements // default_vocab))
    return chunk_rows or default_rows, chunk_vocab or default_vocab


def _logit_tiles(x32: torch.Tensor, w32: torch.Tensor, inv_t: float, chunk_vocab: int):
    """Yield (first column, fp32 tempered logits [rows, cols]) over the vocabulary."""
    for v0 in range(0, w32.shape[0], chunk_vocab):
        z = x32 @ w32[v0 : v0 + chunk_vocab].T
        if inv_t != 1.0:
            z.mul_(inv_t)
        yield v0, z


def _target_logit(z: torch.Tensor, targets: torch.Tensor, v0: int) -> torch.Tensor:
    """z[row, target - v0] where the target falls in this tile, else 0."""
    local = targets - v0
    inside = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(inside, picked, 0.0)


def _block_stats(
    x32: torch.Tensor,
    w32: torch.Tensor,
    targets: torch.Tensor,
    inv_t: float,
    chunk_vocab: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online log-sum-exp over the vocabulary for one row block.

    Returns (lse, target logit, mean logit E_p[z] or empty).
    """
    rows = x32.shape[0]
    running_max = x32.new_full((rows,), float("-inf"))
    sum_exp = x32.new_zeros(rows)
    sum_exp_z = x32.new_zeros(rows)
    target_z = x32.new_zeros(rows)
    for v0, z in _logit_tiles(x32, w32, inv_t, chunk_vocab):
        new_max = torch.maximum(running_max, z.amax(dim=1))
        rescale = torch.exp(running_max - new_max)
        e = torch.exp(z - new_max.unsqueeze(1))
        sum_exp = sum_exp * rescale + e.sum(dim=1)
        if with_entropy:
            sum_exp_z = sum_exp_z * rescale + (e * z).sum(dim=1)
        target_z += _target_logit(z, targets, v0)
        running_max = new_max
    lse = running_max + torch.log(sum_exp)
    mean_z = sum_exp_z / sum_exp if with_entropy else x32.new_empty(0)
    return lse, target_z, mean_z


def _exp_tile_(
    z: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole vocabulary in one tile: z becomes exp(z - rowmax) in place (no second exp is
    needed for the gradient). Returns (lse, target logit, mean logit or empty, sum of exp)."""
    target_z = _target_logit(z, targets, 0)
    row_max = z.amax(dim=1)
    z.sub_(row_max.unsqueeze(1))
    shifted_mean = (z * torch.exp(z)).sum(dim=1) if with_entropy else None
    z.exp_()
    sum_exp = z.sum(dim=1)
    lse = row_max + torch.log(sum_exp)
    mean_z = row_max + shifted_mean / sum_exp if with_entropy else z.new_empty(0)
    return lse, target_z, mean_z, sum_exp


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; fp64 inputs stay fp64 (for gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear_logprob_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H], targets [N] -> (logp, entropy or [0], lse), each [N] fp32."""
    n, v = hidden.shape[0], weight.shape[0]
    chunk_rows, chunk_vocab = chunk_sizes(n, v, chunk_rows, chunk_vocab)
    inv_t = 1.0 / temperature
    acc = accumulation_dtype(hidden.dtype)
    w32 = weight.to(acc)
    logp = hidden.new_empty(n, dtype=acc)
    lse = hidden.new_empty(n, dtype=acc)
    entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)
    for r0 in range(0, n, chunk_rows):
        rows = slice(r0, r0 + chunk_rows)
        t = targets[rows]
        block_lse, target_z, mean_z = _block_stats(
            hidden[rows].to(acc), w32, t, inv_t, chunk_vocab, with_entropy
        )
        valid = t != ignore_index
        lse[rows] = block_lse
        logp[rows] = torch.where(valid, target_z - block_lse, 0.0)
        if with_entropy:
            entropy[rows] = torch.where(valid, block_lse - mean_z, 0.0)
    return logp, entropy, lse


def _grad_logits_(
    z: torch.Tensor,
    targets: torch.Tensor,
    v0: int,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    mean_z: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    inv_t: float,
) -> torch.Tensor:
    """Overwrite the logit tile z with dLoss/d(pre-temperature logits); returns it."""
    cols = z.shape[1]
    p = torch.exp(z - lse.unsqueeze(1))
    if grad_entropy is not None:
        # dH/dz = p * (E_p[z] - z), computed before z is overwritten.
        z.neg_().add_(mean_z.unsqueeze(1)).mul_(p).mul_(grad_entropy.unsqueeze(1))
        z.sub_(p.mul_(grad_logp.unsqueeze(1)))
    else:
        torch.mul(p, grad_logp.unsqueeze(1), out=z).neg_()
    local = targets - v0
    inside = (local >= 0) & (local < cols)
    hit = torch.where(inside, grad_logp, 0.0).unsqueeze(1)
    z.scatter_add_(1, local.clamp(0, cols - 1).unsqueeze(1), hit)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def _block_grads(
    x32: torch.Tensor,
    w32: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    mean_z: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    inv_t: float,
    chunk_vocab: int,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """dHidden [rows, H] fp32 for one row block; adds the block's dWeight into grad_weight."""
    grad_x = torch.zeros_like(x32)
    for v0, z in _logit_tiles(x32, w32, inv_t, chunk_vocab):
        dz = _grad_logits_(z, targets, v0, lse, grad_logp, mean_z, grad_entropy, inv_t)
        w_tile = w32[v0 : v0 + dz.shape[1]]
        grad_x.addmm_(dz, w_tile)
        if grad_weight is not None:
            grad_weight[v0 : v0 + dz.shape[1]].addmm_(dz.T, x32)
    return grad_x


def linear_logprob_backward(
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
    need_grad_weight: bool,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients for an arbitrary upstream gradient; logit tiles are recomputed, never stored.

    Returns (dHidden [N, H] fp32, dWeight [V, H] fp32 or None).
    """
    n, v = hidden.shape[0], weight.shape[0]
    chunk_rows, chunk_vocab = chunk_sizes(n, v, chunk_rows, chunk_vocab)
    inv_t = 1.0 / temperature
    acc = accumulation_dtype(hidden.dtype)
    w32 = weight.to(acc)
    valid = targets != ignore_index
    g = torch.zeros(n, dtype=acc, device=hidden.device)
    if grad_logp is not None:
        g = torch.where(valid, grad_logp.to(acc), 0.0)
    ge = torch.where(valid, grad_entropy.to(acc), 0.0) if grad_entropy is not None else None
    mean_z = lse - entropy if ge is not None else None
    grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
    grad_weight = torch.zeros(v, hidden.shape[1], dtype=acc, device=hidden.device)
    grad_weight = grad_weight if need_grad_weight else None
    for r0 in range(0, n, chunk_rows):
        rows = slice(r0, r0 + chunk_rows)
        grad_hidden[rows] = _block_grads(
            hidden[rows].to(acc),
            w32,
            targets[rows],
            lse[rows],
            g[rows],
            mean_z[rows] if mean_z is not None else None,
            ge[rows] if ge is not None else None,
            inv_t,
            chunk_vocab,
            grad_weight,
        )
    return grad_hidden, grad_weight


def linear_logprob_row_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_grad: RowGrad,
    *,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    need_grads: bool,
    need_grad_weight: bool,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs and, in the same pass, the gradients of a per-token loss.

    `row_grad(rows, logp[rows])` returns dLoss/dlogp for those rows (ignored rows are zeroed
    here). Returns (logp [N], entropy [N] or [0], dHidden [N, H] fp32 or None, dWeight [V, H]
    fp32 or None).
    """
    n, v = hidden.shape[0], weight.shape[0]
    chunk_rows, chunk_vocab = chunk_sizes(n, v, chunk_rows, chunk_vocab)
    inv_t = 1.0 / temperature
    acc = accumulation_dtype(hidden.dtype)
    w32 = weight.to(acc)
    logp = hidden.new_empty(n, dtype=acc)
    entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)
    grad_hidden = hidden.new_empty(hidden.shape, dtype=acc) if need_grads else None
    grad_weight = None
    if need_grads and need_grad_weight:
        grad_weight = torch.zeros(v, hidden.shape[1], dtype=acc, device=hidden.device)
    single_tile = chunk_vocab >= v
    for r0 in range(0, n, chunk_rows):
        rows = slice(r0, min(r0 + chunk_rows, n))
        t = targets[rows]
        x32 = hidden[rows].to(acc)
        if single_tile:
            ((_, e),) = _logit_tiles(x32, w32, inv_t, chunk_vocab)
            lse, target_z, mean_z, sum_exp = _exp_tile_(e, t, with_entropy)
        else:
            lse, target_z, mean_z = _block_stats(x32, w32, t, inv_t, chunk_vocab, with_entropy)
        valid = t != ignore_index
        logp[rows] = torch.where(valid, target_z - lse, 0.0)
        if with_entropy:
            entropy[rows] = torch.where(valid, lse - mean_z, 0.0)
        if not need_grads:
            continue
        g = torch.where(valid, row_grad(rows, logp[rows]).to(acc), 0.0)
        if not single_tile:
            grad_hidden[rows] = _block_grads(
                x32, w32, t, lse, g, None, None, inv_t, chunk_vocab, grad_weight
            )
            continue
        # dz = inv_t * g * (onehot - e / sum_exp), formed in place in the exp tile.
        e.mul_((-g * inv_t / sum_exp).unsqueeze(1))
        e.scatter_add_(1, t.clamp(min=0).unsqueeze(1), (g * inv_t).unsqueeze(1))
        grad_hidden[rows] = e @ w32
        if grad_weight is not None:
            grad_weight.addmm_(e.T, x32)
    return logp, entropy, grad_hidden, grad_weight


def grpo_forward(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logp: torch.Tensor | None,
    sampler_logp: torch.Tensor | None,
    *,
    beta: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    tis_cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token GRPO over [N] tensors with its gradient written out (no autograd).

    Returns (loss [] fp32, dLoss/dlogp [N] fp32, metric sums [NUM_METRIC_SUMS] fp32) where the
    metric sums are those the Triton kernel reduces; `grpo_loss.finalize_metrics` turns them into
    averages. `old_logp=None` takes pi_old to be the current policy: old = logp (no autograd
    here, so it is the detached value), the ratio is exactly 1 and dratio/dlogp = 1.
    """
    n = logp.shape[0]
    logp = logp.float()
    old_logp = logp if old_logp is None else old_logp.float()
    adv = advantages.float()
    w = weights.float()
    ratio = torch.exp(logp - old_logp)
    low, high = 1.0 - clip_low, 1.0 + clip_high
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(low, high)
    # A NaN advantage or old log-prob poisons the gradient too, not only the loss.
    take_unclipped = (unclipped >= clipped) | unclipped.isnan()
    pg = torch.where(take_unclipped, unclipped, clipped)
    dpg = torch.where(take_unclipped, unclipped, 0.0)
    dual_active = torch.zeros_like(take_unclipped)
    if dual_clip is not None:
        dual_active = (adv < 0) & (pg > -adv * dual_clip)
        pg = torch.where(dual_active, -adv * dual_clip, pg)
        dpg = torch.where(dual_active, 0.0, dpg)
    tis_clipped = torch.zeros_like(take_unclipped)
    gap = torch.zeros_like(logp)
    tis = torch.ones_like(logp)
    if sampler_logp is not None:
        gap = (old_logp - sampler_logp.float()).abs()
        tis = torch.exp(old_logp - sampler_logp.float())
        if tis_cap is not None:
            tis_clipped = tis > tis_cap
            tis = tis.clamp(max=tis_cap)
        pg, dpg = pg * tis, dpg * tis
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        delta = ref_logp.float() - logp
        kl = torch.exp(delta) - delta - 1.0
        if beta != 0.0:
            pg = pg + beta * kl
            dpg = dpg + beta * (1.0 - torch.exp(delta))
    # Tokens of weight 0 are dropped with `where`, not multiplied by 0: their log-probs may be
    # padding (an old_logp of -inf would make 0 * inf = nan).
    counted = w != 0
    loss = torch.where(counted, w * pg, 0.0).sum()
    cnt = counted.float()
    masked_ratio = torch.where(counted, ratio, -math.inf)
    ratio_max = masked_ratio.amax() if n else ratio.new_tensor(-math.inf)
    sums = torch.stack(
        [
            (cnt * ((adv < 0) & (ratio < low))).sum(),
            (cnt * ((adv > 0) & (ratio > high))).sum(),
            (cnt * dual_active).sum(),
            (cnt * tis_clipped).sum(),
            torch.where(counted, kl, 0.0).sum(),
            torch.where(counted, ratio, 0.0).sum(),
            ratio_max,
            cnt.sum(),
            torch.where(counted, gap, 0.0).sum(),
            torch.where(counted, tis, 0.0).sum(),
            torch.where(counted, tis * tis, 0.0).sum(),
        ]
    )
    return loss, torch.where(counted, w * dpg, 0.0), sums
