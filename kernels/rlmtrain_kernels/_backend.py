"""Which implementation runs an op: the Triton kernels or the chunked torch backend.

The kernels package is embedded by other trainers, so it probes its own backends here instead of
importing the trainer's device module, and imports triton only here: without it the package still
imports and the torch backend runs. Triton is usable when it imports and either the tensors
live on a CUDA device or `TRITON_INTERPRET=1` was set before triton was imported (the interpreter
runs the real kernels on CPU tensors, which is how the tests exercise them without a GPU).

`impl="auto"` takes Triton for CUDA tensors and torch otherwise, and says so once in the log;
an explicit `impl="triton"` that cannot run raises `KernelBackendUnavailable` naming the reason.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = [
    "HAS_TRITON",
    "IMPLS",
    "KernelBackendUnavailable",
    "resolve_impl",
    "tl",
    "triton",
    "triton_interpreting",
]

log = logging.getLogger("rlmtrain_kernels")

IMPLS = ("auto", "triton", "torch")


class _TritonMissing:
    """Stands in for the triton module where it is not installed (CPU-only torch, macOS), so that
    the kernel modules import and the torch backend runs; `resolve_impl` refuses impl="triton"
    before any kernel could be launched."""

    @staticmethod
    def jit(fn):
        return fn

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)


try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton, tl = _TritonMissing(), None
    HAS_TRITON = False


class KernelBackendUnavailable(RuntimeError):
    """An explicitly requested kernel implementation cannot run on these tensors."""


def triton_interpreting() -> bool:
    """True when Triton executes kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unusable_reason(device: torch.device) -> str | None:
    """Why impl="triton" cannot run on `device`; None where it can."""
    if not HAS_TRITON:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cuda" or (device.type == "cpu" and triton_interpreting()):
        return None
    if device.type == "cpu":
        return (
            "the tensors are on the CPU and TRITON_INTERPRET=1 is not set "
            "(set it before triton is imported to run the kernels in the interpreter)"
        )
    return f"Triton kernels here support CUDA tensors only, got device {device}"


_logged: set[str] = set()


def resolve_impl(impl: str, device: torch.device, op: str) -> str:
    """Map `impl` ("auto" | "triton" | "torch") to the backend that runs `op` on `device`."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch"
    reason = triton_unusable_reason(device)
    if impl == "triton":
        if reason is not None:
            raise KernelBackendUnavailable(f"{op}: impl='triton' cannot run: {reason}")
        return "triton"
    if device.type == "cuda" and reason is None:
        return "triton"
    key = f"{op}:{device.type}"
    # Logging inside a torch.compile trace would break the graph; eager calls log it first.
    if key not in _logged and not torch.compiler.is_compiling():
        _logged.add(key)
        log.info("%s: impl='auto' uses the chunked torch backend on %s tensors", op, device.type)
    return "torch"
