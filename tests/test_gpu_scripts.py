"""The GPU measurements of the whole loop (`bench/gpu/loop.sh`) run here in their CPU modes, at
the tiny shape, each in a subprocess as the device call runs it, and print their figures: GPU
runs are rare and short, so a script that rotted between them would cost one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # about 40 s in all


def run_script(name: str, *arguments: str, tmp_path: Path) -> dict:
    """The script's summary, from its last line (JSON) and from the file --out wrote. One
    thread: beside the other pytest worker on two cores, OpenMP's spinning threads took 7x."""
    out = tmp_path / f"{name}.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu" / f"{name}.py"), *arguments, "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    printed = json.loads(run.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    return printed


def test_rl_step_times_each_phase_of_the_trainers_step(tmp_path):
    arguments = ("--device", "cpu", "--preset", "tiny", "--steps", "2", "--tasks", "1")
    summary = run_script("rl_step", *arguments, tmp_path=tmp_path)
    assert summary["exit_code"] == 0 and summary["steps_done"] == 2
    assert summary["timed_steps"] == [1]  # step 0 is the warm-up
    for key in ("rollout_s", "train_s", "sync_s", "step_s", "engine_tokens_per_s", "peak_rss_gib"):
        assert summary[key] > 0, key
    assert summary["step_s"] >= summary["rollout_s"] + summary["train_s"] + summary["sync_s"]
    assert summary["generated_tokens"] > 0 and summary["tokens"] > summary["generated_tokens"]
    assert summary["logged_turns"] == 2 * 1 * 2 * 2  # steps x tasks x samples x turns


def test_sync_buckets_moves_every_weight_at_each_bucket_size(tmp_path):
    arguments = ("--device", "cpu", "--preset", "tiny", "--bucket-mb", "1", "64", "--repeats", "1")
    summary = run_script("sync_buckets", *arguments, tmp_path=tmp_path)
    small, large = summary["results"]
    assert small["bucket_mb"] == 1 and large["bucket_mb"] == 64
    assert small["buckets"] > large["buckets"] == 1  # the tiny model's 6.5 MB fit one 64 MiB
    for result in summary["results"]:
        assert result["seconds"] > result["far_side_s"] > 0 and result["gb_per_s"] > 0


@pytest.mark.parametrize(
    "options",
    [(), ("--optimizer-offload", "--compile-layers")],
    ids=["adamw", "offload-compiled"],
)
def test_memory_budget_measures_a_grpo_step(tmp_path, options):
    arguments = ("--device", "cpu", "--preset", "tiny", *options)
    arguments += ("--micro-batch-tokens", "512", "--sample-tokens", "128")
    summary = run_script("memory_budget", *arguments, tmp_path=tmp_path)
    assert summary["optimizer_offload"] is summary["compile_layers"] is bool(options)
    assert summary["step_s"] > 0 and summary["tflops"] > 0 and summary["mfu_datasheet"] > 0
    assert summary["out_of_memory_in"] is None
    assert summary["micro_batches"] == 2 and summary["tokens"] == 1024
    assert summary["peak_rss_gib"] > 0


def test_train_step_times_eager_and_compiled_layers_and_profiles_them(tmp_path):
    arguments = ("--device", "cpu", "--preset", "tiny", "--samples", "4", "--sample-tokens", "96")
    arguments += ("--micro-batch-tokens", "256", "--steps", "1", "--layers", "eager", "compiled")
    summary = run_script("train_step", *arguments, "--profile", tmp_path=tmp_path)
    eager, compiled = summary["results"]
    assert (eager["layers"], compiled["layers"]) == ("eager", "compiled")
    for result in (eager, compiled):
        assert result["tokens"] == 4 * 96 and result["step_s"] > 0 and result["tflops"] > 0
        profile = result["profile"]
        assert profile["by_kind_ms"]["matmul"] > 0 and profile["longest"]
        assert 0 < profile["kernels_ms"] <= profile["span_ms"]
    # The compiled regions ran under FSDP2, as the trainer runs them.
    assert compiled["profile"]["by_kind_ms"].get("compiled elementwise", 0) > 0
    assert "compiled elementwise" not in eager["profile"]["by_kind_ms"]
