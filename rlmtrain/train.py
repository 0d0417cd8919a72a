"""The single training script: data, SFT warm-up on teacher trees, then GRPO over rollout trees.

    rlmtrain train --config configs/tiny-cpu.toml [--section.key=value ...]

Read top to bottom, it is the whole loop of ARCHITECTURE.md on one process:

1. data: the env's three disjoint task sets (`Env.split_tasks`): the SFT slice, the RL tasks and
   the held-out evaluation tasks, each from its file or synthesised from its own paper groups;
2. tokenizer and model: a BPE trained on the run's own training text when `model.tokenizer` is
   'bpe' (the model then gets exactly its vocabulary), the model from its preset or a checkpoint;
3. SFT: the env's scripted teacher plays the SFT slice through the scheduler on a scripted
   engine; trees with a REPL error or a zero score are dropped; every kept turn is an NLL
   sample, batched by tokens (`train.sft_step_tokens`) and averaged over completion tokens;
4. RL: each step rolls out `tasks_per_step` tasks x G roots with the scheduler on the engine
   (sampling seeded per step), scores roots, turns rewards into tree advantages and exact
   per-token weights, packs the turns and takes `algo.updates_per_batch` clipped-GRPO updates
   through the fused loss; the new weights go to the engine by their Hugging Face names;
5. evaluation of the held-out tasks (`evaluation.evaluate`) at init, after SFT, every
   `eval.every` RL steps and at the end, all recorded by `runlog.RunLog` (metrics, evaluations,
   sample trees, TensorBoard, W&B, the curves' PNG); the final model is saved as a Hugging Face
   checkpoint with its tokenizer.

Single-process (CPU or one GPU). FSDP2 sharding, vLLM colocation and resuming build on these
same seams and are not wired here yet; a config asking for them stops with a clear error.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec
import numpy as np
import torch
import uvloop
from tqdm.contrib.logging import logging_redirect_tqdm

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
from rlmtrain.devices import resolve_device
from rlmtrain.envs.base import Env, Task, get_env
from rlmtrain.evaluation import evaluate, spawned
from rlmtrain.kernels import fused_linear_grpo_loss, fused_linear_logprob, fused_linear_nll
from rlmtrain.model import Transformer, build_model, named_hf_tensors, save_hf
from rlmtrain.model.bpe import copy_tokenizer_files, train_bpe, trained_tokenizer_dir
from rlmtrain.model.tokenizer import Tokenizer, load_tokenizer
from rlmtrain.rewards.exploration import (
    beta_schedule,
    diversity_bonus,
    explored_reward,
    tree_turns,
)
from rlmtrain.rewards.tool_credit import rule_credit
from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout.engine import Engine, SamplingParams
from rlmtrain.rollout.engines import build_engine
from rlmtrain.rollout.scheduler import Scheduler
from rlmtrain.runlog import RunLog

log = logging.getLogger("rlmtrain.train")
T = TypeVar("T")


def main(cfg: Config) -> int:
    logging.basicConfig(level=cfg.logging.level.upper(), format="%(message)s", stream=sys.stderr)
    _refuse_unwired(cfg)
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    # Log lines print above the run's progress bar instead of cutting through it.
    with logging_redirect_tqdm():
        return uvloop.run(_train(cfg))


async def _train(cfg: Config) -> int:
    began = time.perf_counter()
    device = resolve_device(cfg.train.device)
    run_dir = Path(cfg.checkpoint.dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- data
    env = get_env(cfg.data.env, cfg)
    sft_tasks = env.split_tasks(cfg, "sft") if cfg.train.sft_steps else []
    rl_tasks = env.split_tasks(cfg, "rl") if cfg.train.steps else []
    eval_tasks = env.split_tasks(cfg, "eval") if cfg.eval.every else []
    if cfg.eval.tasks:
        eval_tasks = eval_tasks[: cfg.eval.tasks]
    log.info(
        "data: %s, %d SFT / %d RL / %d held-out tasks",
        cfg.data.env,
        len(sft_tasks),
        len(rl_tasks),
        len(eval_tasks),
    )

    # ---------------------------------------------------------------- tokenizer and model
    cfg, tokenizer, tokenizer_dir = _tokenizer(cfg, env, [*sft_tasks, *rl_tasks], run_dir)
    model = build_model(cfg.model).to(device)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ConfigError(
            f"model.tokenizer: vocabulary of {tokenizer.vocab_size} does not fit the model's "
            f"{model.args.vocab_size} embeddings"
        )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.sft_lr or cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    log.info(
        "model: %s, %.2fM parameters, vocabulary %d, on %s",
        cfg.model.preset,
        _millions(model),
        model.args.vocab_size,
        device,
    )
    # The engine serves its own copy of the policy, kept in step through update_weights by HF
    # names exactly as a separate inference engine is; on a CPU the copy costs only the weights.
    engine = build_engine(cfg, tokenizer)
    runlog = RunLog(cfg, run_dir)
    save = functools.partial(_save, model, tokenizer_dir)

    async def evaluate_now(phase: str, step: int) -> None:
        if not eval_tasks:
            return
        await engine.update_weights(named_hf_tensors(model))
        report = await evaluate(
            cfg, model, tokenizer, env, eval_tasks, engine=engine, phase=phase, step=step
        )
        runlog.eval(report)
        log.info(
            "eval %-5s step %3d  reward %s  spawn rate %s  children/root %.2f  (%d tasks, %.0f s)",
            phase,
            step,
            _number(report["reward_mean"]),
            _percent(report["spawn_rate"]),
            report["children_per_root"],
            report["tasks"],
            report["seconds"],
        )

    try:
        await evaluate_now("init", 0)

        # ------------------------------------------------------------ SFT warm-up
        if cfg.train.sft_steps:
            samples = await _teacher_samples(cfg, env, sft_tasks, tokenizer)
            batches = _token_batches(samples, cfg.train.sft_step_tokens)
            for step in range(cfg.train.sft_steps):
                step_began = time.perf_counter()
                row = _sft_step(model, optimizer, _pack(next(batches), cfg), cfg, device)
                row.update(phase="sft", step=step, seconds=time.perf_counter() - step_began)
                runlog.step(row)
                _maybe_save(save, cfg, "sft", step)
                if step % cfg.logging.every == 0 or step == cfg.train.sft_steps - 1:
                    log.info(
                        "sft %3d  nll %.4f  entropy %.3f  tokens %d  %.0f tok/s",
                        step,
                        row["loss"],
                        row["entropy"],
                        row["tokens"],
                        row["tokens"] / row["seconds"],
                    )
            for group in optimizer.param_groups:
                group["lr"] = cfg.train.lr
            await evaluate_now("sft", cfg.train.sft_steps)

        # ------------------------------------------------------------ RL
        if cfg.train.steps:
            await _rl(
                cfg,
                model,
                optimizer,
                tokenizer,
                env,
                rl_tasks,
                device,
                engine,
                runlog,
                save,
                evaluate_now,
            )
            await evaluate_now("final", cfg.train.sft_steps + cfg.train.steps)

        # ------------------------------------------------------------ save
        out = save(run_dir / "final")
        log.info("saved %s (%.0f s in all)", out, time.perf_counter() - began)
        if eval_tasks:
            sys.stderr.write(runlog.summary_table() + "\n")
    finally:
        runlog.close()
        await engine.close()
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
    engine: Engine,
    runlog: RunLog,
    save: Callable[[Path], Path],
    evaluate_now: Callable[[str, int], Awaitable[None]],
) -> None:
    await engine.update_weights(named_hf_tensors(model))
    # The k3 KL anchors the policy to where RL started (after SFT): a frozen copy of it.
    reference = _frozen_copy(model) if cfg.algo.kl_beta > 0 else None
    picks = _batches(tasks, cfg.train.tasks_per_step)
    for step in range(cfg.train.steps):
        began = time.perf_counter()
        batch = next(picks)
        # Seeded per step: each request's stream comes from (seed, trajectory id, turn), so a
        # rerun samples the same trees whatever order the engine batched them in.
        sampling = SamplingParams(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=cfg.train.seed * 1_000_003 + step,
        )
        scheduler = Scheduler(engine, tokenizer, cfg.rollout, sampling=sampling)
        groups = await scheduler.rollout(batch, env, cfg.rollout.n_samples)
        scores = await env.root_scores(batch, groups)
        rewards = _with_exploration_bonus(groups, scores, cfg, step)
        credit = _tool_credit(groups) if cfg.algo.tool_credit_alpha > 0 else None
        advantages, adv_stats = compute_advantages(groups, rewards, cfg.algo, tool_credit=credit)
        flat = [r for rs in scores for r in rs if r is not None]
        row: dict[str, Any] = {
            "phase": "rl",
            "step": step,
            "reward_mean": _mean(flat),
            "groups_kept": len(advantages),
            "groups_dropped_uniform": adv_stats.groups_dropped_uniform,
            "roots_unscored": adv_stats.roots_unscored,
            **_rollout_row(scheduler, groups),
        }
        samples = build_samples(groups, advantages, cfg.algo, num_groups=max(1, len(advantages)))
        if samples:
            train_began = time.perf_counter()
            row.update(_grpo_step(model, optimizer, _pack(samples, cfg), cfg, device, reference))
            row["train_s"] = time.perf_counter() - train_began
            sync_began = time.perf_counter()
            await engine.update_weights(named_hf_tensors(model))
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
        _maybe_save(save, cfg, "rl", step)
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
        every = cfg.eval.every
        if every and (step + 1) % every == 0 and step + 1 < cfg.train.steps:
            await evaluate_now("rl", cfg.train.sft_steps + step + 1)


# ==================================================================== train steps


def _pack(samples: list[Sample], cfg: Config) -> PackedBatches:
    return pack(
        samples,
        cfg.algo.micro_batch_tokens,
        truncate=cfg.algo.truncate_long_samples,
        shared_prefix_tokens=cfg.algo.shared_prefix_tokens,
    )


def _sft_step(model, optimizer, batches: PackedBatches, cfg: Config, device) -> dict[str, Any]:
    """One optimizer step of weighted NLL over every micro-batch (weights sum to the objective);
    the step's sums stay on the device and are read once."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    head = _head(cfg)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, entropy sum, trained
    for mb in batches.micro_batches():
        if mb.num_tokens == 0:
            continue
        mb = mb.to(device)
        hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.prefix_of)
        loss, entropy = head.nll(
            hidden, model.lm_head_weight, mb.targets, mb.weights, return_entropy=True
        )
        loss.backward()
        mask = mb.targets != IGNORE_INDEX
        sums += torch.stack([loss.detach(), entropy.detach()[mask].sum(), mask.sum()]).double()
    grad_norm = _clip_and_step(model, optimizer, cfg)
    loss_sum, entropy_sum, trained = sums.tolist()
    return {
        "loss": loss_sum,
        "entropy": entropy_sum / max(1.0, trained),
        "tokens": batches.stats.tokens,
        "shared_tokens": batches.stats.shared_tokens,
        "trained_tokens": int(trained),
        "grad_norm": grad_norm,
    }


_GRPO_SUMS = ("loss", "clip_frac_low", "clip_frac_high", "tis_clipped_frac", "kl_mean", "entropy")


def _grpo_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    batches: PackedBatches,
    cfg: Config,
    device: torch.device,
    reference: Transformer | None = None,
) -> dict[str, Any]:
    """Clipped-GRPO updates over the rollout batch's micro-batches.

    With one update per batch (`algo.updates_per_batch = 1`) pi_old is the detached current
    policy, which the fused loss takes as `old_logp=None`: no second forward. With more, the
    micro-batches are split into that many mini-batches, pi_old is computed once before the
    first update, and the clip then acts. pi_ref is the frozen `reference`; the engine's
    log-probs enter through truncated IS. Metrics are summed on the device and read once.
    """
    micro = [mb.to(device) for mb in batches.micro_batches() if mb.num_tokens]
    updates = min(cfg.algo.updates_per_batch, len(micro))
    old = [_logprobs(model, mb, cfg) if updates > 1 else None for mb in micro]
    ref = [_logprobs(reference, mb, cfg) if reference is not None else None for mb in micro]
    model.train()
    head = _head(cfg)
    sums = torch.zeros(len(_GRPO_SUMS), dtype=torch.float64, device=device)
    mismatch = torch.zeros((), dtype=torch.float64, device=device)
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
            share = mb.num_tokens / batches.stats.tokens
            sums += torch.stack(
                [
                    loss.detach(),
                    m.clip_low_frac * share,
                    m.clip_high_frac * share,
                    m.tis_clipped_frac * share,
                    m.kl_mean * share,
                    entropy.detach()[trained].mean() * share,
                ]
            ).double()
            if old[i] is not None and trained.any():
                gap = (old[i] - mb.sampler_logp)[trained].abs().max().double()
                mismatch = torch.maximum(mismatch, gap)
        norms.append(_clip_and_step(model, optimizer, cfg))
    row = dict(zip(_GRPO_SUMS, sums.tolist(), strict=True))
    if updates > 1:
        row["engine_logp_max_abs_diff"] = float(mismatch)
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


def _clip_and_step(model: Transformer, optimizer: torch.optim.Optimizer, cfg: Config) -> float:
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if not math.isfinite(norm):
        raise FloatingPointError(f"gradient norm is {norm}; step skipped would hide it, stopping")
    optimizer.step()
    return norm


# ==================================================================== data, tokenizer, saving


def _refuse_unwired(cfg: Config) -> None:
    if cfg.rollout.engine != "native":
        raise ConfigError(
            f"rollout.engine: '{cfg.rollout.engine}' is not wired into train yet; use 'native'"
        )
    if cfg.checkpoint.resume:
        raise ConfigError("checkpoint.resume: resuming is not wired into train yet")


def _tokenizer(
    cfg: Config, env: Env, tasks: list[Task], run_dir: Path
) -> tuple[Config, Tokenizer, Path | None]:
    """The run's tokenizer and the config that names it: 'bpe' is trained here on the run's own
    training text (never the held-out split's) into run_dir/tokenizer, and a randomly
    initialised model then gets exactly that many embedding rows unless model.vocab_size says."""
    if cfg.model.tokenizer != "bpe":
        tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.hf_dir)
        folder = Path(cfg.model.tokenizer or cfg.model.hf_dir)
        return cfg, tokenizer, folder if cfg.model.tokenizer != "byte" else None
    if cfg.model.hf_dir:
        raise ConfigError("model.tokenizer: 'bpe' trains a new vocabulary; a loaded hf_dir has one")
    folder = trained_tokenizer_dir(run_dir)
    began = time.perf_counter()
    tokenizer = train_bpe(env.vocabulary_texts(tasks), cfg.model.bpe_vocab_size, folder)
    log.info(
        "tokenizer: BPE of %d ids trained in %.1f s (%s)",
        tokenizer.vocab_size,
        time.perf_counter() - began,
        folder,
    )
    model = msgspec.structs.replace(
        cfg.model, tokenizer=str(folder), vocab_size=cfg.model.vocab_size or tokenizer.vocab_size
    )
    return msgspec.structs.replace(cfg, model=model), tokenizer, folder


async def _teacher_samples(
    cfg: Config, env: Env, tasks: list[Task], tokenizer: Tokenizer
) -> list[Sample]:
    """The SFT samples: the env's scripted teacher plays `tasks` through the scheduler; trees
    with a REPL error or a zero score (the env's own reward) are dropped (SPEC.md §5)."""
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


def _token_batches(samples: list[Sample], budget: int) -> Iterator[list[Sample]]:
    """SFT batches of about `budget` tokens, endlessly, reshuffled every pass; each batch's
    weights are re-normalised to the mean over its completion tokens (plain SFT NLL)."""
    order = list(range(len(samples)))
    while True:
        random.shuffle(order)
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


def _save(model: Transformer, tokenizer_dir: Path | None, out: Path) -> Path:
    """The model as a Hugging Face checkpoint, with the tokenizer files it was trained with."""
    save_hf(model, out)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def _maybe_save(save: Callable[[Path], Path], cfg: Config, phase: str, step: int) -> None:
    every = cfg.checkpoint.every
    if every and (step + 1) % every == 0:
        out = save(Path(cfg.checkpoint.dir) / f"{phase}-step{step + 1}")
        log.info("saved %s", out)


# ==================================================================== helpers


def _rollout_row(scheduler: Scheduler, groups: list[RolloutGroup]) -> dict[str, Any]:
    m = scheduler.metrics
    roots = [root for group in groups for root in group.roots]
    return {
        "rollout_s": m.wall_s,
        "generated_tokens": m.generated_tokens,
        "engine_tokens_per_s": m.tokens_per_s,
        "engine_occupancy": m.engine_occupancy,
        "finish_reasons": m.finish_reasons,
        "children_per_root": m.children_per_root_mean,
        "spawn_rate": _mean(spawned(root) for root in roots),
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


def _number(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"


def _percent(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.0%}"


def _millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def _stats_line(stats: msgspec.Struct) -> str:
    return ", ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(stats).items())
