"""Every subcommand of `rlmtrain`, one module each, behind one front door (`rlmtrain.cli`).

A command module holds its arguments (`add_arguments`) and its run (`run(args, overrides)` ->
exit code). Its top-level imports stay light, since the front door reads every command's
arguments to build the parser: what a command needs (torch, an engine, an env) it imports when
it runs, so `rlmtrain config show` or `rlmtrain --help` loads none of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rlmtrain.errors import UserError


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]
    help: str
    module: str
    # Whether `--section.key=value` config overrides follow the command's own arguments.
    takes_overrides: bool = True

    @property
    def name(self) -> str:
        return "rlmtrain " + " ".join(self.words)


COMMANDS = (
    Command(("train",), "run the main training job", "rlmtrain.commands.train"),
    Command(("eval",), "evaluate a checkpoint on held-out tasks", "rlmtrain.commands.eval"),
    Command(
        ("rollout",), "sample trajectory trees of the configured tasks", "rlmtrain.commands.rollout"
    ),
    Command(
        ("data", "prepare"),
        "make the config's task sets and tokenizer in its run folder, as train does",
        "rlmtrain.commands.data_prepare",
    ),
    Command(
        ("data", "synth"),
        "synthesise paper groups, render to PDF, parse back",
        "rlmtrain.commands.data_synth",
        takes_overrides=False,
    ),
    Command(
        ("data", "ingest"),
        "parse a folder of PDFs into a corpus JSONL",
        "rlmtrain.commands.data_ingest",
        takes_overrides=False,
    ),
    Command(
        ("model", "import-gguf"),
        "write a GGUF file as a Hugging Face folder (the gguf extra)",
        "rlmtrain.commands.model_import",
        takes_overrides=False,
    ),
    Command(
        ("config", "show"),
        "print the resolved config as TOML",
        "rlmtrain.commands.config_show",
    ),
)
"""In the order `rlmtrain --help` lists them."""

GROUPS = {
    "data": "build data sets",
    "model": "import model checkpoints",
    "config": "inspect configuration",
}


def output_file(path: str, flag: str) -> Path:
    """`path`, a file the command is to write, refused up front where its folder is missing or
    not writable (a UserError naming `flag`): found at the end, it would lose the work."""
    out = Path(path)
    folder = out.parent
    if out.is_dir():
        raise UserError(f"{flag} {out}: is a folder; name a file")
    if not folder.is_dir():
        raise UserError(f"{flag} {out}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {out}: the folder {folder} is not writable")
    return out


def workers(value: int | None, flag: str = "--workers") -> int | None:
    """A process count given on the command line: None (the CPUs) or at least 1."""
    if value is not None and value < 1:
        raise UserError(f"{flag} must be >= 1, got {value}")
    return value
