"""`rlmtrain model import-gguf (FILE | --from-package NAME) --out DIR [--dtype D]`: a GGUF file as
a Hugging Face folder that `load_hf`, vLLM and transformers load (`model.gguf_import`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("file", nargs="?", help="the .gguf file")
    source.add_argument(
        "--from-package", metavar="NAME", help="the .gguf file an installed package ships"
    )
    parser.add_argument("--out", required=True, help="folder to write (absent or empty)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="stored weight dtype"
    )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlmtrain.model.gguf_import import find_package_gguf, import_gguf

    path = find_package_gguf(args.from_package) if args.from_package else Path(args.file)
    import_gguf(path, args.out, dtype=args.dtype)
    return 0
