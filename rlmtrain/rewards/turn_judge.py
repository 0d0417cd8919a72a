"""What the per-turn judges (`step_rubric`, `tool_credit`) share.

Both show the judge a trajectory the same way (the query, then each turn's code, output and error
as numbered steps), make one request per trajectory whose reply holds one entry per turn, and
judge a group trajectory by trajectory, each against its own prompt. They differ in the system
prompt, the closing request, the reply type and what they do with the entries.
"""

from __future__ import annotations

import asyncio
import functools
import typing
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import msgspec

from rlmtrain.rewards.chat_client import ChatClient, Unscored
from rlmtrain.rlm.records import RolloutGroup, Turn

__all__ = ["ask_per_turn", "judge_each_trajectory", "steps_messages"]

R = TypeVar("R", bound=msgspec.Struct)
T = TypeVar("T")


def steps_messages(
    system_prompt: str, query: str, turns: list[Turn], request: str, output_chars: int = 800
) -> list[dict[str, str]]:
    """Chat messages showing `turns` as numbered steps after the query, ending with `request`;
    outputs and errors are cut to `output_chars` each."""
    steps = []
    for i, turn in enumerate(turns, 1):
        text = f"Step {i}\ncode:\n{turn.code}\noutput:\n{turn.output[:output_chars]}"
        if turn.error:
            text += f"\nerror:\n{turn.error[:output_chars]}"
        steps.append(text)
    user = f"Query:\n{query}\n\n" + "\n\n".join(steps) + f"\n\n{request}"
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]


async def ask_per_turn(
    client: ChatClient,
    messages: list[dict[str, str]],
    reply_type: type[R],
    field: str,
    n_turns: int,
) -> R | Unscored:
    """The judge's reply, whose list `field` must have one entry per turn: a list of another
    length is a malformed reply and retried like one (a shifted entry would judge the wrong turn).
    """

    def one_per_turn(reply: R) -> None:
        got = len(getattr(reply, field))
        if got != n_turns:
            raise ValueError(f"expected {n_turns} {field}, got {got}")

    # The schema the server decodes to says the length too, so a server that keeps to it cannot
    # answer with another count (the check stays for servers that do not).
    exact = _with_length(reply_type, field, n_turns)
    return await client.complete_json(messages, exact, one_per_turn)


@functools.cache
def _with_length(reply_type: type[R], field: str, length: int) -> type[R]:
    """`reply_type` whose list `field` must hold exactly `length` entries (a subclass, so the
    reply reads as before)."""
    entries = typing.get_type_hints(reply_type, include_extras=True)[field]
    exact = Annotated[entries, msgspec.Meta(min_length=length, max_length=length)]
    return msgspec.defstruct(
        f"{reply_type.__name__}Of{length}", [(field, exact)], bases=(reply_type,)
    )


async def judge_each_trajectory(
    group: RolloutGroup, judge: Callable[[str, list[Turn]], Awaitable[T]]
) -> dict[str, T]:
    """`judge(prompt, turns)` of every trajectory of a group (roots and children), concurrently,
    by trajectory id."""
    trajectories = group.trajectories
    results = await asyncio.gather(*(judge(t.prompt, t.turns) for t in trajectories))
    return {t.id: r for t, r in zip(trajectories, results, strict=True)}
