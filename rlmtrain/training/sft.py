"""The SFT warm-up: the env's scripted teacher plays the SFT slice through the scheduler on a
scripted engine; trees with a REPL error or a zero score are dropped (docs/algorithm.md §5);
every kept turn is an NLL sample, batched by tokens (`train.sft_step_tokens`), averaged over
completion tokens, each step's batch dealt over the ranks. Ends with the held-out evaluation.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator

import msgspec
import numpy as np

from rlmtrain import parallel, watchdog
from rlmtrain.algo import Sample, build_sft_samples
from rlmtrain.config import Config, ConfigError
from rlmtrain.envs.base import Env, Task
from rlmtrain.errors import UserError
from rlmtrain.model.tokenizer import Tokenizer
from rlmtrain.optim import lr_at, set_lr
from rlmtrain.rlm.records import failed_everywhere
from rlmtrain.rollout.teaching import teach
from rlmtrain.training.run import Run, max_over_ranks, mean_or_nan
from rlmtrain.training.steps import pack_samples, sft_step

log = logging.getLogger("rlmtrain.train")


async def sft_phase(run: Run) -> None:
    """SFT from where the run stands to `train.sft_steps`, then its evaluation; the run then
    stands at RL's step 0. Nothing to do for a run without SFT or already past it."""
    cfg, world = run.cfg, run.world
    steps = cfg.train.sft_steps
    if not steps or run.state.phase != "sft":
        return
    # A run resumed at SFT's end skips the teacher's trees: it would only skip them.
    if run.state.step < steps:
        watchdog.phase("sft: the teacher's trees")
        samples = parallel.broadcast(
            await teacher_samples(cfg, run.env, run.tasks.sft, run.tokenizer)
            if world.is_main
            else None
        )
        batches = token_batches(samples, cfg.train.sft_step_tokens, cfg.train.seed)
        for _ in range(run.state.step):
            next(batches)
        for step in range(run.state.step, steps):
            watchdog.phase(f"sft step {step}")
            began = time.perf_counter()
            lr = lr_at(cfg, "sft", step)
            set_lr(run.optimizer, lr)
            packed = pack_samples(next(batches), cfg, world.size)
            await run.sync.release()
            row = sft_step(run.model, run.optimizer, packed, cfg, run.device, rank=world.rank)
            row.update(phase="sft", step=step, lr=lr, seconds=time.perf_counter() - began)
            max_over_ranks(row)
            run.sync.stale()
            run.runlog.step(row)
            if run.due(step, steps):
                run.checkpoint("sft", step + 1, lr)
            if step % cfg.logging.every == 0 or step == steps - 1:
                log.info(
                    "sft %3d  nll %.4f  entropy %.3f  tokens %d  %.0f tok/s",
                    step,
                    row["loss"],
                    row["entropy"],
                    row["tokens"],
                    row["tokens"] / row["seconds"],
                )
    await run.evaluate_once("sft", steps)
    run.state = msgspec.structs.replace(run.state, phase="rl", step=0)


async def teacher_samples(
    cfg: Config, env: Env, tasks: list[Task], tokenizer: Tokenizer
) -> list[Sample]:
    """The SFT samples: the env's scripted teacher plays `tasks` through the scheduler; trees
    with a REPL error or a zero score (the env's own reward) are dropped."""
    began = time.perf_counter()
    groups = await teach(env, tasks, tokenizer, cfg.rollout)
    failure = failed_everywhere(groups)
    if failure:  # the machine's doing, not the teacher's nor the limits'
        raise UserError(f"sft: no tree of the {env.name} teacher could run: {failure}")
    scores = {}
    for group, values in zip(groups, await env.root_scores(tasks, groups), strict=True):
        for root, value in zip(group.roots, values, strict=True):
            scores[root.id] = 0.0 if value is None else value
    samples, stats = build_sft_samples(groups, lambda root, task: scores[root.id], cfg.algo)
    turns = sum(len(t.turns) for g in groups for t in g.trajectories)
    kept = ", ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(stats).items())
    log.info(
        "sft: teacher played %d tasks (%d turns, mean score %.3f) in %.1f s; kept %s; "
        "%d samples, %d completion tokens",
        len(groups),
        turns,
        mean_or_nan(scores.values()),
        time.perf_counter() - began,
        kept,
        len(samples),
        sum(s.completion_len for s in samples),
    )
    if not samples:
        raise ConfigError(f"train.sft_steps: the teacher kept no tree ({kept})")
    return samples


def token_batches(samples: list[Sample], budget: int, seed: int) -> Iterator[list[Sample]]:
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
