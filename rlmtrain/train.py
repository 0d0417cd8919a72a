"""The training run, read top to bottom: start, evaluate, SFT warm-up, GRPO, export.

    rlmtrain train --config configs/tiny-cpu.toml [--section.key=value ...]
    torchrun --nproc_per_node 8 -m rlmtrain train --config ...   (one rank per device)

Each line of `_train` is one phase of docs/architecture.md, and each lives in its own module:

1. start (`training.startup`): the env's three disjoint task sets (`Env.split_tasks`: the SFT
   slice, the RL tasks, the held-out tasks, each from its file or synthesised by rank 0 into the
   run folder), the tokenizer (a BPE trained on the run's own training text when
   `model.tokenizer` is 'bpe'), the model sharded with FSDP2 over the ranks (fp32 masters,
   `model.dtype` compute) with AdamW, the state a resumed run goes on from (`resume`), the
   engine and the run log;
2. the held-out evaluation of the starting policy (`evaluation.evaluate`, on rank 0);
3. SFT (`training.sft`): NLL on the env's scripted teacher's trees;
4. RL (`training.rl`): GRPO over rollout trees with exact per-token weights, evaluated every
   `eval.every` steps and at the end;
5. export: the final model as a Hugging Face checkpoint with its tokenizer.

Both phases save resumable checkpoints every `checkpoint.every` steps (`checkpointing`), from
which `checkpoint.resume` goes on exactly. The step functions are `training.steps`.
"""

from __future__ import annotations

import logging
import random
import sys
import time

import numpy as np
import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from rlmtrain import parallel, stops
from rlmtrain.config import Config, ConfigError
from rlmtrain.launch import check_launcher
from rlmtrain.resume import after_a_stop
from rlmtrain.stops import Terminated, stop_on_sigterm, stopped_by
from rlmtrain.training.rl import rl_phase
from rlmtrain.training.sft import sft_phase
from rlmtrain.training.split import serve_rollouts
from rlmtrain.training.startup import check_run_rules, start_run

log = logging.getLogger("rlmtrain.train")


def main(cfg: Config) -> int:
    """Train as `cfg` says, as one rank of the world the environment describes (one process
    when not launched by torchrun)."""
    check_launcher()  # several SLURM tasks without torchrun would be as many separate runs
    refused = parallel.split_refused(cfg.rollout.inference_ranks)
    if refused:
        raise ConfigError(f"rollout.inference_ranks: {refused}")
    world, device = parallel.start(cfg.train.device, inference_ranks=cfg.rollout.inference_ranks)
    try:
        level = cfg.logging.level.upper() if world.is_main else "WARNING"
        logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr, force=True)
        if world.trains:
            check_run_rules(cfg, device)
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        # A SIGTERM unwinds the run like an exception wherever it is (`stops`), so its cleanup
        # runs; the line it ends with says what running the same command again does.
        try:
            # Log lines print above the run's progress bar instead of cutting through it.
            with stop_on_sigterm(), logging_redirect_tqdm():
                if not world.trains:
                    # Watched from the start: its first wait is for the trainers to reach RL.
                    with parallel.watch(cfg.parallel.stall_timeout_s):
                        return stops.run(serve_rollouts(world, device))
                return stops.run(_train(cfg, world, device))
        except (Terminated, KeyboardInterrupt) as stop:
            # Ctrl-C too: one line saying what comes next, not a traceback from every rank.
            signum = stopped_by(stop)
            log.warning("stopped by %s; %s", signum.name, after_a_stop(cfg))
            return 128 + signum
    finally:
        parallel.stop()


async def _train(cfg: Config, world: parallel.World, device: torch.device) -> int:
    began = time.perf_counter()
    run = await start_run(cfg, world, device)
    try:
        # Watched once started: the start's long single calls (an engine's, a model's load)
        # mark nothing, and the process group's timeout bounds them.
        with parallel.watch(cfg.parallel.stall_timeout_s):
            if run.resume_from is None:
                await run.evaluate("init", 0)
            await sft_phase(run)
            await rl_phase(run)
            out = run.export()
        log.info("saved %s (%.0f s in all)", out, time.perf_counter() - began)
        if run.tasks.held_out and world.is_main:
            sys.stderr.write(run.runlog.summary_table() + "\n")
    finally:
        await run.close()
    return 0


if __name__ == "__main__":
    # An older launch line would otherwise import this module, do nothing and exit 0.
    sys.exit(
        "rlmtrain.train is not a script: run `rlmtrain train ...`, `python -m rlmtrain train ...` "
        "or `torchrun ... -m rlmtrain train ...`"
    )
