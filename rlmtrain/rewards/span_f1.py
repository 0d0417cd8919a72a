"""Span F1: the verifiable reward for evidence selection and the SFT filter (docs/algorithm.md §3).

Definition. Both sides are normalised (lower-cased, every run of whitespace collapsed to one
space, stripped), then cut into overlapping character n-grams (n = 5 by default). A string
shorter than n is one gram: itself. With P(x) and T(x) the multiplicities of gram x in the
prediction and the truth,

    overlap = sum_x min(P(x), T(x)),  precision = overlap / |P|,  recall = overlap / |T|,
    F1 = 2 · precision · recall / (precision + recall)      (0 when overlap is 0).

Why n-grams and not single characters: a bag of characters scores two unrelated English
paragraphs of the same length near 0.8 (letter frequencies are alike), so it cannot tell the right
passage from a wrong one; five-character windows are shared almost only by text that overlaps.
Extra predicted text adds grams to |P| and lowers precision; a missing part of the truth lowers
recall. It is order-insensitive beyond n characters, which is what lets a prediction list the
right passages in any order.

Several truth spans are all required (a query's evidence is the set of its passages): their grams
are pooled into one multiset, each span cut on its own, so recall is the share of all the evidence
found. A prediction given as several spans is pooled the same way. Empty against empty is 1.0;
empty against non-empty is 0.0.
"""

from __future__ import annotations

import re
from collections import Counter

__all__ = ["normalize", "span_f1"]

DEFAULT_NGRAM = 5

_WHITESPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower-case, collapse whitespace runs to one space, strip."""
    return _WHITESPACE.sub(" ", text).strip().lower()


def _grams(spans: list[str], n: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    for span in spans:
        text = normalize(span)
        if not text:
            continue
        if len(text) < n:
            counts[text] += 1
        else:
            counts.update(text[i : i + n] for i in range(len(text) - n + 1))
    return counts


def span_f1(
    prediction: str | list[str], truth: str | list[str], *, n: int = DEFAULT_NGRAM
) -> float:
    """Character n-gram F1 in [0, 1] between predicted and ground-truth spans (see module doc)."""
    if n < 1:
        raise ValueError(f"span_f1: n must be >= 1, got {n}")
    pred = _grams([prediction] if isinstance(prediction, str) else list(prediction), n)
    gold = _grams([truth] if isinstance(truth, str) else list(truth), n)
    if not pred and not gold:
        return 1.0
    if not pred or not gold:
        return 0.0
    overlap = sum((pred & gold).values())
    if overlap == 0:
        return 0.0
    precision = overlap / sum(pred.values())
    recall = overlap / sum(gold.values())
    return 2 * precision * recall / (precision + recall)
