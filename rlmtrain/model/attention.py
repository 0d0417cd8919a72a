"""Causal attention over packed sequences; the one place the backend is chosen.

A packed batch is `q[T, Hq, D]`, `k, v[T, Hkv, D]` with `cu_seqlens[B+1]` marking where each
sequence starts: no padding and no batch dimension, and a token attends only to earlier tokens of
its own sequence. Grouped-query attention (Hq a multiple of Hkv) is handled by every backend.

Backends:
- "flash": flash-attn's `flash_attn_varlen_func`, CUDA only.
- "flex": torch `flex_attention` with a document-causal `BlockMask` built once per batch from
  cu_seqlens. Compiled on CUDA. On CPU it runs uncompiled, by measurement on torch 2.13: it has
  no CPU backward at all, compiled or not (asking it for gradients raises); compiled forward is
  fast (T=2048: 0.17 s against 0.66 s for sdpa) but its first compile takes 3-20 s and the
  dynamic-shape recompile that the next packed length triggers fails in inductor's C++ codegen.
  Uncompiled it materialises the scores and is slower than sdpa, so CPU flex is a correct
  inference path, not the default.
- "sdpa": `scaled_dot_product_attention(is_causal=True)` per sequence. No masked-out work and
  no compiler, so it is the CPU default and the reference the others are tested against.

"auto" takes flash when installed (and activations are fp16/bf16, all it supports), else flex on
CUDA, else sdpa, logging the fallback once.
An explicit request for a backend that cannot run raises `BackendUnavailable`.
"""

from __future__ import annotations

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
    cu_seqlens: Tensor  # [B+1] int32, on the tokens' device
    bounds: tuple[int, ...]  # cu_seqlens as Python ints (sdpa slices by them)
    max_seqlen: int
    block_mask: BlockMask | None = None  # flex only

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.backend == "flash":
            return _flash(q, k, v, self)
        if self.backend == "flex":
            return _flex(q, k, v, self)
        return _sdpa_per_sequence(q, k, v, self.bounds)


def plan_attention(
    requested: str, cu_seqlens: Tensor, num_tokens: int, dtype: torch.dtype
) -> PackedAttention:
    """Check `cu_seqlens[B+1]` against `num_tokens` and prepare the metadata of the backend
    chosen for `requested`, the tokens' device and the activation `dtype`."""
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
    block_mask = _document_block_mask(cu32, num_tokens) if backend == "flex" else None
    return PackedAttention(backend, cu32, bounds, max(lengths), block_mask)


def _sdpa_per_sequence(q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...]) -> Tensor:
    out = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        # [1, H, L, D]: without the batch dim torch's CPU dispatch falls back to the math kernel,
        # which materialises the L x L scores (9x slower fwd+bwd at L = 8192, measured).
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0])
    return torch.cat(out, dim=1).transpose(0, 1)


def _flash(q: Tensor, k: Tensor, v: Tensor, plan: PackedAttention) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    cu, m = plan.cu_seqlens, plan.max_seqlen
    return flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)


def _document_block_mask(cu_seqlens: Tensor, num_tokens: int):
    from torch.nn.attention.flex_attention import create_block_mask

    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=torch.int32)
    document = torch.searchsorted(cu_seqlens[1:], positions, right=True)

    def document_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(
        document_causal, None, None, num_tokens, num_tokens, device=cu_seqlens.device
    )


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
