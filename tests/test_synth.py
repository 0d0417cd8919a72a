"""Synthetic corpus: determinism, task shape, gold spans in the parsed text, parser noise, CLI."""

from __future__ import annotations

from collections import Counter

import msgspec
import pypdfium2 as pdfium
import pytest

from rlmtrain.cli import main
from rlmtrain.envs.base import read_tasks
from rlmtrain.envs.evidence import EvidenceTask
from rlmtrain.envs.pdf import read_corpus
from rlmtrain.envs.synth import locate_span, synthesize

GROUPS = 8


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    summary = synthesize(out, groups=GROUPS, seed=11, workers=2)
    return out, summary


def _portable(path):
    """Corpus records without the absolute source path, which differs between folders."""
    return [msgspec.structs.replace(p, source="") for p in read_corpus(path).values()]


def test_same_seed_same_data_any_worker_count(synth_dir, tmp_path):
    out, _ = synth_dir
    again = tmp_path / "again"
    synthesize(again, groups=GROUPS, seed=11, workers=1)
    assert (again / "tasks.jsonl").read_bytes() == (out / "tasks.jsonl").read_bytes()
    assert _portable(again / "corpus.jsonl") == _portable(out / "corpus.jsonl")
    pdf = sorted((out / "pdfs").iterdir())[0]
    assert (again / "pdfs" / pdf.name).read_bytes() == pdf.read_bytes()
    other = tmp_path / "other"
    synthesize(other, groups=2, seed=12, workers=1)
    first = next(read_tasks(other / "tasks.jsonl", EvidenceTask))
    assert first != next(read_tasks(out / "tasks.jsonl", EvidenceTask))


def test_task_shape(synth_dir):
    out, summary = synth_dir
    corpus = read_corpus(out / "corpus.jsonl")
    tasks = list(read_tasks(out / "tasks.jsonl", EvidenceTask))
    assert summary.tasks == len(tasks) and summary.papers == len(corpus)
    per_group = Counter(task.id.split("-")[0] for task in tasks)
    assert max(per_group.values()) <= 3
    kinds = Counter(task.kind for task in tasks)
    assert set(kinds) <= {"datasets", "baselines", "results", "limitation"} and len(kinds) >= 3
    for task in tasks:
        assert 1 <= len(task.paper_ids) <= 10
        relevant = {span.paper_id for span in task.evidence}
        assert relevant <= set(task.paper_ids)
        if len(task.paper_ids) > 1:
            assert len(relevant) < len(task.paper_ids), task.id  # not every paper is relevant
        for span in task.evidence:
            assert corpus[span.paper_id].text[span.start : span.end] == span.text
            assert len(span.text) > 80
    assert any(len(task.paper_ids) >= 4 for task in tasks)


def test_gold_spans_found_for_95_percent_of_queries(synth_dir):
    _, summary = synth_dir
    queries = summary.tasks + summary.lost_queries
    assert summary.lost_queries / queries <= 0.05


def test_pdfs_carry_parser_noise_that_ingest_removes(synth_dir):
    out, _ = synth_dir
    corpus = read_corpus(out / "corpus.jsonl")
    hyphenated = headers = 0
    for paper in corpus.values():
        doc = pdfium.PdfDocument(paper.source)
        raw = "".join(doc[i].get_textpage().get_text_range() for i in range(len(doc)))
        doc.close()
        hyphenated += "\ufffe" in raw
        headers += raw.count("preprint under review") >= 2
        assert "preprint under review" not in paper.text
        assert "\ufffe" not in paper.text
    assert hyphenated >= len(corpus) // 2
    assert headers == len(corpus)


def test_locate_span_tolerates_noise_inside_but_not_far_apart():
    paragraph = (
        "The quick brown fox jumps over the lazy dog. It then rests for a while, "
        "near the quiet river bank, until the sun goes down."
    )
    text = "Intro. " + paragraph + " Outro."
    assert locate_span(text, paragraph) == (7, 7 + len(paragraph))
    noisy = text.replace("for a while", "for a Running Header 12 while")
    start, end = locate_span(noisy, paragraph)
    assert noisy[start:end] == paragraph.replace("for a while", "for a Running Header 12 while")
    far = paragraph[:40] + " x" * 200 + paragraph[-40:]
    assert locate_span(far, paragraph) is None


def test_cli(tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "synth",
                "--out",
                str(tmp_path),
                "--groups",
                "2",
                "--seed",
                "5",
                "--no-progress",
            ]
        )
        == 0
    )
    report = capsys.readouterr().out
    assert report.startswith("wrote ") and "from 2 groups" in report
    assert (tmp_path / "corpus.jsonl").is_file() and (tmp_path / "tasks.jsonl").is_file()
    assert len(list((tmp_path / "pdfs").glob("*.pdf"))) == len(
        read_corpus(tmp_path / "corpus.jsonl")
    )
    assert main(["data", "synth", "--out", str(tmp_path), "--groups", "0"]) == 2
    assert "--groups must be >= 1" in capsys.readouterr().err
    a_file = tmp_path / "corpus.jsonl"
    assert main(["data", "synth", "--out", str(a_file), "--groups", "1", "--no-progress"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rlmtrain data synth: error: --out") and str(a_file) in line, line


def test_a_smaller_synthesis_into_the_same_folder_leaves_none_of_the_earlier_pdfs(tmp_path):
    """They would join a later `data ingest` of the folder; a file of the user's stays."""
    synthesize(tmp_path, groups=3, seed=5, workers=1)
    (tmp_path / "pdfs" / "notes.pdf").write_bytes(b"the user's")
    synthesize(tmp_path, groups=1, seed=5, workers=1)
    corpus = read_corpus(tmp_path / "corpus.jsonl")
    names = {path.name for path in (tmp_path / "pdfs").iterdir()}
    assert names == {f"{paper_id}.pdf" for paper_id in corpus} | {"notes.pdf"}
