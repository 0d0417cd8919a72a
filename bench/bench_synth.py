"""`rlmtrain data synth --groups 100` end to end: fpdf2 render, pypdfium2 parse, span location.

Run: `python -m pytest bench/bench_synth.py -q -s`. The target is under 60 s for 100 groups on a
2-core machine. Figures: wall seconds, papers/s, PDF pages/s and MB of PDF written, for one run
(a second run would only re-measure the same deterministic work), printed and in `extra_info`.
"""

from __future__ import annotations

import os
import time

import pytest

from rlmtrain.envs.pdf import read_corpus
from rlmtrain.envs.synth import synthesize

GROUPS = 100


@pytest.mark.slow
def test_synth_100_groups(benchmark, tmp_path):
    out = tmp_path / "synth"

    def run():
        began = time.perf_counter()
        summary = synthesize(out, groups=GROUPS, seed=0)
        return summary, time.perf_counter() - began

    summary, seconds = benchmark.pedantic(run, rounds=1, iterations=1)
    corpus = read_corpus(out / "corpus.jsonl")
    pages = sum(paper.pages for paper in corpus.values())
    pdf_mb = sum(p.stat().st_size for p in (out / "pdfs").iterdir()) / 2**20
    info = {
        "groups": GROUPS,
        "workers": os.cpu_count(),
        "papers": summary.papers,
        "tasks": summary.tasks,
        "lost_queries": summary.lost_queries,
        "seconds": round(seconds, 2),
        "papers_per_s": round(summary.papers / seconds, 1),
        "pages_per_s": round(pages / seconds, 1),
        "pdf_mb": round(pdf_mb, 1),
    }
    benchmark.extra_info.update(info)
    print("\nsynth:", ", ".join(f"{k}={v}" for k, v in info.items()))
