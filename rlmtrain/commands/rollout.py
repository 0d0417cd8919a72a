"""`rlmtrain rollout --config F --out rollouts.jsonl [--limit N]`: sample trees, write them.

Runs the configured environment's training tasks (`Env.split_tasks(config, "rl")`: the
`data.train_path` file, or the split synthesised into the run folder) through the scheduler on
the configured engine, G = `rollout.n_samples` trees per task, with a progress bar on stderr
(trees done, tokens/s, engine occupancy). The policy is the config's model (`model.hf_dir`, or
its preset from `model.seed`) with the run's tokenizer (for 'bpe', the one train made, or made
here as train makes it). The groups go to `--out` as msgspec JSONL (`records.write_groups`)
before they are scored, so a failing reward never loses a rollout; the summary on stdout has the
rollout metrics and the mean root reward. Each group is appended to `--out` as its last tree
ends, so a rollout killed midway keeps the groups it finished; at the end the file is rewritten
in task order. A rollout none of whose trees could run (every root failed in the scheduler:
a chat template that cannot render, ...) is an error naming the first cause, after the write.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlmtrain.commands import output_file
from rlmtrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run file (default: built-in defaults)")
    parser.add_argument("--out", required=True, help="output JSONL of RolloutGroups")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain import stops
    from rlmtrain.config import load_config
    from rlmtrain.envs.base import get_env

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    out = output_file(args.out, "--out")
    config = load_config(args.config, overrides)
    env = get_env(config.data.env, config)
    tasks = env.split_tasks(config, "rl")[: args.limit]
    print(stops.run(_rollout(config, tasks, env, out)))
    return 0


async def _rollout(config: Any, tasks: list[Any], env: Any, out: Path) -> str:
    import msgspec

    from rlmtrain.model.tokenizer import with_chat_template_kwargs
    from rlmtrain.rlm.records import failed_everywhere, write_groups
    from rlmtrain.rollout.engines import build_engine
    from rlmtrain.rollout.progress import RolloutProgress
    from rlmtrain.rollout.scheduler import Scheduler
    from rlmtrain.training.run import mean_or_nan
    from rlmtrain.training.startup import prepared_tokenizer

    config, tokenizer = prepared_tokenizer(config, env)
    # The scheduler binds them too; here a tokenizer that cannot use them fails before the model
    # loads.
    tokenizer = with_chat_template_kwargs(tokenizer, config.rollout.chat_template_kwargs)
    engine = build_engine(config, tokenizer)
    scheduler = Scheduler(engine, tokenizer, config.rollout)
    progress = RolloutProgress(len(tasks) * config.rollout.n_samples, engine)
    scheduler.on_tree_done = progress.tree_done
    encoder = msgspec.json.Encoder()
    with open(out, "wb", buffering=0) as kept:

        def keep(group: Any) -> None:
            kept.write(encoder.encode(group) + b"\n")

        scheduler.on_group_done = keep
        try:
            groups = await scheduler.rollout(tasks, env, config.rollout.n_samples)
        finally:
            progress.close()
            await engine.close()
    written = write_groups(out, groups)
    failure = failed_everywhere(groups)
    if failure:
        raise UserError(f"no tree could run ({written} groups written to {out}): {failure}")
    scores = await env.root_scores(tasks, groups)
    reward = mean_or_nan(s for values in scores for s in values if s is not None)
    return (
        f"wrote {written} groups to {out}\n{scheduler.metrics.line()}\n"
        f"mean root reward {reward:.4f}"
    )
