"""Rewards: span F1, the rubric LLM judge, tool credit, the exploration bonus, step rubrics."""

from rlmtrain.rewards.chat_client import ChatClient, ChatStats, JudgeConfig, Unscored
from rlmtrain.rewards.judge import JudgeScore, RubricJudge
from rlmtrain.rewards.span_f1 import span_f1

__all__ = [
    "ChatClient",
    "ChatStats",
    "JudgeConfig",
    "JudgeScore",
    "RubricJudge",
    "Unscored",
    "span_f1",
]
