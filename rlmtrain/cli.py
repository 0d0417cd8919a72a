"""`rlmtrain <command>`: the command-line entry point.

Every command takes `--config FILE` and any number of `--section.key=value` overrides. Bad input
(config, data paths) ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rlmtrain.config import ConfigError, load_config, parse_args_and_overrides, to_toml


def _config_show(args: argparse.Namespace, overrides: list[str]) -> int:
    config = load_config(args.config, overrides)
    sys.stdout.write(to_toml(config))
    return 0


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain import train
    from rlmtrain.devices import BackendUnavailable
    from rlmtrain.envs.base import TaskFormatError
    from rlmtrain.model import CheckpointError
    from rlmtrain.model.tokenizer import TokenizerError

    config = load_config(args.config, overrides)
    try:
        return train.main(config)
    except (TaskFormatError, CheckpointError, TokenizerError, BackendUnavailable) as exc:
        # Bad input found once the run has started (a task file, a checkpoint, a tokenizer
        # folder, a missing backend): the message names it; a traceback would bury it.
        print(f"rlmtrain: error: {exc}", file=sys.stderr)
        return 2


# Commands whose arguments belong to the module that implements them: words -> (module, help).
_DELEGATED = {
    ("data", "ingest"): ("rlmtrain.envs.pdf", "parse a folder of PDFs into a corpus JSONL"),
    ("data", "synth"): (
        "rlmtrain.envs.synth",
        "synthesise paper groups, render to PDF, parse back",
    ),
    ("rollout",): ("rlmtrain.rollout.cli", "sample trajectory trees of the configured tasks"),
    ("eval",): ("rlmtrain.eval_cli", "evaluate a checkpoint on held-out tasks"),
    ("model", "import-gguf"): (
        "rlmtrain.model.gguf_import",
        "write a GGUF file as a Hugging Face folder (the gguf extra)",
    ),
}


def _delegate(argv: list[str]) -> int | None:
    """Run a delegated command if argv names one; None otherwise."""
    for words, (module, _) in _DELEGATED.items():
        if tuple(argv[: len(words)]) == words:
            return importlib.import_module(module).cli(argv[len(words) :])
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlmtrain", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run the main training job")
    train.add_argument("--config", help="TOML run file (default: built-in defaults)")
    train.set_defaults(run=_train)

    config = commands.add_parser("config", help="inspect configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("--config", help="TOML run file (default: built-in defaults)")
    show.set_defaults(run=_config_show)

    groups = {}
    for group, text in (("data", "build data sets"), ("model", "import model checkpoints")):
        group_parser = commands.add_parser(group, help=text)
        groups[group] = group_parser.add_subparsers(dest=f"{group}_command", required=True)
    for words, (_, text) in _DELEGATED.items():
        parent = groups[words[0]] if len(words) > 1 else commands
        parent.add_parser(words[-1], help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    delegated = _delegate(argv)
    if delegated is not None:
        return delegated
    parser = build_parser()
    args, overrides = parse_args_and_overrides(parser, argv)
    try:
        return args.run(args, overrides)
    except ConfigError as exc:
        print(f"rlmtrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
