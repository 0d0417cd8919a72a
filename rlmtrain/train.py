"""The single training script: data, SFT warm-up on teacher trees, then GRPO over rollout trees.

    rlmtrain train --config configs/tiny-cpu.toml [--section.key=value ...]

Read top to bottom, it is the whole loop of ARCHITECTURE.md on one process:

1. data: the environment's tasks (the evidence corpus is synthesised, rendered to PDF and parsed
   back when no task file is given);
2. SFT: the environment's scripted teacher plays its tasks through the real REPL and trajectory
   loop; trees with a REPL error or a zero score are dropped; every kept turn is an NLL sample;
3. RL: each step rolls out `tasks_per_step` tasks × G roots with the scheduler on the engine,
   scores roots, turns rewards into tree advantages and exact per-token weights, packs the turns
   and takes one clipped-GRPO step through the fused loss; the new weights go to the engine by
   their Hugging Face names;
4. the final model is saved as a Hugging Face checkpoint.

Single-process (CPU or one GPU). FSDP2 sharding, vLLM colocation and resuming build on these
same seams and are not wired here yet; a config asking for them stops with a clear error.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch
import uvloop

from rlmtrain.algo import (
    MicroBatch,
    PackedBatches,
    build_samples,
    build_sft_samples,
    compute_advantages,
    pack,
)
from rlmtrain.config import Config, ConfigError
from rlmtrain.devices import resolve_device
from rlmtrain.envs.base import Env, Task, get_env
from rlmtrain.kernels import fused_linear_grpo_loss, fused_linear_logprob, fused_linear_nll
from rlmtrain.model import Transformer, build_model, named_hf_tensors, save_hf
from rlmtrain.model.tokenizer import Tokenizer, load_tokenizer
from rlmtrain.rewards.exploration import (
    beta_schedule,
    diversity_bonus,
    explored_reward,
    tree_turns,
)
from rlmtrain.rewards.tool_credit import rule_credit
from rlmtrain.rlm.agent import AgentLimits
from rlmtrain.rlm.records import RolloutGroup, Trajectory
from rlmtrain.rollout.cli import RolloutProgress, load_tasks
from rlmtrain.rollout.engines import build_engine
from rlmtrain.rollout.scheduler import Scheduler

log = logging.getLogger("rlmtrain.train")
T = TypeVar("T")

_TEACHERS = {
    "evidence": "rlmtrain.envs.evidence_teacher",
    "booknav": "rlmtrain.envs.booknav_teacher",
    "codenav": "rlmtrain.envs.codenav_teacher",
}


def main(cfg: Config) -> int:
    # ---------------------------------------------------------------- set-up
    logging.basicConfig(level=cfg.logging.level.upper(), format="%(message)s", stream=sys.stderr)
    _refuse_unwired(cfg)
    device = resolve_device(cfg.train.device)
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    run_dir = Path(cfg.checkpoint.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = _MetricsLog(Path(cfg.logging.metrics_path or run_dir / "metrics.jsonl"))

    # ---------------------------------------------------------------- data
    env = get_env(cfg.data.env, cfg)
    tasks = load_tasks(cfg, env)
    log.info("data: %d %s tasks", len(tasks), cfg.data.env)

    # ---------------------------------------------------------------- model
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.hf_dir)
    model = build_model(cfg.model).to(device)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ConfigError(
            f"model.tokenizer: vocabulary of {tokenizer.vocab_size} does not fit the model's "
            f"{model.args.vocab_size} embeddings"
        )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    log.info("model: %s, %.2fM parameters on %s", cfg.model.preset, _millions(model), device)

    # ---------------------------------------------------------------- SFT warm-up
    if cfg.train.sft_steps:
        teacher_groups, scorer = _teacher_groups(cfg, env, tasks, tokenizer)
        picks = _batches(teacher_groups, cfg.train.tasks_per_step)
        for step in range(cfg.train.sft_steps):
            began = time.perf_counter()
            pick = next(picks)
            samples, stats = build_sft_samples(pick, scorer, cfg.algo)
            if not samples:
                log.info("sft %d: no teacher tree kept (%s), skipped", step, _stats_line(stats))
                continue
            batches = pack(
                samples, cfg.algo.micro_batch_tokens, truncate=cfg.algo.truncate_long_samples
            )
            row = _sft_step(model, optimizer, batches, cfg, device)
            row.update(phase="sft", step=step, seconds=time.perf_counter() - began)
            metrics.write(row)
            _maybe_save(model, cfg, "sft", step)
            if step % cfg.logging.every == 0 or step == cfg.train.sft_steps - 1:
                log.info(
                    "sft %3d  nll %.4f  entropy %.3f  tokens %d  %.0f tok/s",
                    step,
                    row["loss"],
                    row["entropy"],
                    row["tokens"],
                    row["tokens"] / row["seconds"],
                )

    # ---------------------------------------------------------------- RL
    if cfg.train.steps:
        uvloop.run(_rl(cfg, model, optimizer, tokenizer, env, tasks, device, metrics))

    # ---------------------------------------------------------------- save
    out = run_dir / "final"
    save_hf(model, out)
    log.info("saved %s", out)
    return 0


# ==================================================================== RL phase


async def _rl(
    cfg: Config,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    tokenizer: Tokenizer,
    env: Env,
    tasks: list[Task],
    device: torch.device,
    metrics: _MetricsLog,
) -> None:
    # The engine serves its own copy of the policy, kept in step through update_weights by HF
    # names exactly as a separate inference engine is; on a CPU the copy costs only the weights.
    engine = build_engine(cfg, tokenizer)
    await engine.update_weights(named_hf_tensors(model))
    scheduler = Scheduler(engine, tokenizer, cfg.rollout)
    # The k3 KL anchors the policy to where RL started (after SFT): a frozen copy of it.
    reference = _frozen_copy(model) if cfg.algo.kl_beta > 0 else None
    picks = _batches(tasks, cfg.train.tasks_per_step)
    try:
        for step in range(cfg.train.steps):
            began = time.perf_counter()
            batch = next(picks)
            progress = RolloutProgress(len(batch) * cfg.rollout.n_samples, engine)
            scheduler.on_tree_done = progress.tree_done
            try:
                groups = await scheduler.rollout(batch, env, cfg.rollout.n_samples)
            finally:
                progress.close()
            scores = await env.root_scores(batch, groups)
            rewards = _with_exploration_bonus(groups, scores, cfg, step)
            credit = _tool_credit(groups) if cfg.algo.tool_credit_alpha > 0 else None
            advantages, adv_stats = compute_advantages(
                groups, rewards, cfg.algo, tool_credit=credit
            )
            row: dict[str, Any] = {
                "phase": "rl",
                "step": step,
                "reward_mean": _mean(r for rs in scores for r in rs if r is not None),
                "groups_kept": len(advantages),
                "groups_dropped_uniform": adv_stats.groups_dropped_uniform,
                "roots_unscored": adv_stats.roots_unscored,
                **_rollout_row(scheduler),
            }
            samples = build_samples(
                groups, advantages, cfg.algo, num_groups=max(1, len(advantages))
            )
            if samples:
                batches = pack(
                    samples, cfg.algo.micro_batch_tokens, truncate=cfg.algo.truncate_long_samples
                )
                row.update(_grpo_step(model, optimizer, batches, cfg, device, reference))
                await engine.update_weights(named_hf_tensors(model))
            _maybe_save(model, cfg, "rl", step)
            row["seconds"] = time.perf_counter() - began
            metrics.write(row)
            if step % cfg.logging.every == 0 or step == cfg.train.steps - 1:
                log.info(
                    "rl %3d  reward %.3f  groups %d/%d  loss %s  tokens %d  rollout %.1f s  "
                    "step %.1f s  finish %s",
                    step,
                    row["reward_mean"],
                    len(advantages),
                    len(groups),
                    f"{row['loss']:.4f}" if "loss" in row else "-",
                    row.get("tokens", 0),
                    row["rollout_s"],
                    row["seconds"],
                    row["finish_reasons"],
                )
    finally:
        await engine.close()


# ==================================================================== train steps


def _forward(
    model: Transformer, mb: MicroBatch, device: torch.device
) -> tuple[MicroBatch, torch.Tensor]:
    mb = mb.to(device)
    return mb, model(mb.input_ids, mb.position_ids, mb.cu_seqlens)


def _sft_step(model, optimizer, batches: PackedBatches, cfg: Config, device) -> dict[str, Any]:
    """One optimizer step of weighted NLL over every micro-batch (weights sum to the objective)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total_loss, entropy_sum, trained = 0.0, 0.0, 0
    for mb in batches.micro_batches():
        if mb.num_tokens == 0:
            continue
        mb, hidden = _forward(model, mb, device)
        loss, entropy = fused_linear_nll(
            hidden,
            model.lm_head_weight,
            mb.targets,
            mb.weights,
            return_entropy=True,
            impl=cfg.train.loss_impl,
        )
        loss.backward()
        mask = mb.targets != -100
        total_loss += loss.item()
        entropy_sum += float(entropy[mask].sum())
        trained += int(mask.sum())
    grad_norm = _clip_and_step(model, optimizer, cfg)
    return {
        "loss": total_loss,
        "entropy": entropy_sum / max(1, trained),
        "tokens": batches.stats.tokens,
        "trained_tokens": trained,
        "grad_norm": grad_norm,
    }


def _grpo_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    batches: PackedBatches,
    cfg: Config,
    device: torch.device,
    reference: Transformer | None = None,
) -> dict[str, Any]:
    """One clipped-GRPO step over every micro-batch. pi_old is the policy before this step (one
    update per rollout) and pi_ref the frozen `reference`, both from no-grad passes; the engine's
    log-probs enter through truncated IS."""
    micro = [mb.to(device) for mb in batches.micro_batches() if mb.num_tokens]
    old = [_logprobs(model, mb, cfg) for mb in micro]
    ref = [_logprobs(reference, mb, cfg) if reference is not None else None for mb in micro]
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = dict.fromkeys(("loss", "clip_frac_low", "clip_frac_high", "kl_mean"), 0.0)
    mismatch = 0.0
    for mb, old_logp, ref_logp in zip(micro, old, ref, strict=True):
        hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens)
        loss, m = fused_linear_grpo_loss(
            hidden,
            model.lm_head_weight,
            mb.targets,
            old_logp,
            mb.advantages,
            mb.weights,
            ref_logp=ref_logp,
            beta=cfg.algo.kl_beta,
            clip_low=cfg.algo.clip_low,
            clip_high=cfg.algo.clip_high,
            dual_clip=cfg.algo.dual_clip or None,
            sampler_logp=mb.sampler_logp if cfg.algo.tis_cap else None,
            tis_cap=cfg.algo.tis_cap or None,
            impl=cfg.train.loss_impl,
        )
        loss.backward()
        share = mb.num_tokens / batches.stats.tokens
        sums["loss"] += loss.item()
        sums["clip_frac_low"] += float(m.clip_low_frac) * share
        sums["clip_frac_high"] += float(m.clip_high_frac) * share
        sums["kl_mean"] += float(m.kl_mean) * share
        trained = mb.targets != -100
        if trained.any():
            gap = (old_logp - mb.sampler_logp)[trained].abs().max()
            mismatch = max(mismatch, float(gap))
    return {
        **sums,
        "engine_logp_max_abs_diff": mismatch,
        "tokens": batches.stats.tokens,
        "grad_norm": _clip_and_step(model, optimizer, cfg),
    }


@torch.no_grad()
def _logprobs(model: Transformer, mb: MicroBatch, cfg: Config) -> torch.Tensor:
    model.eval()
    hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens)
    return fused_linear_logprob(hidden, model.lm_head_weight, mb.targets, impl=cfg.train.loss_impl)


def _frozen_copy(model: Transformer) -> Transformer:
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def _with_exploration_bonus(
    groups: list[RolloutGroup], scores: list[list[float | None]], cfg: Config, step: int
) -> list[list[float | None]]:
    """R_n = r + beta_n * b * 1[r = 1] (SPEC.md §3), b the tree's tool diversity, beta_n the
    cosine schedule over the RL steps; the scores unchanged when the bonus is off."""
    if cfg.algo.exploration_beta <= 0:
        return scores
    beta = beta_schedule(step, cfg.train.steps, cfg.algo.exploration_beta)
    return [
        [
            explored_reward(r, diversity_bonus(tree_turns(group, root)), beta)
            for r, root in zip(rs, group.roots, strict=True)
        ]
        for group, rs in zip(groups, scores, strict=True)
    ]


def _tool_credit(groups: list[RolloutGroup]) -> dict[str, list[int]]:
    """Per-turn useful/neutral/harmful labels by the rule-based labeller, every trajectory."""
    labels: dict[str, list[int]] = {}
    for group in groups:
        labels.update(rule_credit(group))
    return labels


def _maybe_save(model: Transformer, cfg: Config, phase: str, step: int) -> None:
    every = cfg.checkpoint.every
    if every and (step + 1) % every == 0:
        out = Path(cfg.checkpoint.dir) / f"{phase}-step{step + 1}"
        save_hf(model, out)
        log.info("saved %s", out)


def _clip_and_step(model: Transformer, optimizer: torch.optim.Optimizer, cfg: Config) -> float:
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if not math.isfinite(norm):
        raise FloatingPointError(f"gradient norm is {norm}; step skipped would hide it, stopping")
    optimizer.step()
    return norm


# ==================================================================== helpers


def _refuse_unwired(cfg: Config) -> None:
    if cfg.rollout.engine != "native":
        raise ConfigError(
            f"rollout.engine: '{cfg.rollout.engine}' is not wired into train yet; use 'native'"
        )
    if cfg.checkpoint.resume:
        raise ConfigError("checkpoint.resume: resuming is not wired into train yet")


def _teacher_groups(
    cfg: Config, env: Env, tasks: list[Task], tokenizer: Tokenizer
) -> tuple[list[RolloutGroup], Callable[[Trajectory, Any], float]]:
    """The teacher's trees for every task, and the SFT filter's score: the env's own reward of
    each root (span F1 for evidence without a judge), unscored counted as 0."""
    teacher = importlib.import_module(_TEACHERS[cfg.data.env])
    began = time.perf_counter()

    async def play() -> tuple[list[RolloutGroup], dict[str, float]]:
        limits = AgentLimits.from_config(cfg.rollout)
        groups = await teacher.teach(env, tasks, tokenizer, limits=limits)
        scores: dict[str, float] = {}
        for group, values in zip(groups, await env.root_scores(tasks, groups), strict=True):
            for root, value in zip(group.roots, values, strict=True):
                scores[root.id] = 0.0 if value is None else value
        return groups, scores

    groups, scores = uvloop.run(play())
    turns = sum(len(t.turns) for g in groups for t in g.trajectories)
    log.info(
        "sft: teacher played %d tasks (%d turns, mean score %.3f) in %.1f s",
        len(groups),
        turns,
        _mean(scores.values()),
        time.perf_counter() - began,
    )
    return groups, lambda root, task: scores[root.id]


def _rollout_row(scheduler: Scheduler) -> dict[str, Any]:
    m = scheduler.metrics
    return {
        "rollout_s": m.wall_s,
        "generated_tokens": m.generated_tokens,
        "engine_tokens_per_s": m.tokens_per_s,
        "engine_occupancy": m.engine_occupancy,
        "finish_reasons": m.finish_reasons,
        "children_per_root": m.children_per_root_mean,
    }


def _batches(items: list[T], size: int) -> Iterator[list[T]]:
    """`size` items per step, endlessly: a window sliding over a shuffled order (wrapping at the
    end), reshuffled every len(items) // size steps."""
    order = list(range(len(items)))
    per_pass = max(1, len(order) // size)
    for step in itertools.count():
        if step % per_pass == 0:
            random.shuffle(order)
        start = (step * size) % len(order)
        yield [items[order[(start + i) % len(order)]] for i in range(min(size, len(order)))]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def _stats_line(stats: msgspec.Struct) -> str:
    return ", ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(stats).items())


class _MetricsLog:
    """Per-step metrics as JSON lines, flushed every step so a killed run keeps its curve."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 - lives as long as the run

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(msgspec.json.encode(row) + b"\n")
        self._file.flush()
