"""One optimizer step of each phase over this rank's share of a packed batch: SFT's weighted NLL
(`sft_step`) and clipped GRPO (`grpo_step`), through the LM-head ops `train.loss_impl` names (the
fused kernels, or the unfused check). The trainer's phases call these; so can a loop of one's
own, a bench or a test, with a model sharded by `parallel.shard`.

Metrics are summed on the device over micro-batches and ranks and read once a step: a read per
micro-batch would stall the device queue as often.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from rlmtrain import parallel, watchdog
from rlmtrain.algo import IGNORE_INDEX, MicroBatch, PackedBatches, Sample, pack
from rlmtrain.algo.unfused import unfused_grpo_loss, unfused_logprob, unfused_nll
from rlmtrain.config import Config
from rlmtrain.kernels import fused_linear_grpo_loss, fused_linear_logprob, fused_linear_nll
from rlmtrain.model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`model.dtype`'s names: the compute dtype of the sharded policy (its masters stay fp32)."""


def pack_samples(samples: list[Sample], cfg: Config, world_size: int = 1) -> PackedBatches:
    return pack(
        samples,
        cfg.algo.micro_batch_tokens,
        world_size=world_size,
        truncate=cfg.algo.truncate_long_samples,
        shared_prefix_tokens=cfg.algo.shared_prefix_tokens,
    )


def rank_micro_batches(batches: PackedBatches, rank: int, device) -> list[MicroBatch]:
    """This rank's micro-batches on the device; an empty one (the packer deals every rank the
    same count) becomes a one-token micro-batch that trains nothing, so that this rank still
    joins every collective of the forward and backward."""
    return [
        (mb if mb.num_tokens else MicroBatch.placeholder()).to(device)
        for mb in batches.micro_batches(rank)
    ]


def sft_step(
    model, optimizer, batches: PackedBatches, cfg: Config, device, *, rank: int = 0
) -> dict[str, Any]:
    """One optimizer step of weighted NLL over this rank's micro-batches (weights over all
    ranks sum to the objective); the step's sums stay on the device and are read once."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    head = head_ops(cfg)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, entropy sum, trained
    for mb in rank_micro_batches(batches, rank, device):
        hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.prefix_of)
        loss, entropy = head.nll(
            hidden, model.lm_head_weight, mb.targets, mb.weights, return_entropy=True
        )
        loss.backward()
        mask = mb.targets != IGNORE_INDEX
        sums += torch.stack([loss.detach(), entropy.detach()[mask].sum(), mask.sum()]).double()
        watchdog.mark()
    grad_norm = clip_and_step(model, optimizer, cfg)
    loss_sum, entropy_sum, trained = parallel.all_sum(sums).tolist()
    return {
        "loss": loss_sum,
        "entropy": entropy_sum / max(1.0, trained),
        "tokens": batches.stats.tokens,
        "shared_tokens": batches.stats.shared_tokens,
        "trained_tokens": int(trained),
        "grad_norm": grad_norm,
    }


# Summed over micro-batches and ranks; the last two give the token-mean entropy.
GRPO_SUMS = (
    "loss",
    "clip_frac_low",
    "clip_frac_high",
    "tis_clipped_frac",
    "engine_logp_gap",
    "kl_mean",
    "tis_weight_mean",
    "tis_weight_sq_mean",
    "entropy_sum",
    "trained_tokens",
)


def grpo_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    batches: PackedBatches,
    cfg: Config,
    device: torch.device,
    reference: Transformer | None = None,
    *,
    rank: int = 0,
) -> dict[str, Any]:
    """Clipped-GRPO updates over this rank's micro-batches of the rollout batch.

    With one update per batch (`algo.updates_per_batch = 1`) pi_old is the detached current
    policy, which the fused loss takes as `old_logp=None`: no second forward. With more, the
    micro-batches are split into that many mini-batches, pi_old is computed once before the
    first update, and the clip then acts. pi_ref is the frozen `reference`; the engine's
    log-probs enter through truncated IS. Metrics are summed on the device (and over the
    ranks) and read once.
    """
    micro = rank_micro_batches(batches, rank, device)
    # The packer gives every rank the same count, so every rank splits alike.
    updates = min(cfg.algo.updates_per_batch, len(micro))
    old = [policy_logprobs(model, mb, cfg) if updates > 1 else None for mb in micro]
    ref = [policy_logprobs(reference, mb, cfg) if reference is not None else None for mb in micro]
    model.train()
    head = head_ops(cfg)
    sums = torch.zeros(len(GRPO_SUMS), dtype=torch.float64, device=device)
    mismatch = torch.zeros(1, dtype=torch.float64, device=device)
    norms = []
    for chunk in np.array_split(np.arange(len(micro)), updates):
        optimizer.zero_grad(set_to_none=True)
        for i in chunk.tolist():
            mb = micro[i]
            hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.prefix_of)
            loss, m, entropy = head.grpo(
                hidden,
                model.lm_head_weight,
                mb.targets,
                old[i],
                mb.advantages,
                mb.weights,
                ref_logp=ref[i],
                beta=cfg.algo.kl_beta,
                clip_low=cfg.algo.clip_low,
                clip_high=cfg.algo.clip_high,
                dual_clip=cfg.algo.dual_clip or None,
                sampler_logp=mb.sampler_logp if cfg.algo.tis_cap else None,
                tis_cap=cfg.algo.tis_cap or None,
                temperature=cfg.rollout.temperature,
                return_entropy=True,
            )
            # Each mini-batch's weights are its share of the whole objective; scaled back up,
            # every update sees a gradient of the objective's size.
            (loss * updates).backward()
            watchdog.mark()
            trained = mb.targets != IGNORE_INDEX
            share = mb.num_tokens / batches.stats.tokens if trained.any() else 0.0
            sums += torch.stack(
                [
                    loss.detach(),
                    m.clip_low_frac * share,
                    m.clip_high_frac * share,
                    m.tis_clipped_frac * share,
                    m.sampler_logp_gap * share,
                    m.kl_mean * share,
                    m.tis_weight_mean * share,
                    m.tis_weight_sq_mean * share,
                    entropy.detach()[trained].sum(),
                    trained.sum(),
                ]
            ).double()
            if old[i] is not None and trained.any():
                gap = (old[i] - mb.sampler_logp)[trained].abs().max().double()
                mismatch = torch.maximum(mismatch, gap)
        norms.append(clip_and_step(model, optimizer, cfg))
    row = dict(zip(GRPO_SUMS, parallel.all_sum(sums).tolist(), strict=True))
    row["entropy"] = row.pop("entropy_sum") / max(1.0, row.pop("trained_tokens"))
    weight_mean, weight_sq_mean = row.pop("tis_weight_mean"), row.pop("tis_weight_sq_mean")
    if cfg.algo.tis_cap:
        # Kish's effective sample size of the truncated-IS weights, as a share of the tokens:
        # 1 when the sampler's tokens are the trained policy's, lower as they grow stale.
        row["tis_ess_frac"] = weight_mean**2 / weight_sq_mean if weight_sq_mean > 0 else 1.0
    else:
        # Measured only where the engine's log-probs enter the loss (truncated IS).
        del row["engine_logp_gap"]
    if updates > 1:
        row["engine_logp_max_abs_diff"] = float(parallel.all_max(mismatch))
    row.update(
        tokens=batches.stats.tokens,
        shared_tokens=batches.stats.shared_tokens,
        updates=updates,
        grad_norm=max(norms),
    )
    return row


@torch.no_grad()
def policy_logprobs(model: Transformer, mb: MicroBatch, cfg: Config) -> torch.Tensor:
    model.eval()
    hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.prefix_of)
    return head_ops(cfg).logprob(
        hidden, model.lm_head_weight, mb.targets, temperature=cfg.rollout.temperature
    )


class HeadOps(NamedTuple):
    logprob: Callable[..., Any]
    nll: Callable[..., Any]
    grpo: Callable[..., Any]


def head_ops(cfg: Config) -> HeadOps:
    """The LM-head losses `train.loss_impl` names: the fused ops, or the unfused check."""
    if cfg.train.loss_impl == "unfused":
        return HeadOps(unfused_logprob, unfused_nll, unfused_grpo_loss)
    impl = cfg.train.loss_impl
    return HeadOps(
        functools.partial(fused_linear_logprob, impl=impl),
        functools.partial(fused_linear_nll, impl=impl),
        functools.partial(fused_linear_grpo_loss, impl=impl),
    )


def clip_and_step(model: Transformer, optimizer: torch.optim.Optimizer, cfg: Config) -> float:
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # Over sharded gradients the norm is a DTensor; its whole value is the global norm.
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(norm):
        raise FloatingPointError(f"gradient norm is {norm}; step skipped would hide it, stopping")
    optimizer.step()
    # The gradients are spent: freed now, not at the next step, so a rollout does not hold them.
    optimizer.zero_grad(set_to_none=True)
    return norm
