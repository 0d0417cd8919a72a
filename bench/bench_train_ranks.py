"""Train-step throughput of the tiny model at 1 and 2 CPU ranks (FSDP2 over gloo).

Each run is a subprocess (`python` alone, or torchrun with 2 ranks, one thread per rank, as on
this 2-core machine) that times the trainer's own GRPO step, `training.steps.grpo_step`, on a fixed
batch of 32 random samples of 256-767 tokens (about 16k tokens, micro-batches of 4096 tokens):
one warm-up step, then `STEPS` timed ones. Printed and stored in `extra_info`: tokens per second
of the whole batch (all ranks together) and the 2-rank speed-up.

    .venv/bin/python -m pytest bench/bench_train_ranks.py --benchmark-only -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5


def _batch(vocab: int):
    import numpy as np

    from rlmtrain.algo import Sample

    draw = np.random.default_rng(0)
    samples = []
    for i in range(32):
        length = int(draw.integers(256, 768))
        prompt = length // 2
        completion = length - prompt
        samples.append(
            Sample(
                task_id=f"t{i // 4}", root_id=f"r{i}", trajectory_id=f"r{i}", depth=0, turn=0,
                input_ids=draw.integers(0, vocab, length).astype(np.int64), prompt_len=prompt,
                sampler_logp=np.full(completion, -7.0, np.float32),
                advantages=draw.standard_normal(completion).astype(np.float32),
                weights=np.full(completion, 1.0 / (32 * completion), np.float32),
            )
        )  # fmt: skip
    return samples


def _worker() -> None:
    import msgspec
    import torch

    from rlmtrain import parallel
    from rlmtrain.algo import pack
    from rlmtrain.config import Config, ModelConfig
    from rlmtrain.model import build_model
    from rlmtrain.optim import build_optimizer
    from rlmtrain.training.steps import grpo_step

    world, device = parallel.start("cpu")
    try:
        cfg = Config()
        cfg = msgspec.structs.replace(
            cfg,
            model=ModelConfig(preset="tiny", vocab_size=2048),
            algo=msgspec.structs.replace(cfg.algo, micro_batch_tokens=4096, tis_cap=0.0),
            train=msgspec.structs.replace(cfg.train, sft_steps=0),
        )
        model = parallel.shard(build_model(cfg.model), device, torch.float32)
        optimizer = build_optimizer(model, cfg, "rl")
        packed = pack(_batch(2048), cfg.algo.micro_batch_tokens, world_size=world.size)
        grpo_step(model, optimizer, packed, cfg, device, rank=world.rank)
        parallel.barrier()
        began = time.perf_counter()
        for _ in range(STEPS):
            grpo_step(model, optimizer, packed, cfg, device, rank=world.rank)
        parallel.barrier()
        seconds = (time.perf_counter() - began) / STEPS
        if world.is_main:
            tokens = packed.stats.tokens
            print(
                json.dumps({"tokens": tokens, "step_s": seconds, "tokens_per_s": tokens / seconds})
            )
    finally:
        parallel.stop()


def _run(ranks: int) -> dict:
    head = [sys.executable]
    if ranks > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
    result = subprocess.run(
        [*head, __file__], cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_train_step_tokens_per_second_at_1_and_2_ranks(benchmark):
    figures: dict[int, dict] = {}

    def both() -> None:
        for ranks in (1, 2):
            figures[ranks] = _run(ranks)

    benchmark.pedantic(both, rounds=1, iterations=1)
    print("\ntrain step of the tiny model (GRPO, fused loss, FSDP2), whole batch")
    print("ranks  tokens  step s  tokens/s")
    for ranks, f in figures.items():
        print(f"{ranks:>5}  {f['tokens']:>6}  {f['step_s']:6.2f}  {f['tokens_per_s']:8.0f}")
    speedup = figures[2]["tokens_per_s"] / figures[1]["tokens_per_s"]
    print(f"2-rank speed-up {speedup:.2f}x (each rank has {max(1, (os.cpu_count() or 2) // 2)} "
          "thread(s) of this machine's cores)")  # fmt: skip
    benchmark.extra_info.update(
        {f"tokens_per_s_{r}_ranks": f["tokens_per_s"] for r, f in figures.items()}
    )
    benchmark.extra_info["speedup_2_ranks"] = speedup


if __name__ == "__main__":
    _worker()
