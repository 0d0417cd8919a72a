"""The RL phase: GRPO over rollout trees, step by step, then the final evaluation.

One step: the step's `tasks_per_step` x G roots are dealt over the ranks (`rollout.dealing`);
each rank rolls out its share on its own engine (sampling seeded by the request's place in the
tree), the groups are put back together and each is scored on one rank, which turns rewards into
tree advantages and exact per-token weights over the global number of kept groups; the samples
of every rank are gathered and re-dealt by tokens, and `algo.updates_per_batch` clipped-GRPO
updates run through the fused loss; the new weights go to every engine by their Hugging Face
names.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from rlmtrain import checkpointing, memory, parallel, watchdog
from rlmtrain.algo import build_samples, compute_advantages
from rlmtrain.algo.staleness import summarise, token_staleness
from rlmtrain.config import Config
from rlmtrain.envs.base import Task
from rlmtrain.errors import UserError
from rlmtrain.model import Transformer
from rlmtrain.optim import build_optimizer, lr_at, set_lr
from rlmtrain.resume import after_a_stop
from rlmtrain.rewards.step_rewards import StepRewarder
from rlmtrain.rollout import dealing
from rlmtrain.rollout.scheduler import Scheduler
from rlmtrain.training.batches import task_batches
from rlmtrain.training.materialise import sharded_like
from rlmtrain.training.run import Run, max_over_ranks, mean_or_nan
from rlmtrain.training.split import RemoteRollouts, StepRollout, rollout_fields, step_sampling
from rlmtrain.training.steps import DTYPES, grpo_step, pack_samples

log = logging.getLogger("rlmtrain.train")


async def rl_phase(run: Run) -> None:
    """GRPO from where the run stands to `train.steps`, then the final evaluation."""
    cfg = run.cfg
    # A split world's inference ranks roll out every step (`training.split`).
    remote = RemoteRollouts(run.world, cfg, run.device) if run.world.inference_ranks else None
    if not cfg.train.steps:
        if remote is not None:
            await remote.start(0, run.model)  # nothing to roll out: they end
        return
    first = run.state.step
    if first == 0 or not run.optimizer.state:
        # RL starts from optimizer state of its own. Adam's moments from SFT would go on
        # pushing along SFT's gradients for tens of steps (momentum) and divide RL's far
        # smaller gradients by SFT's second moments: measured on the default, RL then
        # lowered held-out reward on one seed in three. A resumed RL phase whose checkpoint
        # held a fresh optimizer (no update yet) gets RL's too, not the one start-up built
        # for SFT with SFT's epsilon.
        run.optimizer = build_optimizer(run.model, cfg, "rl")
    reference = reference_policy(run.cfg, run.model, run.device, run.resume_from, first)
    if remote is not None:
        await remote.start(first, run.model)
    picks = task_batches(run.tasks.rl, cfg.train.tasks_per_step, cfg.train.seed)
    for _ in range(first):
        next(picks)
    rewarder = StepRewarder(cfg, run.env)
    try:
        for step in range(first, cfg.train.steps):
            lr = await rl_step(run, step, next(picks), rewarder, reference, remote)
            every = cfg.eval.every
            if every and (step + 1) % every == 0 and step + 1 < cfg.train.steps:
                await run.evaluate("rl", cfg.train.sft_steps + step + 1)
            # After the step's evaluation: a run resumed from here has it on record and goes on
            # from the generators as they were after it.
            if run.due(step, cfg.train.steps):
                run.checkpoint("rl", step + 1, lr, reference)
    finally:
        await rewarder.close()
    # A run resumed after its last step (killed in the export) has it on record.
    await run.evaluate_once("final", cfg.train.sft_steps + cfg.train.steps)


async def rl_step(
    run: Run,
    step: int,
    tasks: list[Task],
    rewarder: StepRewarder,
    reference: Transformer | None,
    remote: RemoteRollouts | None = None,
) -> float:
    """One GRPO step on `tasks` (the whole step's, dealt here over the ranks, or rolled out by
    the inference ranks of a split world: `remote`); its row goes to the run log. Returns the
    step's learning rate."""
    cfg, world = run.cfg, run.world
    began = time.perf_counter()
    watchdog.phase(f"rl step {step}: rollout")
    lr = lr_at(cfg, "rl", step)
    set_lr(run.optimizer, lr)
    if remote is None:
        await run.sync()
        rolled = await roll_out_here(run, step, tasks)
        # The weights this step trains: the engine's, synced before the rollout.
        version = run.engine.stats().weight_version
    else:
        waited = time.perf_counter()
        rolled = await remote.take(step, tasks)
        rolled.fields["rollout_wait_s"] = time.perf_counter() - waited
        version = step  # the inference ranks count versions as the updates of this phase
    marks = {"rollout": memory.figures(run.device)}
    groups, scored = rolled.groups, rolled.scored
    batch = [tasks[i] for i in scored]
    roots = [root for group in groups for root in group.roots]
    failed = [root for root in roots if root.failure]
    rewards = await rewarder(batch, groups, step)
    advantages, adv_stats = compute_advantages(groups, rewards, cfg.algo)
    counts = parallel.all_sum(
        torch.tensor(
            [
                len(advantages),
                adv_stats.groups_dropped_uniform,
                adv_stats.roots_unscored,
                len(roots),
                len(failed),
                *rewarder.local_sums(rewards),
            ],
            dtype=torch.float64,
        )
    )
    kept, dropped, unscored, all_roots, all_failed = (int(c) for c in counts[:5].tolist())
    if all_roots and all_failed == all_roots:  # the same verdict on every rank
        causes = parallel.all_gather(failed[0].failure if failed else "")
        raise UserError(
            f"rl step {step}: no tree could run (each of its {all_roots} roots failed in the "
            f"scheduler): {next(c for c in causes if c)}; {after_a_stop(cfg)}"
        )
    # Every weight divides by the global count of kept groups: docs/algorithm.md §4's
    # objective for the whole batch, of which each rank holds a share.
    local = build_samples(groups, advantages, cfg.algo, num_groups=max(1, kept))
    scores = rewards.env_scores
    flat_local = [r for rs in scores for r in rs if r is not None]
    shares = parallel.all_gather((local, flat_local, token_staleness(groups, version)))
    samples = [sample for share, _, _ in shares for sample in share]
    flat = [r for _, rewards_of_rank, _ in shares for r in rewards_of_rank]
    ages = sum((rank_ages for _, _, rank_ages in shares), Counter())
    staleness = summarise(ages)
    row: dict[str, Any] = {
        "phase": "rl",
        "step": step,
        "lr": lr,
        "reward_mean": mean_or_nan(flat),
        "groups_kept": kept,
        "groups_dropped_uniform": dropped,
        "roots_unscored": unscored,
        "roots_failed": all_failed,
        **rolled.fields,
        **rewarder.row(counts[5:].tolist()),
        **staleness.row(),
    }
    if samples:
        watchdog.phase(f"rl step {step}: training")
        train_began = time.perf_counter()
        packed = pack_samples(samples, cfg, world.size)
        await run.sync.release()
        row.update(
            grpo_step(run.model, run.optimizer, packed, cfg, run.device, reference, rank=world.rank)
        )
        row["train_s"] = time.perf_counter() - train_began
        marks["train"] = memory.figures(run.device)
        run.sync.stale()
    if samples or remote is not None:
        watchdog.phase(f"rl step {step}: weight sync")
        sync_began = time.perf_counter()
        if remote is None:
            await run.sync()
        elif step + 1 < cfg.train.steps:
            # Every update but the last goes to the inference ranks (one that trained nothing
            # too): each waits for the version that admits its next step.
            await remote.send_weights(run.model)
        row["sync_s"] = time.perf_counter() - sync_began
        marks["sync"] = memory.figures(run.device)
    row.update(memory.step_row(marks))
    # The step waits for the slowest engine.
    max_over_ranks(row, "rollout_s")
    row["seconds"] = time.perf_counter() - began
    run.runlog.step(row)
    run.runlog.samples("rl", step, groups, scores)
    run.runlog.histograms(
        "rl",
        step,
        reward=flat,
        advantage=[float(a) for sample in samples for a in sample.advantages],
        staleness=[age for age, tokens in sorted(ages.items()) for _ in range(tokens)],
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
    return lr


async def roll_out_here(run: Run, step: int, tasks: list[Task]) -> StepRollout:
    """The step's roots dealt over the ranks' own engines (`rollout.dealing`: every engine
    rolls out), each group put back whole on the rank that holds its first root, which scores
    it: only the parts of groups a share boundary cut travel."""
    cfg, world = run.cfg, run.world
    shares = dealing.deal(len(tasks), cfg.rollout.n_samples, world.size)
    mine = shares[world.rank]
    scheduler = Scheduler(run.engine, run.tokenizer, cfg.rollout, sampling=step_sampling(cfg, step))
    rolled = (
        await scheduler.rollout(
            [tasks[task] for task, _ in mine],
            run.env,
            cfg.rollout.n_samples,
            samples=[samples for _, samples in mine],
        )
        if mine
        else []
    )
    parts = [(task, group) for (task, _), group in zip(mine, rolled, strict=True)]
    scored = [i for i in range(len(tasks)) if dealing.owner(i, shares) == world.rank]
    sent = parallel.all_gather([(t, g) for t, g in parts if t not in scored])
    groups = dealing.merge(
        tasks, scored, [parts if r == world.rank else p for r, p in enumerate(sent)]
    )
    fields = rollout_fields(scheduler.metrics, rolled)
    # Whether every engine worked this step (an idle one shows as 0).
    fields["generated_tokens_per_rank"] = parallel.all_gather(fields["generated_tokens"])
    return StepRollout(groups, scored, fields)


def reference_policy(
    cfg: Config, model: Transformer, device: torch.device, resume_from: Path | None, step: int
) -> Transformer | None:
    """The k3 KL's anchor: the policy where RL started (after SFT), frozen and sharded like it;
    a run resumed inside RL reads the one its checkpoint saved."""
    if cfg.algo.kl_beta <= 0:
        return None
    reference = sharded_like(model, device, DTYPES[cfg.model.dtype])
    if resume_from is not None and step > 0:
        checkpointing.load_frozen(resume_from, "reference", reference)
    else:
        set_model_state_dict(reference, get_model_state_dict(model))
    reference.requires_grad_(False)
    return reference.eval()
