"""The evidence env's records: a task (its papers, its gold passages, its query family) and a
gold span. Apart from the env, so the synthesiser and the teacher that make and read them need
not import the env that uses them."""

from __future__ import annotations

import msgspec

from rlmtrain.envs.base import Task

__all__ = ["EvidenceSpan", "EvidenceTask"]


class EvidenceSpan(msgspec.Struct, kw_only=True):
    paper_id: str
    start: int
    """Character offset into the paper's parsed text."""
    end: int
    text: str
    """text == paper.text[start:end]."""


class EvidenceTask(Task, kw_only=True):
    paper_ids: list[str]
    """The papers put in the context, in this order."""
    evidence: list[EvidenceSpan]
    """The gold passages; a query may draw on several papers, not necessarily all."""
    kind: str = ""
    """The query family (datasets, baselines, results, limitation) for per-kind metrics."""
