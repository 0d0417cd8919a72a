"""What a rank's memory holds: measured at each phase of a step, and estimated before a run.

Measured (`figures`, `step_row`): on CUDA, the trainer's allocated and reserved bytes and its
peak since the last mark (the caching allocator's own counters), and the device's used bytes,
of which what the trainer has not reserved is the engine's (vLLM's engine process, the CUDA
contexts); on a CPU, the process's resident bytes and its peak since it started (the kernel's
high-water mark, which cannot be reset). A step row carries every
rank's figures for each mark, and their maximum over ranks for the curves.

Estimated (`estimate`, `check_fits`): per rank, the model states (fp32 masters, fp32 gradients,
AdamW's two fp32 moments: 16 bytes a parameter, divided over the ranks a model is sharded on;
8 with `train.optimizer_offload`, whose moments are in host memory),
a KL reference's fp32 shards, the weights FSDP2 gathers (the root unit with its whole fp32
gradient, and two decoder blocks in the compute dtype), the activations of one micro-batch of
`algo.micro_batch_tokens`, AdamW's step temporaries, and the engine's share (vLLM:
`rollout.gpu_memory_utilization` of the card; the native engine: its weights and KV cache).
A colocated vLLM engine sleeps through the train step, so the states then meet the train
step's own terms, and during the rollout the engine; otherwise all of them at once. The
activation term is a count of the tensors a block keeps per token (the fused loss never holds
[tokens, vocabulary] logits), not a measurement; `bench/gpu/memory_budget.py` measures it.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

from rlmtrain import parallel
from rlmtrain.config import Config, ConfigError
from rlmtrain.devices import host_memory
from rlmtrain.model import ModelArgs, kv_cache_bytes

GIB = 2**30
# What a card keeps for itself and the CUDA context before any tensor: refused above the rest.
_CARD_RESERVE = 0.05


def figures(device: torch.device) -> dict[str, float]:
    """This rank's memory now, in GiB; on CUDA the peak since the last call (it resets it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        marks = {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": reserved,
            "peak": torch.cuda.max_memory_allocated(device),
            "engine": max(0, total - free - reserved),
        }
        torch.cuda.reset_peak_memory_stats(device)
    else:
        marks = {"resident": resident_bytes(), "peak": peak_resident_bytes()}
    return {name: round(value / GIB, 3) for name, value in marks.items()}


def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """This process's largest resident memory since it started (the kernel's high-water mark)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def step_row(marks: dict[str, dict[str, float]]) -> dict[str, dict[str, float | list[float]]]:
    """A step row's memory: every rank's `figures` at each mark ("memory_gib_ranks", lists in
    rank order) and their maximum over ranks ("memory_gib", for the curves). A collective."""
    ranks = parallel.all_gather(marks)
    per_rank = {
        f"{mark}_{name}": [rank[mark][name] for rank in ranks]
        for mark, values in marks.items()
        for name in values
    }
    return {
        "memory_gib": {key: max(values) for key, values in per_rank.items()},
        "memory_gib_ranks": per_rank,
    }


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank at the two moments that matter."""

    states: int
    host: int
    """AdamW's moments in host memory (`train.optimizer_offload`), not on the card."""
    reference: int
    gathered: int
    activations: int
    optimizer_step: int
    engine: int
    colocated: bool

    @property
    def training(self) -> int:
        """The train step's peak: the forward and backward's, or AdamW's step after them."""
        held = self.states + self.reference
        return held + max(self.gathered + self.activations, self.optimizer_step)

    @property
    def peak(self) -> int:
        if self.colocated:  # the engine sleeps while the trainer computes
            return max(self.training, self.states + self.reference + self.engine)
        return self.training + self.engine

    def describe(self) -> str:
        parts = [f"model states {self.states / GIB:.1f}"]
        if self.reference:
            parts.append(f"KL reference {self.reference / GIB:.1f}")
        parts += [
            f"gathered weights {self.gathered / GIB:.1f}",
            f"activations {self.activations / GIB:.1f}",
            f"optimizer step {self.optimizer_step / GIB:.1f}",
            f"engine {self.engine / GIB:.1f}"
            + (" (asleep while training)" if self.colocated else ""),
        ]
        if self.host:
            parts.append(f"AdamW moments in host memory {self.host / GIB:.1f}")
        return f"~{self.peak / GIB:.1f} GiB a rank ({', '.join(parts)} GiB)"


def estimate(cfg: Config, args: ModelArgs, world_size: int, card_bytes: int) -> Estimate:
    """Per-rank memory of training `args` as `cfg` says over `world_size` ranks, on cards of
    `card_bytes` (the vLLM engine's share is a fraction of the card)."""
    parameters = _parameters(args)
    shard_ranks = max(1, world_size // cfg.parallel.replicate)
    compute_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    attention_width = args.num_heads * args.head_dim
    kv_width = args.num_kv_heads * args.head_dim
    # What a block keeps per token for its backward: the hidden-wide tensors around attention
    # and the MLP, q and the attention output, k and v, and the MLP's four intermediates.
    per_token_block = (
        4 * args.hidden_size + 2 * attention_width + 2 * kv_width + 4 * args.intermediate_size
    ) * compute_bytes
    tokens = cfg.algo.micro_batch_tokens
    if cfg.model.activation_checkpointing:  # each block keeps its input; one is recomputed
        activations = tokens * (
            args.num_layers * args.hidden_size * compute_bytes + per_token_block
        )
    else:
        activations = tokens * args.num_layers * per_token_block
    # The root unit (embedding, final norm, head) stays gathered through the forward and the
    # backward, with its whole fp32 gradient before the reduce-scatter; two blocks are gathered
    # at a time (the one running, the one prefetched).
    root = parameters - args.num_layers * _block_parameters(args)
    gathered = root * (compute_bytes + 4) + 2 * _block_parameters(args) * compute_bytes
    if cfg.rollout.engine == "vllm":
        engine = int(cfg.rollout.gpu_memory_utilization * card_bytes)
    else:
        engine = parameters * compute_bytes + kv_cache_bytes(
            args, cfg.rollout.kv_cache_tokens, compute_bytes
        )
    if cfg.train.optimizer_offload:
        # One parameter's moments on the device at a time, and the step's temporary the size of
        # one: the largest is an embedding.
        host = 8 * parameters // shard_ranks
        optimizer_step = 12 * args.vocab_size * args.hidden_size // shard_ranks
    else:
        host = 0
        # AdamW's multi-tensor step holds fp32 temporaries the size of the shards it updates.
        optimizer_step = 4 * parameters // shard_ranks
    return Estimate(
        states=16 * parameters // shard_ranks - host,
        host=host,
        reference=4 * parameters // shard_ranks if cfg.algo.kl_beta > 0 else 0,
        gathered=gathered,
        activations=activations,
        optimizer_step=optimizer_step,
        engine=engine,
        colocated=cfg.rollout.colocate,
    )


def check_fits(cfg: Config, args: ModelArgs, world_size: int, device: torch.device) -> Estimate:
    """`estimate` on this rank's card; ConfigError in one line when it cannot fit. A CPU run
    is refused only past all of its host's memory, RAM and swap, over the ranks it runs there:
    the estimate leaves out the interpreter's own gigabyte or two, so it fits a host by less
    than it seems, but what exceeds the whole host cannot run at all (a KV cache of a trillion
    tokens would otherwise fail at its allocation, after the data and the model)."""
    card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    guess = estimate(cfg, args, world_size, card)
    if card and guess.peak > (1 - _CARD_RESERVE) * card:
        raise ConfigError(
            f"memory: this run needs {guess.describe()} on a {card / GIB:.0f} GiB card; shard "
            "over more ranks, lower algo.micro_batch_tokens, set model.activation_checkpointing "
            "or rollout.colocate, set train.optimizer_offload, or lower "
            "rollout.gpu_memory_utilization"
        )
    host, ranks_here = host_memory(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not card and host and guess.peak * ranks_here > host:
        raise ConfigError(
            f"memory: this run needs {guess.describe()}, {ranks_here} rank(s) on a host of "
            f"{host / GIB:.0f} GiB (RAM and swap); lower rollout.kv_cache_tokens or "
            "algo.micro_batch_tokens, or set model.activation_checkpointing"
        )
    return guess


def _block_parameters(args: ModelArgs) -> int:
    attention = args.hidden_size * args.head_dim * (2 * args.num_heads + 2 * args.num_kv_heads)
    mlp = 3 * args.hidden_size * args.intermediate_size
    return attention + mlp + 2 * args.hidden_size + (2 * args.head_dim if args.qk_norm else 0)


def _parameters(args: ModelArgs) -> int:
    embeddings = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
    return args.num_layers * _block_parameters(args) + embeddings + args.hidden_size
