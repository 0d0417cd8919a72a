"""LLM judges: the rubric judge of evidence answers (docs/algorithm.md §3) and the pass/fail proof
judge of BookNavigator (seed 002, see `ProofJudge`).

The judge model sees the query, the ground-truth evidence and the prediction, and must reply with
one JSON object `{"precision": 1-10, "recall": 1-10, "reason": "..."}`: precision = how much of
the prediction is evidence for the query, recall = how much of the evidence it covers. The score
is (precision - 1 + recall - 1) / 18, so the rubric's floor maps to 0 and its ceiling to 1 (the
peer system's (P + R) / 20 could never reach 0). A reply outside the schema is retried, not
clamped.

When no reply can be had (see `chat_client` for the retry contract) the sample is not silently 0:
with `on_unscored="span_f1"` it gets the verifiable span F1 against the same evidence and says so
in `method`; with `on_unscored="drop"` its score is None and the trainer drops it from its group.
A root with no final answer is a real 0 (`method="no_answer"`) and costs no request.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import msgspec

from rlmtrain.rewards.chat_client import ChatClient, JudgeConfig, Unscored
from rlmtrain.rewards.span_f1 import span_f1

__all__ = [
    "PROOF_SYSTEM_PROMPT",
    "RUBRIC_SYSTEM_PROMPT",
    "JudgeScore",
    "ProofJudge",
    "ProofReply",
    "ProofVerdict",
    "RubricJudge",
    "RubricReply",
    "proof_messages",
    "rubric_messages",
]

RUBRIC_SYSTEM_PROMPT = """\
You grade answers that quote evidence passages for a query.
You are given the query, the ground-truth evidence and the predicted evidence.
Rate on two integer scales from 1 (worst) to 10 (best):
- precision: how much of the prediction is relevant evidence for the query (10 = nothing extra);
- recall: how much of the ground-truth evidence the prediction contains (10 = all of it).
Reply with exactly one JSON object and nothing else:
{"precision": <1-10>, "recall": <1-10>, "reason": "<one sentence>"}"""

Rating = Annotated[int, msgspec.Meta(ge=1, le=10)]
Reason = Annotated[str, msgspec.Meta(max_length=400)]
"""The judge's one sentence. Bounded so that a server decoding to the reply's schema ends the
string: a guided decoder lets an unbounded string run to max_tokens, and a cut reply is no JSON."""


class RubricReply(msgspec.Struct, kw_only=True):
    precision: Rating
    recall: Rating
    reason: Reason = ""


class JudgeScore(msgspec.Struct, kw_only=True):
    score: float | None
    """In [0, 1]; None only with on_unscored='drop' when the judge failed."""
    method: Literal["judge", "span_f1", "no_answer", "unscored"]
    """Where the score came from."""
    precision: int | None = None
    recall: int | None = None
    reason: str = ""
    """The judge's reason, or why it could not score."""


def rubric_messages(query: str, truth: str | list[str], prediction: str) -> list[dict[str, str]]:
    evidence = truth if isinstance(truth, str) else "\n---\n".join(truth)
    user = (
        f"Query:\n{query}\n\nGround-truth evidence:\n{evidence}\n\n"
        f"Predicted evidence:\n{prediction}"
    )
    return [
        {"role": "system", "content": RUBRIC_SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


class RubricJudge:
    """Scores predictions against ground-truth evidence with a rubric LLM judge."""

    def __init__(self, config: JudgeConfig, client: ChatClient | None = None):
        self.config = config
        self.client = client if client is not None else ChatClient(config)

    async def score(self, query: str, truth: str | list[str], prediction: str | None) -> JudgeScore:
        if prediction is None or not prediction.strip():
            return JudgeScore(score=0.0, method="no_answer", reason="no final answer")
        reply = await self.client.complete_json(
            rubric_messages(query, truth, prediction), RubricReply
        )
        if isinstance(reply, Unscored):
            return self._unscored(truth, prediction, reply.reason)
        return JudgeScore(
            score=(reply.precision - 1 + reply.recall - 1) / 18,
            method="judge",
            precision=reply.precision,
            recall=reply.recall,
            reason=reply.reason,
        )

    async def score_many(
        self, query: str, truth: str | list[str], predictions: list[str | None]
    ) -> list[JudgeScore]:
        """Score a group's predictions concurrently (the client bounds requests in flight)."""
        return list(await asyncio.gather(*(self.score(query, truth, p) for p in predictions)))

    def _unscored(self, truth: str | list[str], prediction: str, why: str) -> JudgeScore:
        if self.config.on_unscored == "span_f1":
            return JudgeScore(
                score=span_f1(prediction, truth),
                method="span_f1",
                reason=f"judge unavailable, span F1 used: {why}",
            )
        return JudgeScore(score=None, method="unscored", reason=why)


PROOF_SYSTEM_PROMPT = """\
You grade proofs. You are given a problem, a reference solution and a submitted proof.
The submission passes if it is a complete and correct proof of the problem: it may argue
differently from the reference, but every step must hold and no case may be missing.
Reply with exactly one JSON object and nothing else:
{"verdict": "pass" or "fail", "reason": "<one sentence>"}"""


class ProofReply(msgspec.Struct, kw_only=True):
    verdict: Literal["pass", "fail"]
    reason: Reason = ""


class ProofVerdict(msgspec.Struct, kw_only=True):
    score: float | None
    """+1 pass, -1 fail (a missing answer fails); None when the judge could not answer."""
    method: Literal["judge", "no_answer", "unscored"]
    reason: str = ""


def proof_messages(problem: str, reference: str, proof: str) -> list[dict[str, str]]:
    user = f"Problem:\n{problem}\n\nReference solution:\n{reference}\n\nSubmitted proof:\n{proof}"
    return [
        {"role": "system", "content": PROOF_SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


class ProofJudge:
    """Pass/fail verdicts on proofs against a hidden reference (BookNavigator, seed 002).

    A proof has no verifiable fallback (span overlap with a reference proof says little about
    correctness), so a verdict that cannot be had is always None with its reason, and the trainer
    drops that sample from its group.
    """

    def __init__(self, config: JudgeConfig, client: ChatClient | None = None):
        self.client = client if client is not None else ChatClient(config)

    async def verdict(self, problem: str, reference: str, proof: str | None) -> ProofVerdict:
        if proof is None or not proof.strip():
            return ProofVerdict(score=-1.0, method="no_answer", reason="no final answer")
        reply = await self.client.complete_json(
            proof_messages(problem, reference, proof), ProofReply
        )
        if isinstance(reply, Unscored):
            return ProofVerdict(score=None, method="unscored", reason=reply.reason)
        return ProofVerdict(
            score=1.0 if reply.verdict == "pass" else -1.0, method="judge", reason=reply.reason
        )
