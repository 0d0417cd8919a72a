"""A scripted evidence-selection teacher: the code an expert would write, root and children.

Cold-start SFT data (SPEC.md §5) must be the records a policy leaves, so the teacher plays through
the real trajectory loop and jailed REPL: each trajectory's plan is a list of code blocks played
by `rlm.scripted.ScriptedPolicy`, and the plan never reads REPL output itself; what depends on
the papers is computed by the code (REPL variables persist between turns), the habit the student
should learn.

The expert reads the query, not the gold spans. A rule per query family gives the keyword
variants to search, how to tell from title and abstract whether a paper is worth reading, and
the phrase that opens an answering passage; the passage is that phrase's sentence and the next
one, cut out with `extract_section`. Strategies follow the system prompt:

    one paper:   list_papers -> search keyword variants -> refine around the opening phrase
                 -> extract -> FINAL_VAR
    many papers: list_papers, triage by title/abstract -> rlm_query_batched, one child per paper
                 (a child plays the one-paper plan on its paper) -> join "[id] passage", FINAL_VAR

A query no rule recognises raises ValueError naming it: a teacher that guesses poisons SFT data.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from rlmtrain.envs.evidence import EvidenceEnv, EvidenceTask
from rlmtrain.rlm.agent import (
    AgentLimits,
    ChatTokenizer,
    ChildCall,
    child_answer,
    root_trajectory,
)
from rlmtrain.rlm.records import RolloutGroup, Trajectory
from rlmtrain.rlm.repl import ReplLimits, Zygote
from rlmtrain.rlm.scripted import play_plan

log = logging.getLogger("rlmtrain")

__all__ = [
    "CHILD_INSTRUCTION",
    "QueryRule",
    "child_plan",
    "child_prompt",
    "parse_query",
    "root_plan",
    "teach",
]


class QueryRule(msgspec.Struct, kw_only=True, frozen=True):
    family: str
    keywords: list[str]
    """Search variants, most specific first."""
    opening: str
    """The phrase that opens an answering passage (matched with its case)."""
    relevant: str
    """Lower-case text whose presence in a paper's title + abstract makes it worth reading."""


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
            )
        if family == "results":
            d = match["d"]
            return QueryRule(
                family=family,
                keywords=[f"On {d},", d, match["metric"]],
                opening=f"On {d},",
                relevant=d.lower(),
            )
        t = match["t"]
        if family == "baselines":
            return QueryRule(
                family=family,
                keywords=["following baselines", "baselines", "compare"],
                opening="We compare",
                relevant=f"builds on {t.lower()}",
            )
        return QueryRule(
            family=family,
            keywords=["limitation of", "limitation", "drawback"],
            opening="A limitation of",
            relevant=f"builds on {t.lower()}",
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
    return _single_paper_turns(parse_query(match[1]), label=False)


def root_plan(task: EvidenceTask) -> list[str]:
    """The root's code: the one-paper plan, or triage and one child per paper worth reading."""
    rule = parse_query(task.query)
    if len(task.paper_ids) == 1:
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
        f"query = {task.query!r}\n"
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
# Playing the plans through the real loop
# ---------------------------------------------------------------------------------------------


async def _teach_one(
    env: EvidenceEnv,
    task: EvidenceTask,
    tokenizer: ChatTokenizer,
    limits: AgentLimits,
    repl_limits: ReplLimits | None,
) -> RolloutGroup:
    context = env.context(task)
    zygote = await Zygote.start(
        context=context, tool_modules=env.tool_modules(), limits=repl_limits
    )
    trajectories: list[Trajectory] = []

    async def play(blocks: list[str], trajectory: Trajectory, context: Any = None) -> None:
        await play_plan(
            blocks,
            trajectory,
            env=env,
            tokenizer=tokenizer,
            limits=limits,
            zygote=zygote,
            task=task,
            spawn=spawn,
            context=context,
        )

    async def run_child(call: ChildCall) -> str:
        trajectories.append(call.trajectory)
        if not call.with_repl:
            return "[evidence teacher: children run with a REPL; raise max_depth]"
        await play(child_plan(call.trajectory.prompt), call.trajectory, call.context)
        return child_answer(call.trajectory)

    async def spawn(calls: list[ChildCall]) -> list[str]:
        return list(await asyncio.gather(*(run_child(call) for call in calls)))

    root = root_trajectory(task.id, 0, task.query)
    try:
        await play(root_plan(task), root)
    finally:
        await zygote.close()
    return RolloutGroup(task=task, trajectories=[root, *trajectories])


async def teach(
    env: EvidenceEnv,
    tasks: Sequence[EvidenceTask],
    tokenizer: ChatTokenizer,
    *,
    limits: AgentLimits | None = None,
    repl_limits: ReplLimits | None = None,
    concurrency: int = 4,
) -> list[RolloutGroup]:
    """One teacher tree per task (root + children), in task order; `concurrency` trees at once.

    `limits` must allow children with a REPL (max_depth >= 1), the plans' 5 turns, and prompts
    as long as the system prompt plus history in the student's tokens (default: 32k tokens).
    """
    limits = limits or AgentLimits(max_turns=5, max_depth=1, max_prompt_tokens=32768)
    if limits.max_depth < 1 or limits.max_turns < 5:
        raise ValueError(
            f"evidence teacher: needs max_depth >= 1 and max_turns >= 5, got "
            f"max_depth={limits.max_depth}, max_turns={limits.max_turns}"
        )
    gate = asyncio.Semaphore(concurrency)

    async def one(task: EvidenceTask) -> RolloutGroup:
        async with gate:
            return await _teach_one(env, task, tokenizer, limits, repl_limits)

    groups = list(await asyncio.gather(*(one(task) for task in tasks)))
    unfinished = Counter(
        t.finish_reason for g in groups for t in g.trajectories if t.finish_reason != "final"
    )
    if unfinished:
        # Most often "context": the byte tokenizer makes prompts ~4x longer than a BPE one, and
        # the system prompt plus one list_papers output needs about 10k byte tokens.
        log.warning(
            "evidence teacher: %d of %d trajectories did not finish (%s); max_prompt_tokens=%d",
            sum(unfinished.values()),
            sum(len(g.trajectories) for g in groups),
            ", ".join(f"{reason}: {n}" for reason, n in unfinished.most_common()),
            limits.max_prompt_tokens,
        )
    return groups
