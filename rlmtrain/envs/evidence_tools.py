"""The evidence environment's REPL tools (docs/algorithm.md §2), injected into workers via `TOOLS`.

Standard library only: each REPL zygote imports this module, and worker start-up time is paid
per tree. The docstrings are what the model reads in its system prompt, so every edge case is
stated there, not here. Input mistakes raise TypeError/ValueError whose message names the tool
and the bad argument: the REPL shows the error to the model, which can then fix its call.

A paper collection is a dict paper id -> {"title", "abstract", "text"} (the REPL's `context`).
The tools also accept one paper record on its own (a dict with a string "text"), which they treat
as a collection holding one paper with the id "paper".
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TOOLS", "extract_section", "get_paper_abstract", "list_papers", "search"]

LIST_ABSTRACT_CHARS = 300
"""How much of each abstract list_papers prints."""

SENTENCE_REACH = 400
"""How far beyond the window a snippet may widen to reach a sentence boundary."""

_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def _papers(ctx: Any, tool: str) -> dict[str, dict[str, Any]]:
    if isinstance(ctx, dict) and isinstance(ctx.get("text"), str):
        return {"paper": ctx}
    if not isinstance(ctx, dict):
        raise TypeError(
            f"{tool}: expected the paper dict (paper id -> {{title, abstract, text}}), "
            f"got {type(ctx).__name__}"
        )
    for paper_id, paper in ctx.items():
        if not isinstance(paper, dict):
            raise TypeError(
                f"{tool}: paper {paper_id!r} should be a dict with title/abstract/text, "
                f"got {type(paper).__name__}"
            )
    return ctx


def list_papers(ctx):
    """Print every paper of `ctx` (paper id -> {"title", "abstract", "text"}) as
    "[id] title" and its abstract (the first 300 characters, "..." when cut), in dict order,
    then return the list of titles in the same order. A paper without a title prints and
    returns "(untitled)". An empty dict prints "(no papers)" and returns []. A single paper
    record ({"title", "abstract", "text"}) is listed as one paper with the id "paper".
    """
    papers = _papers(ctx, "list_papers")
    if not papers:
        print("(no papers)")
        return []
    titles = []
    for paper_id, paper in papers.items():
        title = str(paper.get("title") or "(untitled)")
        abstract = " ".join(str(paper.get("abstract") or "").split())
        if len(abstract) > LIST_ABSTRACT_CHARS:
            abstract = abstract[:LIST_ABSTRACT_CHARS].rstrip() + "..."
        print(f"[{paper_id}] {title}\n    {abstract or '(no abstract)'}")
        titles.append(title)
    return titles


def search(text, keyword, window=300, bidirectional=True):
    """Case-insensitive search for the literal `keyword` (not a regex; any run of whitespace in it
    matches any run of whitespace). Returns sentence-aligned snippets around the hits.

    - `text` a string: returns a list of snippet strings in text order; [] when there is no hit.
    - `text` a paper dict (paper id -> {"title", "abstract", "text"}, e.g. `context`): searches
      each paper's "text" and returns {paper id: [snippets]} holding only papers with a hit
      ({} when none has one). A dict of plain strings is searched the same way; a single
      paper record is searched as {"paper": record}.
    - Each snippet spans `window` characters before the hit (none when `bidirectional=False`),
      the hit, and `window` characters after it, clipped to the text's start and end, then
      widened to whole sentences (a sentence ends at . ! or ? followed by a space), by at most
      400 more characters on each side (past that, cut at a space). window=0 gives just the
      sentence(s) holding the hit.
    - Hits whose snippets overlap are merged into one snippet, so no text appears twice.
    Raises ValueError for an empty keyword or a negative window.
    """
    if not isinstance(keyword, str) or not keyword.strip():
        raise ValueError(f"search: keyword must be a non-empty string, got {keyword!r}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"search: window must be an int >= 0, got {window!r}")
    pattern = re.compile(r"\s+".join(map(re.escape, keyword.split())), re.IGNORECASE)
    if isinstance(text, str):
        return _snippets(text, pattern, window, bidirectional)
    if isinstance(text, dict):
        papers = text if not isinstance(text.get("text"), str) else {"paper": text}
        hits = {}
        for paper_id, paper in papers.items():
            body = paper.get("text") if isinstance(paper, dict) else paper
            if not isinstance(body, str):
                raise TypeError(
                    f"search: paper {paper_id!r} has no string 'text' (got {type(body).__name__})"
                )
            snippets = _snippets(body, pattern, window, bidirectional)
            if snippets:
                hits[paper_id] = snippets
        return hits
    raise TypeError(f"search: text must be a string or a paper dict, got {type(text).__name__}")


def _snippets(text: str, pattern: re.Pattern[str], window: int, bidirectional: bool) -> list[str]:
    spans: list[list[int]] = []
    for hit in pattern.finditer(text):
        before = max(0, hit.start() - window) if bidirectional else hit.start()
        start = _sentence_start(text, before, SENTENCE_REACH)
        end = _sentence_end(text, min(len(text), hit.end() + window), SENTENCE_REACH)
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [text[a:b].strip() for a, b in spans]


def _sentence_start(text: str, pos: int, limit: int) -> int:
    """Back from `pos` to the start of its sentence, at most `limit` characters further."""
    floor = max(0, pos - limit)
    for match in reversed(list(_SENTENCE_END.finditer(text, floor, pos))):
        return match.end()
    if floor == 0:
        return 0
    space = text.find(" ", floor, pos)
    return pos if space < 0 else space + 1


def _sentence_end(text: str, pos: int, limit: int) -> int:
    """Forward from `pos` to the end of its sentence, at most `limit` characters further."""
    if pos > 0 and _SENTENCE_END.match(text, pos - 1):
        return pos
    ceiling = min(len(text), pos + limit)
    match = _SENTENCE_END.search(text, pos, ceiling)
    if match is not None:
        return match.end()
    if ceiling == len(text):
        return ceiling
    space = text.rfind(" ", pos, ceiling)
    return pos if space < 0 else space


def _find_phrase(snippet: str, phrase: str, start: int = 0) -> re.Match[str] | None:
    pattern = r"\s+".join(map(re.escape, phrase.split()))
    return re.compile(pattern, re.IGNORECASE).search(snippet, start)


def extract_section(snippet, start_phrase, end_phrase):
    """Return the part of `snippet` from the first occurrence of `start_phrase` through the end of
    the first occurrence of `end_phrase` that follows it, both included, with the snippet's
    original case and spacing. Matching ignores case, and any run of whitespace in a phrase
    matches any run of whitespace.

    - `start_phrase` missing from the snippet (or "" / None): the span starts at its start.
    - `end_phrase` missing after the start (or "" / None): the span runs to the snippet's end.
    - `end_phrase` is searched from the start phrase's end, so it never matches inside it.
    Example: extract_section("A b. We use X and Y. Z.", "we use", "y.") -> "We use X and Y."
    Raises TypeError when `snippet` is not a string (pass one element of search's list).
    """
    if not isinstance(snippet, str):
        hint = (
            " (search returns a list or dict: pass one snippet string)"
            if isinstance(snippet, list | dict)
            else ""
        )
        raise TypeError(
            f"extract_section: snippet must be a string, got {type(snippet).__name__}{hint}"
        )
    for name, phrase in (("start_phrase", start_phrase), ("end_phrase", end_phrase)):
        if phrase is not None and not isinstance(phrase, str):
            raise TypeError(
                f"extract_section: {name} must be a string, got {type(phrase).__name__}"
            )
    begin, after = 0, 0
    if start_phrase and start_phrase.strip():
        found = _find_phrase(snippet, start_phrase)
        if found is not None:
            begin, after = found.start(), found.end()
    end = len(snippet)
    if end_phrase and end_phrase.strip():
        found = _find_phrase(snippet, end_phrase, after)
        if found is not None:
            end = found.end()
    return snippet[begin:end]


def get_paper_abstract(ctx, paper_id):
    """Return the header that labels a paper in a child prompt, as three lines:
    "Paper ID: <id>", "Title: <title>", "Abstract: <abstract>" (whitespace collapsed).
    Raises KeyError naming the known ids when `paper_id` is not in `ctx`.
    """
    papers = _papers(ctx, "get_paper_abstract")
    if paper_id not in papers:
        known = ", ".join(map(repr, list(papers)[:20])) or "none"
        raise KeyError(f"get_paper_abstract: unknown paper id {paper_id!r}; known ids: {known}")
    paper = papers[paper_id]
    title = " ".join(str(paper.get("title") or "(untitled)").split())
    abstract = " ".join(str(paper.get("abstract") or "(no abstract)").split())
    return f"Paper ID: {paper_id}\nTitle: {title}\nAbstract: {abstract}"


TOOLS = [list_papers, search, extract_section, get_paper_abstract]
