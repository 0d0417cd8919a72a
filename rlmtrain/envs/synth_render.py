"""A synthetic paper printed to PDF with fpdf2: one or two columns, running headers and page
numbers, hyphenation, so that parsing it back (`envs.pdf`) meets the noise of real papers."""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime
from pathlib import Path

from rlmtrain.envs.synth_papers import PaperSpec

__all__ = ["render"]


_PAGE_W, _PAGE_H, _MARGIN, _GUTTER = 210.0, 297.0, 18.0, 8.0
_BODY_PT, _LINE_MM = 9.5, 4.4
_FIXED_DATE = datetime(2024, 1, 1, tzinfo=UTC)
_HYPHENATABLE = re.compile(r"^[a-z]{7,}[,.;:]?$")


class _Layout:
    """Manual line layout on fpdf2 (its own wrapping never hyphenates): the cursor moves down a
    column, then to the next column, then to a new page that gets the running header/footer."""

    def __init__(self, spec: PaperSpec, rng: random.Random):
        from fpdf import FPDF

        self.pdf = FPDF(unit="mm", format="A4")
        self.pdf.set_creation_date(_FIXED_DATE)
        self.pdf.set_auto_page_break(False)
        if spec.metadata_title:
            self.pdf.set_title(spec.title)
        self.header = f"{spec.method} - preprint under review"
        self.rng = rng
        self.page = 0
        self.full = [(_MARGIN, _PAGE_W - 2 * _MARGIN)]
        half = (_PAGE_W - 2 * _MARGIN - _GUTTER) / 2
        self.split = [(_MARGIN, half), (_MARGIN + half + _GUTTER, half)]
        self.columns = self.full
        self.col = 0
        self.top = 0.0
        self._new_page()

    def _new_page(self) -> None:
        pdf = self.pdf
        pdf.add_page()
        self.page += 1
        pdf.set_font("Helvetica", size=7.5)
        pdf.text(_MARGIN, 10, self.header)
        pdf.text(_PAGE_W / 2 - 2, _PAGE_H - 10, str(self.page))
        self.col = 0
        self.top = 20.0
        self.y = self.top

    def use_columns(self, columns: list[tuple[float, float]]) -> None:
        if columns is not self.columns:
            self.columns = columns
            self.col = 0
            self.top = self.y

    def _advance(self, height: float) -> None:
        if self.y + height <= _PAGE_H - 18:
            return
        if self.col + 1 < len(self.columns):
            self.col += 1
            self.y = self.top
        else:
            self._new_page()

    def _width(self, word: str, size: float) -> float:
        # Summing the core font's glyph widths directly: fpdf2's get_string_width copies its
        # graphics state on every call and was half the run time.
        widths = self.pdf.current_font.cw
        return sum(widths[c] for c in word) * size / 1000 / self.pdf.k

    def paragraph(
        self, text: str, *, size: float = _BODY_PT, style: str = "", gap: float = 1.8
    ) -> None:
        self.pdf.set_font("Helvetica", style=style, size=size)
        line_mm = _LINE_MM * size / _BODY_PT
        space = self._width(" ", size)
        words = text.split()
        line: list[str] = []
        used = 0.0
        while words:
            word = words.pop(0)
            width = self._width(word, size)
            limit = self.columns[self.col][1]
            if not line or used + space + width <= limit:
                used += (space if line else 0.0) + width
                line.append(word)
                continue
            room = limit - used - space
            if _HYPHENATABLE.match(word) and self.rng.random() < 0.7:
                cut = self._hyphen_cut(word, room, size)
                if cut:
                    line.append(word[:cut] + "-")
                    words.insert(0, word[cut:])
                    self._emit(line, line_mm)
                    line, used = [], 0.0
                    continue
            self._emit(line, line_mm)
            line, used = [word], width
        if line:
            self._emit(line, line_mm)
        self.y += gap

    def _hyphen_cut(self, word: str, room: float, size: float) -> int:
        """The longest prefix (>= 3 letters, leaving >= 3) that fits with its hyphen; 0 if none."""
        letters = len(word.rstrip(",.;:"))
        for cut in range(letters - 3, 2, -1):
            if self._width(word[:cut] + "-", size) <= room:
                return cut
        return 0

    def _emit(self, words: list[str], line_mm: float) -> None:
        self._advance(line_mm)
        x = self.columns[self.col][0]
        self.y += line_mm
        self.pdf.text(x, self.y, " ".join(words))

    def save(self, path: Path) -> None:
        self.pdf.output(str(path))


def render(spec: PaperSpec, path: Path, rng: random.Random) -> None:
    layout = _Layout(spec, rng)
    layout.paragraph(spec.title, size=14, style="B", gap=2.0)
    layout.paragraph(spec.authors, size=9, gap=4.0)
    for heading, paragraphs in spec.sections:
        if heading == "":
            layout.paragraph("Abstract", size=10, style="B", gap=0.5)
            for paragraph in paragraphs:
                layout.paragraph(paragraph, size=9)
            layout.y += 3.0
            layout.use_columns(layout.split if spec.two_columns else layout.full)
            continue
        layout.paragraph(heading, size=10.5, style="B", gap=0.8)
        for paragraph in paragraphs:
            layout.paragraph(paragraph)
    layout.save(path)
