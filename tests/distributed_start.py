"""A run's policy started from a saved checkpoint on however many ranks this process is one of,
with the memory it took: each rank prints nothing, rank 0 prints one JSON line with every
rank's resident-memory peak above its baseline and the bytes of its own fp32 shards.

    torchrun --nproc_per_node 2 tests/distributed_start.py CHECKPOINT_DIR

`tests/test_distributed.py` writes a Qwen3-0.6B-shaped checkpoint and runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource

import torch

from rlmtrain import parallel
from rlmtrain.config import Config, ModelConfig
from rlmtrain.optim import build_optimizer
from rlmtrain.training.materialise import sharded_policy


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    args = parser.parse_args()
    world, device = parallel.start("cpu")
    try:
        cfg = Config(model=ModelConfig(hf_dir=args.checkpoint, tokenizer=""))
        parallel.barrier()
        baseline = resident_bytes()
        model = sharded_policy(cfg.model, device, torch.float32)
        build_optimizer(model, cfg)
        peak = peak_resident_bytes() - baseline
        shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
        whole_bytes = sum(p.numel() * 4 for p in model.parameters())
        rows = parallel.all_gather({"rank": world.rank, "peak": peak, "shard": shard_bytes})
        if world.is_main:
            print(json.dumps({"whole_fp32_bytes": whole_bytes, "ranks": rows}))
    finally:
        parallel.stop()


if __name__ == "__main__":
    main()
