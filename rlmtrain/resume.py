"""Where a run goes on from: the checkpoint `checkpoint.resume` continues, and the starting state
of a run that has none.

A resumed run must be the same run: its seed, its schedules (the LR schedule, the exploration
bonus's and the tool credit's) and the settings its synthesised data and task order follow are
recorded in every checkpoint and checked against the config before anything is loaded, since
the generators restored from the checkpoint would otherwise silently overrule the config, a
schedule changed midway is no longer the run's schedule, and a resume under another data seed
would synthesise other tasks over the run's own and train on them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

import msgspec
import torch

from rlmtrain import checkpointing
from rlmtrain.config import Config
from rlmtrain.model import CheckpointError
from rlmtrain.optim import warmup_within
from rlmtrain.run_folder import RunFolder

log = logging.getLogger("rlmtrain.train")

SCHEDULE_KEYS = (
    "train.sft_steps",
    "train.steps",
    "train.sft_lr",
    "train.lr",
    "train.lr_schedule",
    "train.sft_lr_schedule",
    "train.warmup_steps",
    "train.sft_warmup_steps",
    "train.min_lr_ratio",
    "algo.exploration_beta",
    "algo.tool_credit_alpha",
)
"""Config keys the LR schedule, the exploration bonus's cosine schedule and the tool credit's
alpha are functions of. Every checkpoint records them; a resume under other values is refused,
since it would not continue the run's schedules but switch to others midway. `train.steps` is
the exception where nothing depends on it (`_rl_length_free`): a finished run then goes on for
more RL steps when they are asked for."""


DATA_KEYS = (
    "data.env",
    "data.seed",
    "data.synth_groups",
    "data.sft_groups",
    "data.eval_groups",
    "data.synth_max_papers",
    "data.teacher_flawed_share",
)
"""Config keys the synthesised task sets and the task order are functions of. Task files a run
reads (`data.*_path`) are not among them: a file moved between the run's start and its resume
is the same file."""


def schedules(cfg: Config) -> dict[str, float | int | str]:
    return _values(cfg, SCHEDULE_KEYS)


def data_settings(cfg: Config) -> dict[str, float | int | str]:
    return _values(cfg, DATA_KEYS)


def _values(cfg: Config, keys: tuple[str, ...]) -> dict[str, float | int | str]:
    values = {}
    for key in keys:
        section, name = key.split(".")
        values[key] = getattr(getattr(cfg, section), name)
    return values


def _rl_length_free(
    recorded: dict[str, float | int | str], wanted: dict[str, float | int | str]
) -> bool:
    """Whether nothing the RL phase does depends on its length: a constant LR (a warm-up
    counts steps from the start, not to the end) and no exploration bonus, whose weight decays
    over `train.steps`. A run may then be resumed with more or fewer RL steps, unless one of
    the two lengths cuts the warm-up short where the other does not (a phase shorter than its
    warm-up warms up over all its steps but its last); a run recorded with no RL steps has
    followed no RL schedule at all."""
    warmup = int(wanted["train.warmup_steps"])
    before, after = int(recorded.get("train.steps", 0)), int(wanted["train.steps"])
    same_warmup = before == 0 or warmup_within(warmup, before) == warmup_within(warmup, after)
    return (
        wanted["train.lr_schedule"] == "constant"
        and not wanted["algo.exploration_beta"]
        and same_warmup
    )


def _check_schedules(
    checkpoint: Path, recorded: dict[str, float | int | str], wanted: dict[str, float | int | str]
) -> None:
    free = {"train.steps"} if _rl_length_free(recorded, wanted) else set()
    changed = _changed(SCHEDULE_KEYS, recorded, wanted, free)
    if changed:
        raise CheckpointError(
            f"{checkpoint}: its run's schedules follow {', '.join(changed)}; resume with the "
            "checkpoint's values, or start a new run in another checkpoint.dir"
        )


def _check_data(
    checkpoint: Path, recorded: dict[str, float | int | str], wanted: dict[str, float | int | str]
) -> None:
    changed = _changed(DATA_KEYS, recorded, wanted)
    if changed:
        raise CheckpointError(
            f"{checkpoint}: its run's tasks follow {', '.join(changed)}; resume with the "
            "checkpoint's values, or start a new run in another checkpoint.dir"
        )


def _changed(
    keys: tuple[str, ...],
    recorded: dict[str, float | int | str],
    wanted: dict[str, float | int | str],
    free: Collection[str] = (),
) -> list[str]:
    """ "key=recorded (the config says wanted)" for each of `keys` the checkpoint recorded with
    another value than the config's, but those in `free`; a key it never recorded (a
    checkpoint older than the key's recording) is not compared."""
    return [
        f"{key}={recorded[key]!r} (the config says {wanted[key]!r})"
        for key in keys
        if key in recorded and recorded[key] != wanted[key] and key not in free
    ]


def resume_point(cfg: Config, folder: RunFolder) -> Path | None:
    """The checkpoint `checkpoint.resume` continues from; None for a fresh run (also when the
    run has none yet). An incomplete or damaged newest one, or one whose schedules the config
    would change, is a CheckpointError."""
    if not cfg.checkpoint.resume:
        earlier = checkpointing.names(folder.root)
        if earlier:
            # A new run's checkpoints would mix with these: pruning by step could delete the
            # new run's and a later resume could pick the old run's.
            raise CheckpointError(
                f"{folder.checkpoints} holds an earlier run's checkpoints "
                f"(newest {earlier[-1]}): --checkpoint.resume=true continues that run; to start "
                "a new one, choose another checkpoint.dir or remove that folder"
            )
        return None
    found = checkpointing.latest(folder.root)
    if found is None:
        return None
    recorded = checkpointing.trainer_state(found)
    _check_schedules(found, recorded.schedules, schedules(cfg))
    _check_data(found, recorded.data, data_settings(cfg))
    if recorded.seed != cfg.train.seed:
        # The data order and every sample drawn follow the seed; the generators restored from
        # the checkpoint would silently overrule the config's.
        raise CheckpointError(
            f"{found}: its run was seeded with train.seed={recorded.seed} (the config says "
            f"{cfg.train.seed}); resume with the checkpoint's seed, or start a new run in "
            "another checkpoint.dir"
        )
    return found


def after_a_stop(cfg: Config) -> str:
    """What running the same command again does, for the line that reports a stopped run."""
    folder = RunFolder.of(cfg)
    try:
        found = checkpointing.latest(folder.root)
    except CheckpointError as exc:
        return f"its newest checkpoint cannot be resumed: {exc}"
    if found is None:
        if cfg.checkpoint.every == 0:
            return (
                "no checkpoint was saved (checkpoint.every = 0), so the same command starts "
                "over; checkpoint.every = N saves one every N steps"
            )
        return "no checkpoint was saved yet, so the same command starts over"
    if cfg.checkpoint.resume:
        return f"the same command resumes from {found}"
    return f"the same command with --checkpoint.resume=true resumes from {found}"


def starting_state(
    cfg: Config,
    world_size: int,
    resume_from: Path | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> checkpointing.TrainerState:
    """The run's state at its start: a fresh run's first phase at step 0, or the state of the
    checkpoint it resumes, whose model and optimizer are loaded into `model` and `optimizer`."""
    fresh = checkpointing.TrainerState(
        phase="sft" if cfg.train.sft_steps else "rl",
        step=0,
        lr=0.0,
        seed=cfg.train.seed,
        world_size=world_size,
        schedules=schedules(cfg),
        data=data_settings(cfg),
    )
    if resume_from is None:
        return fresh
    loaded = checkpointing.load(resume_from, model, optimizer)
    log.info("resumed from %s: %s step %d", resume_from, loaded.phase, loaded.step)
    # Checked equal by `resume_point`; recorded anew where an older checkpoint had none.
    return msgspec.structs.replace(loaded, schedules=fresh.schedules, data=fresh.data)
