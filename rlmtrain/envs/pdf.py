"""PDF ingest: a folder of papers -> `corpus.jsonl` of {id, title, abstract, text}.

Text comes from pypdfium2, page by page, and is cleaned the way a careful reader would:

1. Lines. pdfium ends a visual line with "\\r\\n", except after a line-end hyphen, which it
   reports as U+FFFE with no break; we put the break back so every visual line is one line.
2. Running headers and footers. A line in the first or last three lines of a page is dropped when
   its shape (lower-cased, digits replaced by '#') recurs in those zones on at least half the pages
   (and on two or more). Page numbers ("7", "Page 7", "7 of 12", "vii") in those zones are dropped
   on every page.
3. Hyphenation. A line-end hyphen followed by a lower-case letter on the next line is undone
   ("evalu-" + "ation" -> "evaluation"); before anything else it stays, joined without a space
   ("state-of-the-" + "Art" -> "state-of-the-Art"). A compound split at its own hyphen before a
   lower-case word ("two-" + "column") loses its hyphen: the price of the common case.
4. Whitespace. Every run of whitespace becomes one space: paper text is a single line.

Title: the PDF's metadata Title when it looks real (not empty, "untitled", a file name or a
"Microsoft Word - " stub); otherwise the layout's: the first run of text on page 1 set in its
largest font, when that font is clearly larger than the body's (titles wrap over lines, so "the
first line" alone cuts them); otherwise the first line of page 1.

Abstract: the text after a line starting with "Abstract" up to the first heading "Introduction" /
"1 Introduction" / "I. Introduction" or a numbered heading "1 Word"; without an "Abstract" line,
the text between the title and that heading; without either, the first 1,000 characters after
the title.

A file that is corrupt, empty, encrypted, not a PDF, or has no text layer (image-only scans) is
skipped with a reason; the run goes on and the summary lists it. Files are parsed in a process
pool (pdfium is not thread-safe, and parsing is CPU-bound).
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import msgspec

from rlmtrain.envs.pool import map_in_processes
from rlmtrain.errors import UserError
from rlmtrain.rlm.records import write_jsonl

__all__ = [
    "IngestSummary",
    "Paper",
    "SkippedFile",
    "clean_pages",
    "IngestError",
    "find_abstract",
    "ingest_dir",
    "ingest_files",
    "parse_pdf",
    "read_corpus",
    "write_corpus",
]


class Paper(msgspec.Struct, kw_only=True):
    id: str
    """The file name without its extension."""
    title: str
    abstract: str
    text: str
    """The whole cleaned text, title and abstract included, on one line."""
    source: str = ""
    """The file the paper was parsed from."""
    pages: int = 0


class SkippedFile(msgspec.Struct, kw_only=True):
    path: str
    reason: str


class IngestSummary(msgspec.Struct, kw_only=True):
    papers: int
    skipped: list[SkippedFile]

    def report(self) -> str:
        lines = [f"ingested {self.papers} of {self.papers + len(self.skipped)} files"]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)}:")
            lines.extend(f"  {s.path}: {s.reason}" for s in self.skipped)
        return "\n".join(lines)


class _Unreadable(Exception):
    """A file we skip; the message is the reason shown in the summary."""


# ---------------------------------------------------------------------------------------------
# One file
# ---------------------------------------------------------------------------------------------


def parse_pdf(path: str | Path, paper_id: str | None = None) -> Paper:
    """Parse one PDF; raises ValueError with the reason when the file must be skipped."""
    try:
        return _parse(Path(path), paper_id)
    except _Unreadable as exc:
        raise ValueError(f"{path}: {exc}") from None


def _parse(path: Path, paper_id: str | None) -> Paper:
    import pypdfium2 as pdfium

    with path.open("rb") as f:
        head = f.read(1024)
    if not head:
        raise _Unreadable("empty file")
    if b"%PDF-" not in head:
        raise _Unreadable("not a PDF (no %PDF- header)")
    try:
        doc = pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as exc:
        message = str(exc)
        if "password" in message.lower():
            raise _Unreadable("encrypted (needs a password)") from None
        raise _Unreadable(f"corrupt PDF ({message})") from None
    try:
        metadata_title = _metadata_title(doc.get_metadata_dict().get("Title", ""))
        pages, largest_text = [], ""
        for i in range(len(doc)):
            text, largest = _page_text(doc[i], with_largest=i == 0 and not metadata_title)
            pages.append(text)
            largest_text = largest_text or largest
    finally:
        doc.close()
    if not pages:
        raise _Unreadable("no pages")
    lines = clean_pages(pages)
    if not any(line for page in lines for line in page):
        raise _Unreadable("no text layer (image-only or blank pages)")
    title = metadata_title or _flatten(largest_text) or _first_line(lines[0])
    joined = "\n".join("\n".join(page) for page in lines)
    return Paper(
        id=paper_id or path.stem,
        title=title,
        abstract=find_abstract(joined, title),
        text=_flatten(joined),
        source=str(path),
        pages=len(pages),
    )


def _page_text(page, *, with_largest: bool) -> tuple[str, str]:
    """The page's raw text and, if asked, the text set in its largest font near the top."""
    textpage = page.get_textpage()
    try:
        text = textpage.get_text_range()
        return text, _largest_font_run(textpage) if with_largest else ""
    finally:
        textpage.close()
        page.close()


_TITLE_SCAN_CHARS = 1500
_TITLE_SIZE_RATIO = 1.15


def _largest_font_run(textpage) -> str:
    """The first run of characters in the largest font among the first 1,500 of the page, when
    that font is at least 15% larger than the most common one (else ""). Characters pdfium
    generates itself (line breaks, size <= 1) do not end the run."""
    import pypdfium2.raw as pdfium_c

    count = min(textpage.count_chars(), _TITLE_SCAN_CHARS)
    sizes = [pdfium_c.FPDFText_GetFontSize(textpage, i) for i in range(count)]
    real = [round(size, 1) for size in sizes if size > 1.0]
    if not real:
        return ""
    largest, common = max(real), Counter(real).most_common(1)[0][0]
    if largest < _TITLE_SIZE_RATIO * common:
        return ""
    start = next(i for i, size in enumerate(sizes) if round(size, 1) == largest)
    end = start
    while end < count and (sizes[end] <= 1.0 or round(sizes[end], 1) >= largest * 0.95):
        end += 1
    return "\n".join(_visual_lines(textpage.get_text_range(start, end - start)))


# ---------------------------------------------------------------------------------------------
# Cleaning
# ---------------------------------------------------------------------------------------------

# pdfium reports a hyphen at a line end as U+FFFE (older builds: U+0002) and drops the break.
_SOFT_HYPHENS = ("\ufffe", "\x02")
_EDGE_LINES = 3
_ROMAN = r"(?=[ivxlc])c{0,3}(xc|xl|l?x{0,3})(ix|iv|v?i{0,3})"
_PAGE_NUMBER = re.compile(
    rf"^(page\s*)?(\d{{1,4}}|{_ROMAN})(\s*(/|of)\s*\d{{1,4}})?$", re.IGNORECASE
)
_DIGITS = re.compile(r"\d+")
_SPACES = re.compile(r"\s+")


def clean_pages(pages: list[str]) -> list[list[str]]:
    """Raw pdfium page texts -> per page, its visual lines without running headers, footers
    and page numbers (hyphens and whitespace are left to the join)."""
    split = [_visual_lines(page) for page in pages]
    running = _running_lines(split)
    cleaned = []
    for lines in split:
        keep = []
        for idx, line in enumerate(lines):
            at_edge = idx < _EDGE_LINES or idx >= len(lines) - _EDGE_LINES
            if at_edge and (_PAGE_NUMBER.match(line) or _shape(line) in running):
                continue
            keep.append(line)
        cleaned.append(keep)
    return cleaned


def _visual_lines(page: str) -> list[str]:
    for mark in _SOFT_HYPHENS:
        page = page.replace(mark, "\ufffe\n")
    lines = (line.strip() for line in page.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    return [line for line in lines if line]


def _shape(line: str) -> str:
    return _SPACES.sub(" ", _DIGITS.sub("#", line.lower())).strip()


def _running_lines(pages: list[list[str]]) -> set[str]:
    """Shapes that recur in the edge zones of at least half the pages (and at least two)."""
    if len(pages) < 2:
        return set()
    counts: Counter[str] = Counter()
    for lines in pages:
        edges = lines[:_EDGE_LINES] + lines[max(_EDGE_LINES, len(lines) - _EDGE_LINES) :]
        counts.update({_shape(line) for line in edges})
    needed = max(2, (len(pages) + 1) // 2)
    return {shape for shape, n in counts.items() if n >= needed}


_SOFT_BREAK = re.compile(r"\ufffe\n(?=[a-z])")
_HARD_BREAK = re.compile(r"(?<=[a-z])-\n(?=[a-z])")
_COMPOUND_BREAK = re.compile(r"(?<=\w)-\n(?=\w)")


def _flatten(text: str) -> str:
    """Undo line-end hyphenation, then collapse all whitespace to single spaces."""
    text = _SOFT_BREAK.sub("", text).replace("\ufffe\n", "-\n").replace("\ufffe", "-")
    text = _COMPOUND_BREAK.sub("-", _HARD_BREAK.sub("", text))
    return _SPACES.sub(" ", text).strip()


# ---------------------------------------------------------------------------------------------
# Title and abstract
# ---------------------------------------------------------------------------------------------

_STUB_TITLE = re.compile(r"^(untitled|microsoft word -|.*\.(pdf|docx?|tex|dvi)$)", re.IGNORECASE)


def _metadata_title(title: str) -> str:
    title = _SPACES.sub(" ", title or "").strip()
    if len(title) < 4 or _STUB_TITLE.match(title):
        return ""
    return title


def _first_line(first_page: list[str]) -> str:
    return _flatten(first_page[0]) if first_page else ""


_ABSTRACT_START = re.compile(r"^\s*abstract\b[\s.:\-]*", re.IGNORECASE | re.MULTILINE)
_ABSTRACT_END = re.compile(
    r"^\s*(((\d+|[IVX]+)\.?\s+)?introduction\b|1\.?\s+[A-Z][a-z])", re.IGNORECASE | re.MULTILINE
)
_FALLBACK_ABSTRACT_CHARS = 1000


def find_abstract(text: str, title: str = "") -> str:
    """The abstract of a paper's line-structured text (rules in the module docstring)."""
    start = _ABSTRACT_START.search(text)
    if start is not None:
        body = text[start.end() :]
        end = _ABSTRACT_END.search(body)
        return _flatten(body[: end.start()] if end else body[:_FALLBACK_ABSTRACT_CHARS])
    body = text
    flat_title = _flatten(title).lower()
    if flat_title:
        # Skip past the title lines when they open the text.
        first_lines = body.split("\n", 2)
        for k in (1, 2):
            if _flatten("\n".join(first_lines[:k])).lower() == flat_title:
                body = "\n".join(first_lines[k:])
                break
    end = _ABSTRACT_END.search(body)
    if end is not None:
        return _flatten(body[: end.start()])
    return _flatten(body)[:_FALLBACK_ABSTRACT_CHARS]


# ---------------------------------------------------------------------------------------------
# Many files
# ---------------------------------------------------------------------------------------------


def _parse_or_skip(path: str) -> Paper | SkippedFile:
    try:
        return _parse(Path(path), None)
    except _Unreadable as exc:
        return SkippedFile(path=path, reason=str(exc))
    except Exception as exc:  # a parser crash on one file must not end the run
        return SkippedFile(path=path, reason=f"parser error: {type(exc).__name__}: {exc}")


def ingest_files(
    paths: Iterable[str | Path], *, workers: int | None = None, progress: bool = False
) -> tuple[list[Paper], list[SkippedFile]]:
    """Parse files in a process pool (workers=None: one per CPU; 1: in this process).

    Returns the papers and the skipped files, both in the order of `paths`.
    """
    from tqdm import tqdm

    paths = [str(p) for p in paths]
    bar = tqdm(total=len(paths), desc="ingest", unit="pdf", file=sys.stderr, disable=not progress)
    with bar:
        results = map_in_processes(_parse_or_skip, paths, workers, bar.update)
    papers = [r for r in results if isinstance(r, Paper)]
    skipped = [r for r in results if isinstance(r, SkippedFile)]
    return papers, skipped


class IngestError(UserError, ValueError):
    """A PDF folder that cannot be ingested as a whole (missing, or two files of one paper id)."""


def ingest_dir(
    pdf_dir: str | Path, out: str | Path, *, workers: int | None = None, progress: bool = False
) -> IngestSummary:
    """Parse every regular, non-hidden file under `pdf_dir` (recursively, sorted) into `out`.

    Files that are not PDFs are reported as skipped rather than silently ignored, so a folder
    of the wrong files is visible in the summary.
    """
    pdf_dir = Path(pdf_dir)
    if not pdf_dir.is_dir():
        raise IngestError(f"PDF folder not found: {pdf_dir}")
    found = sorted(
        p
        for p in pdf_dir.rglob("*")
        if not any(part.startswith(".") for part in p.relative_to(pdf_dir).parts)
    )
    paths = [p for p in found if p.is_file()]
    # A link to nothing is listed, not passed over: it stands for a paper the user meant.
    dangling = [p for p in found if p.is_symlink() and not p.exists()]
    # A paper's id and source are its file's name, and a corpus is UTF-8 JSON: a name that is
    # not UTF-8 (bytes the file system keeps as they are) is reported, printably, not parsed.
    unnamed = [p for p in paths if not _utf8(str(p))]
    paths = [p for p in paths if _utf8(str(p))]
    papers, skipped = ingest_files(paths, workers=workers, progress=progress)
    skipped += [
        SkippedFile(
            path=os.fsencode(p).decode("utf-8", "backslashreplace"),
            reason="its name is not UTF-8; rename it",
        )
        for p in unnamed
    ]
    skipped += [SkippedFile(path=str(p), reason="a symbolic link to nothing") for p in dangling]
    duplicate = [id_ for id_, n in Counter(p.id for p in papers).items() if n > 1]
    if duplicate:
        raise IngestError(f"{pdf_dir}: several files share the paper id(s) {', '.join(duplicate)}")
    write_corpus(out, papers)
    return IngestSummary(papers=len(papers), skipped=skipped)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def write_corpus(path: str | Path, papers: Iterable[Paper]) -> int:
    """Write papers as JSON lines (`write_jsonl`: a failed write leaves a corpus already there
    as it was); returns how many were written."""
    return write_jsonl(path, papers)


def read_corpus(path: str | Path) -> dict[str, Paper]:
    """Paper id -> Paper from a corpus JSONL (errors name the file, line and field)."""
    from rlmtrain.envs.base import read_tasks

    return {paper.id: paper for paper in read_tasks(path, Paper)}
