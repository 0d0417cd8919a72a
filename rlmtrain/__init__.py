"""rlmtrain: reinforcement learning for recursive language models."""

__version__ = "0.1.0"
