"""Fixtures shared by the test modules (the repository's conftest.py sets the session up)."""

from pathlib import Path

import pytest
from smollm2 import shared_smollm2


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, worker_id) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, fp32, imported once per test run."""
    return shared_smollm2(tmp_path_factory, worker_id)
