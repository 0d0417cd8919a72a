"""A scripted evidence-selection teacher: the code an expert would write, root and children.

Like every teacher it plays through the real scheduler (`rollout/teaching.py`): `reply` reads the
prompt as a policy would and answers with that turn's block of the plan. The plan never reads REPL
output itself: what depends on the papers is computed by the code (REPL variables persist
between turns), the habit the student should learn.

The expert reads the query, not the gold spans. A rule per query family gives the keyword
variants to search, how to tell from title and abstract whether a paper is worth reading, and
the phrase that opens an answering passage; the passage is that phrase's sentence and the next
one, cut out with `extract_section`. Strategies follow the system prompt:

    one paper:   list_papers -> search keyword variants -> refine around the opening phrase
                 -> extract -> FINAL_VAR
    many papers: list_papers, triage by title/abstract -> rlm_query_batched, one child per paper
                 (a child plays the one-paper plan on its paper) -> join "[id] passage", FINAL_VAR

The compact plans (prompt_style = "compact", for small models trained from scratch) keep the
same strategy in two turns each, in code that is the same for every query of a role:

    one paper:   lead = the opening words of the query's family, looked up by the query's
                 second word; search(context, lead) -> the sentences, FINAL_VAR
    many papers: key = cut from `query`; picks = papers whose abstract names the key
                 -> rlm_query_batched([query] * len(picks), one paper each) -> join, FINAL_VAR

Nothing in them retypes the query: the REPL's `query` holds it (`rlm.agent` binds it), and what
the code needs is computed from it, so a policy learns one template per role, not a copy of
every name it meets nor a constant per family.

With `flawed_share` (`data.teacher_flawed_share`) the teacher plays that share of the queries
with a flawed child plan: its search quotes 0 or 400 characters past the opening words instead
of 150, one token away from the plan, so that SFT leaves a choice whose outcomes differ for RL
to learn. The root's plan is never flawed: where the flaw was the root's (every paper sent to a
helper, no triage) its shorter code slipped less at temperature 1 than triage's, and RL chose
the flaw (docs/recipes.md).

A query no rule recognises raises ValueError naming it: a teacher that guesses poisons SFT data.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import msgspec

from rlmtrain.config import ConfigError, RolloutConfig
from rlmtrain.envs.evidence_tasks import EvidenceTask
from rlmtrain.envs.teacher import fenced_code, flaw_of, last_user_message, query_and_turn
from rlmtrain.rlm.prompts import PromptStyle

log = logging.getLogger("rlmtrain")

__all__ = [
    "CHILD_INSTRUCTION",
    "QueryRule",
    "child_plan",
    "child_prompt",
    "compact_child_plan",
    "compact_root_plan",
    "full_child_plan",
    "full_root_plan",
    "parse_query",
    "reply",
    "root_plan",
    "teacher",
    "TEACHER_LIMITS",
]


class QueryRule(msgspec.Struct, kw_only=True, frozen=True):
    family: str
    keywords: list[str]
    """Search variants, most specific first."""
    opening: str
    """The phrase that opens an answering passage (matched with its case)."""
    relevant: str
    """Lower-case text whose presence in a paper's title + abstract makes it worth reading."""
    key: str
    """The name the query turns on (method, dataset or technique), as the abstracts spell it."""


_FAMILIES: list[tuple[str, re.Pattern[str]]] = [
    ("datasets", re.compile(r"Which datasets are used to evaluate (?P<m>.+?)\?")),
    (
        "baselines",
        re.compile(r"Which baselines are used to evaluate the methods based on (?P<t>.+?)\?"),
    ),
    (
        "limitation",
        re.compile(r"What limitations are reported for approaches that rely on (?P<t>.+?)\?"),
    ),
    ("results", re.compile(r"Which method achieves the best (?P<metric>.+?) on (?P<d>.+?)\?")),
]


def parse_query(query: str) -> QueryRule:
    """The rule for a query of a known family; ValueError otherwise."""
    for family, pattern in _FAMILIES:
        match = pattern.search(query)
        if match is None:
            continue
        if family == "datasets":
            m = match["m"]
            return QueryRule(
                family=family,
                keywords=[f"evaluate {m}", "benchmarks", "datasets"],
                opening=f"We evaluate {m}",
                relevant=f"{m.lower()}:",
                key=m,
            )
        if family == "results":
            d = match["d"]
            return QueryRule(
                family=family,
                keywords=[f"On {d},", d, match["metric"]],
                opening=f"On {d},",
                relevant=d.lower(),
                key=d,
            )
        t = match["t"]
        if family == "baselines":
            return QueryRule(
                family=family,
                keywords=["following baselines", "baselines", "compare"],
                opening="We compare",
                relevant=f"builds on {t.lower()}",
                key=t,
            )
        return QueryRule(
            family=family,
            keywords=["limitation of", "limitation", "drawback"],
            opening="A limitation of",
            relevant=f"builds on {t.lower()}",
            key=t,
        )
    raise ValueError(f"evidence teacher: no rule for query {query!r}")


# The helper defined in the REPL by the extraction turn: the opening phrase's sentence and the
# sentence after it, cut from the snippet with extract_section.
_PASSAGE_HELPER = """import re

def passage(snippet, opening):
    at = snippet.find(opening)
    if at < 0:
        return ""
    sentences = re.split(r"(?<=[.!?])\\s+", snippet[at:])
    last = sentences[1] if len(sentences) > 1 else sentences[0]
    return extract_section(snippet[at:], opening, " ".join(last.split()[-4:])).strip()
"""


def _single_paper_turns(rule: QueryRule, label: bool) -> list[str]:
    """Look at the paper, search variants, refine around the opening, extract, finish (5 turns)."""
    answer = '"\\n".join(f"[{paper_id}] {p}" for p in found)' if label else '"\\n".join(found)'
    return [
        "titles = list_papers(context)\n"
        "paper_id = next(iter(context))\n"
        "text = context[paper_id]['text']\n"
        "print(len(text), 'characters of text')",
        f"for keyword in {rule.keywords!r}:\n"
        "    snippets = search(text, keyword, window=100)\n"
        "    print(repr(keyword), len(snippets), 'hits')\n"
        "    for snippet in snippets[:2]:\n"
        "        print('  ', snippet[:200])",
        f"opening = {rule.opening!r}\n"
        "snippets = [s for s in search(text, opening, window=400) if opening in s]\n"
        "print(len(snippets), 'snippets hold the opening phrase')\n"
        "for snippet in snippets[:2]:\n"
        "    print(snippet[:500])",
        _PASSAGE_HELPER + "\n"
        "found = []\n"
        "for snippet in snippets:\n"
        "    p = passage(snippet, opening)\n"
        "    if p and p not in found:\n"
        "        found.append(p)\n"
        f"answer = {answer}\n"
        "print(answer)",
        'FINAL_VAR("answer")',
    ]


CHILD_INSTRUCTION = "Quote the passages of this paper that answer the query."


def child_prompt(header: str, query: str) -> str:
    """What the root's code asks a child: the paper header, the instruction, the query."""
    return f"{header}\n\n{CHILD_INSTRUCTION}\nQuery: {query}"


def child_plan(prompt: str) -> list[str]:
    """A child's code: the one-paper plan for the query in its prompt."""
    match = re.search(r"^Query: (.+)$", prompt, re.MULTILINE)
    if match is None:
        raise ValueError(
            f"evidence teacher: child prompt without a 'Query:' line: {prompt[:200]!r}"
        )
    return full_child_plan(match[1])


def full_child_plan(query: str) -> list[str]:
    """A child's code for `query`: the one-paper plan, passages unlabelled."""
    return _single_paper_turns(parse_query(query), label=False)


def root_plan(task: EvidenceTask) -> list[str]:
    """The root's code: the one-paper plan, or triage and one child per paper worth reading."""
    return full_root_plan(task.query, len(task.paper_ids))


def full_root_plan(query: str, n_papers: int) -> list[str]:
    """`root_plan` for a query over `n_papers` papers."""
    rule = parse_query(query)
    if n_papers == 1:
        return _single_paper_turns(rule, label=True)
    return [
        "titles = list_papers(context)\n"
        f"for keyword in {rule.keywords[:2]!r}:\n"
        "    hits = search(context, keyword, window=0)\n"
        "    print(repr(keyword), {paper_id: len(s) for paper_id, s in hits.items()})",
        f"wanted = {rule.relevant!r}\n"
        "picks = [paper_id for paper_id, paper in context.items()\n"
        "         if wanted in (paper['title'] + ' ' + paper['abstract']).lower()]\n"
        "print('worth reading:', picks)",
        f"query = {query!r}\n"
        f"prompts = [get_paper_abstract(context, paper_id) + '\\n\\n' + {CHILD_INSTRUCTION!r}\n"
        "           + '\\nQuery: ' + query for paper_id in picks]\n"
        "contexts = [{paper_id: context[paper_id]} for paper_id in picks]\n"
        "answers = rlm_query_batched(prompts, contexts)\n"
        "for paper_id, text in zip(picks, answers):\n"
        "    print(paper_id, '->', text[:300])",
        "answer = '\\n'.join(f'[{paper_id}] {line}' for paper_id, text in zip(picks, answers)\n"
        "                    if not text.startswith('[rlm_query')\n"
        "                    for line in text.splitlines() if line.strip())\n"
        'FINAL_VAR("answer")',
    ]


# ---------------------------------------------------------------------------------------------
# The compact plans (prompt_style = "compact": small models trained from scratch)
# ---------------------------------------------------------------------------------------------


# The compact plans hold no choice a policy has to make from the query: every query's root runs
# the same code, and so does every child. What depends on the query's family is looked up by the
# code in the REPL (the family is the query's second word), not recalled by the policy. With one
# constant per family to recall instead (the split words, the opening phrase), a tiny model's SFT
# confused a different family on each seed. The root's code and the child's share no line and
# no variable: where they shared their first and last lines, a policy slipped from one into the
# other mid-turn, and RL's push away from those slips made the other role worse
# (docs/recipes.md).

_OPENING = (
    "lead = {'datasets': 'We evaluate', 'baselines': 'We compare', "
    "'limitations': 'A limitation of'}.get(query.split()[1], "
    "'On ' + query.split(' on ')[-1].rstrip('?') + ',')"
)
"""The words that open an answering passage, by the query's second word (datasets, baselines,
limitations; "method" for results, whose passage opens with the dataset the query ends on)."""

_KEY = "key = query.replace(' evaluate ', ' on ').split(' on ')[-1].rstrip('?')"
"""The name the query turns on: every family's ends the query after " on " or " evaluate "."""


_WINDOW = 150
"""Characters the child's search quotes past the opening words: the passage is the sentence
they open and the next one."""

_FLAWED_WINDOWS = (0, 400)
"""The windows of the flawed child plans (`data.teacher_flawed_share`): the opening sentence
alone (half the passage), or several sentences past it. Each is one token away from the plan
and scores about 0.56 against its 0.89 over the SFT tasks (docs/recipes.md)."""


def compact_child_plan(query: str, flawed_share: float = 0.0) -> list[str]:
    """One paper: search the words that open the answer, answer with the sentences they open.
    The code is the same for every query (`parse_query` only refuses one of no known family),
    except in the `flawed_share` of the queries whose search quotes a flawed window."""
    parse_query(query)
    flaw = flaw_of(query, flawed_share, len(_FLAWED_WINDOWS))
    window = _WINDOW if flaw is None else _FLAWED_WINDOWS[flaw]
    return [
        f"{_OPENING}\n"
        f"hits = [s for v in search(context, lead, window={window}, bidirectional=False)"
        ".values() for s in v]\n"
        "print(len(hits), 'passages')",
        'answer = "\\n".join(hits)\nFINAL_VAR("answer")',
    ]


def compact_root_plan(query: str, n_papers: int, flawed_share: float = 0.0) -> list[str]:
    """Several papers: keep those whose abstract names the query's key, one helper each with the
    query as its prompt, join the answers of those that gave one; one paper: the child's plan."""
    if n_papers == 1:
        return compact_child_plan(query, flawed_share)
    parse_query(query)
    return [
        f"{_KEY}\n"
        "picks = [p for p in context if key in context[p]['abstract']]\n"
        "answers = rlm_query_batched([query] * len(picks), [{p: context[p]} for p in picks])\n"
        "print(len(answers), 'answers')",
        'final = "\\n".join(a for a in answers if not a.startswith("[rlm_query"))\n'
        'FINAL_VAR("final")',
    ]


# ---------------------------------------------------------------------------------------------
# Playing the plans: a scripted engine behind the real scheduler
# ---------------------------------------------------------------------------------------------

_PAPERS = re.compile(r"`context` holds (\d+) papers?")


def reply(prompt_text: str, style: PromptStyle = "full", flawed_share: float = 0.0) -> str:
    """The teacher's completion for a templated prompt: the plan block of this turn, fenced.

    The plan is read off the prompt's last user message alone, as a policy would: the query,
    the turn number, and whether it is a root ("`context` holds N papers") or a child. Past the
    end of its plan the teacher says nothing (an empty reply).
    """
    query, index = query_and_turn(prompt_text, "evidence teacher")
    papers = _PAPERS.search(last_user_message(prompt_text))
    if style == "compact":
        blocks = (
            compact_root_plan(query, int(papers[1]), flawed_share)
            if papers
            else compact_child_plan(query, flawed_share)
        )
    else:
        blocks = full_root_plan(query, int(papers[1])) if papers else full_child_plan(query)
    return fenced_code(blocks[index]) if index < len(blocks) else ""


TEACHER_LIMITS = RolloutConfig(
    max_turns=5, max_depth=1, max_prompt_tokens=32768, max_new_tokens=2048
)
"""Limits under which the full-style teacher's trees finish with the byte tokenizer, whose
prompts are ~4x longer than a BPE one's (the full system prompt plus one list_papers output
needs about 10k byte tokens); unfinished teacher trajectories are most often "context"."""


def teacher(config: RolloutConfig, flawed_share: float = 0.0) -> Callable[[str], str]:
    """The teacher's reply under `config`'s prompt style, flawed in `flawed_share` of the
    queries; a ConfigError where `config` cannot carry its trees: children need a REPL
    (max_depth >= 1) and the plans need their turns (5 in the full style, 2 in the compact
    one), or where the style has no flawed plan (the full one)."""
    needed = 2 if config.prompt_style == "compact" else 5
    if config.max_depth < 1 or config.max_turns < needed:
        raise ConfigError(
            f"rollout.max_turns: the evidence teacher needs rollout.max_depth >= 1 and "
            f"max_turns >= {needed} for its SFT trees, got max_depth={config.max_depth}, "
            f"max_turns={config.max_turns}"
        )
    style = config.prompt_style
    if flawed_share and style != "compact":
        raise ConfigError(
            f"data.teacher_flawed_share: the evidence teacher flaws only its compact plans; "
            f"rollout.prompt_style is {style!r}"
        )
    return lambda text: reply(text, style, flawed_share)
