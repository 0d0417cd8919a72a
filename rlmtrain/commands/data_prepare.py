"""`rlmtrain data prepare --config F [--section.key=value ...]`: the config's three task sets
(SFT slice, RL tasks, held-out tasks) and its tokenizer, made in the run folder as `rlmtrain
train` makes them (`Env.split_tasks`, a BPE on the training text when `model.tokenizer` is
'bpe'), so they can be read before a run, or made once for several commands."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run file (default: built-in defaults)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain.config import load_config
    from rlmtrain.envs.base import get_env
    from rlmtrain.run_folder import RunFolder
    from rlmtrain.training.startup import prepared_tokenizer, task_sets

    config = load_config(args.config, overrides)
    env = get_env(config.data.env, config)
    folder = RunFolder.of(config).make()
    tasks = task_sets(config, env)
    config, tokenizer = prepared_tokenizer(config, env, tasks)
    for split, made in zip(("sft", "rl", "eval"), tasks, strict=True):
        if not made:
            print(f"{split:5s}     - (the config runs no {split} phase)")
            continue
        source = _source(config, split) or folder.data(split) / "tasks.jsonl"
        print(f"{split:5s} {len(made):5d} tasks  {source}")
    where = config.model.tokenizer or config.model.hf_dir
    print(f"tokenizer: {tokenizer.vocab_size} ids ({where})")
    return 0


def _source(config, split: str) -> str:
    data = config.data
    if split == "eval":
        return data.eval_path
    return (data.sft_path or data.train_path) if split == "sft" else data.train_path
