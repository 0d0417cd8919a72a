"""Rewards: span F1, the rubric LLM judge, tool credit, the exploration bonus, step rubrics."""

from rlmtrain.rewards.span_f1 import span_f1

__all__ = ["span_f1"]
