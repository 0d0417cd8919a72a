"""`rlmtrain config show --config F [--section.key=value ...]`: the resolved config as TOML, each
key with its description."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run file (default: built-in defaults)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain.config import load_config, to_toml

    sys.stdout.write(to_toml(load_config(args.config, overrides)))
    return 0
