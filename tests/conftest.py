"""Fixtures shared by the test modules (the repository's conftest.py sets the session up)."""

from pathlib import Path

import pytest
from memorised_run import memorise, synth_two_tasks
from smollm2 import shared_smollm2


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, worker_id) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, fp32, imported once per test run."""
    return shared_smollm2(tmp_path_factory, worker_id)


@pytest.fixture(scope="module")
def two_tasks(tmp_path_factory) -> Path:
    """One synthetic paper group's tasks (two questions over two papers) and their corpus."""
    return synth_two_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def memorised(tmp_path_factory, two_tasks) -> tuple[str, ...]:
    """The arguments that start a run from the tiny model that learned the two tasks by heart
    (`memorised_run.memorise`), made once per module that asks."""
    return memorise(tmp_path_factory.mktemp("memorised"), two_tasks)
