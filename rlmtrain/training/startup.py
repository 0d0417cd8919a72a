"""A run's start: everything the phases need, checked and made in the order that loses nothing.

Checks that need no work come first (the judge served, the run folder writable, the checkpoint
to resume from sound), then the data (synthesised by rank 0, read by the others), the tokenizer,
the model sharded over the ranks with its optimizer and state, the engine and the run log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import torch

from rlmtrain import memory, parallel
from rlmtrain.config import Config, ConfigError
from rlmtrain.envs.base import Env, Task, check_env_name, get_env
from rlmtrain.kernels import triton_unusable_reason
from rlmtrain.launch import check_shared_folder
from rlmtrain.model import PRESETS, model_skeleton
from rlmtrain.model.bpe import BPE_FILES, train_bpe
from rlmtrain.model.tokenizer import Tokenizer, load_tokenizer, with_chat_template_kwargs
from rlmtrain.optim import build_optimizer
from rlmtrain.resume import resume_point, starting_state
from rlmtrain.rewards.chat_client import check_served
from rlmtrain.rollout.engines import build_engine
from rlmtrain.run_folder import RunFolder
from rlmtrain.runlog import RunLog, check_wandb
from rlmtrain.training.materialise import sharded_policy
from rlmtrain.training.run import EngineSync, Run, TaskSets
from rlmtrain.training.steps import DTYPES

log = logging.getLogger("rlmtrain.train")
T = TypeVar("T")


def check_run_rules(cfg: Config, device: torch.device) -> None:
    """The rules of a training run that the config alone cannot check (`config.rules` checks
    those at load): a known preset and env, replicas that divide the world, a root a step for
    every rank's engine, an engine that samples the policy, colocation on a GPU, Triton loss
    kernels where they can run, wandb installed where a W&B project is set. Refused before
    anything starts; the env's own rules (`Env.teacher`'s limits) follow in `start_run`, before
    anything is written."""
    if not cfg.model.hf_dir and cfg.model.preset not in PRESETS:
        raise ConfigError(
            f"model.preset: unknown preset {cfg.model.preset!r}; known: {', '.join(PRESETS)}"
        )
    check_env_name(cfg.data.env)
    if parallel.size() % cfg.parallel.replicate:
        raise ConfigError(
            f"parallel.replicate: {parallel.size()} ranks do not split into "
            f"{cfg.parallel.replicate} replicas of equal size"
        )
    roots = cfg.train.tasks_per_step * cfg.rollout.n_samples
    engines = cfg.rollout.inference_ranks or parallel.size()
    if cfg.train.steps and roots < engines:
        raise ConfigError(
            f"train.tasks_per_step: {cfg.train.tasks_per_step} x rollout.n_samples "
            f"{cfg.rollout.n_samples} = {roots} roots a step leave engines of {engines} "
            "ranks idle; raise either to at least the number of ranks that roll out"
        )
    if cfg.train.loss_impl == "triton" and triton_unusable_reason(device):
        raise ConfigError(
            f"train.loss_impl: 'triton' cannot run on {device}: "
            f"{triton_unusable_reason(device)} ('auto' picks what runs)"
        )
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
    check_wandb(cfg)


async def start_run(cfg: Config, world: parallel.World, device: torch.device) -> Run:
    check_served(cfg.judge)  # before the run writes anything
    env = get_env(cfg.data.env, cfg)
    folder = RunFolder.of(cfg)
    # First, so ranks that see different folders cannot disagree about what is in it below.
    check_shared_folder(folder, world)
    resume_from = resume_point(cfg, folder)
    if cfg.train.sft_steps and resume_from is None:
        # The env's rules for the run's limits. A resumed run's teacher may never play (its
        # checkpoint may be past SFT); where it does, it refuses the limits as it starts.
        env.teacher(cfg.rollout)
    folder.make()
    if cfg.checkpoint.resume and resume_from is None:
        log.info("checkpoint.resume: no checkpoint in %s yet, starting fresh", folder.root)

    # Rank 0 synthesises the data and trains the tokenizer; the others then read its files.
    tasks = on_main_first(world, lambda: task_sets(cfg, env))
    log.info(
        "data: %s, %d SFT / %d RL / %d held-out tasks",
        cfg.data.env,
        len(tasks.sft),
        len(tasks.rl),
        len(tasks.held_out),
    )
    training_tasks = [*tasks.sft, *tasks.rl]
    resuming = resume_from is not None
    cfg, tokenizer, tokenizer_dir = on_main_first(
        world, lambda: run_tokenizer(cfg, env, training_tasks, folder, world, resuming=resuming)
    )

    shape = model_skeleton(cfg.model).args
    vocab_size = shape.vocab_size
    guess = memory.check_fits(cfg, shape, world.size, device)
    log.info("memory: estimated %s", guess.describe())
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"model.tokenizer: vocabulary of {tokenizer.vocab_size} does not fit the model's "
            f"{vocab_size} embeddings"
        )
    # Refused here, before the model and the engine start, when the tokenizer cannot use them.
    tokenizer = with_chat_template_kwargs(tokenizer, cfg.rollout.chat_template_kwargs)
    model = sharded_policy(cfg.model, device, DTYPES[cfg.model.dtype], cfg.parallel.replicate)
    # A resumed run's optimizer takes its hyperparameters from the checkpoint it loads.
    optimizer = build_optimizer(model, cfg, "sft" if cfg.train.sft_steps else "rl")
    log.info(
        "model: %s, %.2fM parameters, vocabulary %d, on %d x %s (%s compute, fp32 masters)",
        cfg.model.hf_dir or f"preset {cfg.model.preset}",
        sum(p.numel() for p in model.parameters()) / 1e6,
        model.args.vocab_size,
        world.size,
        device.type,
        cfg.model.dtype,
    )
    state = starting_state(cfg, world.size, resume_from, model, optimizer)

    # The engine serves its own copy of the policy, kept in step through update_weights by HF
    # names exactly as a separate inference engine is; on a CPU the copy costs only the weights.
    # Either engine starts with storage and no loaded weights, and receives the policy at the
    # first sync, before any rollout or evaluation: a load would be overwritten unread.
    engine = build_engine(cfg, tokenizer, device=device, weights="sync")
    try:
        runlog = RunLog(cfg, folder.root, rank0=world.is_main)
        if resuming:
            runlog.resume_after(state.phase, state.step)
        else:
            runlog.start_fresh()
    except BaseException:
        await engine.close()  # vLLM's engine processes would outlive the trainer
        raise
    return Run(
        cfg=cfg,
        world=world,
        device=device,
        folder=folder,
        env=env,
        tasks=tasks,
        tokenizer=tokenizer,
        tokenizer_dir=tokenizer_dir,
        model=model,
        optimizer=optimizer,
        state=state,
        resume_from=resume_from,
        engine=engine,
        sync=EngineSync(engine, model, colocate=cfg.rollout.colocate),
        runlog=runlog,
    )


def on_main_first(world: parallel.World, make: Callable[[], T]) -> T:
    """`make()` on rank 0, then on the others once it is done: for steps that write shared
    files (data synthesis, tokenizer training) which the others then only read."""
    if world.is_main:
        made = make()
        parallel.barrier()
        return made
    parallel.barrier()
    return make()


def task_sets(cfg: Config, env: Env) -> TaskSets:
    sft = env.split_tasks(cfg, "sft") if cfg.train.sft_steps else []
    rl = env.split_tasks(cfg, "rl") if cfg.train.steps else []
    held_out = env.split_tasks(cfg, "eval") if cfg.eval.every else []
    if cfg.eval.tasks:
        held_out = held_out[: cfg.eval.tasks]
    sft_key = "sft_path" if cfg.data.sft_path else "train_path"
    _check_held_out(held_out, [("train_path", rl), (sft_key, sft)])
    return TaskSets(sft, rl, held_out)


def _check_held_out(held_out: list[Task], trained: list[tuple[str, list[Task]]]) -> None:
    """Refuse held-out tasks that a phase trains on (the same record in both files: the same
    file named twice, or a task copied across): their figures would be training figures
    reported as held-out. Synthesised sets come from disjoint groups and never share one."""
    encode = msgspec.json.encode
    held = {encode(task) for task in held_out}
    for key, tasks in trained:
        shared = [task for task in tasks if encode(task) in held]
        if shared:
            raise ConfigError(
                f"data.eval_path: {len(shared)} of the {len(held_out)} held-out tasks are "
                f"training tasks too (task {shared[0].id!r} is also in data.{key}): held-out "
                "figures would be training figures; evaluate on tasks no phase trains on"
            )


def run_tokenizer(
    cfg: Config,
    env: Env,
    tasks: list[Task],
    folder: RunFolder,
    world: parallel.World,
    *,
    resuming: bool = False,
) -> tuple[Config, Tokenizer, Path | None]:
    """The run's tokenizer and the config that names it: 'bpe' is trained (by rank 0; the
    others load it) on the run's own training text (never the held-out split's) into the run
    folder's tokenizer/, and a randomly initialised model then gets exactly that many embedding
    rows unless model.vocab_size says. A resumed run reads the tokenizer its checkpoints were
    trained with: retrained on changed data or settings, its ids would no longer match the
    weights."""
    if cfg.model.tokenizer != "bpe":
        tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.hf_dir)
        named = Path(cfg.model.tokenizer or cfg.model.hf_dir)
        return cfg, tokenizer, named if cfg.model.tokenizer != "byte" else None
    trained = folder.tokenizer
    if resuming:
        if not (trained / BPE_FILES[0]).is_file():
            raise ConfigError(
                f"checkpoint.resume: {trained} holds no tokenizer; the run's checkpoints cannot "
                "be read without the ids they were trained on"
            )
        tokenizer = load_tokenizer(str(trained))
    elif world.is_main:
        began = time.perf_counter()
        tokenizer = train_bpe(
            env.vocabulary_texts(tasks),
            cfg.model.bpe_vocab_size,
            trained,
            split_digits=cfg.model.bpe_split_digits,
        )
        log.info(
            "tokenizer: BPE of %d ids trained in %.1f s (%s)",
            tokenizer.vocab_size,
            time.perf_counter() - began,
            trained,
        )
    else:
        tokenizer = load_tokenizer(str(trained))
    model = msgspec.structs.replace(
        cfg.model, tokenizer=str(trained), vocab_size=cfg.model.vocab_size or tokenizer.vocab_size
    )
    return msgspec.structs.replace(cfg, model=model), tokenizer, trained


def prepared_tokenizer(
    cfg: Config, env: Env, tasks: TaskSets | None = None
) -> tuple[Config, Tokenizer]:
    """The run's tokenizer for a command other than train (eval, rollout, data prepare): the
    one train made when the run folder has it, else made as train makes it (a BPE on the
    config's SFT and RL tasks, synthesised into the run folder where the config says, or
    `tasks` where the caller has read them already), so the command runs on a fresh folder and
    a later train on the same config finds the same ids."""
    folder = RunFolder.of(cfg)
    made = (folder.tokenizer / BPE_FILES[0]).is_file()
    training: list[Task] = []
    if cfg.model.tokenizer == "bpe" and not made:
        tasks = task_sets(cfg, env) if tasks is None else tasks
        training = [*tasks.sft, *tasks.rl]
        folder.make()  # only to write the BPE in: a finished run's folder may be read-only
    world = parallel.World()
    cfg, tokenizer, _ = run_tokenizer(cfg, env, training, folder, world, resuming=made)
    return cfg, tokenizer
