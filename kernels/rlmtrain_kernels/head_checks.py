"""Argument checks the linear-head ops share: one clear error naming the bad input, before any
kernel sees it."""

from __future__ import annotations

import numbers

import torch

__all__ = [
    "FLOAT_DTYPES", "check_backend_dtype", "check_linear_inputs", "check_real", "check_tensor",
]  # fmt: skip

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_LARGEST_INVERSE = torch.finfo(torch.float32).max
"""1 / temperature scales fp32 logits: a temperature whose inverse overflows fp32 (below about
3e-39) would turn every log-prob into NaN."""


def check_tensor(op: str, name: str, value: object) -> None:
    """A torch.Tensor, or a TypeError naming `name` (a numpy array or a list fails later in
    ways that do not: numpy's `.device` is the string 'cpu')."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{op}: {name} must be a torch.Tensor, got {type(value).__name__} "
            "(torch.as_tensor makes one)"
        )


def check_real(op: str, name: str, value: object) -> None:
    """A real number (a Python, numpy or 0-dim tensor one), or a TypeError naming `name`: a
    string (a YAML loader reads 1e-3 as one) or a bool is not an option's value."""
    if isinstance(value, (str, bytes, bool)) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{op}: {name} must be a real number, got {value!r}")


def check_linear_inputs(
    op: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
) -> None:
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        check_tensor(op, name, value)
    check_real(op, "temperature", temperature)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(
            f"{op}: ignore_index must be an int (keep -100 where no row is ignored), "
            f"got {ignore_index!r}"
        )
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
    # Written so that NaN fails it; infinity would make every log-prob -log V and train nothing.
    if not (0.0 < temperature < float("inf") and 1.0 / temperature <= _LARGEST_INVERSE):
        raise ValueError(
            f"{op}: temperature must be finite and > 0 (its inverse within fp32), got {temperature}"
        )


def check_backend_dtype(op: str, backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == torch.float64:
        raise ValueError(
            f"{op}: float64 inputs run on impl='torch' only (they exist for gradcheck)"
        )
