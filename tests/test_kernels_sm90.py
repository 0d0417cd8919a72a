"""The kernels build for a Hopper GPU at their committed CUDA tile shapes, fit its shared memory,
put 16-bit matrix work on its warpgroup MMA and add gradients with vector reductions (and the
GRPO loss kernel and the stored-logits row passes build too), checked on a machine without one:
bench/gpu/compile_check.py compiles the real kernels for sm_90 through Triton's ahead-of-time
path (ptxas included) in a subprocess, since this process runs Triton's interpreter, which
compiles nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton carries no ptxas to build for sm_90")
def test_committed_tiles_build_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu" / "compile_check.py")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    built = {(r["kernel"], r["dtype"]) for r in reports}
    assert built == {
        *((kernel, dtype) for kernel in ("forward", "backward", "dlogits")
          for dtype in ("bfloat16", "float32")),
        ("grpo_loss", "float32"),
        ("row_stats", "float32"),
        ("row_dlogits", "bfloat16"),
    }, run.stderr[-2000:]  # fmt: skip
    for r in reports:
        assert "error" not in r, r
        assert r["shared_bytes"] <= 232_448, r
        matrix_work = r["kernel"] in ("forward", "backward", "dlogits")
        if matrix_work and r["dtype"] == "bfloat16":  # on Hopper's warpgroup MMA, not the old path
            assert r["hgmma"] > 0 and r["hmma"] == 0, r
        if not matrix_work:  # the row passes: a few registers a thread, none spilled
            assert r["stack_bytes"] == 0, r
        if r["kernel"] == "backward":  # dX and dW added 16 bytes at a time
            assert r["vector_reductions"] > 0 and r["scalar_reductions"] == 0, r
    assert run.returncode == 0, run.stderr[-2000:]
