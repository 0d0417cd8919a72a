"""Causal attention over packed sequences; the one place the backend is chosen.

A packed batch is `q[T, Hq, D]`, `k, v[T, Hkv, D]` with `cu_seqlens[R+1]` marking where each
row starts: no padding and no batch dimension, and a token attends only to earlier tokens of its
own row. Grouped-query attention (Hq a multiple of Hkv) is handled by every backend.

Shared prefixes: with `prefix_of[R]`, row r may continue row `prefix_of[r]` (-1: it continues
nothing). Its tokens then attend to the whole prefix row and causally to their own row, exactly
as if the prefix were copied in front of them; the prefix is laid out, projected and attended to
once for all its continuations, and its keys and values receive every continuation's gradient.
One level only: a prefix row continues nothing itself. Many per-turn samples of one batch begin
with the same system prompt, so this removes most of a training forward's tokens (packing.py).

Backends:
- "flash": flash-attn's `flash_attn_varlen_func`, CUDA only.
- "flex": torch `flex_attention` with a document-causal `BlockMask` built once per batch from
  cu_seqlens. Compiled on CUDA. On CPU it runs uncompiled, by measurement on torch 2.13: it has
  no CPU backward at all, compiled or not (asking it for gradients raises); compiled forward is
  fast (T=2048: 0.17 s against 0.66 s for sdpa) but its first compile takes 3-20 s and the
  dynamic-shape recompile that the next packed length triggers fails in inductor's C++ codegen.
  Uncompiled it materialises the scores and is slower than sdpa, so CPU flex is a correct
  inference path, not the default.
- "sdpa": `scaled_dot_product_attention` per row: `is_causal=True`, or for a continuation its
  prefix's keys and values in front of its own under a bottom-right-aligned causal mask (CPU
  SDPA takes a boolean mask without materialising scores in fp32: 1.5 ms against 4.6 ms for the
  copied-prefix row at 130 + 310 tokens, fwd+bwd, measured). No masked-out work and no
  compiler, so it is the CPU default and the reference the others are tested against.

"auto" takes flash when installed (and activations are fp16/bf16, all it supports), else flex on
CUDA, else sdpa, logging the fallback once.
An explicit request for a backend that cannot run raises `BackendUnavailable`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from rlmtrain import devices

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "AttentionChoice",
    "PackedAttention",
    "check_choice",
    "plan_attention",
    "resolve_backend",
]

AttentionChoice = Literal["auto", "flash", "flex", "sdpa"]
_CHOICES = ("auto", "flash", "flex", "sdpa")


def check_choice(requested: str) -> None:
    """Fail early, at model construction, on a bad name or on flash where it cannot exist."""
    if requested not in _CHOICES:
        raise ValueError(f"attention backend {requested!r} is not one of {', '.join(_CHOICES)}")
    if requested == "flash" and not devices.HAS_FLASH_ATTN:
        raise devices.BackendUnavailable(
            f"attention='flash' needs a CUDA device and the flash-attn package "
            f"(pip install flash-attn); here HAS_CUDA={devices.HAS_CUDA}, "
            f"HAS_FLASH_ATTN={devices.HAS_FLASH_ATTN}"
        )


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that will run for `requested` on `device` with activations in `dtype`:
    "flash", "flex" or "sdpa"."""
    check_choice(requested)
    on_cuda = device.type == "cuda"
    flash_dtype = dtype in (torch.float16, torch.bfloat16)
    if requested == "flash":
        if not (on_cuda and flash_dtype):
            raise devices.BackendUnavailable(
                f"attention='flash' runs on CUDA in fp16/bf16 only, got {device.type} {dtype}"
            )
        return "flash"
    if requested in ("flex", "sdpa"):
        return requested
    if on_cuda and devices.HAS_FLASH_ATTN and flash_dtype:
        return "flash"
    if on_cuda:
        why = "flash-attn not installed" if not devices.HAS_FLASH_ATTN else f"{dtype} activations"
        devices.log_fallback_once(
            f"attention-auto-flex-{why}", f"attention=auto: {why}, using flex_attention"
        )
        return "flex"
    devices.log_fallback_once(
        "attention-auto-sdpa",
        f"attention=auto on {device.type}: using per-sequence SDPA (flex_attention has no "
        f"backward on {device.type} in torch {torch.__version__})",
    )
    return "sdpa"


@dataclass(frozen=True)
class PackedAttention:
    """Attention for one packed batch, shared by all layers of a forward pass.

    Call it with `q[T, Hq, D]`, `k[T, Hkv, D]`, `v[T, Hkv, D]`; it returns `[T, Hq, D]`.
    """

    backend: str
    cu_seqlens: Tensor  # [R+1] int32, on the tokens' device
    bounds: tuple[int, ...]  # cu_seqlens as Python ints (sdpa slices by them)
    max_seqlen: int
    block_mask: BlockMask | None = None  # flex only
    prefixes: tuple[int, ...] | None = None  # prefix_of as Python ints; None: no row continues
    masks: tuple[Tensor | None, ...] = ()  # sdpa with prefixes: each continuation's key mask
    kv_index: Tensor | None = None  # flash with prefixes: each row's keys, prefix first
    cu_seqlens_k: Tensor | None = None  # flash with prefixes: rows of k[kv_index]
    max_seqlen_k: int = 0

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.backend == "flash":
            return _flash(q, k, v, self)
        if self.backend == "flex":
            return _flex(q, k, v, self)
        return _sdpa_per_row(q, k, v, self.bounds, self.prefixes, self.masks)


def plan_attention(
    requested: str,
    cu_seqlens: Tensor,
    num_tokens: int,
    dtype: torch.dtype,
    prefix_of: Tensor | None = None,
) -> PackedAttention:
    """Check `cu_seqlens[R+1]` (and `prefix_of[R]` when given) against `num_tokens` and prepare
    the metadata of the backend chosen for `requested`, the tokens' device and the activation
    `dtype`."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with B+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    bounds = tuple(cu_seqlens.tolist())
    if bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(
            f"cu_seqlens must run from 0 to T={num_tokens}, got {bounds[0]}..{bounds[-1]}"
        )
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if min(lengths) < 1:
        raise ValueError(
            f"cu_seqlens must be strictly increasing (no empty sequence), got {list(bounds)}"
        )
    backend = resolve_backend(requested, cu_seqlens.device, dtype)
    cu32 = cu_seqlens.to(torch.int32)
    prefixes = _check_prefixes(prefix_of, len(lengths))
    plan = PackedAttention(backend, cu32, bounds, max(lengths), prefixes=prefixes)
    if backend == "flex":
        parents = None if prefixes is None else prefix_of.to(cu32.device, torch.int32)
        plan = dataclasses.replace(plan, block_mask=_row_block_mask(cu32, num_tokens, parents))
    if backend == "sdpa" and prefixes is not None:
        plan = dataclasses.replace(plan, masks=_continuation_masks(bounds, prefixes, cu32.device))
    if backend == "flash" and prefixes is not None:
        kv_index, cu_k = _continuation_keys(bounds, prefixes, cu32.device)
        key_lengths = (cu_k[1:] - cu_k[:-1]).tolist()
        plan = dataclasses.replace(
            plan, kv_index=kv_index, cu_seqlens_k=cu_k, max_seqlen_k=max(key_lengths)
        )
    return plan


def _check_prefixes(prefix_of: Tensor | None, rows: int) -> tuple[int, ...] | None:
    """prefix_of as Python ints, or None when no row continues another."""
    if prefix_of is None:
        return None
    prefixes = tuple(prefix_of.tolist())
    if len(prefixes) != rows:
        raise ValueError(f"prefix_of must have one entry per row ({rows}), got {len(prefixes)}")
    for row, parent in enumerate(prefixes):
        if parent != -1 and not (0 <= parent < rows and parent != row and prefixes[parent] == -1):
            raise ValueError(
                f"prefix_of[{row}] = {parent}: a row continues -1 or another row that itself "
                f"continues nothing"
            )
    return prefixes if any(parent != -1 for parent in prefixes) else None


def _sdpa_per_row(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bounds: tuple[int, ...],
    prefixes: tuple[int, ...] | None,
    masks: tuple[Tensor | None, ...],
) -> Tensor:
    out = []
    for row, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        # [1, H, L, D]: without the batch dim torch's CPU dispatch falls back to the math kernel,
        # which materialises the L x L scores (9x slower fwd+bwd at L = 8192, measured).
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        parent = -1 if prefixes is None else prefixes[row]
        if parent == -1:
            out.append(
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0]
            )
            continue
        p_start, p_end = bounds[parent], bounds[parent + 1]
        ks, vs = (
            torch.cat((x[p_start:p_end].transpose(0, 1).unsqueeze(0), own), dim=2)
            for x, own in ((k, ks), (v, vs))
        )
        out.append(
            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=masks[row], enable_gqa=True)[0]
        )
    return torch.cat(out, dim=1).transpose(0, 1)


def _continuation_masks(
    bounds: tuple[int, ...], prefixes: tuple[int, ...], device: torch.device
) -> tuple[Tensor | None, ...]:
    """For sdpa, built once per batch for all layers: the keys [prefix; own] each query of a
    continuation sees (None for a row that continues nothing)."""
    masks: list[Tensor | None] = []
    for row, parent in enumerate(prefixes):
        if parent == -1:
            masks.append(None)
            continue
        shared, length = bounds[parent + 1] - bounds[parent], bounds[row + 1] - bounds[row]
        # Query i (at position shared + i) sees keys 0 .. shared + i: causal, bottom-right aligned.
        masks.append(
            torch.arange(shared + length, device=device)[None, :]
            <= torch.arange(length, device=device)[:, None] + shared
        )
    return tuple(masks)


def _continuation_keys(
    bounds: tuple[int, ...], prefixes: tuple[int, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    """For flash: the token index of every key each row sees (its prefix row's, then its own)
    and the cumulative key counts per row."""
    pieces, key_bounds = [], [0]
    for row, parent in enumerate(prefixes):
        own = torch.arange(bounds[row], bounds[row + 1])
        if parent != -1:
            own = torch.cat((torch.arange(bounds[parent], bounds[parent + 1]), own))
        pieces.append(own)
        key_bounds.append(key_bounds[-1] + own.numel())
    kv_index = torch.cat(pieces).to(device)
    return kv_index, torch.tensor(key_bounds, dtype=torch.int32, device=device)


def _flash(q: Tensor, k: Tensor, v: Tensor, plan: PackedAttention) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    cu, m = plan.cu_seqlens, plan.max_seqlen
    if plan.kv_index is None:
        return flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)
    # flash-attn >= 2.1 aligns the causal mask bottom-right when a row has more keys than
    # queries: query i of a continuation sees its whole prefix and its own keys up to i.
    return flash_attn_varlen_func(
        q,
        k[plan.kv_index],
        v[plan.kv_index],
        cu,
        plan.cu_seqlens_k,
        m,
        plan.max_seqlen_k,
        causal=True,
    )


def _row_block_mask(cu_seqlens: Tensor, num_tokens: int, parents: Tensor | None):
    from torch.nn.attention.flex_attention import create_block_mask

    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=torch.int32)
    row = torch.searchsorted(cu_seqlens[1:], positions, right=True)

    def row_causal(b, h, q_idx, kv_idx):
        return (row[q_idx] == row[kv_idx]) & (q_idx >= kv_idx)

    def row_causal_or_prefix(b, h, q_idx, kv_idx):
        return row_causal(b, h, q_idx, kv_idx) | (parents[row[q_idx]] == row[kv_idx])

    mask = row_causal if parents is None else row_causal_or_prefix
    return create_block_mask(mask, None, None, num_tokens, num_tokens, device=cu_seqlens.device)


def _flex(q: Tensor, k: Tensor, v: Tensor, plan: PackedAttention) -> Tensor:
    if (
        q.device.type != "cuda"
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        raise devices.BackendUnavailable(
            f"attention='flex' cannot train on {q.device.type}: torch {torch.__version__} has no "
            f"flex_attention backward there; use attention='sdpa' (or 'auto')"
        )
    qf, kf, vf = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D]
    out = _flex_kernel(q.device.type)(qf, kf, vf, block_mask=plan.block_mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


@functools.cache
def _flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        # Default dynamic-shape handling: packed lengths vary every step, so after the first
        # recompile torch marks T dynamic instead of compiling once per length.
        return torch.compile(flex_attention)

    def uncompiled(*args, **kwargs):
        # The unfused path is chosen on purpose (see the module notes); silence torch's advice.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return uncompiled
