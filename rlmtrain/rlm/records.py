"""What a rollout leaves behind: turns, trajectories and the groups they form.

These Structs are the contract between the RLM runtime, the rewards and the algorithm. Every turn
keeps the exact token ids sent to and returned by the engine and the sampler's log-probs, so
nothing downstream re-tokenises (re-applying a chat template per turn drifts by a token here and
there, which is enough to break the ratio). A tree is stored flat: `RolloutGroup.trajectories`
holds the G roots of one task and all their descendants, linked by `parent_id` / `children`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = [
    "FinishReason",
    "RolloutGroup",
    "ToolCall",
    "Trajectory",
    "Turn",
    "failed_everywhere",
    "read_groups",
    "write_groups",
    "write_jsonl",
]

FinishReason = Literal["final", "max_turns", "context", "timeout", "error", "aborted"]


class ToolCall(msgspec.Struct, kw_only=True):
    """One call of an environment tool (or builtin) written in a turn's code."""

    name: str
    args: str = ""
    """The arguments as the code writes them (clipped), for credit judges and the exploration
    bonus."""


class Turn(msgspec.Struct, kw_only=True):
    prompt_ids: list[int]
    """Token ids of the prompt exactly as sent to the engine."""
    completion_ids: list[int]
    """Token ids exactly as the engine returned them."""
    sampler_logprobs: list[float]
    """The engine's log-prob of each completion token, len == len(completion_ids)."""
    weight_versions: list[int] = []
    """The engine's weight version under which each completion token was sampled (the
    `Completion`'s), len == len(completion_ids); empty where the engine does not say or the turn
    is a teacher's."""
    code: str = ""
    """The code extracted from the completion and run in the REPL ('' if none)."""
    output: str = ""
    """What the code printed, after truncation; this is what the next prompt shows."""
    error: str = ""
    """The REPL error text of this turn ('' if it ran cleanly)."""
    tool_calls: list[ToolCall] = []
    """The tool and builtin calls in `code`, in source order (`rlm.code_calls`): read by the
    trainer off the code it sent, never taken from the worker's word."""
    started: float = 0.0
    """Unix time the turn's engine request was issued."""
    ended: float = 0.0
    """Unix time the turn's REPL exec returned."""


class Trajectory(msgspec.Struct, kw_only=True):
    id: str
    root_id: str
    """Id of the root of this tree (== id for a root)."""
    parent_id: str | None
    depth: int
    """0 for a root; a child is its parent's depth + 1."""
    task_id: str
    sample_idx: int
    """Which of the task's G roots this tree belongs to."""
    prompt: str
    """The query it answers: the task query for a root, the rlm_query prompt for a child."""
    turns: list[Turn] = []
    children: list[str] = []
    """Ids of the child trajectories, in the order they were spawned."""
    answer: str | None = None
    finish_reason: FinishReason = "aborted"
    failure: str = ""
    """Why the scheduler could not run it (no REPL for its task, a prompt the chat template
    could not render, an engine error), with finish_reason "error"; "" when it ran, whatever
    its code did."""

    @property
    def is_root(self) -> bool:
        return self.parent_id is None


class RolloutGroup(msgspec.Struct, kw_only=True):
    task: Any
    """The task record as the environment defines it (a msgspec Struct or its builtin form)."""
    trajectories: list[Trajectory]

    @property
    def roots(self) -> list[Trajectory]:
        return sorted(
            (t for t in self.trajectories if t.parent_id is None), key=lambda t: t.sample_idx
        )

    def by_id(self) -> dict[str, Trajectory]:
        return {t.id: t for t in self.trajectories}

    def tree(self, root: Trajectory) -> list[Trajectory]:
        """`root` and all its descendants, depth first in spawn order (a parent before its
        children): the one walk of a tree that rewards, advantages, samples and logs share.

        A child id missing from the group, or a trajectory reached twice, is a malformed group
        and raises ValueError naming the task and the ids: every consumer would otherwise see
        a different tree.
        """
        by_id = self.by_id()
        order: list[Trajectory] = []
        seen: set[str] = set()
        stack = [root]
        while stack:
            traj = stack.pop()
            if traj.id in seen:
                raise ValueError(
                    f"task {traj.task_id}: trajectory {traj.id} is reached twice under root "
                    f"{root.id}"
                )
            seen.add(traj.id)
            order.append(traj)
            for child_id in reversed(traj.children):
                if child_id not in by_id:
                    raise ValueError(
                        f"task {traj.task_id}: child {child_id} of {traj.id} is not in the group"
                    )
                stack.append(by_id[child_id])
        return order


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RolloutGroup)


def failed_everywhere(groups: Iterable[RolloutGroup]) -> str | None:
    """The first root's failure when every root of `groups` (at least one) failed in the
    scheduler (`Trajectory.failure`): a cause of the input's or the machine's, not of what the
    policy wrote; None otherwise."""
    roots = [root for group in groups for root in group.roots]
    if roots and all(root.failure for root in roots):
        return roots[0].failure
    return None


def write_groups(path: str | Path, groups: Iterable[RolloutGroup]) -> int:
    """Write groups as JSON lines (`write_jsonl`); returns how many were written."""
    return write_jsonl(path, groups)


def write_jsonl(path: str | Path, records: Iterable[Any]) -> int:
    """Write msgspec records as JSON lines; returns how many were written. Written beside
    `path` and renamed into place: a write that fails or is killed leaves what `path` held
    as it was."""
    n = 0
    partial = f"{path}.partial"
    try:
        with open(partial, "wb") as f:
            for record in records:
                f.write(_encoder.encode(record))
                f.write(b"\n")
                n += 1
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    return n


def read_groups(path: str | Path) -> Iterator[RolloutGroup]:
    """Read groups written by `write_groups`; a bad line raises ValueError naming file and line."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from None
