"""Rewards: span F1, the rubric LLM judge, tool credit, the exploration bonus, step rubrics."""

from rlmtrain.rewards.chat_client import ChatClient, ChatStats, JudgeConfig, Unscored
from rlmtrain.rewards.exploration import beta_schedule, diversity_bonus, explored_reward
from rlmtrain.rewards.judge import JudgeScore, ProofJudge, ProofVerdict, RubricJudge
from rlmtrain.rewards.span_f1 import span_f1
from rlmtrain.rewards.step_rubric import (
    StepRubricJudge,
    StepRubricWeights,
    heuristic_step_rewards,
    heuristic_step_scores,
)
from rlmtrain.rewards.tool_credit import CreditLabels, ToolCreditJudge, rule_credit, rule_labels

__all__ = [
    "ChatClient",
    "ChatStats",
    "CreditLabels",
    "JudgeConfig",
    "JudgeScore",
    "ProofJudge",
    "ProofVerdict",
    "RubricJudge",
    "StepRubricJudge",
    "StepRubricWeights",
    "ToolCreditJudge",
    "Unscored",
    "beta_schedule",
    "diversity_bonus",
    "explored_reward",
    "heuristic_step_rewards",
    "heuristic_step_scores",
    "rule_credit",
    "rule_labels",
    "span_f1",
]
