"""One rank's GRPO train step on a Qwen3-shaped model with random weights: tokens per second and
model FLOP utilisation against the datasheet's dense bf16 rate.

The trainer's own step (`training.steps.grpo_step`: FSDP2 over the one rank, bf16 compute with fp32
master weights, the fused GRPO loss, AdamW) runs on a fixed batch of random samples, half prompt
and half completion; one warm-up step, then `--steps` timed ones. The FLOPs counted are the
model's useful ones, 3 x the forward: the weight matrices over every token, causal attention over
each sequence, and the LM head over the completion tokens only (the rows the loss trains; the
others never reach the head).

Run: `python3 bench/gpu/train_step.py [--preset qwen3-0.6b] [--samples 64] [--device cuda]`.
On a CPU, `--preset tiny --device cpu` checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import numpy as np
import torch

from rlmtrain import parallel
from rlmtrain.algo import Sample, pack
from rlmtrain.config import Config, ModelConfig
from rlmtrain.model import build_model, preset
from rlmtrain.optim import build_optimizer
from rlmtrain.training.steps import grpo_step

DATASHEET_BF16_DENSE_FLOPS = 989.4e12  # H100/H200 SXM


def random_batch(samples: int, vocab: int, seed: int = 0) -> list[Sample]:
    """Samples of 1024-3071 tokens, the first half prompt, with random advantages."""
    return random_samples(samples, vocab, np.random.default_rng(seed))


def random_samples(
    count: int, vocab: int, draw: np.random.Generator, length: int | None = None
) -> list[Sample]:
    """`count` samples of `length` tokens (None: 1024-3071 each), the first half prompt: random
    tokens and advantages, the weights one objective over the batch."""
    batch = []
    for i in range(count):
        tokens = length or int(draw.integers(1024, 3072))
        prompt = tokens // 2
        completion = tokens - prompt
        batch.append(
            Sample(
                task_id=f"t{i // 8}", root_id=f"r{i}", trajectory_id=f"r{i}", depth=0, turn=0,
                input_ids=draw.integers(0, vocab, tokens).astype(np.int64), prompt_len=prompt,
                sampler_logp=np.full(completion, -7.0, np.float32),
                advantages=draw.standard_normal(completion).astype(np.float32),
                weights=np.full(completion, 1.0 / (count * completion), np.float32),
            )
        )  # fmt: skip
    return batch


def useful_flops(args, batch: list[Sample]) -> float:
    """3 x the forward's FLOPs: matrices x tokens, causal attention, the head over completions."""
    attn = args.hidden_size * args.head_dim * (2 * args.num_heads + 2 * args.num_kv_heads)
    mlp = 3 * args.hidden_size * args.intermediate_size
    tokens = sum(len(s.input_ids) for s in batch)
    completions = sum(len(s.input_ids) - s.prompt_len for s in batch)
    pairs = sum(len(s.input_ids) * (len(s.input_ids) + 1) // 2 for s in batch)
    forward = (
        2 * args.num_layers * (attn + mlp) * tokens
        + 4 * args.num_layers * args.num_heads * args.head_dim * pairs
        + 2 * args.hidden_size * args.vocab_size * completions
    )
    return 3.0 * forward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    world, device = parallel.start(options.device)
    try:
        cfg = Config()
        cfg = msgspec.structs.replace(
            cfg,
            model=ModelConfig(preset=options.preset),
            algo=msgspec.structs.replace(
                cfg.algo, micro_batch_tokens=options.micro_batch_tokens, tis_cap=0.0
            ),
        )
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = parallel.shard(build_model(cfg.model), device, dtype)
        optimizer = build_optimizer(model, cfg, "rl")
        vocab = preset(options.preset).vocab_size
        batch = random_batch(options.samples, vocab)
        packed = pack(batch, cfg.algo.micro_batch_tokens, world_size=world.size)

        def synchronize() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()

        grpo_step(model, optimizer, packed, cfg, device, rank=world.rank)
        synchronize()
        began = time.perf_counter()
        for _ in range(options.steps):
            grpo_step(model, optimizer, packed, cfg, device, rank=world.rank)
        synchronize()
        seconds = (time.perf_counter() - began) / options.steps
        flops = useful_flops(preset(options.preset), batch) / seconds
        result = {
            "preset": options.preset,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "tokens": packed.stats.tokens,
            "step_s": seconds,
            "tokens_per_s": packed.stats.tokens / seconds,
            "tflops": flops / 1e12,
            "mfu_datasheet": flops / DATASHEET_BF16_DENSE_FLOPS,
        }
        if device.type == "cuda":
            result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(json.dumps(result))
    finally:
        parallel.stop()


if __name__ == "__main__":
    main()
