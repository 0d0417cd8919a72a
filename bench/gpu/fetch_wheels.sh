#!/usr/bin/env bash
# Wheels the GPU machine's image lacks, for bench/gpu/run.sh and loop.sh: the peers (Liger, Cut
# Cross-Entropy), msgspec (the model tests, the trainer) and the PDF libraries the evidence env's
# task synthesis needs (loop.sh's RL step: fpdf2 with defusedxml, pypdfium2). Run here, on a
# machine with a package index; the files land in .whl/ (git-ignored) and travel with the device
# call (carry: [".whl"]). The device image runs CPython 3.12 on x86-64.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1 msgspec==0.19.0 \
    fpdf2==2.8.9 defusedxml==0.7.1 pypdfium2==5.15.2
ls -l .whl
