"""Shared pytest setup for tests/ and bench/.

Triton runs in its interpreter on CPU-only machines; `gpu` tests skip there.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported: it selects the interpreter at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
