"""BookNavigator's REPL tools (docs/algorithm.md §2): a table of contents, an index, and sections.

Standard library only (with `repl_context`): every REPL zygote imports this module. The book
is the REPL's `context`, a dict {"title": str, "sections": [{"id", "title", "text"}, ...]} in
reading order. The tools find it as the global `context` of the code that calls them (the REPL
namespace), so the model writes `read_section("2.1")` as the task describes, not
`read_section(context, "2.1")`; passing `book=` explicitly works too (tests, teachers, helper
functions). The docstrings are what the model reads; input mistakes raise errors naming the tool
and the bad argument, which the REPL shows to the model so it can fix the call.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from rlmtrain.envs.repl_context import caller_context

__all__ = ["TOOLS", "get_toc", "read_section", "search_index"]

SNIPPET_CHARS = 160
"""Characters of text around an index hit (half before, half after)."""

MAX_INDEX_HITS = 20


def _book(book: Any, tool: str) -> dict[str, Any]:
    if book is None:
        book = caller_context(sys._getframe(2), tool, "book")
    if not isinstance(book, dict) or not isinstance(book.get("sections"), list):
        raise TypeError(
            f"{tool}: expected the book dict {{'title', 'sections': [...]}}, "
            f"got {type(book).__name__}"
        )
    return book


def get_toc(book=None):
    """Print the table of contents, one "id  title" line per section in reading order, and
    return the same lines as a list of strings. `book` defaults to `context`."""
    sections = _book(book, "get_toc")["sections"]
    lines = [f"{s['id']}  {s['title']}" for s in sections]
    print("\n".join(lines) if lines else "(empty book)")
    return lines


def search_index(keyword, book=None):
    """Look `keyword` up in the book's index: every section whose title or text contains it
    (case-insensitive; several words must appear as one phrase). Prints one line per hit,
    "id  title: ...snippet...", titles matches first, then text matches in reading order, at most
    20; returns the list of matching section ids in the same order. No hit prints "(no hits)"
    and returns []. `book` defaults to `context`."""
    if not isinstance(keyword, str) or not keyword.strip():
        raise ValueError(f"search_index: keyword must be a non-empty string, got {keyword!r}")
    sections = _book(book, "search_index")["sections"]
    pattern = re.compile(re.escape(" ".join(keyword.split())).replace(r"\ ", r"\s+"), re.I)
    in_title = [s for s in sections if pattern.search(s["title"])]
    in_text = [s for s in sections if s not in in_title and pattern.search(s["text"])]
    hits = (in_title + in_text)[:MAX_INDEX_HITS]
    if not hits:
        print("(no hits)")
        return []
    for section in hits:
        print(f"{section['id']}  {section['title']}: {_snippet(section['text'], pattern)}")
    return [s["id"] for s in hits]


def _snippet(text: str, pattern: re.Pattern[str]) -> str:
    match = pattern.search(text)
    if match is None:
        return " ".join(text[:SNIPPET_CHARS].split()) + ("..." if len(text) > SNIPPET_CHARS else "")
    start = max(0, match.start() - SNIPPET_CHARS // 2)
    end = min(len(text), match.end() + SNIPPET_CHARS // 2)
    body = " ".join(text[start:end].split())
    return ("..." if start else "") + body + ("..." if end < len(text) else "")


def read_section(section_id, book=None):
    """Return the full text of section `section_id` (e.g. "2.1") as a string; print it to see
    it. An unknown id raises KeyError listing the ids that exist. `book` defaults to `context`."""
    sections = _book(book, "read_section")["sections"]
    wanted = str(section_id).strip()
    for section in sections:
        if section["id"] == wanted:
            return f"{section['id']} {section['title']}\n\n{section['text']}"
    known = ", ".join(s["id"] for s in sections)
    raise KeyError(f"read_section: no section {section_id!r}; sections are: {known}")


TOOLS = [get_toc, search_index, read_section]
