"""`rlmtrain train --config F [--section.key=value ...]`: the training run (`rlmtrain.train`);
under torchrun, `torchrun --nproc_per_node N -m rlmtrain train ...` runs one rank of it."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run file (default: built-in defaults)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain import train
    from rlmtrain.config import load_config

    return train.main(load_config(args.config, overrides))
