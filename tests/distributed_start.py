"""A run's policy started from a saved checkpoint on however many ranks this process is one of,
then exported, with the memory each took: rank 0 prints one JSON line with every rank's
resident-memory peak above its baseline after the start and after the export, the bytes of its
own fp32 shards and of the largest whole parameter.

    torchrun --nproc_per_node 2 tests/distributed_start.py CHECKPOINT_DIR EXPORT_DIR

`tests/test_distributed.py` writes a Qwen3-0.6B-shaped checkpoint and runs it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlmtrain import parallel
from rlmtrain.config import Config, ModelConfig
from rlmtrain.memory import peak_resident_bytes, resident_bytes
from rlmtrain.model.tokenizer import load_tokenizer
from rlmtrain.optim import build_optimizer
from rlmtrain.training.materialise import sharded_policy
from rlmtrain.training.run import export


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("export")
    args = parser.parse_args()
    world, device = parallel.start("cpu")
    try:
        model_cfg = ModelConfig(hf_dir=args.checkpoint, tokenizer="", dtype="bfloat16")
        cfg = Config(model=model_cfg)
        parallel.barrier()
        baseline = resident_bytes()
        model = sharded_policy(cfg.model, device, torch.bfloat16)
        build_optimizer(model, cfg, "sft")
        started = peak_resident_bytes() - baseline
        export(model, cfg, load_tokenizer("byte"), None, Path(args.export))
        exported = peak_resident_bytes() - baseline
        shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
        whole_bytes = sum(p.numel() * 4 for p in model.parameters())
        largest = max(p.numel() * 4 for p in model.parameters())
        rows = parallel.all_gather(
            {"rank": world.rank, "start": started, "export": exported, "shard": shard_bytes}
        )
        if world.is_main:
            print(json.dumps({"whole_fp32_bytes": whole_bytes, "largest": largest, "ranks": rows}))
    finally:
        parallel.stop()


if __name__ == "__main__":
    main()
