"""The single training script: data, SFT warm-up on teacher trees, then GRPO over rollout trees.

Why one file: it is the loop a user reads top to bottom to know what a run does; every piece it
calls lives in its own module.

    rlmtrain train --config configs/tiny-cpu.toml [--section.key=value ...]
    python -m rlmtrain.train --config ...                      (the same, one process)
    torchrun --nproc_per_node 8 -m rlmtrain.train --config ... (one rank per device)

Read top to bottom, it is the whole loop of docs/architecture.md:

1. data: the env's three disjoint task sets (`Env.split_tasks`): the SFT slice, the RL tasks and
   the held-out evaluation tasks, each from its file or synthesised from its own paper groups
   (by rank 0; the other ranks read what it wrote);
2. tokenizer and model: a BPE trained on the run's own training text when `model.tokenizer` is
   'bpe' (the model then gets exactly its vocabulary), the model from its preset or a checkpoint,
   sharded with FSDP2 over the ranks (`parallel.shard`; fp32 master weights, `model.dtype`
   compute), AdamW and its LR schedule (`optim`);
3. SFT: the env's scripted teacher plays the SFT slice through the scheduler on a scripted
   engine; trees with a REPL error or a zero score are dropped; every kept turn is an NLL
   sample, batched by tokens (`train.sft_step_tokens`), averaged over completion tokens, each
   step's batch dealt over the ranks;
4. RL: each step's `tasks_per_step` tasks are dealt over the ranks; each rank rolls out its
   share x G roots on its own engine (sampling seeded by the request's place in the tree),
   scores roots and turns rewards into tree advantages and exact per-token weights over the
   global number of kept groups; the samples of every rank are gathered and re-dealt by tokens,
   and `algo.updates_per_batch` clipped-GRPO updates run through the fused loss; the new weights
   go to every engine by their Hugging Face names;
5. evaluation of the held-out tasks (`evaluation.evaluate`, on rank 0) at init, after SFT, every
   `eval.every` RL steps and at the end, all recorded by `runlog.RunLog`; resumable checkpoints
   every `checkpoint.every` steps (`checkpointing`), from which `checkpoint.resume` goes on
   exactly; the final model exported as a Hugging Face checkpoint with its tokenizer.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec
import numpy as np
import torch
import uvloop
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm.contrib.logging import logging_redirect_tqdm

from rlmtrain import checkpointing, parallel
from rlmtrain.algo import (
    IGNORE_INDEX,
    MicroBatch,
    PackedBatches,
    Sample,
    build_samples,
    build_sft_samples,
    compute_advantages,
    pack,
)
from rlmtrain.algo.unfused import unfused_grpo_loss, unfused_logprob, unfused_nll
from rlmtrain.config import Config, ConfigError
from rlmtrain.envs.base import Env, Task, check_env_name, get_env
from rlmtrain.evaluation import evaluate, spawned
from rlmtrain.kernels import fused_linear_grpo_loss, fused_linear_logprob, fused_linear_nll
from rlmtrain.model import PRESETS, CheckpointError, Transformer, build_model, save_hf
from rlmtrain.model.bpe import BPE_FILES, tokenizer_files, train_bpe, trained_tokenizer_dir
from rlmtrain.model.hf import hf_named
from rlmtrain.model.tokenizer import Tokenizer, load_tokenizer
from rlmtrain.optim import build_optimizer, lr_at, set_lr
from rlmtrain.rewards.chat_client import check_served
from rlmtrain.rewards.exploration import (
    beta_schedule,
    diversity_bonus,
    explored_reward,
    tree_turns,
)
from rlmtrain.rewards.turn_signals import TurnSignals, step_totals
from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout.engine import Engine, SamplingParams
from rlmtrain.rollout.engines import build_engine
from rlmtrain.rollout.scheduler import Scheduler
from rlmtrain.runlog import RunLog

log = logging.getLogger("rlmtrain.train")
T = TypeVar("T")


def main(cfg: Config) -> int:
    """Train as `cfg` says, as one rank of the world the environment describes (one process
    when not launched by torchrun)."""
    world, device = parallel.start(cfg.train.device)
    try:
        level = cfg.logging.level.upper() if world.is_main else "WARNING"
        logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr, force=True)
        _refuse_unwired(cfg, device)
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        # A SIGTERM (a plain `kill`, torchrun stopping the other ranks after one failed, a
        # scheduler's preemption) unwinds the run like an exception wherever it is, inside a
        # train step too, so its cleanup runs: the engine is closed (vLLM's engine processes
        # would otherwise outlive the trainer, orphaned and polling a core), REPL zygotes and
        # the run log too. The run resumes from its newest checkpoint.
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            # Log lines print above the run's progress bar instead of cutting through it.
            with logging_redirect_tqdm():
                return uvloop.run(_train(cfg, world, device))
        except _Terminated:
            log.warning("stopped by SIGTERM; the same command resumes from the newest checkpoint")
            return 128 + signal.SIGTERM
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        parallel.stop()


class _Terminated(BaseException):
    """A SIGTERM, raised where the main thread is: BaseException, like KeyboardInterrupt, so no
    `except Exception` on the way swallows it."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


async def _train(cfg: Config, world: parallel.World, device: torch.device) -> int:
    began = time.perf_counter()
    check_served(cfg.judge)  # before the run writes anything
    run_dir = _run_dir(cfg)
    resume_from = _resume_point(cfg, run_dir)

    # ---------------------------------------------------------------- data
    env = get_env(cfg.data.env, cfg)
    # Rank 0 synthesises the data and trains the tokenizer; the others then read its files.
    sft_tasks, rl_tasks, eval_tasks = _on_main_first(world, lambda: _task_sets(cfg, env))
    log.info(
        "data: %s, %d SFT / %d RL / %d held-out tasks",
        cfg.data.env,
        len(sft_tasks),
        len(rl_tasks),
        len(eval_tasks),
    )

    # ---------------------------------------------------------------- tokenizer and model
    cfg, tokenizer, tokenizer_dir = _on_main_first(
        world,
        lambda: _tokenizer(
            cfg, env, [*sft_tasks, *rl_tasks], run_dir, world, resuming=resume_from is not None
        ),
    )
    policy = build_model(msgspec.structs.replace(cfg.model, dtype="float32"))
    if tokenizer.vocab_size > policy.args.vocab_size:
        raise ConfigError(
            f"model.tokenizer: vocabulary of {tokenizer.vocab_size} does not fit the model's "
            f"{policy.args.vocab_size} embeddings"
        )
    model = parallel.shard(policy, device, _DTYPES[cfg.model.dtype])
    optimizer = build_optimizer(model, cfg)
    log.info(
        "model: %s, %.2fM parameters, vocabulary %d, on %d x %s (%s compute, fp32 masters)",
        cfg.model.hf_dir or f"preset {cfg.model.preset}",
        _millions(model),
        model.args.vocab_size,
        world.size,
        device.type,
        cfg.model.dtype,
    )
    state = checkpointing.TrainerState(
        phase="sft" if cfg.train.sft_steps else "rl",
        step=0,
        lr=0.0,
        seed=cfg.train.seed,
        world_size=world.size,
        schedules=_schedules(cfg),
    )
    if resume_from is not None:
        loaded = checkpointing.load(resume_from, model, optimizer)
        # Checked equal by `_resume_point`; recorded anew where an older checkpoint had none.
        state = msgspec.structs.replace(loaded, schedules=state.schedules)
        log.info("resumed from %s: %s step %d", resume_from, state.phase, state.step)
    # The engine serves its own copy of the policy, kept in step through update_weights by HF
    # names exactly as a separate inference engine is; on a CPU the copy costs only the weights.
    # Either engine starts from the config's model and receives the policy at the first sync,
    # before any rollout or evaluation.
    engine = build_engine(cfg, tokenizer, device=device)
    runlog = RunLog(cfg, run_dir, rank0=world.is_main)
    if resume_from is None:
        runlog.start_fresh()
    else:
        runlog.resume_after(state.phase, state.step)
    sync = _EngineSync(engine, model, colocate=cfg.rollout.colocate)

    async def evaluate_now(phase: str, step: int) -> None:
        if not eval_tasks:
            return
        await sync()
        if world.is_main:
            report = await evaluate(
                cfg, model, tokenizer, env, eval_tasks, engine=engine, phase=phase, step=step
            )
            runlog.eval(report)
            log.info(
                "eval %-5s step %3d  reward %s  spawn rate %s  children/root %.2f  "
                "(%d tasks, %.0f s)",
                phase,
                step,
                _number(report["reward_mean"]),
                _percent(report["spawn_rate"]),
                report["children_per_root"],
                report["tasks"],
                report["seconds"],
            )
        parallel.barrier()

    def save_checkpoint(
        phase: str, step: int, lr: float, reference: Transformer | None = None
    ) -> None:
        done = msgspec.structs.replace(state, phase=phase, step=step, lr=lr)
        frozen = {"reference": reference} if reference is not None else None
        out = checkpointing.save(
            run_dir, model, optimizer, done, keep=cfg.checkpoint.keep, frozen=frozen
        )
        log.info("checkpoint %s", out)

    try:
        if resume_from is None:
            await evaluate_now("init", 0)

        # ------------------------------------------------------------ SFT warm-up
        in_sft = cfg.train.sft_steps > 0 and state.phase == "sft"
        # A run resumed at SFT's end skips the teacher's trees: it would only skip them.
        if in_sft and state.step < cfg.train.sft_steps:
            samples = parallel.broadcast(
                await _teacher_samples(cfg, env, sft_tasks, tokenizer) if world.is_main else None
            )
            batches = _token_batches(samples, cfg.train.sft_step_tokens, cfg.train.seed)
            for _ in range(state.step):
                next(batches)
            for step in range(state.step, cfg.train.sft_steps):
                step_began = time.perf_counter()
                lr = lr_at(cfg, "sft", step)
                set_lr(optimizer, lr)
                packed = _pack(next(batches), cfg, world.size)
                await sync.release()
                row = _sft_step(model, optimizer, packed, cfg, device, rank=world.rank)
                row.update(phase="sft", step=step, lr=lr, seconds=time.perf_counter() - step_began)
                sync.stale()
                runlog.step(row)
                if _due(cfg, step, cfg.train.sft_steps):
                    save_checkpoint("sft", step + 1, lr)
                if step % cfg.logging.every == 0 or step == cfg.train.sft_steps - 1:
                    log.info(
                        "sft %3d  nll %.4f  entropy %.3f  tokens %d  %.0f tok/s",
                        step,
                        row["loss"],
                        row["entropy"],
                        row["tokens"],
                        row["tokens"] / row["seconds"],
                    )
        if in_sft:
            # Rank 0 keeps the records; every rank must agree, as evaluation ends at a barrier.
            if not parallel.broadcast(runlog.evaluated("sft")):
                await evaluate_now("sft", cfg.train.sft_steps)
            state = msgspec.structs.replace(state, phase="rl", step=0)

        # ------------------------------------------------------------ RL
        if cfg.train.steps:
            if state.step == 0:
                # RL starts from optimizer state of its own. Adam's moments from SFT would go on
                # pushing along SFT's gradients for tens of steps (momentum) and divide RL's far
                # smaller gradients by SFT's second moments: measured on the default, RL then
                # lowered held-out reward on one seed in three.
                optimizer = build_optimizer(model, cfg)
            reference = _reference(cfg, model, device, resume_from, state.step)
            await _rl(
                cfg,
                world,
                model,
                optimizer,
                tokenizer,
                env,
                rl_tasks,
                device,
                engine,
                sync,
                runlog,
                state.step,
                reference,
                save_checkpoint,
                evaluate_now,
            )
            # A run resumed after its last step (killed in the export) has it on record.
            if not parallel.broadcast(runlog.evaluated("final")):
                await evaluate_now("final", cfg.train.sft_steps + cfg.train.steps)

        # ------------------------------------------------------------ export
        out = _export(cfg, model, tokenizer, tokenizer_dir, run_dir / "final", world)
        log.info("saved %s (%.0f s in all)", out, time.perf_counter() - began)
        if eval_tasks and world.is_main:
            sys.stderr.write(runlog.summary_table() + "\n")
    finally:
        runlog.close()
        await engine.close()
    return 0


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _EngineSync:
    """Sends the policy's weights to the engine when they changed since the last send: every
    rank streams the parameters, each gathered whole from the shards as its engine takes it
    (`parallel.full_parameters`, the ranks in lockstep), into its own engine.

    Colocated (`rollout.colocate`), it also lends the GPU to the trainer: `release` puts vLLM
    to sleep before a train step, at level 2 (weights and KV cache freed, nothing copied to the
    host: the sync resends every weight, and each vLLM worker checks that none is missing), and
    the next call wakes it in two phases, the weights, then the sync, then the KV cache, so the
    buckets in transit never share the GPU with a KV cache. Requests wait while it sleeps.
    """

    def __init__(self, engine: Engine, model: torch.nn.Module, *, colocate: bool) -> None:
        self._engine = engine
        self._model = model
        self._colocate = colocate
        self._current = False
        self._asleep = False

    def stale(self) -> None:
        self._current = False

    async def release(self) -> None:
        if self._colocate and not self._asleep:
            await self._engine.sleep(level=2)
            self._asleep = True
            self._current = False

    async def __call__(self) -> None:
        if self._asleep:
            await self._engine.wake(("weights",))
        if not self._current:
            await self._engine.update_weights(hf_named(parallel.full_parameters(self._model)))
            self._current = True
        if self._asleep:
            await self._engine.wake(("kv_cache",))
            self._asleep = False


# ==================================================================== RL phase


async def _rl(
    cfg: Config,
    world: parallel.World,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    tokenizer: Tokenizer,
    env: Env,
    tasks: list[Task],
    device: torch.device,
    engine: Engine,
    sync: _EngineSync,
    runlog: RunLog,
    first_step: int,
    reference: Transformer | None,
    save_checkpoint: Callable[..., None],
    evaluate_now: Callable[[str, int], Awaitable[None]],
) -> None:
    picks = _batches(tasks, cfg.train.tasks_per_step, cfg.train.seed)
    for _ in range(first_step):
        next(picks)
    signals = TurnSignals(cfg)
    try:
        for step in range(first_step, cfg.train.steps):
            began = time.perf_counter()
            lr = lr_at(cfg, "rl", step)
            set_lr(optimizer, lr)
            await sync()
            # This rank's share of the step's tasks, all G roots of a task on one rank.
            batch = next(picks)[world.rank :: world.size]
            # Each request's seed comes from (this seed, trajectory id, turn): a rerun samples the
            # same trees whatever order the engine batched them in, on any number of ranks.
            sampling = SamplingParams(
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                seed=cfg.train.seed * 1_000_003 + step,
            )
            scheduler = Scheduler(engine, tokenizer, cfg.rollout, sampling=sampling)
            groups = await scheduler.rollout(batch, env, cfg.rollout.n_samples) if batch else []
            scores = await env.root_scores(batch, groups) if batch else []
            rewards = _with_exploration_bonus(groups, scores, cfg, step)
            credit = await signals.credit(groups)
            step_scores = await signals.steps(groups)
            advantages, adv_stats = compute_advantages(
                groups, rewards, cfg.algo, tool_credit=credit, step_rewards=step_totals(step_scores)
            )
            counts = parallel.all_sum(
                torch.tensor(
                    [
                        len(advantages),
                        adv_stats.groups_dropped_uniform,
                        adv_stats.roots_unscored,
                        *signals.local_sums(step_scores),
                    ],
                    dtype=torch.float64,
                )
            )
            kept, dropped, unscored = (int(c) for c in counts[:3].tolist())
            # Every weight divides by the global count of kept groups: docs/algorithm.md §4's
            # objective for the whole batch, of which each rank holds a share.
            local = build_samples(groups, advantages, cfg.algo, num_groups=max(1, kept))
            flat_local = [r for rs in scores for r in rs if r is not None]
            shares = parallel.all_gather((local, flat_local))
            samples = [sample for share, _ in shares for sample in share]
            flat = [r for _, rewards_of_rank in shares for r in rewards_of_rank]
            row: dict[str, Any] = {
                "phase": "rl",
                "step": step,
                "lr": lr,
                "reward_mean": _mean(flat),
                "groups_kept": kept,
                "groups_dropped_uniform": dropped,
                "roots_unscored": unscored,
                **_rollout_row(scheduler, groups),
                **signals.row(counts[3:].tolist()),
            }
            if samples:
                train_began = time.perf_counter()
                packed = _pack(samples, cfg, world.size)
                await sync.release()
                row.update(
                    _grpo_step(model, optimizer, packed, cfg, device, reference, rank=world.rank)
                )
                row["train_s"] = time.perf_counter() - train_began
                sync.stale()
                sync_began = time.perf_counter()
                await sync()
                row["sync_s"] = time.perf_counter() - sync_began
            row["seconds"] = time.perf_counter() - began
            runlog.step(row)
            runlog.samples("rl", step, groups, scores)
            runlog.histograms(
                "rl",
                step,
                reward=flat,
                advantage=[float(a) for sample in samples for a in sample.advantages],
                response_length=[
                    len(turn.completion_ids)
                    for group in groups
                    for trajectory in group.trajectories
                    for turn in trajectory.turns
                ],
            )
            if step % cfg.logging.every == 0 or step == cfg.train.steps - 1:
                log.info(
                    "rl %3d  reward %.3f  groups %d/%d  loss %s  tokens %d  rollout %.1f s  "
                    "step %.1f s  finish %s",
                    step,
                    row["reward_mean"],
                    kept,
                    kept + dropped,
                    f"{row['loss']:.4f}" if "loss" in row else "-",
                    row.get("tokens", 0),
                    row["rollout_s"],
                    row["seconds"],
                    row["finish_reasons"],
                )
            every = cfg.eval.every
            if every and (step + 1) % every == 0 and step + 1 < cfg.train.steps:
                await evaluate_now("rl", cfg.train.sft_steps + step + 1)
            # After the step's evaluation: a run resumed from here has it on record and goes on
            # from the generators as they were after it.
            if _due(cfg, step, cfg.train.steps):
                save_checkpoint("rl", step + 1, lr, reference)
    finally:
        await signals.close()


# ==================================================================== train steps


def _pack(samples: list[Sample], cfg: Config, world_size: int = 1) -> PackedBatches:
    return pack(
        samples,
        cfg.algo.micro_batch_tokens,
        world_size=world_size,
        truncate=cfg.algo.truncate_long_samples,
        shared_prefix_tokens=cfg.algo.shared_prefix_tokens,
    )


def _my_micro_batches(batches: PackedBatches, rank: int, device) -> list[MicroBatch]:
    """This rank's micro-batches on the device; an empty one (the packer deals every rank the
    same count) becomes a one-token micro-batch that trains nothing, so that this rank still
    joins every collective of the forward and backward."""
    return [
        (mb if mb.num_tokens else MicroBatch.placeholder()).to(device)
        for mb in batches.micro_batches(rank)
    ]


def _sft_step(
    model, optimizer, batches: PackedBatches, cfg: Config, device, *, rank: int = 0
) -> dict[str, Any]:
    """One optimizer step of weighted NLL over this rank's micro-batches (weights over all
    ranks sum to the objective); the step's sums stay on the device and are read once."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    head = _head(cfg)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, entropy sum, trained
    for mb in _my_micro_batches(batches, rank, device):
        hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.prefix_of)
        loss, entropy = head.nll(
            hidden, model.lm_head_weight, mb.targets, mb.weights, return_entropy=True
        )
        loss.backward()
        mask = mb.targets != IGNORE_INDEX
        sums += torch.stack([loss.detach(), entropy.detach()[mask].sum(), mask.sum()]).double()
    grad_norm = _clip_and_step(model, optimizer, cfg)
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
_GRPO_SUMS = (
    "loss",
    "clip_frac_low",
    "clip_frac_high",
    "tis_clipped_frac",
    "engine_logp_gap",
    "kl_mean",
    "entropy_sum",
    "trained_tokens",
)


def _grpo_step(
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
    micro = _my_micro_batches(batches, rank, device)
    # The packer gives every rank the same count, so every rank splits alike.
    updates = min(cfg.algo.updates_per_batch, len(micro))
    old = [_logprobs(model, mb, cfg) if updates > 1 else None for mb in micro]
    ref = [_logprobs(reference, mb, cfg) if reference is not None else None for mb in micro]
    model.train()
    head = _head(cfg)
    sums = torch.zeros(len(_GRPO_SUMS), dtype=torch.float64, device=device)
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
                    entropy.detach()[trained].sum(),
                    trained.sum(),
                ]
            ).double()
            if old[i] is not None and trained.any():
                gap = (old[i] - mb.sampler_logp)[trained].abs().max().double()
                mismatch = torch.maximum(mismatch, gap)
        norms.append(_clip_and_step(model, optimizer, cfg))
    row = dict(zip(_GRPO_SUMS, parallel.all_sum(sums).tolist(), strict=True))
    row["entropy"] = row.pop("entropy_sum") / max(1.0, row.pop("trained_tokens"))
    if not cfg.algo.tis_cap:
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
def _logprobs(model: Transformer, mb: MicroBatch, cfg: Config) -> torch.Tensor:
    model.eval()
    hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.prefix_of)
    return _head(cfg).logprob(
        hidden, model.lm_head_weight, mb.targets, temperature=cfg.rollout.temperature
    )


class _HeadOps(NamedTuple):
    logprob: Callable[..., Any]
    nll: Callable[..., Any]
    grpo: Callable[..., Any]


def _head(cfg: Config) -> _HeadOps:
    """The LM-head losses `train.loss_impl` names: the fused ops, or the unfused check."""
    if cfg.train.loss_impl == "unfused":
        return _HeadOps(unfused_logprob, unfused_nll, unfused_grpo_loss)
    impl = cfg.train.loss_impl
    return _HeadOps(
        functools.partial(fused_linear_logprob, impl=impl),
        functools.partial(fused_linear_nll, impl=impl),
        functools.partial(fused_linear_grpo_loss, impl=impl),
    )


def _uninitialised_like(model: Transformer) -> Transformer:
    """A model of `model`'s shape whose weights are left unset (built on the meta device and
    given storage only): for a copy whose weights are loaded next, where a default init of a
    large model would cost minutes for nothing."""
    with torch.device("meta"):
        skeleton = Transformer(
            model.args,
            attention=model.attention,
            activation_checkpointing=model.activation_checkpointing,
        )
    return skeleton.to_empty(device="cpu")


def _reference(
    cfg: Config, model: Transformer, device: torch.device, resume_from: Path | None, step: int
) -> Transformer | None:
    """The k3 KL's anchor: the policy where RL started (after SFT), frozen and sharded like it;
    a run resumed inside RL reads the one its checkpoint saved."""
    if cfg.algo.kl_beta <= 0:
        return None
    reference = parallel.shard(_uninitialised_like(model), device, _DTYPES[cfg.model.dtype])
    if resume_from is not None and step > 0:
        checkpointing.load_frozen(resume_from, "reference", reference)
    else:
        set_model_state_dict(reference, get_model_state_dict(model))
    reference.requires_grad_(False)
    return reference.eval()


def _with_exploration_bonus(
    groups: list[RolloutGroup], scores: list[list[float | None]], cfg: Config, step: int
) -> list[list[float | None]]:
    """R_n = r + beta_n * b * 1[r = 1] (docs/algorithm.md §3), b the tree's tool diversity,
    beta_n the cosine schedule over the RL steps; the scores unchanged when the bonus is off."""
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


def _clip_and_step(model: Transformer, optimizer: torch.optim.Optimizer, cfg: Config) -> float:
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # Over sharded gradients the norm is a DTensor; its whole value is the global norm.
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(norm):
        raise FloatingPointError(f"gradient norm is {norm}; step skipped would hide it, stopping")
    optimizer.step()
    return norm


# ==================================================================== data, tokenizer, saving


def _refuse_unwired(cfg: Config, device: torch.device) -> None:
    if not cfg.model.hf_dir and cfg.model.preset not in PRESETS:
        raise ConfigError(
            f"model.preset: unknown preset {cfg.model.preset!r}; known: {', '.join(PRESETS)}"
        )
    check_env_name(cfg.data.env)
    if cfg.rollout.colocate and device.type != "cuda":
        raise ConfigError(
            "rollout.colocate: vLLM's sleep mode frees GPU memory; this run trains on "
            f"{device.type} (set it false)"
        )
    if cfg.rollout.engine == "sim":
        raise ConfigError(
            "rollout.engine: 'sim' samples pseudo-random tokens, not the policy; train with "
            "'native' or 'vllm'"
        )


SCHEDULE_KEYS = (
    "train.sft_steps",
    "train.steps",
    "train.sft_lr",
    "train.lr",
    "train.lr_schedule",
    "train.warmup_steps",
    "train.min_lr_ratio",
    "algo.exploration_beta",
    "algo.tool_credit_alpha",
)
"""Config keys the LR schedule, the exploration bonus's cosine schedule and the tool credit's
alpha are functions of. Every checkpoint records them; a resume under other values is refused,
since it would not continue the run's schedules but switch to others midway."""


def _schedules(cfg: Config) -> dict[str, float | int | str]:
    values = {}
    for key in SCHEDULE_KEYS:
        section, name = key.split(".")
        values[key] = getattr(getattr(cfg, section), name)
    return values


def _check_schedules(
    checkpoint: Path, recorded: dict[str, float | int | str], wanted: dict[str, float | int | str]
) -> None:
    changed = [
        f"{key}={recorded[key]!r} (the config says {wanted[key]!r})"
        for key in SCHEDULE_KEYS
        if key in recorded and recorded[key] != wanted[key]
    ]
    if changed:
        raise CheckpointError(
            f"{checkpoint}: its run's schedules follow {', '.join(changed)}; resume with the "
            "checkpoint's values, or start a new run in another checkpoint.dir"
        )


def _run_dir(cfg: Config) -> Path:
    """The run folder, made; refused at the start, in one line, where the run could not write
    what it makes (before hours of training end in a lost export)."""
    run_dir = Path(cfg.checkpoint.dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"checkpoint.dir: cannot make {run_dir}: {exc.strerror}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"checkpoint.dir: {run_dir} is not writable")
    final = run_dir / "final"
    if final.exists() and not final.is_dir():
        raise ConfigError(f"checkpoint.dir: {final}, where the trained model goes, is a file")
    if cfg.logging.metrics_path:
        metrics = Path(cfg.logging.metrics_path)
        if metrics.is_dir():
            raise ConfigError(f"logging.metrics_path: {metrics} is a folder; name a .jsonl file")
        try:
            metrics.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"logging.metrics_path: cannot make {metrics.parent}: {exc.strerror}"
            ) from None
    return run_dir


def _resume_point(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` continues from; None for a fresh run (also when the
    run has none yet). An incomplete or damaged newest one, or one whose schedules the config
    would change, is a CheckpointError."""
    if not cfg.checkpoint.resume:
        earlier = checkpointing.names(run_dir)
        if earlier:
            # A new run's checkpoints would mix with these: pruning by step could delete the
            # new run's and a later resume could pick the old run's.
            raise CheckpointError(
                f"{checkpointing.checkpoints_dir(run_dir)} holds an earlier run's checkpoints "
                f"(newest {earlier[-1]}): --checkpoint.resume=true continues that run; to start "
                "a new one, choose another checkpoint.dir or remove that folder"
            )
        return None
    found = checkpointing.latest(run_dir)
    if found is None:
        log.info("checkpoint.resume: no checkpoint in %s yet, starting fresh", run_dir)
        return None
    recorded = checkpointing.trainer_state(found)
    _check_schedules(found, recorded.schedules, _schedules(cfg))
    if recorded.seed != cfg.train.seed:
        # The data order and every sample drawn follow the seed; the generators restored from
        # the checkpoint would silently overrule the config's.
        raise CheckpointError(
            f"{found}: its run was seeded with train.seed={recorded.seed} (the config says "
            f"{cfg.train.seed}); resume with the checkpoint's seed, or start a new run in "
            "another checkpoint.dir"
        )
    return found


def _on_main_first(world: parallel.World, make: Callable[[], T]) -> T:
    """`make()` on rank 0, then on the others once it is done: for steps that write shared
    files (data synthesis, tokenizer training) which the others then only read."""
    if world.is_main:
        made = make()
        parallel.barrier()
        return made
    parallel.barrier()
    return make()


def _task_sets(cfg: Config, env: Env) -> tuple[list[Task], list[Task], list[Task]]:
    sft = env.split_tasks(cfg, "sft") if cfg.train.sft_steps else []
    rl = env.split_tasks(cfg, "rl") if cfg.train.steps else []
    held_out = env.split_tasks(cfg, "eval") if cfg.eval.every else []
    if cfg.eval.tasks:
        held_out = held_out[: cfg.eval.tasks]
    return sft, rl, held_out


def _tokenizer(
    cfg: Config,
    env: Env,
    tasks: list[Task],
    run_dir: Path,
    world: parallel.World,
    *,
    resuming: bool = False,
) -> tuple[Config, Tokenizer, Path | None]:
    """The run's tokenizer and the config that names it: 'bpe' is trained (by rank 0; the
    others load it) on the run's own training text (never the held-out split's) into
    run_dir/tokenizer, and a randomly initialised model then gets exactly that many embedding
    rows unless model.vocab_size says. A resumed run reads the tokenizer its checkpoints were
    trained with: retrained on changed data or settings, its ids would no longer match the
    weights."""
    if cfg.model.tokenizer != "bpe":
        tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.hf_dir)
        folder = Path(cfg.model.tokenizer or cfg.model.hf_dir)
        return cfg, tokenizer, folder if cfg.model.tokenizer != "byte" else None
    folder = trained_tokenizer_dir(run_dir)
    if resuming:
        if not (folder / BPE_FILES[0]).is_file():
            raise ConfigError(
                f"checkpoint.resume: {folder} holds no tokenizer; the run's checkpoints cannot "
                "be read without the ids they were trained on"
            )
        tokenizer = load_tokenizer(str(folder))
    elif world.is_main:
        began = time.perf_counter()
        tokenizer = train_bpe(env.vocabulary_texts(tasks), cfg.model.bpe_vocab_size, folder)
        log.info(
            "tokenizer: BPE of %d ids trained in %.1f s (%s)",
            tokenizer.vocab_size,
            time.perf_counter() - began,
            folder,
        )
    else:
        tokenizer = load_tokenizer(str(folder))
    model = msgspec.structs.replace(
        cfg.model, tokenizer=str(folder), vocab_size=cfg.model.vocab_size or tokenizer.vocab_size
    )
    return msgspec.structs.replace(cfg, model=model), tokenizer, folder


async def _teacher_samples(
    cfg: Config, env: Env, tasks: list[Task], tokenizer: Tokenizer
) -> list[Sample]:
    """The SFT samples: the env's scripted teacher plays `tasks` through the scheduler; trees
    with a REPL error or a zero score (the env's own reward) are dropped (docs/algorithm.md §5)."""
    began = time.perf_counter()
    groups = await env.teach(tasks, tokenizer, cfg)
    scores = {}
    for group, values in zip(groups, await env.root_scores(tasks, groups), strict=True):
        for root, value in zip(group.roots, values, strict=True):
            scores[root.id] = 0.0 if value is None else value
    samples, stats = build_sft_samples(groups, lambda root, task: scores[root.id], cfg.algo)
    turns = sum(len(t.turns) for g in groups for t in g.trajectories)
    log.info(
        "sft: teacher played %d tasks (%d turns, mean score %.3f) in %.1f s; kept %s; "
        "%d samples, %d completion tokens",
        len(groups),
        turns,
        _mean(scores.values()),
        time.perf_counter() - began,
        _stats_line(stats),
        len(samples),
        sum(s.completion_len for s in samples),
    )
    if not samples:
        raise ConfigError(f"train.sft_steps: the teacher kept no tree ({_stats_line(stats)})")
    return samples


def _token_batches(samples: list[Sample], budget: int, seed: int) -> Iterator[list[Sample]]:
    """SFT batches of about `budget` tokens, endlessly, reshuffled every pass by a generator of
    their own (so the k-th batch depends on the seed alone); each batch's weights are
    re-normalised to the mean over its completion tokens (plain SFT NLL)."""
    shuffle = random.Random(f"sft/{seed}").shuffle
    order = list(range(len(samples)))
    while True:
        shuffle(order)
        batch: list[Sample] = []
        tokens = 0
        for index in order:
            batch.append(samples[index])
            tokens += samples[index].length
            if tokens >= budget:
                yield _token_mean(batch)
                batch, tokens = [], 0
        if batch:
            yield _token_mean(batch)


def _token_mean(batch: list[Sample]) -> list[Sample]:
    total = sum(s.completion_len for s in batch)
    return [
        msgspec.structs.replace(s, weights=np.full(s.completion_len, 1.0 / total, np.float32))
        for s in batch
    ]


def _export(
    cfg: Config,
    model: Transformer,
    tokenizer: Tokenizer,
    tokenizer_dir: Path | None,
    out: Path,
    world: parallel.World,
) -> Path:
    """The model as a Hugging Face checkpoint in `model.dtype`, with the tokenizer files it was
    trained with: the whole state gathered from the shards, written by rank 0."""
    state = parallel.full_state(model)
    if world.is_main:
        files = tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
        generation = None
        if not any(f.name == "generation_config.json" for f in files):
            generation = {"eos_token_id": list(tokenizer.stop_ids)}
        save_hf(
            model,
            out,
            state=state,
            dtype=_DTYPES[cfg.model.dtype],
            generation=generation,
            extra_files=files,
        )
    parallel.barrier()
    return out


def _due(cfg: Config, step: int, steps: int) -> bool:
    """Whether step `step` of a phase of `steps` ends in a checkpoint: every N, and the phase's
    last, so a run killed after a phase never has to do any of it again."""
    every = cfg.checkpoint.every
    return bool(every) and ((step + 1) % every == 0 or step + 1 == steps)


# ==================================================================== helpers


def _rollout_row(scheduler: Scheduler, groups: list[RolloutGroup]) -> dict[str, Any]:
    m = scheduler.metrics
    roots = [root for group in groups for root in group.roots]
    if m is None:  # this rank drew no task this step (fewer tasks than ranks)
        return {"rollout_s": 0.0, "generated_tokens": 0, "finish_reasons": {}, "spawn_rate": 0.0}
    return {
        "rollout_s": m.wall_s,
        "generated_tokens": m.generated_tokens,
        "engine_tokens_per_s": m.tokens_per_s,
        "engine_occupancy": m.engine_occupancy,
        "finish_reasons": m.finish_reasons,
        "children_per_root": m.children_per_root_mean,
        "spawn_rate": _mean(spawned(root) for root in roots),
    }


def _batches(items: list[T], size: int, seed: int) -> Iterator[list[T]]:
    """`size` items per step, endlessly: a window sliding over a shuffled order (wrapping at the
    end), reshuffled every len(items) // size steps by a generator of its own, so the k-th
    step's tasks depend on the seed alone (a resumed run skips k and is back in place)."""
    shuffle = random.Random(f"rl/{seed}").shuffle
    order = list(range(len(items)))
    per_pass = max(1, len(order) // size)
    for step in itertools.count():
        if step % per_pass == 0:
            shuffle(order)
        start = (step * size) % len(order)
        yield [items[order[(start + i) % len(order)]] for i in range(min(size, len(order)))]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _number(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"


def _percent(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.0%}"


def _millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def _stats_line(stats: msgspec.Struct) -> str:
    return ", ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(stats).items())


@record
def _launched_main() -> int:
    """`python -m rlmtrain.train` and `torchrun ... -m rlmtrain.train`: the arguments of
    `rlmtrain train`. Elastic's `record` writes a failing rank's traceback where torchrun
    reports it; torchrun then stops the other ranks."""
    from rlmtrain.cli import main as cli_main

    return cli_main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(_launched_main())
