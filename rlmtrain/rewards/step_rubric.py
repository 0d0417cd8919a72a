"""Rubric step rewards of LongTraceRL (docs/algorithm.md §3): a dense per-turn signal on top of the
sparse final reward, added to each turn's advantage by the algorithm.

Each turn t of a trajectory gets four numbers and their weighted sum

    step_t = w_rel · relevance_t + w_gain · info_gain_t + w_coh · coherence_t − w_eff

where w_eff is a flat per-step cost (a trajectory pays for every turn it takes). Heuristic
definitions, deterministic and cheap enough to score every turn of every rollout:

- relevance_t = |K ∩ W_t| / |K|: K the query's keywords (words of ≥ 3 letters, minus a short stop
  list), W_t the words of the turn's code and output. 1.0 if the query has no keywords.
- info_gain_t = novelty of the turn's output against all earlier outputs (share of new word
  trigrams, `rewards.novelty`); 0 for an empty output.
- coherence_t = 0 if the turn errored or re-ran an earlier turn's code (whitespace-normalised);
  else 1 for the first turn; else 1 if the code builds on the history — reads a name that earlier
  code assigned, or contains a word (≥ 4 letters, not in the query) of the previous output — and
  0.5 if it does not.

`StepRubricJudge` asks the judge model for relevance and coherence instead (0-10 each, one request
per trajectory, rescaled to [0, 1]); information gain stays the heuristic (it is a count, not a
judgement). When the judge cannot answer, the heuristic values are used and `method` says so.
"""

from __future__ import annotations

import ast
from typing import Annotated, Literal

import msgspec

from rlmtrain.rewards.chat_client import ChatClient, JudgeConfig, Unscored
from rlmtrain.rewards.novelty import novelty, words
from rlmtrain.rewards.turn_judge import ask_per_turn, judge_each_trajectory, steps_messages
from rlmtrain.rlm.records import RolloutGroup, Turn

__all__ = [
    "STEP_CRITERIA",
    "STEP_RUBRIC_SYSTEM_PROMPT",
    "JudgedSteps",
    "StepRubricJudge",
    "StepRubricWeights",
    "StepScore",
    "combine",
    "heuristic_step_rewards",
    "heuristic_step_scores",
    "query_keywords",
]

_STOP_TEXT = (
    "the and for are but not you all any can had her was one our out has his how its may new "
    "now own say she too use who why did does what when where which while with this that these "
    "those from into onto than then them they there their been being have some such only also "
    "each about above after before between both other very will would could should "
)
_STOP_WORDS = frozenset(_STOP_TEXT.split())


class StepRubricWeights(msgspec.Struct, kw_only=True, frozen=True):
    """Weights of the step rubric; `efficiency` is a cost paid once per step."""

    relevance: float = 0.3
    info_gain: float = 0.4
    coherence: float = 0.3
    efficiency: float = 0.05


class StepScore(msgspec.Struct, kw_only=True):
    relevance: float
    info_gain: float
    coherence: float
    total: float
    """The weighted sum minus the per-step cost."""


STEP_CRITERIA = ("relevance", "info_gain", "coherence")
"""The criteria of a `StepScore`, in its order; reports name them `step_<criterion>`."""


def query_keywords(query: str) -> set[str]:
    return {w for w in words(query) if len(w) >= 3 and w not in _STOP_WORDS}


def combine(
    relevance: float, info_gain: float, coherence: float, weights: StepRubricWeights
) -> StepScore:
    total = (
        weights.relevance * relevance
        + weights.info_gain * info_gain
        + weights.coherence * coherence
        - weights.efficiency
    )
    return StepScore(relevance=relevance, info_gain=info_gain, coherence=coherence, total=total)


def _names(code: str) -> tuple[set[str], set[str]]:
    """(names assigned, names read) by `code`; empty sets for code that does not parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set(), set()
    stored: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (stored if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            stored.add(node.name)
        elif isinstance(node, ast.alias):
            stored.add((node.asname or node.name).split(".")[0])
    return stored, loaded


def _relevance(keywords: set[str], turn: Turn) -> float:
    if not keywords:
        return 1.0
    return len(keywords & set(words(turn.code + "\n" + turn.output))) / len(keywords)


def _coherence(turn: Turn, history: list[Turn], assigned: set[str], query_words: set[str]) -> float:
    code = " ".join(turn.code.split())
    if turn.error or any(code == " ".join(past.code.split()) for past in history):
        return 0.0
    if not history:
        return 1.0
    if _names(turn.code)[1] & assigned:
        return 1.0
    carried = {w for w in words(history[-1].output) if len(w) >= 4 and w.isalpha()} - query_words
    return 1.0 if carried & set(words(turn.code)) else 0.5


def heuristic_step_scores(
    query: str, turns: list[Turn], weights: StepRubricWeights | None = None
) -> list[StepScore]:
    """Per-turn rubric scores by the heuristics of the module doc."""
    weights = weights or StepRubricWeights()
    keywords = query_keywords(query)
    query_words = set(words(query))
    scores: list[StepScore] = []
    assigned: set[str] = set()
    for t, turn in enumerate(turns):
        history = turns[:t]
        scores.append(
            combine(
                _relevance(keywords, turn),
                novelty(turn.output, (past.output for past in history)),
                _coherence(turn, history, assigned, query_words),
                weights,
            )
        )
        assigned |= _names(turn.code)[0]
    return scores


def heuristic_step_rewards(
    group: RolloutGroup, weights: StepRubricWeights | None = None
) -> dict[str, list[float]]:
    """Per-turn totals of every trajectory of a group, each scored against its own prompt, by
    trajectory id (the shape `algo.advantages.compute_advantages` takes as `step_rewards`)."""
    return {
        t.id: [s.total for s in heuristic_step_scores(t.prompt, t.turns, weights)]
        for t in group.trajectories
    }


STEP_RUBRIC_SYSTEM_PROMPT = """\
You rate the steps of an agent that answers a query by running Python code with tools.
For each step, in order, give two integers from 0 to 10:
- relevance: how much the step works towards answering the query;
- coherence: how well the step follows from the earlier steps and their results.
Reply with exactly one JSON object and nothing else:
{"steps": [{"relevance": <0-10>, "coherence": <0-10>}, ...]}  (one entry per step)"""

_Rating = Annotated[int, msgspec.Meta(ge=0, le=10)]


class _StepRating(msgspec.Struct):
    relevance: _Rating
    coherence: _Rating


class _StepRubricReply(msgspec.Struct):
    steps: list[_StepRating]


class JudgedSteps(msgspec.Struct, kw_only=True):
    scores: list[StepScore]
    method: Literal["judge", "heuristic"]
    reason: str = ""


class StepRubricJudge:
    """Relevance and coherence from the judge model, information gain from the heuristic."""

    def __init__(
        self,
        config: JudgeConfig,
        client: ChatClient | None = None,
        weights: StepRubricWeights | None = None,
    ):
        self.client = client if client is not None else ChatClient(config)
        self.weights = weights or StepRubricWeights()

    async def score(self, query: str, turns: list[Turn]) -> JudgedSteps:
        heuristic = heuristic_step_scores(query, turns, self.weights)
        if not turns:
            return JudgedSteps(scores=[], method="heuristic", reason="no turns")
        messages = steps_messages(
            STEP_RUBRIC_SYSTEM_PROMPT, query, turns, f"Rate all {len(turns)} steps."
        )
        reply = await ask_per_turn(self.client, messages, _StepRubricReply, "steps", len(turns))
        if isinstance(reply, Unscored):
            return JudgedSteps(scores=heuristic, method="heuristic", reason=reply.reason)
        scores = [
            combine(r.relevance / 10, h.info_gain, r.coherence / 10, self.weights)
            for r, h in zip(reply.steps, heuristic, strict=True)
        ]
        return JudgedSteps(scores=scores, method="judge")

    async def score_group(self, group: RolloutGroup) -> dict[str, JudgedSteps]:
        """Scores of every trajectory of a group, concurrently; `{id: [s.total for s in
        r.scores]}` is `compute_advantages`'s `step_rewards`."""
        return await judge_each_trajectory(group, self.score)
