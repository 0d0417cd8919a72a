"""Turn-level tool credit (docs/algorithm.md §3): label each turn useful (+1), neutral (0) or
harmful (-1).

The algorithm turns labels into advantages (Ã_t = A + α·|A|·(c_t − c̄), in `rlmtrain.algo`);
this module only produces the labels, from two sources:

- `ToolCreditJudge`: the judge model reads the query and each turn's code, output and error and
  replies `{"labels": [...]}`, one of -1/0/1 per turn (`turn_judge.ask_per_turn`: a list of the
  wrong length is retried like a malformed reply).
- `rule_labels`: a deterministic labeller, used when no judge is configured or the judge could
  not answer (the result says which). Per turn, first rule that applies:
    1. the turn raised an error                                   -> -1 (a wasted turn)
    2. it made tool calls and every one repeats an earlier call   ->  0 (nothing new asked)
    3. its output's novelty against earlier outputs ≥ threshold   -> +1 (new information)
    4. otherwise                                                  ->  0
  Novelty is the share of new word trigrams (`rewards.novelty`); calls compare by
  `exploration.call_key`; FINAL/FINAL_VAR are not tool calls.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rlmtrain.rewards.chat_client import ChatClient, JudgeConfig, Unscored
from rlmtrain.rewards.exploration import call_key, tool_calls
from rlmtrain.rewards.novelty import novelty
from rlmtrain.rewards.turn_judge import ask_per_turn, judge_each_trajectory, steps_messages
from rlmtrain.rlm.records import RolloutGroup, Turn

__all__ = [
    "TOOL_CREDIT_SYSTEM_PROMPT",
    "CreditLabels",
    "ToolCreditJudge",
    "credit_messages",
    "rule_credit",
    "rule_labels",
]

Label = Literal[-1, 0, 1]

TOOL_CREDIT_SYSTEM_PROMPT = """\
You assess the steps of an agent that answers a query by running Python code with tools.
For each step, in order, give one label:
  1 = useful: it obtained information that moves the answer forward;
  0 = neutral: it repeated earlier work or changed nothing;
 -1 = harmful: it failed with an error, or misled the agent.
Reply with exactly one JSON object and nothing else: {"labels": [<one label per step>]}"""


class CreditReply(msgspec.Struct):
    labels: list[Label]


class CreditLabels(msgspec.Struct, kw_only=True):
    labels: list[int]
    """One of -1/0/1 per turn, aligned with the trajectory's turns."""
    method: Literal["judge", "rules"]
    reason: str = ""
    """Why the rules were used, when they were."""


def rule_labels(turns: list[Turn], *, novelty_threshold: float = 0.5) -> list[int]:
    """The deterministic labeller of the module doc."""
    labels: list[int] = []
    seen_calls: set[tuple[str, str]] = set()
    outputs: list[str] = []
    for turn in turns:
        keys = [call_key(c) for c in tool_calls([turn])]
        if turn.error:
            label = -1
        elif keys and all(k in seen_calls for k in keys):
            label = 0
        elif novelty(turn.output, outputs) >= novelty_threshold:
            label = 1
        else:
            label = 0
        labels.append(label)
        seen_calls.update(keys)
        outputs.append(turn.output)
    return labels


def rule_credit(group: RolloutGroup, *, novelty_threshold: float = 0.5) -> dict[str, list[int]]:
    """`rule_labels` of every trajectory of a group, by trajectory id (the shape
    `algo.advantages.compute_advantages` takes as `tool_credit`)."""
    return {
        t.id: rule_labels(t.turns, novelty_threshold=novelty_threshold) for t in group.trajectories
    }


def credit_messages(query: str, turns: list[Turn], output_chars: int = 800) -> list[dict[str, str]]:
    return steps_messages(
        TOOL_CREDIT_SYSTEM_PROMPT, query, turns, f"Give {len(turns)} labels.", output_chars
    )


class ToolCreditJudge:
    """Labels turns with the judge model; falls back to `rule_labels` when it cannot."""

    def __init__(
        self,
        config: JudgeConfig,
        client: ChatClient | None = None,
        *,
        novelty_threshold: float = 0.5,
    ):
        self.client = client if client is not None else ChatClient(config)
        self.novelty_threshold = novelty_threshold

    async def label(self, query: str, turns: list[Turn]) -> CreditLabels:
        if not turns:
            return CreditLabels(labels=[], method="rules", reason="no turns")
        reply = await ask_per_turn(
            self.client, credit_messages(query, turns), CreditReply, "labels", len(turns)
        )
        if isinstance(reply, Unscored):
            labels = rule_labels(turns, novelty_threshold=self.novelty_threshold)
            return CreditLabels(labels=labels, method="rules", reason=reply.reason)
        return CreditLabels(labels=list(reply.labels), method="judge")

    async def label_group(self, group: RolloutGroup) -> dict[str, CreditLabels]:
        """Labels of every trajectory of a group (roots and children, each against its own
        prompt), concurrently; `{id: r.labels}` is `compute_advantages`'s `tool_credit`."""
        return await judge_each_trajectory(group, self.label)
