"""`rlmtrain data synth --out DIR --groups N [--seed S] [--workers W]`: synthetic evidence paper
groups, rendered to PDF and parsed back (`envs.synth.synthesize`): pdfs/, corpus.jsonl and
tasks.jsonl in DIR."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlmtrain.commands import workers
from rlmtrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", required=True, help="output folder (pdfs/, corpus.jsonl, tasks.jsonl)"
    )
    parser.add_argument("--groups", type=int, required=True, help="paper groups to make (>= 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed; same seed, same data")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: CPUs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain.envs.synth import synthesize

    if args.groups < 1:
        raise UserError(f"--groups must be >= 1, got {args.groups}")
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {args.out}: {exc.strerror}") from None
    summary = synthesize(
        args.out,
        groups=args.groups,
        seed=args.seed,
        workers=workers(args.workers),
        progress=not args.no_progress,
    )
    print(
        f"wrote {summary.papers} papers and {summary.tasks} tasks from {summary.groups} groups "
        f"to {args.out} in {summary.seconds:.1f} s ({summary.lost_queries} queries dropped: "
        "gold span not found in the parsed text)"
    )
    return 0
