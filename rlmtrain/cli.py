"""`rlmtrain <command>`: the command-line entry point.

Every command takes `--config FILE` and any number of `--section.key=value` overrides. Bad input
(config, data paths) ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from rlmtrain.config import ConfigError, load_config, to_toml


def _config_show(args: argparse.Namespace, overrides: list[str]) -> int:
    config = load_config(args.config, overrides)
    sys.stdout.write(to_toml(config))
    return 0


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain import train

    return train.main(load_config(args.config, overrides))


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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if a.startswith("--") and "." in a.split("=", 1)[0]]
    unknown = [a for a in rest if a not in overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args, overrides)
    except ConfigError as exc:
        print(f"rlmtrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
