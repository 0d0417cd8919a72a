"""The evidence REPL tools, case by case, against hand-worked expectations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlmtrain.envs.evidence_tools import (
    TOOLS,
    extract_section,
    get_paper_abstract,
    list_papers,
    search,
)

TEXT = (
    "We study graphs. Our baseline is GCN. It is weak. "
    "The second baseline is GAT, which uses attention. Results follow."
)

CTX = {
    "p1": {"title": "Graphs A", "abstract": "About graphs.", "text": TEXT},
    "p2": {
        "title": "Speech B",
        "abstract": "About speech. " * 40,
        "text": "No match here. Only audio.",
    },
    "p3": {"title": "", "abstract": "", "text": "BASELINE in capitals. End."},
}


# -- search ----------------------------------------------------------------------------------


def test_search_string_window_zero_gives_whole_sentences():
    assert search(TEXT, "baseline", window=0) == [
        "Our baseline is GCN.",
        "The second baseline is GAT, which uses attention.",
    ]


def test_search_is_case_insensitive_and_literal():
    assert search("A (x+y) term. Next.", "(X+Y)", window=0) == ["A (x+y) term."]
    assert search("a.b c. axb d.", "a.b", window=0) == ["a.b c."]


def test_search_keyword_whitespace_matches_any_run():
    assert search("We use  graph\nneural nets. Fine.", "graph neural", window=0) == [
        "We use  graph\nneural nets."
    ]


def test_search_no_hit_is_empty():
    assert search(TEXT, "transformer") == []
    assert search(CTX, "transformer") == {}


def test_search_overlapping_hits_merge_into_one_snippet():
    # window 20 reaches from the first hit into the second's sentence: one snippet, no repeats;
    # 20 characters before the first hit fall in the first sentence, so the snippet starts there.
    snippets = search(TEXT, "baseline", window=20)
    assert snippets == [TEXT.removesuffix(" Results follow.")]


def test_search_window_clipped_at_text_edges():
    # A window far larger than the text clips to both ends: the snippet is the whole text.
    assert search(TEXT, "graphs", window=10_000) == [TEXT]
    # A hit at the very start and one at the very end.
    assert search("Alpha one. Two omega", "alpha", window=0) == ["Alpha one."]
    assert search("Alpha one. Two omega", "omega", window=0) == ["Two omega"]


def test_search_one_directional_starts_at_the_hit_sentence():
    snippets = search(TEXT, "GAT", window=8, bidirectional=False)
    assert snippets == ["The second baseline is GAT, which uses attention."]
    # 30 characters back from GAT land in the previous sentence, which is then included whole.
    both = search(TEXT, "GAT", window=30)
    assert both == ["It is weak. The second baseline is GAT, which uses attention. Results follow."]


def test_search_long_sentence_is_cut_at_a_space():
    words = " ".join(f"w{i}" for i in range(400))  # ~2,000 chars, no sentence end
    text = words + " needle " + words
    (snippet,) = search(text, "needle", window=10)
    assert "needle" in snippet
    assert len(snippet) <= 10 + 6 + 10 + 2 * 400 + 2
    assert not snippet.startswith(" ") and snippet.split()[0].startswith("w")


def test_search_dict_groups_hits_by_paper():
    hits = search(CTX, "baseline", window=0)
    assert list(hits) == ["p1", "p3"]
    assert hits["p3"] == ["BASELINE in capitals."]
    # A dict of plain strings and a single paper record work the same way.
    assert search({"a": "x baseline. y."}, "baseline", window=0) == {"a": ["x baseline."]}
    assert search(CTX["p3"], "capitals", window=0) == {"paper": ["BASELINE in capitals."]}


def test_search_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="keyword must be a non-empty string"):
        search(TEXT, "  ")
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        search(TEXT, "GCN", window=-1)
    with pytest.raises(TypeError, match="text must be a string or a paper dict, got list"):
        search(["a"], "a")
    with pytest.raises(TypeError, match="paper 'x' has no string 'text'"):
        search({"x": {"title": "t"}}, "a")


# -- extract_section -------------------------------------------------------------------------


def test_extract_section_inclusive_and_case_insensitive():
    assert extract_section(TEXT, "our BASELINE", "gcn.") == "Our baseline is GCN."
    # The docstring's example.
    assert extract_section("A b. We use X and Y. Z.", "we use", "y.") == "We use X and Y."


def test_extract_section_missing_phrases_fall_back_to_the_edges():
    assert extract_section(TEXT, "not there", "GCN.") == "We study graphs. Our baseline is GCN."
    assert extract_section(TEXT, "It is weak", "not there") == TEXT[TEXT.index("It is weak") :]
    assert extract_section(TEXT, "", None) == TEXT
    assert extract_section(TEXT, None, "") == TEXT


def test_extract_section_end_is_searched_after_the_start():
    text = "x end. start here. y end. z end."
    assert extract_section(text, "start", "end.") == "start here. y end."
    # An end phrase equal to the start phrase finds the next occurrence, not the start itself.
    assert extract_section("ab ab ab", "ab", "ab") == "ab ab"
    # When the end phrase only occurs before the start, the span runs to the end.
    assert extract_section("end. start here", "start", "end.") == "start here"


def test_extract_section_keeps_original_spacing_and_matches_across_whitespace():
    snippet = "We  compare\nagainst GCN and GAT. Then more."
    assert (
        extract_section(snippet, "we compare against", "GAT.")
        == "We  compare\nagainst GCN and GAT."
    )


def test_extract_section_rejects_lists_with_a_hint():
    with pytest.raises(TypeError, match="pass one snippet string"):
        extract_section(["a", "b"], "a", "b")
    with pytest.raises(TypeError, match="end_phrase must be a string"):
        extract_section("abc", "a", 3)


# -- list_papers and get_paper_abstract ------------------------------------------------------


def test_list_papers_prints_and_returns_titles(capsys):
    titles = list_papers(CTX)
    out = capsys.readouterr().out
    assert titles == ["Graphs A", "Speech B", "(untitled)"]
    assert "[p1] Graphs A\n    About graphs." in out
    assert "[p3] (untitled)\n    (no abstract)" in out
    speech = out.split("[p2] Speech B\n    ")[1].split("\n")[0]
    assert speech.endswith("...") and len(speech) <= 303


def test_list_papers_single_record(capsys):
    assert list_papers(CTX["p1"]) == ["Graphs A"]
    assert capsys.readouterr().out.startswith("[paper] Graphs A\n")


def test_list_papers_empty_and_wrong_type(capsys):
    assert list_papers({}) == []
    assert capsys.readouterr().out == "(no papers)\n"
    with pytest.raises(TypeError, match="expected the paper dict"):
        list_papers("text")
    with pytest.raises(TypeError, match="paper 'a' should be a dict"):
        list_papers({"a": "text"})


def test_get_paper_abstract_header_and_unknown_id():
    assert get_paper_abstract(CTX, "p1") == "Paper ID: p1\nTitle: Graphs A\nAbstract: About graphs."
    assert (
        get_paper_abstract(CTX, "p3") == "Paper ID: p3\nTitle: (untitled)\nAbstract: (no abstract)"
    )
    with pytest.raises(KeyError, match="unknown paper id 'p9'; known ids: 'p1', 'p2', 'p3'"):
        get_paper_abstract(CTX, "p9")


def test_tools_list_and_stdlib_only_import():
    assert [t.__name__ for t in TOOLS] == [
        "list_papers",
        "search",
        "extract_section",
        "get_paper_abstract",
    ]
    # Workers import this module at start-up: it must pull in nothing beyond the standard library.
    code = (
        "import sys; before = set(sys.modules); import rlmtrain.envs.evidence_tools; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'rlmtrain'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
