"""Synthetic evidence-selection corpus: templated paper groups rendered to PDF and parsed back.

Why render at all: the environment's paper text must carry real parser noise (running headers,
page numbers, undone hyphenation, two-column order), and the cheapest honest way to get it is to
print papers with fpdf2 and read them back through `envs.pdf`, the same pipeline real PDFs use.

A group shares one research area (`synth_words.AREAS`: task, datasets, metric, baselines,
techniques; limitations and filler sentences are common to all areas). Each paper gets an
invented method name, one technique, 2-3 datasets and 3-4 baselines, and the sections of a short
paper; four kinds of paragraph are planted as evidence:

    datasets   "4.1 Datasets"        answers  which datasets evaluate <method>?
    baselines  "4.2 Baselines"       answers  which baselines do <technique> methods compare with?
    results    "5 Results", one per dataset: which method scores best on <dataset>?
    limitation "7 Limitations"       answers  what limitations do <technique> methods report?

Related-work and introduction text mention the same datasets, baselines and techniques as
distractors. Up to three queries per group, of different kinds; a multi-paper query never selects
every paper. Gold spans are located in the parsed text (paper id, char offsets, parsed text); a
span that cannot be located drops its query and is counted in the summary.

The parts: the vocabulary (`synth_words`), a group's papers and queries as data
(`synth_papers`), printing a paper to PDF (`synth_render`); here, parsing them back, locating the
gold spans, and making many groups in a process pool.

Determinism: group g of seed s draws from `random.Random(f"{s}:{g}")`, so a group's papers and
queries do not depend on the worker that made them; PDFs carry a fixed creation date.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import msgspec

from rlmtrain.envs.evidence_tasks import EvidenceSpan, EvidenceTask
from rlmtrain.envs.pdf import Paper, parse_pdf, write_corpus
from rlmtrain.envs.pool import map_in_processes
from rlmtrain.envs.synth_papers import paper_group
from rlmtrain.envs.synth_render import render

__all__ = ["SynthSummary", "locate_span", "synthesize"]


# ---------------------------------------------------------------------------------------------
# Locating gold spans in parsed text
# ---------------------------------------------------------------------------------------------

_ANCHOR = 40


def locate_span(text: str, paragraph: str) -> tuple[int, int] | None:
    """(start, end) of `paragraph` in parsed `text`, or None.

    Exact match first; otherwise the paragraph's first and last 40 characters as anchors, which
    tolerates parser noise inside (a page number or header mid-paragraph, a compound split at its
    hyphen); the anchors must lie within 1.5x the paragraph's length of each other.
    """
    start = text.find(paragraph)
    if start >= 0:
        return start, start + len(paragraph)
    head, tail = paragraph[:_ANCHOR], paragraph[-_ANCHOR:]
    start = text.find(head)
    while start >= 0:
        end = text.find(tail, start + len(head))
        if end >= 0 and end + len(tail) - start <= 1.5 * len(paragraph):
            return start, end + len(tail)
        start = text.find(head, start + 1)
    return None


# ---------------------------------------------------------------------------------------------
# One group, many groups
# ---------------------------------------------------------------------------------------------


class _GroupResult(msgspec.Struct):
    papers: list[Paper]
    tasks: list[EvidenceTask]
    lost_spans: int


def _make_group(args: tuple[int, int, str, int]) -> _GroupResult:
    seed, group, pdf_dir, max_papers = args
    rng = random.Random(f"{seed}:{group}")
    _, specs, queries = paper_group(rng, group, max_papers)
    parsed: dict[str, Paper] = {}
    for spec in specs:
        path = Path(pdf_dir) / f"{spec.id}.pdf"
        render(spec, path, rng)
        parsed[spec.id] = parse_pdf(path)
    by_id = {spec.id: spec for spec in specs}
    tasks, lost = [], 0
    for k, query in enumerate(queries):
        spans = []
        for paper_id, kind in query.evidence:
            text = parsed[paper_id].text
            where = locate_span(text, by_id[paper_id].evidence[kind])
            if where is None:
                break
            spans.append(
                EvidenceSpan(
                    paper_id=paper_id, start=where[0], end=where[1], text=text[where[0] : where[1]]
                )
            )
        if len(spans) < len(query.evidence):
            lost += 1
            continue
        tasks.append(
            EvidenceTask(
                id=f"g{group:04d}-q{k}",
                query=query.query,
                kind=query.kind,
                paper_ids=[spec.id for spec in specs],
                evidence=spans,
            )
        )
    return _GroupResult(papers=list(parsed.values()), tasks=tasks, lost_spans=lost)


class SynthSummary(msgspec.Struct, kw_only=True):
    groups: int
    papers: int
    tasks: int
    lost_queries: int
    """Queries dropped because a gold span was not found in the parsed text."""
    seconds: float


_OWN_PDF = re.compile(r"g\d+-p\d+\.pdf")
"""The names of the PDFs this module writes (group, paper)."""


def synthesize(
    out_dir: str | Path,
    *,
    groups: int,
    seed: int = 0,
    first_group: int = 0,
    max_papers: int = 10,
    workers: int | None = None,
    progress: bool = False,
) -> SynthSummary:
    """Write `out_dir/pdfs/*.pdf`, `out_dir/corpus.jsonl` and `out_dir/tasks.jsonl` for groups
    first_group .. first_group + groups - 1 (disjoint ranges never share a paper or a task)."""
    import time

    from tqdm import tqdm

    from rlmtrain.envs.base import write_tasks

    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if max_papers < 1:
        raise ValueError(f"max_papers must be >= 1, got {max_papers}")
    began = time.perf_counter()
    out_dir = Path(out_dir)
    pdf_dir = out_dir / "pdfs"
    pdf_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(seed, g, str(pdf_dir), max_papers) for g in range(first_group, first_group + groups)]
    bar = tqdm(total=groups, desc="synth", unit="group", file=sys.stderr, disable=not progress)
    with bar:
        results = map_in_processes(_make_group, jobs, workers, bar.update)
    papers = [p for r in results for p in r.papers]
    tasks = [t for r in results for t in r.tasks]
    # A synthesis of other groups into this folder before left its PDFs; they would join any
    # `data ingest` of it. Only this module's own names go: a file of the user's stays.
    written = {Path(paper.source).name for paper in papers}
    for stale in pdf_dir.glob("g*-p*.pdf"):
        if _OWN_PDF.fullmatch(stale.name) and stale.name not in written:
            stale.unlink()
    write_corpus(out_dir / "corpus.jsonl", papers)
    write_tasks(out_dir / "tasks.jsonl", tasks)
    return SynthSummary(
        groups=groups,
        papers=len(papers),
        tasks=len(tasks),
        lost_queries=sum(r.lost_spans for r in results),
        seconds=round(time.perf_counter() - began, 2),
    )
