"""`rlmtrain eval --config X [--checkpoint DIR] [--samples k] [--tasks N] [--out FILE]`.

Evaluates a Hugging Face checkpoint written by `model.save_hf` (default `<checkpoint.dir>/final`)
on the held-out tasks: `data.eval_path` when set, else the synthetic held-out split training
writes to `<checkpoint.dir>/data/eval/tasks.jsonl` (never synthesised here: evaluating on a
split other than the one training held out would be a silent mismatch). The tokenizer is the
checkpoint's when the folder holds tokenizer.json, else `model.tokenizer` (for 'bpe', the one
training left in `<checkpoint.dir>/tokenizer`). The engine serves the checkpoint itself
(`model.hf_dir` is pointed at it, which is what vLLM needs too). `--samples` and `--tasks`
override `eval.samples` and `eval.tasks`.

stdout: the table of `evaluation.format_report`, then the report as one JSON object on the last
line (`--out` writes the same JSON). Bad input (config, checkpoint folder, weights, tokenizer,
task file) is one line on stderr and exit code 2, never a traceback: the loader's own errors are
caught here by type and re-raised as `CheckpointError` naming the path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from rlmtrain.config import Config, ConfigError, load_config, parse_args_and_overrides
from rlmtrain.devices import BackendUnavailable
from rlmtrain.run_folder import RunFolder

__all__ = ["cli", "heldout_path", "load_checkpoint"]


def heldout_path(config: Config) -> Path:
    """The held-out task file; ConfigError (one line, what to do) when it does not exist."""
    if config.data.eval_path:
        path = Path(config.data.eval_path)
        if not path.is_file():
            raise ConfigError(f"data.eval_path: {path} not found")
        return path
    path = RunFolder.of(config).data("eval") / "tasks.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{path}: no held-out tasks; run `rlmtrain train` first (it writes this split) "
            "or set data.eval_path"
        )
    return path


def load_checkpoint(directory: Path, config: Config) -> Any:
    """The model saved in `directory`, in `model.dtype` with `model.attention`.

    Raises `CheckpointError` naming the path for a missing folder, a config.json that is not a
    JSON object or does not describe a model, and missing or unreadable weights.
    """
    from rlmtrain.model import CheckpointError, build_model

    config_path = _check_folder(directory)
    model_config = msgspec.structs.replace(config.model, hf_dir=str(directory))
    try:
        return build_model(model_config)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        # A config.json whose values do not build a model (a string where a size goes, ...).
        raise CheckpointError(
            f"{config_path}: does not describe a model: {type(exc).__name__}: {exc}"
        ) from None


def _check_folder(directory: Path) -> Path:
    """The checkpoint's config.json path, once the folder exists and the file is a JSON object.

    load_hf reads config.json as text and indexes it as a dict: checked here first, bytes that
    are not UTF-8 or JSON that is not an object are named errors rather than tracebacks.
    """
    from rlmtrain.model import CheckpointError

    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint folder not found")
    config_path = directory / "config.json"
    try:
        raw = json.loads(config_path.read_bytes().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: no config.json in the checkpoint folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: unreadable or not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    return config_path


def _tokenizer(directory: Path, config: Config) -> Any:
    """The checkpoint's own tokenizer when it has one, else `model.tokenizer` ('bpe': the one
    the run trained, in `<checkpoint.dir>/tokenizer`)."""
    from rlmtrain.model.tokenizer import load_tokenizer

    if (directory / "tokenizer.json").is_file():
        return load_tokenizer(str(directory))
    if config.model.tokenizer == "bpe":
        trained = RunFolder.of(config).tokenizer
        if not (trained / "tokenizer.json").is_file():
            raise ConfigError(
                f"model.tokenizer: 'bpe' is trained by `rlmtrain train`, but neither {directory} "
                f"nor {trained} holds its tokenizer.json"
            )
        return load_tokenizer(str(trained))
    return load_tokenizer(config.model.tokenizer, config.model.hf_dir)


def _run(config: Config, checkpoint: Path) -> dict[str, Any]:
    import uvloop

    from rlmtrain.envs.base import get_env
    from rlmtrain.evaluation import evaluate
    from rlmtrain.rewards.chat_client import check_served

    _check_folder(checkpoint)  # cheap; before the task files are read
    check_served(config.judge)
    env = get_env(config.data.env, config)
    path = heldout_path(config)
    try:
        tasks = env.load_tasks(path)
    except ValueError as exc:  # TaskFormatError, or a task naming a paper not in the corpus
        raise ConfigError(str(exc)) from None
    if not tasks:
        raise ConfigError(f"{path}: no tasks in the held-out file")
    tokenizer = _tokenizer(checkpoint, config)
    model = load_checkpoint(checkpoint, config)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ConfigError(
            f"model.tokenizer: vocabulary of {tokenizer.vocab_size} does not fit the "
            f"checkpoint's {model.args.vocab_size} embeddings ({checkpoint})"
        )
    # The engine serves the checkpoint too: native builds it from hf_dir, vLLM loads it.
    config = msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, hf_dir=str(checkpoint))
    )
    report = uvloop.run(evaluate(config, model, tokenizer, env, tasks, progress=True))
    return {"phase": "eval", "step": 0, **report}


def cli(argv: list[str]) -> int:
    """`rlmtrain eval` with its arguments (argv after 'eval'); returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="rlmtrain eval",
        description="Evaluate a checkpoint on held-out tasks: reward, pass@k, span F1, tree shape.",
    )
    parser.add_argument("--config", help="TOML run file (default: built-in defaults)")
    parser.add_argument(
        "--checkpoint", help="Hugging Face checkpoint folder (default: <checkpoint.dir>/final)"
    )
    parser.add_argument("--samples", type=int, default=None, help="k trees per task (eval.samples)")
    parser.add_argument(
        "--tasks", type=int, default=None, help="first N tasks; 0 = all (eval.tasks)"
    )
    parser.add_argument("--out", help="also write the JSON report to this file")
    args, overrides = parse_args_and_overrides(parser, argv)
    if args.samples is not None:
        overrides.append(f"--eval.samples={args.samples}")
    if args.tasks is not None:
        overrides.append(f"--eval.tasks={args.tasks}")
    from rlmtrain.envs.base import TaskFormatError
    from rlmtrain.model import CheckpointError
    from rlmtrain.model.tokenizer import TokenizerError

    try:
        config = load_config(args.config, overrides)
        checkpoint = Path(args.checkpoint or RunFolder.of(config).final)
        report = _run(config, checkpoint)
    except (
        ConfigError,
        CheckpointError,
        TokenizerError,
        TaskFormatError,
        BackendUnavailable,
        FileNotFoundError,
    ) as exc:
        print(f"rlmtrain eval: error: {exc}", file=sys.stderr)
        return 2
    from rlmtrain.evaluation import format_report

    line = json.dumps(report)
    # Printed first: an evaluation takes minutes, and a bad --out must not lose its report.
    print(format_report(report))
    print(line)
    if args.out:
        try:
            Path(args.out).write_text(line + "\n")
        except OSError as exc:
            print(f"rlmtrain eval: error: --out {args.out}: {exc.strerror}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
