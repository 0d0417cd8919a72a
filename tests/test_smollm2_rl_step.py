"""One RL step of a real pretrained model: SmolLM2-135M-Instruct, imported from its GGUF file,
trained by `rlmtrain train` as a user runs it (in bf16 compute, the dtype its CPU config uses):
one SFT step on the evidence teacher's trees, a rollout of 1 task x 2 roots through the native
engine, a GRPO update and the weight sync that follows it.

The run must finish with finite losses, the step must train on its group (kept when both roots
miss the answer, then moved by the heuristic step rubrics alone) and update the policy, and the
engine must end holding the trained weights: what it serves equals the run's final export cast
to its dtype, and differs from the imported model in most tensors (`engine_watch_train.py`
writes the engine's weights when the run closes it).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clocks import RUN_HANG_S
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_rl_step_from_smollm2(smollm2_dir, tmp_path):
    run_dir, served = tmp_path / "run", tmp_path / "engine.safetensors"
    overrides = {
        "model.hf_dir": str(smollm2_dir),
        "model.tokenizer": "",  # the folder's own
        "model.dtype": "bfloat16",
        "checkpoint.dir": str(run_dir),
        "data.sft_groups": 1,
        "data.synth_groups": 1,
        "data.synth_max_papers": 2,
        "train.sft_steps": 1,
        "train.sft_lr": 1e-5,
        "train.steps": 1,
        "train.tasks_per_step": 1,
        # Large enough that Adam's first step moves weights past bf16's rounding.
        "train.lr": 1e-3,
        "rollout.n_samples": 2,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens": 128,  # the teacher's turns run under the same limit
        # Both roots of a zero-shot model may well miss the answer: the group is then kept and
        # trained on the heuristic step rubrics alone, which tell its turns apart.
        "algo.drop_uniform_groups": "false",
        "algo.step_rewards": "heuristic",
        "eval.every": 0,
        "logging.progress": "false",
    }
    command = [sys.executable, str(ROOT / "tests" / "engine_watch_train.py")]
    command += ["--config", "configs/tiny-cpu.toml"]
    command += [f"--{key}={value}" for key, value in overrides.items()]
    env = {**os.environ, "RLMTRAIN_TEST_ENGINE_WEIGHTS": str(served)}
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_HANG_S
    )
    assert result.returncode == 0, result.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft, rl = ([r for r in rows if r["phase"] == phase] for phase in ("sft", "rl"))
    assert len(sft) == 1 and len(rl) == 1
    assert math.isfinite(sft[0]["loss"]) and sft[0]["tokens"] > 0
    step = rl[0]
    assert sum(step["finish_reasons"].values()) >= 2 and step["generated_tokens"] > 0
    assert step["groups_kept"] == 1, step
    assert math.isfinite(step["loss"]) and step["tokens"] > 0 and "sync_s" in step

    engine = load_file(served)
    final = load_file(run_dir / "final" / "model.safetensors")
    imported = load_file(smollm2_dir / "model.safetensors")
    assert engine.keys() == final.keys() == imported.keys()
    for name, tensor in engine.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, final[name].to(torch.bfloat16)), name
    moved = [name for name in engine if not torch.equal(engine[name], imported[name].bfloat16())]
    assert len(moved) > 0.9 * len(engine), f"{len(moved)} of {len(engine)} tensors moved"
