"""The per-turn signals of an RL step, as the config asks for them: BookNavigator's tool-credit
labels and LongTraceRL's step-rubric scores, for every trajectory of the step (children too).

Both read what the trainer holds, each turn's code as sent and its output as received
(`rlm.records.Turn`), never what a worker says about itself. Either comes from rules (credit:
`rewards.tool_credit.rule_labels`; steps: the heuristic rubric) or from the judge model, one
request per trajectory; where the judge cannot answer, that trajectory gets the rules' values
and is counted (`judge_fallbacks`), never a silent 0. Every judge request is counted too.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlmtrain.config import Config
from rlmtrain.rewards.chat_client import ChatClient
from rlmtrain.rewards.step_rubric import (
    STEP_CRITERIA,
    StepRubricJudge,
    StepRubricWeights,
    StepScore,
    heuristic_step_scores,
)
from rlmtrain.rewards.tool_credit import ToolCreditJudge, rule_credit
from rlmtrain.rlm.records import RolloutGroup

__all__ = ["TurnSignals", "step_totals"]


class TurnSignals:
    """Tool credit (when `algo.tool_credit_alpha > 0`) and step rewards (unless
    `algo.step_rewards` is off) of one step's groups, and the step's metrics of both: each rank
    gives `local_sums`, and `row` turns their sum over ranks into the metrics row's entries."""

    def __init__(self, cfg: Config):
        algo = cfg.algo
        self.weights = StepRubricWeights(
            relevance=algo.step_relevance_weight,
            info_gain=algo.step_info_gain_weight,
            coherence=algo.step_coherence_weight,
            efficiency=algo.step_cost,
        )
        self.credit_on = algo.tool_credit_alpha > 0
        self.steps_on = algo.step_rewards != "off"
        judged = (self.credit_on and algo.tool_credit == "judge") or algo.step_rewards == "judge"
        self._client = ChatClient(cfg.judge) if judged else None
        self._credit_judge = None
        if self.credit_on and algo.tool_credit == "judge":
            self._credit_judge = ToolCreditJudge(cfg.judge, self._client)
        self._step_judge = None
        if algo.step_rewards == "judge":
            self._step_judge = StepRubricJudge(cfg.judge, self._client, self.weights)
        self.counts: dict[str, int] = {}
        """Per judge in use, its requests and fallbacks since `reset_counts` (always the same
        keys for one config, so every rank's counts line up in an all-reduce)."""
        self.reset_counts()

    def reset_counts(self) -> None:
        kinds = [("credit", self._credit_judge), ("step", self._step_judge)]
        self.counts = {
            f"{kind}_judge_{what}": 0
            for kind, judge in kinds
            if judge is not None
            for what in ("calls", "fallbacks")
        }

    async def credit(self, groups: Sequence[RolloutGroup]) -> dict[str, list[int]] | None:
        """Labels in {-1, 0, 1} per turn, by trajectory id; None when the credit is off."""
        if not self.credit_on:
            return None
        labels: dict[str, list[int]] = {}
        for group in groups:
            if self._credit_judge is None:
                labels.update(rule_credit(group))
                continue
            for traj, judged in (await self._credit_judge.label_group(group)).items():
                labels[traj] = judged.labels
                if judged.labels:  # a trajectory without turns asks nothing
                    self.counts["credit_judge_calls"] += 1
                    self.counts["credit_judge_fallbacks"] += judged.method != "judge"
        return labels

    async def steps(self, groups: Sequence[RolloutGroup]) -> dict[str, list[StepScore]] | None:
        """Rubric scores per turn, by trajectory id; None when step rewards are off."""
        if not self.steps_on:
            return None
        scores: dict[str, list[StepScore]] = {}
        for group in groups:
            if self._step_judge is None:
                for traj in group.trajectories:
                    scores[traj.id] = heuristic_step_scores(traj.prompt, traj.turns, self.weights)
                continue
            for traj, judged in (await self._step_judge.score_group(group)).items():
                scores[traj] = judged.scores
                if judged.scores:
                    self.counts["step_judge_calls"] += 1
                    self.counts["step_judge_fallbacks"] += judged.method != "judge"
        return scores

    def local_sums(self, step_scores: dict[str, list[StepScore]] | None) -> list[float]:
        """This rank's numbers for an all-reduce: over every turn the sum of each criterion and
        of the combined step reward, and the number of turns (all zero when step rewards are
        off); then the judges' counts. The same length on every rank of one config."""
        sums = [0.0] * (len(STEP_CRITERIA) + 2)
        for turns in (step_scores or {}).values():
            for score in turns:
                for i, name in enumerate(STEP_CRITERIA):
                    sums[i] += getattr(score, name)
                sums[-2] += score.total
                sums[-1] += 1
        return [*sums, *self.counts.values()]

    def row(self, summed: Sequence[float]) -> dict[str, float | int]:
        """Metrics from `local_sums` added over ranks: `step_<criterion>` and `step_reward`
        means over every turn (when step rewards are on) and the judges' counts; the counts
        then start again for the next step."""
        width = len(STEP_CRITERIA) + 2
        *sums, turns = summed[:width]
        row: dict[str, float | int] = {}
        if self.steps_on:
            names = (*STEP_CRITERIA, "reward")
            row |= {
                f"step_{n}": total / max(1, turns) for n, total in zip(names, sums, strict=True)
            }
        row |= {key: int(v) for key, v in zip(self.counts, summed[width:], strict=True)}
        self.reset_counts()
        return row

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def step_totals(step_scores: dict[str, list[StepScore]] | None) -> dict[str, list[float]] | None:
    """Each turn's combined step reward, by trajectory id: `compute_advantages`'s
    `step_rewards`."""
    if step_scores is None:
        return None
    return {traj: [score.total for score in turns] for traj, turns in step_scores.items()}
