"""PDF ingest on real files: cleaning, title/abstract heuristics, bad files, synth round trip."""

from __future__ import annotations

import shutil

import pytest
from fpdf import FPDF

from rlmtrain.cli import main
from rlmtrain.envs.evidence import EvidenceEnv
from rlmtrain.envs.pdf import clean_pages, find_abstract, parse_pdf, read_corpus
from rlmtrain.envs.synth import synthesize


def _pdf(path, pages, *, title=None, heading=None, header="Proc. of Testing 2024", size=10):
    """Write a PDF whose pages hold the given lines; page k gets a running header and number."""
    pdf = FPDF(unit="mm", format="A4")
    pdf.set_auto_page_break(False)
    if title is not None:
        pdf.set_title(title)
    for k, lines in enumerate(pages, 1):
        pdf.add_page()
        pdf.set_font("Helvetica", size=7)
        if header:
            pdf.text(20, 10, f"{header} - page {k}")
        pdf.text(105, 287, str(k))
        y = 25.0
        if heading and k == 1:
            pdf.set_font("Helvetica", style="B", size=16)
            pdf.text(20, y, heading)
            y += 9
        pdf.set_font("Helvetica", size=size)
        for line in lines:
            pdf.text(20, y, line)
            y += 5
    pdf.output(str(path))
    return path


BODY = [
    [
        "A Study of Things",
        "Abstract",
        "We show that evalu-",
        "ation of state-of-the-",
        "Art systems matters.",
        "1 Introduction",
        "Things are studied here.",
    ],
    ["The second page continues the argu-", "ment in detail.", "More text follows."],
    ["Third page text.", "The end."],
]


def test_cleaning_headers_page_numbers_hyphens(tmp_path):
    paper = parse_pdf(_pdf(tmp_path / "p.pdf", BODY))
    text = paper.text
    assert "Proc. of Testing" not in text  # running header, page number varies inside it
    assert "evaluation of" in text  # line-end hyphen before a lower-case letter undone
    assert "state-of-the-Art" in text  # before a capital it stays a hyphen
    assert "argument in detail" in text  # undone across the body of page 2
    assert " 2 " not in f" {text} " and " 3 " not in f" {text} "  # page numbers dropped
    assert "  " not in text and "\n" not in text
    assert paper.pages == 3 and paper.id == "p"


def test_clean_pages_page_number_forms():
    numbers = ["iv", "Page 5 of 12", "6 / 12", "vii"]
    bodies = [["Alpha text.", "Ends here."], ["Beta words.", "Go on."], ["Gamma."], ["Delta."]]
    pages = ["\r\n".join([number, *body]) for number, body in zip(numbers, bodies, strict=True)]
    assert clean_pages(pages) == bodies
    # Words made only of numeral letters are not page numbers.
    assert clean_pages(["civil\r\nill\r\nText."]) == [["civil", "ill", "Text."]]


def test_single_page_keeps_its_only_header_but_drops_the_number(tmp_path):
    paper = parse_pdf(_pdf(tmp_path / "one.pdf", [["Just one page.", "Second line."]]))
    # One page cannot show a header *repeating*; only the bare page number is recognised.
    assert paper.text == "Proc. of Testing 2024 - page 1 Just one page. Second line."


def test_title_from_metadata_then_largest_font_then_first_line(tmp_path):
    body = [["Abstract", "Short abstract here.", "1 Introduction", "Body."], ["Page two."]]
    meta = parse_pdf(
        _pdf(tmp_path / "a.pdf", body, title="Real Metadata Title", heading="Big Title")
    )
    assert meta.title == "Real Metadata Title"
    stub = parse_pdf(
        _pdf(tmp_path / "b.pdf", body, title="Microsoft Word - draft.docx", heading="Big Title")
    )
    assert stub.title == "Big Title"
    plain = parse_pdf(_pdf(tmp_path / "c.pdf", [["Plain First Line", *body[0]], ["Page two."]]))
    assert plain.title == "Plain First Line"
    assert meta.abstract == "Short abstract here."


def test_find_abstract_rules():
    text = "Title\nAuthors\nAbstract: We do X.\nAnd Y.\n1 Introduction\nBody"
    assert find_abstract(text, "Title") == "We do X. And Y."
    numbered = "Title\nABSTRACT\nWe do X.\n1 Background\nBody"
    assert find_abstract(numbered, "Title") == "We do X."
    no_marker = "Title\nWe do X without a marker.\nI. Introduction\nBody"
    assert find_abstract(no_marker, "Title") == "We do X without a marker."
    neither = "Title\n" + "word " * 400
    assert len(find_abstract(neither, "Title")) == 1000


def _bad_files(folder):
    good = _pdf(folder / "good.pdf", BODY)
    (folder / "empty.pdf").write_bytes(b"")
    (folder / "notes.txt").write_text("not a pdf at all\n")
    (folder / "corrupt.pdf").write_bytes(good.read_bytes()[:300])
    enc = FPDF()
    enc.set_encryption(owner_password="owner", user_password="secret")
    enc.add_page()
    enc.set_font("Helvetica")
    enc.text(20, 20, "hidden text")
    enc.output(str(folder / "encrypted.pdf"))
    scan = FPDF()
    scan.add_page()
    scan.rect(20, 20, 100, 100, style="F")  # drawn content, no text layer
    scan.output(str(folder / "scan.pdf"))


def test_cli_skips_bad_files_and_ingests_the_rest(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    _bad_files(folder)
    (folder / ".hidden.pdf").write_bytes(b"ignored")
    out = tmp_path / "corpus.jsonl"
    assert (
        main(["data", "ingest", str(folder), "--out", str(out), "--workers", "2", "--no-progress"])
        == 0
    )
    report = capsys.readouterr().out
    assert "ingested 1 of 6 files" in report and "skipped 5:" in report
    reasons = {
        "empty.pdf": "empty file",
        "notes.txt": "not a PDF",
        "corrupt.pdf": "corrupt PDF",
        "encrypted.pdf": "encrypted",
        "scan.pdf": "no text layer",
    }
    for name, reason in reasons.items():
        line = next(
            line for line in report.splitlines() if line.strip().startswith(str(folder / name))
        )
        assert reason in line, line
    assert ".hidden" not in report
    assert list(read_corpus(out)) == ["good"]


def test_cli_bad_folder_is_exit_code_2(tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "ingest",
                str(tmp_path / "missing"),
                "--out",
                str(tmp_path / "c.jsonl"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "PDF folder not found" in capsys.readouterr().err


def test_synth_pdfs_round_trip_through_the_cli(tmp_path, capsys):
    """Re-ingesting synth's PDFs, with bad files mixed in, finds >= 95% of queries' gold spans."""
    summary = synthesize(tmp_path / "synth", groups=6, seed=3, workers=2)
    folder = tmp_path / "mixed"
    shutil.copytree(tmp_path / "synth" / "pdfs", folder)
    _bad_files(folder)
    out = tmp_path / "corpus.jsonl"
    assert main(["data", "ingest", str(folder), "--out", str(out), "--no-progress"]) == 0
    assert "skipped 5:" in capsys.readouterr().out
    corpus = read_corpus(out)
    tasks = EvidenceEnv().load_tasks(tmp_path / "synth" / "tasks.jsonl")
    found = sum(
        all(corpus[s.paper_id].text[s.start : s.end] == s.text for s in task.evidence)
        for task in tasks
    )
    queries = summary.tasks + summary.lost_queries
    assert queries >= 6
    assert found / queries >= 0.95, (found, queries)


@pytest.mark.parametrize("name", ["a.pdf", "sub/b.pdf"])
def test_ingest_recurses_and_names_papers_by_stem(tmp_path, name):
    path = tmp_path / "in" / name
    path.parent.mkdir(parents=True)
    _pdf(path, BODY)
    out = tmp_path / "c.jsonl"
    assert main(["data", "ingest", str(tmp_path / "in"), "--out", str(out), "--no-progress"]) == 0
    assert list(read_corpus(out)) == [path.stem]


def test_a_file_name_that_is_not_utf8_is_skipped_by_name_and_the_rest_ingested(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    _pdf(folder / "good.pdf", BODY)
    shutil.copy(folder / "good.pdf", bytes(folder) + b"/bad\xff.pdf")
    out = tmp_path / "c.jsonl"
    assert main(["data", "ingest", str(folder), "--out", str(out), "--no-progress"]) == 0
    report = capsys.readouterr().out
    assert "ingested 1 of 2 files" in report
    assert "bad\\xff.pdf" in report and "not UTF-8" in report
    assert list(read_corpus(out)) == ["good"]


def test_a_corpus_write_that_fails_leaves_the_corpus_there_as_it_was(tmp_path):
    from rlmtrain.envs.pdf import write_corpus

    folder = tmp_path / "in"
    folder.mkdir()
    paper = parse_pdf(_pdf(folder / "good.pdf", BODY))
    out = tmp_path / "c.jsonl"
    out.write_text("the corpus of an earlier ingest\n")

    def papers_then_a_full_disk():
        yield paper
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_corpus(out, papers_then_a_full_disk())
    assert out.read_text() == "the corpus of an earlier ingest\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "in"]
    assert write_corpus(out, [paper]) == 1
    assert list(read_corpus(out)) == ["good"]


def test_a_symbolic_link_to_nothing_is_listed_as_skipped(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    _pdf(folder / "good.pdf", BODY)
    (folder / "moved.pdf").symlink_to(tmp_path / "elsewhere.pdf")
    out = tmp_path / "c.jsonl"
    assert main(["data", "ingest", str(folder), "--out", str(out), "--no-progress"]) == 0
    report = capsys.readouterr().out
    assert "ingested 1 of 2 files" in report, report
    assert f"{folder / 'moved.pdf'}: a symbolic link to nothing" in report, report
