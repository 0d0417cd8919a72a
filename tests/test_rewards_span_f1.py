"""span_f1 against cases worked out by hand (5-grams unless said)."""

import pytest

from rlmtrain.rewards.span_f1 import normalize, span_f1


def test_identical_after_normalisation_is_one():
    assert span_f1("  The  Cat\nsat ", "the cat sat") == 1.0


def test_extra_text_lowers_precision_only():
    # pred "abcdefgh": 4 grams; truth "abcdef": 2 grams, both in pred -> P = 2/4, R = 1.
    assert span_f1("abcdefgh", "abcdef") == pytest.approx(2 * 0.5 * 1.0 / 1.5)


def test_missing_text_lowers_recall_only():
    # pred 2 grams both in truth's 4 -> P = 1, R = 1/2 -> F1 = 2/3.
    assert span_f1("abcdef", "abcdefgh") == pytest.approx(2 / 3)


def test_disjoint_is_zero():
    assert span_f1("hello world", "quantum flux") == 0.0


def test_unrelated_text_with_same_letters_scores_low():
    # Same multiset of characters, no shared 5-gram: a bag-of-characters F1 would say 1.0.
    assert span_f1("abcdefghij", "jihgfedcba") == 0.0


def test_repeated_grams_count_with_multiplicity():
    # "aaaaaa" has 2 grams "aaaaa"; "aaaaaaaaa" has 5 -> overlap 2, P = 1, R = 2/5.
    assert span_f1("aaaaaa", "aaaaaaaaa") == pytest.approx(2 * 0.4 / 1.4)


def test_several_truths_are_all_required():
    # truth grams: abcde, bcdef (from "abcdef") + vwxyz (short span = one gram) -> 3.
    # pred "abcdef" -> 2 grams, both found: P = 1, R = 2/3 -> F1 = 0.8.
    assert span_f1("abcdef", ["abcdef", "vwxyz"]) == pytest.approx(0.8)
    assert span_f1(["vwxyz", "abcdef"], ["abcdef", "vwxyz"]) == 1.0


def test_short_strings_compare_whole():
    assert span_f1("cat", "CAT") == 1.0
    assert span_f1("cat", "dog") == 0.0


def test_empty_cases():
    assert span_f1("", "") == 1.0
    assert span_f1("   ", []) == 1.0
    assert span_f1("", "text") == 0.0
    assert span_f1("text", "") == 0.0


def test_bigram_option():
    # n=2: "abc" -> ab, bc ; "abd" -> ab, bd -> overlap 1, P = R = 1/2.
    assert span_f1("abc", "abd", n=2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="n must be >= 1"):
        span_f1("a", "a", n=0)


def test_normalize():
    assert normalize(" A\t\tB \n c ") == "a b c"
