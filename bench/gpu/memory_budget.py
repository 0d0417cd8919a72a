"""One rank's memory in a Qwen3-4B-shaped GRPO step at 32k-token micro-batches, on one GPU,
against the card's total.

The train step of the run `configs/qwen3-4b-8xh200.toml` describes, as the trainer runs it: the
policy built by `training.materialise.sharded_policy` (FSDP2, fp32 masters, bf16 compute, the
config's activation checkpointing, random weights), AdamW from `optim.build_optimizer` as the
config sets it, and `training.steps.grpo_step` over random samples of `--sample-tokens` (half
prompt) packed into `--micro-batches` micro-batches of `algo.micro_batch_tokens` (32768). A
first step makes AdamW's moments (and compiles); the second is measured in two parts, split by an
optimizer step pre-hook: forward, backward and clipping, then AdamW's step. Its seconds give the
step's model FLOP utilisation as `train_step.py` counts it (`--compile-layers` for the compiled
layers' figure).

Figures, GiB: the model states at rest (allocated before the step: fp32 masters and AdamW's
moments, unless `--optimizer-offload` keeps the moments in host memory; the gradients are freed
after every step), the gradients (allocated when AdamW starts, less the states), the peak allocated
and reserved of each part and what each adds above states and gradients: the activations (with the
loss's logit slabs and the gathered bf16 blocks; also per token of a micro-batch) and AdamW's
temporaries; the card's total, what was free when the script started (`torch.cuda.mem_get_info`),
and the headroom, free at the start less the reserved peak. The one GPU holds the whole model; on
`--ranks` ranks FSDP2 divides states, gradients and AdamW's temporaries while a micro-batch's
activations stay whole, which gives the derived per-rank figure (an estimate: the vLLM engine's
share of the card is not in it), printed beside the trainer's own pre-flight estimate
(`rlmtrain.memory.estimate`), which this measures. Out of memory is a result: the part that ran out
is named. On a CPU the process's peak resident set stands in, to check that the script runs.

    python3 bench/gpu/memory_budget.py [--preset qwen3-4b] [--optimizer-offload] [--out memory.json]
    python bench/gpu/memory_budget.py --device cpu --preset tiny --micro-batch-tokens 512 \\
        --sample-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from train_step import (  # bench/gpu/, the script's own folder
    DATASHEET_BF16_DENSE_FLOPS,
    random_samples,
    useful_flops,
)

from rlmtrain import memory, parallel
from rlmtrain.config import load_config
from rlmtrain.memory import GIB
from rlmtrain.model import preset
from rlmtrain.optim import build_optimizer
from rlmtrain.training.materialise import sharded_policy
from rlmtrain.training.steps import DTYPES, grpo_step, pack_samples

ROOT = Path(__file__).resolve().parents[2]


class Meter:
    """Allocated bytes and peaks on CUDA (the caching allocator's counters), peak RSS on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def allocated(self) -> float:
        return torch.cuda.memory_allocated() / GIB if self.cuda else 0.0

    def peaks(self) -> tuple[float, float]:
        """(peak allocated, peak reserved) since the last call, in GiB; on a CPU the process's
        peak resident set for both."""
        if not self.cuda:
            peak = memory.peak_resident_bytes() / GIB
            return peak, peak
        torch.cuda.synchronize()
        figures = torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB
        torch.cuda.reset_peak_memory_stats()
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen3-4b-8xh200.toml")
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--micro-batch-tokens", type=int, help="default: the config's")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--sample-tokens", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=8, help="for the derived per-rank figure")
    parser.add_argument(
        "--optimizer-offload", action="store_true", help="AdamW's moments in host memory"
    )
    parser.add_argument(
        "--compile-layers", action="store_true", help="the decoder layers' compiled regions"
    )
    parser.add_argument("--out", type=Path, help="also write the summary here as JSON")
    options = parser.parse_args()

    overrides = ["--model.hf_dir=", f"--model.preset={options.preset}", "--model.tokenizer=byte"]
    if options.optimizer_offload:
        overrides.append("--train.optimizer_offload=true")
    if options.compile_layers:
        overrides.append("--model.compile_layers=true")
    if options.micro_batch_tokens:
        # Under the config's longest turn the load rules ask for truncation, which samples of
        # --sample-tokens (at most a micro-batch) never meet.
        overrides += [
            f"--algo.micro_batch_tokens={options.micro_batch_tokens}",
            "--algo.truncate_long_samples=true",
        ]
    cfg = load_config(options.config, overrides)
    world, device = parallel.start(options.device)
    meter = Meter(device)
    free_at_start, total = torch.cuda.mem_get_info() if meter.cuda else (0, 0)
    # bf16 compute on CUDA as the config says; fp32 on a CPU, where the check is only that it runs.
    dtype = DTYPES[cfg.model.dtype] if device.type == "cuda" else torch.float32
    budget = cfg.algo.micro_batch_tokens
    samples = random_samples(
        options.micro_batches * budget // options.sample_tokens,
        preset(options.preset).vocab_size,
        np.random.default_rng(0),
        length=options.sample_tokens,
    )
    figures: dict = {}
    packed, part = None, "building the policy"
    try:
        model = sharded_policy(cfg.model, device, dtype)
        optimizer = build_optimizer(model, cfg, "rl")
        packed = pack_samples(samples, cfg, world.size)
        figures["weights_gib"] = meter.allocated()

        def split(*_) -> None:  # forward and backward end where the optimizer step begins
            figures["forward_backward"] = meter.peaks()
            figures["with_gradients_gib"] = meter.allocated()

        def step() -> None:
            figures["states_gib"] = meter.allocated()
            figures.pop("forward_backward", None)
            meter.peaks()
            grpo_step(model, optimizer, packed, cfg, device, rank=world.rank)
            figures["optimizer"] = meter.peaks()

        optimizer.register_step_pre_hook(split)
        part = "warm-up step"  # makes AdamW's moments
        step()
        part = "measured step"
        began = time.perf_counter()
        step()
        if meter.cuda:
            torch.cuda.synchronize()
        figures["step_s"] = time.perf_counter() - began
        part = None
    except torch.cuda.OutOfMemoryError as error:
        if part.endswith("step"):
            part += ": AdamW" if "forward_backward" in figures else ": forward and backward"
        figures["error"] = str(error).splitlines()[0]
        figures["peak_at_failure"] = meter.peaks()
    finally:
        parallel.stop()

    summary = {
        "bench": "memory_budget",
        "preset": options.preset,
        "device": torch.cuda.get_device_name() if meter.cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "compile_layers": cfg.model.compile_layers,
        "adam_fused": cfg.train.adam_fused,
        "optimizer_offload": cfg.train.optimizer_offload,
        "micro_batch_tokens": budget,
        "micro_batches": packed.stats.micro_batches if packed else None,
        "tokens": packed.stats.tokens if packed else None,
        "parameters": preset(options.preset).num_params(),
        "out_of_memory_in": part,
    }
    if part is None:
        # The measured step's pace, its memory counters read in it included: the model FLOPs
        # of `train_step.py` (3 x the forward) over the step's seconds.
        flops = useful_flops(preset(options.preset), samples) / figures["step_s"]
        summary.update(
            step_s=figures["step_s"],
            tokens_per_s=packed.stats.tokens / figures["step_s"],
            tflops=flops / 1e12,
            mfu_datasheet=flops / DATASHEET_BF16_DENSE_FLOPS,
        )
    if part is None and not meter.cuda:
        summary["peak_rss_gib"] = figures["optimizer"][0]
    elif part is None:
        # At rest a rank holds masters and moments; gradients live from the first backward to
        # the end of the optimizer step. Both shard over ranks, as do AdamW's temporaries; a
        # micro-batch's activations do not.
        states, held = figures["states_gib"], figures["with_gradients_gib"]
        fb_peak, fb_reserved = figures["forward_backward"]
        opt_peak, opt_reserved = figures["optimizer"]
        summary.update(
            weights_gib=figures["weights_gib"],
            states_gib=states,
            gradients_gib=held - states,
            forward_backward_peak_gib=fb_peak,
            forward_backward_reserved_gib=fb_reserved,
            activations_gib=fb_peak - held,
            activation_bytes_per_token=(fb_peak - held) * GIB / budget,
            optimizer_peak_gib=opt_peak,
            optimizer_reserved_gib=opt_reserved,
            optimizer_temporaries_gib=opt_peak - held,
            peak_allocated_gib=max(fb_peak, opt_peak),
            peak_reserved_gib=max(fb_reserved, opt_reserved),
        )
        ranks = options.ranks
        per_rank = held / ranks + max(fb_peak - held, (opt_peak - held) / ranks)
        summary[f"derived_per_rank_at_{ranks}_ranks_gib"] = per_rank
        # The trainer's pre-flight guess (`memory.estimate`) of the same, to hold it to these.
        one, many = (memory.estimate(cfg, preset(options.preset), n, total) for n in (1, ranks))
        summary["estimate_states_and_gradients_gib"] = one.states / GIB
        summary["estimate_activations_gib"] = (one.activations + one.gathered) / GIB
        summary[f"estimate_training_per_rank_at_{ranks}_ranks_gib"] = many.training / GIB
    else:
        summary["error"] = figures["error"]
        summary["peak_at_failure_gib"], summary["reserved_at_failure_gib"] = figures[
            "peak_at_failure"
        ]
    if meter.cuda:
        summary.update(card_total_gib=total / GIB, free_at_start_gib=free_at_start / GIB)
        if "peak_reserved_gib" in summary:
            summary["headroom_gib"] = free_at_start / GIB - summary["peak_reserved_gib"]

    print(f"\nGRPO step memory, {options.preset} on {summary['device']}, one rank holding all")
    for key, value in summary.items():
        print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    print(json.dumps(summary))
    if options.out:
        options.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
