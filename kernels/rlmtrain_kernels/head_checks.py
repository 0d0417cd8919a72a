"""Argument checks the linear-head ops share: one clear error naming the bad input, before any
kernel sees it."""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "check_backend_dtype", "check_linear_inputs"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_linear_inputs(
    op: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"{op}: hidden must be [N, H], got shape {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"{op}: weight must be [V, H={hidden.shape[1]}], got shape {list(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"{op}: weight has no rows: a vocabulary of 0 tokens has no log-probs")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"{op}: targets must be [N={hidden.shape[0]}], got {list(targets.shape)}")
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(
            f"{op}: hidden and weight must share one of {FLOAT_DTYPES}, "
            f"got {hidden.dtype} and {weight.dtype}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: targets must be int32 or int64, got {targets.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"{op}: hidden, weight, targets on different devices: "
            f"{hidden.device}, {weight.device}, {targets.device}"
        )
    if not temperature > 0.0:
        raise ValueError(f"{op}: temperature must be > 0, got {temperature}")


def check_backend_dtype(op: str, backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == torch.float64:
        raise ValueError(
            f"{op}: float64 inputs run on impl='torch' only (they exist for gradcheck)"
        )
