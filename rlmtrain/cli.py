"""`rlmtrain <command>`: the front door of every command (`rlmtrain.commands`).

Commands that read a run take `--config FILE` and any number of `--section.key=value` overrides.
Bad input of any command (config, data paths, checkpoint, tokenizer, model file, a backend that
is not installed) is a `UserError`, caught here once: one line on stderr naming the input, exit
code 2, never a traceback. A SIGTERM or Ctrl-C stops any command the same way, after its
cleanup: one line, exit 128 + the signal's number (`rlmtrain.stops`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from rlmtrain.commands import COMMANDS, GROUPS, Command
from rlmtrain.config import split_overrides
from rlmtrain.errors import UserError
from rlmtrain.stops import Terminated, stop_on_sigterm, stopped_by


def build_parser() -> tuple[argparse.ArgumentParser, dict[Command, argparse.ArgumentParser]]:
    """The parser of every command, and each command's own (its usage and its errors)."""
    parser = argparse.ArgumentParser(
        prog="rlmtrain", description="Train language models to act as recursive language models."
    )
    top = parser.add_subparsers(dest="command", required=True, metavar="command")
    groups: dict[str, argparse._SubParsersAction] = {}
    own: dict[Command, argparse.ArgumentParser] = {}
    for command in COMMANDS:
        parent = top
        if len(command.words) > 1:
            group = command.words[0]
            if group not in groups:
                group_parser = top.add_parser(group, help=GROUPS[group])
                groups[group] = group_parser.add_subparsers(
                    dest=f"{group}_command", required=True, metavar="command"
                )
            parent = groups[group]
        module = _module(command)
        sub = parent.add_parser(
            command.words[-1],
            help=command.help,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(chosen=command)
        own[command] = sub
    return parser, own


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, own = build_parser()
    args, rest = parser.parse_known_args(argv)
    command: Command = args.chosen
    overrides, unknown = split_overrides(rest)
    if unknown or (overrides and not command.takes_overrides):
        own[command].error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    try:
        with stop_on_sigterm():
            return _module(command).run(args, overrides)
    except UserError as exc:
        print(f"{command.name}: error: {exc}", file=sys.stderr)
        return 2
    except (Terminated, KeyboardInterrupt) as stop:
        # Its cleanup ran on the way (engines closed, partial files removed or kept whole).
        signum = stopped_by(stop)
        print(f"{command.name}: stopped by {signum.name}", file=sys.stderr)
        return 128 + signum


def _module(command: Command) -> ModuleType:
    return importlib.import_module(command.module)


if __name__ == "__main__":
    sys.exit("rlmtrain.cli is not a script: run `rlmtrain ...` or `python -m rlmtrain ...`")
