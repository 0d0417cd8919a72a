"""The kernel package is one module however it is reached.

From the repository root `kernels/` is also importable as a top-level `kernels`, the import name
`transformers` probes for Hugging Face's kernel hub. A second copy would re-register the custom
ops, and torch frees the first registration when it replaces one, leaving `rlmtrain.kernels`
dispatching through freed memory. The check runs in a fresh interpreter from the root.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, torch
import rlmtrain.kernels as ours
from rlmtrain.kernels import fused_linear_grpo_loss
import kernels
assert kernels is ours, "a second copy of the kernel package was imported"
assert sys.modules["kernels"] is ours
import transformers.modeling_utils  # probes `import kernels`
h, w = torch.randn(5, 8), torch.randn(50, 8)
t, z = torch.randint(0, 50, (5,)), torch.zeros(5)
loss, _ = fused_linear_grpo_loss(h, w, t, z, torch.ones(5), torch.ones(5), impl="torch")
assert torch.isfinite(loss)
print("one copy")
"""


def test_top_level_import_aliases_the_installed_package():
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "one copy" in result.stdout
