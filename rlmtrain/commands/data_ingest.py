"""`rlmtrain data ingest PDF_DIR --out corpus.jsonl [--workers N]`: every PDF under a folder
parsed into a corpus JSONL (`envs.pdf.ingest_dir`); files it cannot read are skipped and listed.
Exit 1 when the folder held files but none parsed."""

from __future__ import annotations

import argparse

from rlmtrain.commands import output_file, workers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pdf_dir", help="folder of PDF files (searched recursively)")
    parser.add_argument("--out", required=True, help="corpus JSONL to write")
    parser.add_argument(
        "--workers", type=int, default=None, help="parser processes (default: CPUs)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain.envs.pdf import ingest_dir

    out = output_file(args.out, "--out")

    summary = ingest_dir(
        args.pdf_dir, out, workers=workers(args.workers), progress=not args.no_progress
    )
    print(summary.report())
    return 0 if summary.papers or not summary.skipped else 1
