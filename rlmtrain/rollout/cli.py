"""`rlmtrain rollout --config X --out rollouts.jsonl [--limit N]`: sample trees, write them.

Runs the configured environment's tasks (`data.train_path`, or the synthetic evidence corpus
made into `<checkpoint.dir>/data` when that is empty) through the scheduler on the configured
engine, G = `rollout.n_samples` trees per task, with a progress bar on stderr (trees done,
tokens/s, engine occupancy). The groups go to `--out` as msgspec JSONL (`records.write_groups`)
before they are scored, so a failing reward never loses a rollout; the summary on stdout has the
rollout metrics and the mean root reward.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec

from rlmtrain.config import Config, ConfigError, load_config, parse_args_and_overrides
from rlmtrain.devices import BackendUnavailable
from rlmtrain.rlm.records import RolloutGroup, write_groups
from rlmtrain.rollout.progress import RolloutProgress
from rlmtrain.run_folder import RunFolder

__all__ = ["RolloutProgress", "cli", "load_tasks"]


def load_tasks(config: Config, env: Any) -> list[Any]:
    """The run's training tasks (`Env.split_tasks(config, "rl")`); a malformed line too is a
    ConfigError here."""
    try:
        return env.split_tasks(config, "rl")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _with_trained_tokenizer(config: Config) -> Config:
    """'bpe' names the tokenizer `rlmtrain train` trained into `<checkpoint.dir>/tokenizer`; a
    randomly initialised model then gets its vocabulary, as in training."""
    if config.model.tokenizer != "bpe":
        return config
    folder = RunFolder.of(config).tokenizer
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(
            f"model.tokenizer: 'bpe' is trained by `rlmtrain train` into {folder}, which has no "
            "tokenizer.json yet; run train first or name a tokenizer folder"
        )
    model = msgspec.structs.replace(config.model, tokenizer=str(folder))
    if not model.hf_dir and not model.vocab_size:
        from rlmtrain.model.tokenizer import load_tokenizer

        model = msgspec.structs.replace(model, vocab_size=load_tokenizer(str(folder)).vocab_size)
    return msgspec.structs.replace(config, model=model)


async def _rollout(config: Config, tasks: list[Any], env: Any, out: Path) -> str:
    from rlmtrain.model.tokenizer import load_tokenizer
    from rlmtrain.rollout.engines import build_engine
    from rlmtrain.rollout.scheduler import Scheduler

    config = _with_trained_tokenizer(config)
    tokenizer = load_tokenizer(config.model.tokenizer, config.model.hf_dir)
    engine = build_engine(config, tokenizer)
    scheduler = Scheduler(engine, tokenizer, config.rollout)
    progress = RolloutProgress(len(tasks) * config.rollout.n_samples, engine)
    scheduler.on_tree_done = progress.tree_done
    try:
        groups = await scheduler.rollout(tasks, env, config.rollout.n_samples)
    finally:
        progress.close()
        await engine.close()
    written = write_groups(out, groups)
    reward = await _mean_reward(env, tasks, groups)
    return (
        f"wrote {written} groups to {out}\n{scheduler.metrics.line()}\n"
        f"mean root reward {reward:.4f}"
    )


async def _mean_reward(env: Any, tasks: list[Any], groups: list[RolloutGroup]) -> float:
    scores = [s for values in await env.root_scores(tasks, groups) for s in values if s is not None]
    return sum(scores) / len(scores) if scores else float("nan")


def cli(argv: list[str]) -> int:
    """`rlmtrain rollout` with its arguments (argv after 'rollout'); returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="rlmtrain rollout",
        description="Sample RLM trajectory trees for the configured tasks and write them as JSONL.",
    )
    parser.add_argument("--config", help="TOML run file (default: built-in defaults)")
    parser.add_argument("--out", required=True, help="output JSONL of RolloutGroups")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    args, overrides = parse_args_and_overrides(parser, argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    try:
        import uvloop

        from rlmtrain.envs.base import get_env

        config = load_config(args.config, overrides)
        env = get_env(config.data.env, config)
        tasks = load_tasks(config, env)[: args.limit]
        if not tasks:
            raise ConfigError("data.train_path: no tasks to run")
        summary = uvloop.run(_rollout(config, tasks, env, Path(args.out)))
    except (ConfigError, BackendUnavailable, FileNotFoundError) as exc:
        print(f"rlmtrain rollout: error: {exc}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
