"""`rlmtrain eval --config F [--checkpoint DIR] [--samples k] [--tasks N] [--out FILE]`.

Evaluates a Hugging Face checkpoint written by `model.save_hf` (default `<checkpoint.dir>/final`;
where the run has none yet, the config's own starting model: its preset from `model.seed`, or
`model.hf_dir`, which gives the zero-shot figures) on the held-out tasks the run holds out
(`Env.split_tasks(config, "eval")`: `data.eval_path`, or the split synthesised into the run
folder, made here as train makes it when absent). The tokenizer is the checkpoint's when the
folder holds tokenizer.json, else the run's (`model.tokenizer`; for 'bpe', the one train made,
or made here as train makes it). The engine serves the checkpoint itself (`model.hf_dir` is
pointed at it, which is what vLLM needs too). `--samples` and `--tasks` override `eval.samples`
and `eval.tasks`.

stdout: the table of `evaluation.format_report`, then the report as one JSON object on the last
line (`--out` writes the same JSON). Bad input (config, checkpoint folder, weights, tokenizer,
task file) is a UserError: the loader's own errors are caught here by type and re-raised as
`CheckpointError` naming the path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from rlmtrain.commands import output_file
from rlmtrain.config import Config, ConfigError
from rlmtrain.errors import UserError
from rlmtrain.run_folder import RunFolder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run file (default: built-in defaults)")
    parser.add_argument(
        "--checkpoint",
        help="Hugging Face checkpoint folder (default: <checkpoint.dir>/final, else the "
        "config's starting model)",
    )
    parser.add_argument("--samples", type=int, default=None, help="k trees per task (eval.samples)")
    parser.add_argument(
        "--tasks", type=int, default=None, help="first N tasks; 0 = all (eval.tasks)"
    )
    parser.add_argument("--out", help="also write the JSON report to this file")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain.config import load_config
    from rlmtrain.evaluation import format_report

    if args.samples is not None:
        overrides.append(f"--eval.samples={args.samples}")
    if args.tasks is not None:
        overrides.append(f"--eval.tasks={args.tasks}")
    if args.out:
        output_file(args.out, "--out")
    config = load_config(args.config, overrides)
    report = evaluate_checkpoint(config, Path(args.checkpoint) if args.checkpoint else None)
    line = json.dumps(report)
    # Printed first: an evaluation takes minutes, and a bad --out must not lose its report.
    print(format_report(report))
    print(line)
    if args.out:
        try:
            Path(args.out).write_text(line + "\n")
        except OSError as exc:
            raise UserError(f"--out {args.out}: {exc.strerror}") from None
    return 0


def load_checkpoint(directory: Path, config: Config) -> Any:
    """The model saved in `directory`, in `model.dtype` with `model.attention`; a missing folder,
    a config.json that does not describe a model and missing or unreadable weights are a
    `CheckpointError` naming the path."""
    from rlmtrain.model import build_model

    _check_folder(directory)
    return build_model(msgspec.structs.replace(config.model, hf_dir=str(directory)))


def _check_folder(directory: Path) -> None:
    """The folder exists and its config.json describes a model (cheap: no weights read)."""
    from rlmtrain.model import CheckpointError
    from rlmtrain.model.hf import read_hf_args

    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint folder not found")
    read_hf_args(directory)


def evaluate_checkpoint(config: Config, checkpoint: Path | None) -> dict[str, Any]:
    """The report of `checkpoint` (None: the run's final/, else the config's starting model)."""
    from rlmtrain import stops
    from rlmtrain.envs.base import get_env
    from rlmtrain.evaluation import evaluate
    from rlmtrain.model import build_model
    from rlmtrain.model.tokenizer import with_chat_template_kwargs
    from rlmtrain.rewards.chat_client import check_served
    from rlmtrain.training.startup import prepared_tokenizer

    final = RunFolder.of(config).final
    if checkpoint is None and final.exists():
        checkpoint = final
    if checkpoint is not None:
        _check_folder(checkpoint)  # cheap; before the task files are read
    check_served(config.judge)
    env = get_env(config.data.env, config)
    tasks = env.split_tasks(config, "eval")
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        from rlmtrain.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(checkpoint))
    else:
        config, tokenizer = prepared_tokenizer(config, env)
    # The scheduler binds them too; here a tokenizer that cannot use them fails before the model
    # loads.
    tokenizer = with_chat_template_kwargs(tokenizer, config.rollout.chat_template_kwargs)
    if checkpoint is None:
        started = config.model.hf_dir or f"preset {config.model.preset}, seed {config.model.seed}"
        print(
            f"eval: {final} holds no checkpoint; evaluating the config's starting model "
            f"({started})",
            file=sys.stderr,
        )
        model = build_model(config.model)
    else:
        model = load_checkpoint(checkpoint, config)
        # The engine serves the checkpoint too: native builds it from hf_dir, vLLM loads it.
        config = msgspec.structs.replace(
            config, model=msgspec.structs.replace(config.model, hf_dir=str(checkpoint))
        )
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ConfigError(
            f"model.tokenizer: vocabulary of {tokenizer.vocab_size} does not fit the "
            f"model's {model.args.vocab_size} embeddings ({checkpoint or 'the config'})"
        )
    report = stops.run(evaluate(config, model, tokenizer, env, tasks, progress=True))
    return {"phase": "eval", "step": 0, **report}
