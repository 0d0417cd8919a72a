"""Shared pytest setup for tests/ and bench/.

Triton runs in its interpreter on CPU-only machines; `gpu` tests skip there. Spread over
workers (pytest-xdist), the modules with slow tests start first.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported: it selects the interpreter at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _slow_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _slow_modules_first(items) -> None:
    """Under pytest-xdist, the modules holding `slow` tests go first (each stays whole on one
    worker with `--dist loadfile`): started last, one of them would keep its worker busy long
    after the others ran out of work."""
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture
def uninitialised_is_nan():
    """Memory from torch.empty reads as NaN (ints as their largest value) for the test: a
    result that depends on a buffer nothing wrote shows it, whatever the allocator hands out.
    Deterministic mode does this; it only warns of the nondeterministic ops it meets."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
