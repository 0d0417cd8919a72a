"""The kernels are one package however they are reached, and they install without the trainer.

`rlmtrain.kernels` re-exports the ops of `rlmtrain_kernels` (the same objects: registering the
custom ops twice would make torch free the first registration while callers still dispatch
through it). From the repository root a top-level `kernels` is only the source folder, which
must not shadow Hugging Face's `kernels` hub package that `transformers` probes for.

The standalone test builds the `kernels/` distribution and installs it into a fresh venv that
sees torch but not the trainer, then runs the README's "use the fused loss in your trainer"
example there.
"""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ONE_COPY = """
import sys, torch
import rlmtrain.kernels as trainer_side
import rlmtrain_kernels
assert trainer_side.fused_linear_grpo_loss is rlmtrain_kernels.fused_linear_grpo_loss
import transformers.modeling_utils  # probes for the `kernels` hub package
assert not hasattr(sys.modules.get("kernels"), "fused_linear_grpo_loss")
h, w = torch.randn(5, 8), torch.randn(50, 8)
t, z = torch.randint(0, 50, (5,)), torch.zeros(5)
ones = torch.ones(5)
loss, _ = trainer_side.fused_linear_grpo_loss(h, w, t, z, ones, ones, impl="torch")
assert torch.isfinite(loss)
print("one copy")
"""


def test_the_trainer_and_the_kernels_share_one_copy_of_the_ops():
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, "-c", ONE_COPY], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "one copy" in result.stdout


def test_one_distribution_owns_the_kernels_and_the_trainer_depends_on_it():
    trainer = tomllib.loads((ROOT / "pyproject.toml").read_text())
    kernels = tomllib.loads((ROOT / "kernels" / "pyproject.toml").read_text())
    assert kernels["tool"]["setuptools"]["packages"] == ["rlmtrain_kernels"]
    setuptools = trainer["tool"]["setuptools"]
    assert "rlmtrain_kernels" not in setuptools["packages"]
    assert "rlmtrain_kernels" not in setuptools.get("package-dir", {})
    pinned = f"{kernels['project']['name']}=={kernels['project']['version']}"
    assert pinned in trainer["project"]["dependencies"]
    # As installed: the trainer's metadata requires the kernels' distribution, which is there.
    assert pinned in importlib.metadata.requires("rlmtrain")
    assert importlib.metadata.version("rlmtrain-kernels") == kernels["project"]["version"]


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Use the fused loss in your trainer", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)\n```", section, flags=re.S)
    return example


@pytest.mark.slow
def test_the_kernels_install_alone_and_run_the_readme_example(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # torch from this interpreter's site-packages, read as a plain path: its .pth files (the
    # trainer's editable install among them) are not processed there, so the trainer stays out.
    site = next(Path(p) for p in env_dir.glob("lib/python*/site-packages"))
    (site / "torch-from-host.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Built from a copy: pip builds in the source folder, and a test writes nothing into the tree.
    source = tmp_path / "kernels"
    shutil.copytree(ROOT / "kernels", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-cache-dir", str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    script = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('rlmtrain') is None, 'the trainer is importable'\n"
        + _readme_example()
        + "\nprint('example ran', float(loss))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [python, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "example ran" in run.stdout
