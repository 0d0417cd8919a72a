"""How much of a new observation the history has not seen: the share of new word n-grams.

Shared by the rule-based tool-credit labeller and the step rubric's information gain. Words are
`\\w+` runs, lower-cased; grams are word trigrams by default (a text of fewer words than n is one
gram: all its words). novelty(text, history) = |grams(text) \\ grams(history)| / |grams(text)|
over distinct grams, 0.0 for a text with no words (an empty observation tells nothing new).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["novelty", "word_ngrams", "words"]

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def word_ngrams(text: str, n: int = 3) -> set[tuple[str, ...]]:
    tokens = words(text)
    if not tokens:
        return set()
    if len(tokens) < n:
        return {tuple(tokens)}
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def novelty(text: str, history: Iterable[str], n: int = 3) -> float:
    """Share of `text`'s distinct word n-grams that appear in none of `history`."""
    grams = word_ngrams(text, n)
    if not grams:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    for past in history:
        seen |= word_ngrams(past, n)
    return len(grams - seen) / len(grams)
