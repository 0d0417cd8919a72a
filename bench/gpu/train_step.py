"""One rank's GRPO train step on a Qwen3-shaped model with random weights: tokens per second and
model FLOP utilisation against the datasheet's dense bf16 rate.

The trainer's own step (`training.steps.grpo_step`: FSDP2 over the one rank, bf16 compute with fp32
master weights, the fused GRPO loss, AdamW) runs on a fixed batch of random samples, half prompt
and half completion; one warm-up step, then `--steps` timed ones. The FLOPs counted are the
model's useful ones, 3 x the forward: the weight matrices over every token, causal attention over
each sequence, and the LM head over the completion tokens only (the rows the loss trains; the
others never reach the head).

`--layers eager compiled` times the step once per way of running the decoder layers
(`model.compile_layers`), in one process, each on a model of its own; `--profile` then records
one more step of each and sums its kernels' time by kind (matrix products, attention, the loss
head's kernels, elementwise work eager or compiled, the optimizer, copies), the first place to
look for where a step's time goes, with the longest kernels by name.

Run: `python3 bench/gpu/train_step.py [--preset qwen3-0.6b] [--samples 64] [--layers eager
compiled] [--profile] [--out step.json]`. On a CPU, `--preset tiny --device cpu` checks that it
runs (its profile sums the CPU's operators instead).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

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


# Kernel (CUDA) or operator (CPU) names, lowercased, to the kind of work: the first kind with a
# matching fragment wins, so FSDP2's copies (a multi-tensor copy, chunk_cat) come before the
# optimizer's multi-tensor kernels. "elementwise" is the eager work compiled layers fuse, casts
# and RoPE's concatenation included. Inductor names its fused kernels "triton_poi", "triton_red"
# and "triton_per", its flex attention templates "triton_tem"; flex attention's own compiled
# graphs add a few fused kernels to "compiled elementwise" in an eager run too.
KINDS = (
    ("communication", ("nccl", "c10d", "gloo")),
    ("attention", ("flash", "flex", "fmha", "attention", "triton_tem", "sdpa")),
    ("loss head", ("_logprob_", "_grpo_loss", "_row_stats", "_row_dlogits", "_dlogits")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear", "aten::matmul")),
    ("fsdp copies", ("copyfunctor", "chunk_cat", "split_with_sizes_copy", "fsdp::")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("compiled elementwise", ("triton_poi", "triton_red", "triton_per", "compiledfxgraph",
                              "compiledfunction")),
    ("memcpy and memset", ("memcpy", "memset")),
    ("elementwise", ("elementwise", "reduce", "vectorized", "unrolled", "copy", "catarray",
                     "aten::")),
)  # fmt: skip


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def profile_step(step, device: torch.device) -> dict:
    """One step under torch.profiler: the time of its kernels (CUDA; the CPU's own operators on
    a CPU) summed by kind, the step's span, and the 12 longest kernels."""
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    began = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if on_cuda:
            torch.cuda.synchronize()
    span_ms = (time.perf_counter() - began) * 1e3
    by_kind: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        # CUDA: the kernels' own time; CPU: each operator's self time (children counted once).
        ms = (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / 1e3
        if ms <= 0 or (on_cuda and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        by_kind[kind_of(event.key)] += ms
        kernels.append((ms, event.count, event.key))
    kernels.sort(reverse=True)
    total = sum(by_kind.values())
    return {
        "span_ms": span_ms,
        "kernels_ms": total,
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
        "longest": [{"ms": ms, "calls": n, "name": name[:120]} for ms, n, name in kernels[:12]],
    }


def measure(options, layers: str, world, device: torch.device) -> dict:
    cfg = Config()
    cfg = msgspec.structs.replace(
        cfg,
        model=ModelConfig(
            preset=options.preset,
            compile_layers=layers == "compiled",
            activation_checkpointing=options.activation_checkpointing,
        ),
        algo=msgspec.structs.replace(
            cfg.algo, micro_batch_tokens=options.micro_batch_tokens, tis_cap=0.0
        ),
        train=msgspec.structs.replace(cfg.train, optimizer_offload=options.optimizer_offload),
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = parallel.shard(build_model(cfg.model), device, dtype)
    optimizer = build_optimizer(model, cfg, "rl")
    vocab = preset(options.preset).vocab_size
    batch = random_samples(options.samples, vocab, np.random.default_rng(0), options.sample_tokens)
    packed = pack(batch, cfg.algo.micro_batch_tokens, world_size=world.size)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        grpo_step(model, optimizer, packed, cfg, device, rank=world.rank)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    step()  # compiles: the loss head's kernels, and with compiled layers their regions
    synchronize()
    first_s = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(options.steps):
        step()
    synchronize()
    seconds = (time.perf_counter() - began) / options.steps
    flops = useful_flops(preset(options.preset), batch) / seconds
    result = {
        "layers": layers,
        "tokens": packed.stats.tokens,
        "first_step_s": first_s,
        "step_s": seconds,
        "tokens_per_s": packed.stats.tokens / seconds,
        "tflops": flops / 1e12,
        "mfu_datasheet": flops / DATASHEET_BF16_DENSE_FLOPS,
    }
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if options.profile:
        result["profile"] = profile_step(step, device)
    return result


def report(result: dict) -> None:
    line = (
        f"{result['layers']:>8} layers: {result['step_s']:.3f} s a step, "
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.1f} TFLOP/s, "
        f"MFU {100 * result['mfu_datasheet']:.1f}% (first step {result['first_step_s']:.1f} s)"
    )
    print(line + (f", peak {result['peak_gib']:.1f} GiB" if "peak_gib" in result else ""))
    profile = result.get("profile")
    if profile:
        print(
            f"  profiled step: kernels {profile['kernels_ms']:.1f} ms of {profile['span_ms']:.1f}"
        )
        for kind, ms in profile["by_kind_ms"].items():
            print(f"    {kind:<22} {ms:9.1f} ms  {100 * ms / profile['kernels_ms']:5.1f}%")
        for kernel in profile["longest"]:
            print(f"    {kernel['ms']:9.1f} ms {kernel['calls']:6d}x  {kernel['name'][:90]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--sample-tokens", type=int, help="each sample's length; default 1024-3071")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", nargs="+", choices=("eager", "compiled"), default=["eager"])
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--optimizer-offload", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the summary here as JSON")
    options = parser.parse_args()
    world, device = parallel.start(options.device)
    try:
        summary = {
            "preset": options.preset,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "samples": options.samples,
            "micro_batch_tokens": options.micro_batch_tokens,
            "activation_checkpointing": options.activation_checkpointing,
            "optimizer_offload": options.optimizer_offload,
            "results": [],
        }
        print(f"GRPO train step, {options.preset}, {summary['device']}", flush=True)
        for layers in options.layers:
            summary["results"].append(measure(options, layers, world, device))
            report(summary["results"][-1])
            # Written after each way, so a run cut at its time limit keeps the ways it finished.
            if options.out:
                options.out.write_text(json.dumps(summary, indent=1))
            # The next way builds a model of its own: this one's memory must be back first (two
            # peaks of a 0.6B step, 44 GiB each, would not fit an 80 GB card together). FSDP2's
            # hooks hold the module in reference cycles, which only the collector frees.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps(summary))
    finally:
        parallel.stop()


if __name__ == "__main__":
    main()
