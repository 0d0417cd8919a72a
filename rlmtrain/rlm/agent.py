"""One trajectory of an RLM: prompt, generate, extract, exec, until it ends.

`run_trajectory` drives a single trajectory against one REPL `Session`, turn by turn
(docs/algorithm.md §1):

    messages (prompts.py) -> chat template -> token ids   (over max_prompt_tokens: "context")
    -> await generate(ids)                                (engine "abort": "aborted")
    -> extract_code (extract.py) -> await session.exec(code, on_query)
    -> a Turn with the exact ids, the sampler's log-probs, code, output, error, its calls, times
    FINAL ran: "final" | worker dead: "error" | out of turns: "max_turns" | deadline: "timeout"

It knows no engine, no scheduler and no torch: the engine is a `GenerateFn`, the tokenizer
anything with a chat template, and the children of a trajectory are run by the caller's `spawn`.
When the REPL code calls `rlm_query[_batched]`, this module decides what each prompt becomes,
enforcing the limits in one place: a child trajectory with its own REPL, a plain LM call (the
depth limit in "lm" mode), or an explanatory error string in that answer slot (the depth limit in
"error" mode, over max_children_per_call or max_children_per_trajectory); it never raises into
the REPL. The parent assigns each child its id (`<parent id>.<k>`) and appends it to
`Trajectory.children` before spawning, so ids are unique without any shared counter (a race in
assigning child indices is a known bug of public RLM code) and the tree can be rebuilt from a
flat list. `spawn` runs the children (`run_trajectory` at depth + 1 for `ChildCall.with_repl`,
`run_plain_call` otherwise), records them, and returns `child_answer` of each.

Cancellation: the trajectory record is the caller's object, filled in place; a cancelled run
leaves it with its turns so far and finish_reason "aborted" (the record's default), and the
CancelledError propagates. A deadline (loop time) ends the run with "timeout" instead.
"""

from __future__ import annotations

import asyncio
import functools
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from rlmtrain.config import ROLLOUT_DEFAULTS, RolloutConfig
from rlmtrain.rlm.code_calls import calls_in_code, tool_names
from rlmtrain.rlm.extract import STOP_STRINGS, extract_code
from rlmtrain.rlm.generation import Completion, GenerateFn, SamplingParams
from rlmtrain.rlm.prompts import (
    Message,
    PromptStyle,
    RLMEnv,
    SubcallMode,
    builtin_docs,
    plain_call_messages,
    query_message,
    system_prompt,
    turn_messages,
)
from rlmtrain.rlm.records import FinishReason, Trajectory, Turn
from rlmtrain.rlm.repl import QueryHandler, Session

__all__ = [
    "Agent",
    "AgentLimits",
    "ChatTokenizer",
    "ChildCall",
    "SpawnFn",
    "child_answer",
    "root_trajectory",
    "run_plain_call",
    "run_trajectory",
]


class ChatTokenizer(Protocol):
    """The part of `rlmtrain.model.tokenizer.Tokenizer` the agent uses."""

    @property
    def stop_ids(self) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> list[int]: ...


def _history_budget_chars(max_prompt_tokens: int) -> int:
    # About 4 characters a BPE token; a byte tokenizer overshoots and is shrunk per turn.
    return 4 * max_prompt_tokens


class AgentLimits(msgspec.Struct, kw_only=True, frozen=True):
    """The per-trajectory limits of docs/algorithm.md §1 (the REPL's own are `ReplLimits`),
    defaulting to the config's (`RolloutConfig`), where each is documented."""

    max_turns: int = ROLLOUT_DEFAULTS.max_turns
    max_depth: int = ROLLOUT_DEFAULTS.max_depth
    """Deepest trajectory with a REPL; the root is depth 0."""
    depth_limit_mode: Literal["lm", "error"] = ROLLOUT_DEFAULTS.depth_limit_mode
    """rlm_query at max_depth: a plain LM call (a leaf at depth + 1) or an error string."""
    max_children_per_call: int = ROLLOUT_DEFAULTS.max_children_per_call
    max_children_per_trajectory: int = ROLLOUT_DEFAULTS.max_children_per_trajectory
    max_new_tokens: int = ROLLOUT_DEFAULTS.max_new_tokens
    max_prompt_tokens: int = ROLLOUT_DEFAULTS.max_prompt_tokens
    output_limit_chars: int = ROLLOUT_DEFAULTS.output_limit_chars
    """What the REPL keeps of one exec's output; quoted to the model in the builtin docs."""
    history_budget_chars: int = _history_budget_chars(ROLLOUT_DEFAULTS.max_prompt_tokens)
    """Characters of history before older turns are shortened; shrunk further per trajectory when
    the templated prompt is still over max_prompt_tokens."""
    plain_call_context_chars: int = ROLLOUT_DEFAULTS.output_limit_chars
    """How much of an explicitly passed context a plain LM call sees."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_children_per_call", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_depth < 0 or self.max_children_per_trajectory < 0:
            raise ValueError("AgentLimits.max_depth and max_children_per_trajectory must be >= 0")

    @classmethod
    def from_config(cls, config: RolloutConfig) -> AgentLimits:
        return cls(
            max_turns=config.max_turns,
            max_depth=config.max_depth,
            depth_limit_mode=config.depth_limit_mode,
            max_children_per_call=config.max_children_per_call,
            max_children_per_trajectory=config.max_children_per_trajectory,
            max_new_tokens=config.max_new_tokens,
            max_prompt_tokens=config.max_prompt_tokens,
            output_limit_chars=config.output_limit_chars,
            history_budget_chars=_history_budget_chars(config.max_prompt_tokens),
            plain_call_context_chars=config.output_limit_chars,
        )


class ChildCall(msgspec.Struct, kw_only=True):
    """One child the parent asks the caller's `spawn` to run."""

    trajectory: Trajectory
    """The child's record with ids, depth and prompt set; run it in place and keep it."""
    context: Any | None
    """The child's context; None = the task context of the zygote (no copy needed). One the
    parent's code passed is a `msgspec.Raw`, still encoded: the child's worker decodes it."""
    with_repl: bool
    """True: `run_trajectory` with a fresh session; False: `run_plain_call` (depth limit)."""


SpawnFn = Callable[[list[ChildCall]], Awaitable[list[str]]]
"""Runs the children concurrently and returns `child_answer` of each, in order. It must keep
every call's trajectory record (the parent already lists its id in `children`), turn a failing
child into an explanatory answer, and never hang; cancelling it must cancel the children."""


@dataclass(frozen=True, kw_only=True)
class Agent:
    """What every trajectory of a rollout shares: environment, engine, tokenizer, limits."""

    env: RLMEnv
    generate: GenerateFn
    tokenizer: ChatTokenizer
    limits: AgentLimits = field(default_factory=AgentLimits)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Temperature, top-p/k and seed; max_new_tokens and stops are set from limits per turn."""
    prompt_style: PromptStyle = "full"
    """How long the system prompt and the fresh messages are (`prompts.PromptStyle`); the env
    writes its own strategy and root messages in the style it was built with."""

    def params(
        self, trajectory: Trajectory, turn: int, *, stop_strings: list[str]
    ) -> SamplingParams:
        # A fixed seed on every request would make the G roots of a task identical (zero
        # advantage); mix in the trajectory and turn so each request has its own stream.
        seed = self.sampling.seed
        if seed is not None:
            seed = zlib.crc32(f"{seed}/{trajectory.id}/{turn}".encode()) & 0x7FFFFFFF
        return msgspec.structs.replace(
            self.sampling,
            max_new_tokens=self.limits.max_new_tokens,
            stop_token_ids=list(self.tokenizer.stop_ids),
            stop_strings=stop_strings,
            seed=seed,
        )

    @functools.cached_property
    def call_names(self) -> frozenset[str]:
        """The names whose calls in a turn's code are its tool calls."""
        return tool_names(tuple(self.env.tool_modules()))

    def text_of(self, completion: Completion) -> str:
        """The completion as text, without the stop token that ended it."""
        ids = completion.token_ids
        if ids and ids[-1] in self.tokenizer.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


def root_trajectory(task_id: str, sample_idx: int, query: str) -> Trajectory:
    """The empty record of the `sample_idx`-th root of a task."""
    trajectory_id = f"{task_id}#{sample_idx}"
    return Trajectory(
        id=trajectory_id,
        root_id=trajectory_id,
        parent_id=None,
        depth=0,
        task_id=task_id,
        sample_idx=sample_idx,
        prompt=query,
    )


def _child_of(parent: Trajectory, prompt: str) -> Trajectory:
    return Trajectory(
        id=f"{parent.id}.{len(parent.children)}",
        root_id=parent.root_id,
        parent_id=parent.id,
        depth=parent.depth + 1,
        task_id=parent.task_id,
        sample_idx=parent.sample_idx,
        prompt=prompt,
    )


_WHY_NO_ANSWER = {
    "max_turns": "used all its turns without calling FINAL",
    "context": "outgrew the prompt token limit",
    "timeout": "ran out of time",
    "error": "lost its REPL worker",
    "aborted": "was aborted",
    "final": "ended without an answer",
}


def child_answer(child: Trajectory) -> str:
    """What the parent's rlm_query gets from a finished child: its answer, or why there is none."""
    if child.answer is not None:
        return child.answer
    why = _WHY_NO_ANSWER[child.finish_reason]
    last_error = next((t.error for t in reversed(child.turns) if t.error.strip()), "")
    # A traceback's last line names the exception; one line keeps the parent's output readable.
    detail = f"; last error: {last_error.strip().splitlines()[-1][:300]}" if last_error else ""
    return f"[rlm_query failed: the sub-query {why} ({child.finish_reason}){detail}]"


# ---------------------------------------------------------------------------------------------
# The trajectory loop
# ---------------------------------------------------------------------------------------------


async def run_trajectory(
    agent: Agent,
    trajectory: Trajectory,
    *,
    task: Any,
    session: Session,
    spawn: SpawnFn,
    context: Any | None = None,
    deadline: float | None = None,
) -> Trajectory:
    """Run `trajectory` (a fresh record from `root_trajectory` or a `ChildCall`) to its end.

    `context` is what `session` was forked with (None = the zygote's task context); children
    that pass no context inherit it. `deadline` is in `asyncio` loop time. Returns the record,
    filled in place.
    """
    limits = agent.limits
    subcalls = _subcall_mode(trajectory, limits)
    run = _Run(
        agent=agent,
        trajectory=trajectory,
        task=task,
        session=session,
        on_query=_query_handler(trajectory, limits, subcalls, spawn, context),
        system=system_prompt(
            agent.env,
            builtins=builtin_docs(
                output_limit_chars=limits.output_limit_chars,
                subcalls=subcalls,
                max_children_per_call=limits.max_children_per_call,
                max_children_per_trajectory=limits.max_children_per_trajectory,
                style=agent.prompt_style,
            ),
        ),
        budget=limits.history_budget_chars,
    )
    try:
        async with asyncio.timeout_at(deadline):
            await _bind_query(session, trajectory.prompt)
            for turn_index in range(limits.max_turns):
                ended = await run.turn(turn_index)
                if ended is not None:
                    trajectory.finish_reason = ended
                    return trajectory
            trajectory.finish_reason = "max_turns"
    except TimeoutError:
        if deadline is None or asyncio.get_running_loop().time() < deadline:
            raise
        _note_interrupted(trajectory, "[the trajectory's time ran out during this turn]")
        trajectory.finish_reason = "timeout"
    except asyncio.CancelledError:
        _note_interrupted(trajectory, "[the trajectory was cancelled during this turn]")
        raise
    return trajectory


async def _bind_query(session: Session, query: str) -> None:
    """`query` in the REPL: the question this trajectory answers (a child's is its prompt), so
    code can pass it on or cut names out of it instead of retyping it."""
    result = await session.exec(f"query = {query!r}")
    if result.error or result.dead:
        raise RuntimeError(f"binding `query` in the REPL failed: {result.error or 'worker died'}")


@dataclass(kw_only=True)
class _Run:
    """The state one trajectory carries from turn to turn."""

    agent: Agent
    trajectory: Trajectory
    task: Any
    session: Session
    on_query: QueryHandler
    system: str
    budget: int
    """The history budget in characters; only shrinks (see `_fit_prompt`)."""

    async def turn(self, index: int) -> FinishReason | None:
        """Play turn `index`; returns why the trajectory ended, or None to go on."""
        agent, trajectory, limits = self.agent, self.trajectory, self.agent.limits
        if trajectory.is_root:
            fresh = agent.env.user_prompt(self.task, index, limits.max_turns)
        else:
            fresh = query_message(
                trajectory.prompt, index, limits.max_turns, style=agent.prompt_style
            )
        prompt_ids, self.budget = _fit_prompt(
            agent, self.system, trajectory.turns, fresh, self.budget
        )
        if prompt_ids is None:
            return "context"
        turn = Turn(prompt_ids=prompt_ids, completion_ids=[], sampler_logprobs=[])
        turn.started = time.time()
        params = agent.params(trajectory, index, stop_strings=STOP_STRINGS)
        completion = await agent.generate(prompt_ids, params)
        turn.completion_ids = completion.token_ids
        turn.sampler_logprobs = completion.logprobs
        turn.weight_versions = completion.weight_versions
        trajectory.turns.append(turn)
        if completion.finish_reason == "abort":
            turn.ended = time.time()
            return "aborted"
        extraction = extract_code(agent.text_of(completion), finish_reason=completion.finish_reason)
        if not extraction.code:
            turn.output = extraction.feedback
            turn.ended = time.time()
            return None
        turn.code = extraction.code
        result = await self.session.exec(extraction.code, on_query=self.on_query)
        turn.output, turn.error = result.output, result.error
        turn.tool_calls = calls_in_code(extraction.code, agent.call_names)
        turn.ended = time.time()
        if result.final is not None:
            trajectory.answer = result.final
            return "final"
        return "error" if result.dead else None


def _note_interrupted(trajectory: Trajectory, note: str) -> None:
    if trajectory.turns and trajectory.turns[-1].ended == 0.0:
        last = trajectory.turns[-1]
        last.error = note
        last.ended = time.time()


def _fit_prompt(
    agent: Agent, system: str, turns: Sequence[Turn], fresh: str, budget: int
) -> tuple[list[int] | None, int]:
    """Prompt ids under max_prompt_tokens, shrinking the history budget as needed.

    Returns (ids or None when even the smallest history does not fit, the budget used); the
    budget only shrinks over a trajectory, so later turns start from one that fitted.
    """
    limit = agent.limits.max_prompt_tokens
    previous: list[Message] | None = None
    while True:
        messages = turn_messages(system, turns, fresh, budget_chars=budget)
        if messages == previous:  # the history cannot get any shorter
            return None, budget
        ids = agent.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if len(ids) <= limit:
            return ids, budget
        previous = messages
        # Scale what the history holds now by the overshoot, with some margin for the parts
        # that do not shrink (system prompt, newest turn, fresh query).
        history_chars = sum(len(m["content"]) for m in messages[1:]) - len(fresh)
        budget = int(min(budget, history_chars) * limit / len(ids) * 0.9)


def _subcall_mode(trajectory: Trajectory, limits: AgentLimits) -> SubcallMode:
    if limits.max_children_per_trajectory == 0:
        return "none"
    if trajectory.depth < limits.max_depth:
        return "repl"
    return "plain" if limits.depth_limit_mode == "lm" else "none"


def _query_handler(
    trajectory: Trajectory,
    limits: AgentLimits,
    subcalls: SubcallMode,
    spawn: SpawnFn,
    own_context: Any | None,
) -> QueryHandler:
    """The REPL's `on_query`: limits decide each slot; the allowed ones go to `spawn` together."""

    async def on_query(prompts: list[str], contexts: list[Any | None]) -> list[str]:
        if len(contexts) != len(prompts):
            why = f"{len(prompts)} prompts but {len(contexts)} contexts were given"
            return [f"[rlm_query not run: {why}]"] * len(prompts)
        answers: list[str] = [""] * len(prompts)
        calls: list[ChildCall] = []
        slots: list[int] = []
        for slot, (prompt, context) in enumerate(zip(prompts, contexts, strict=True)):
            refusal = _refusal(slot, prompt, trajectory, limits, subcalls)
            if refusal:
                answers[slot] = f"[rlm_query not run: {refusal}]"
                continue
            child = _child_of(trajectory, prompt)
            trajectory.children.append(child.id)
            inherited = own_context if context is None else context
            calls.append(
                ChildCall(trajectory=child, context=inherited, with_repl=subcalls == "repl")
            )
            slots.append(slot)
        if calls:
            try:
                results = await spawn(calls)
                if len(results) != len(calls):
                    raise ValueError(
                        f"spawn returned {len(results)} answers for {len(calls)} calls"
                    )
            except Exception as exc:  # the handler must not raise into the REPL
                results = [f"[rlm_query failed: {type(exc).__name__}: {exc}]"] * len(calls)
            for slot, answer in zip(slots, results, strict=True):
                answers[slot] = answer
        return answers

    return on_query


def _refusal(
    slot: int, prompt: Any, trajectory: Trajectory, limits: AgentLimits, subcalls: SubcallMode
) -> str:
    """Why the prompt in `slot` of one call may not run ('' when it may)."""
    if subcalls == "none":
        if limits.max_children_per_trajectory == 0:
            return "sub-queries are disabled (max_children_per_trajectory = 0)"
        return f"the depth limit ({limits.max_depth}) is reached; answer without sub-queries"
    if not isinstance(prompt, str):
        return f"the prompt must be a string, got {type(prompt).__name__}"
    if slot >= limits.max_children_per_call:
        limit = limits.max_children_per_call
        return f"at most {limit} prompts run per call; this was prompt {slot + 1}"
    if len(trajectory.children) >= limits.max_children_per_trajectory:
        return f"this trajectory has used all {limits.max_children_per_trajectory} sub-queries"
    return ""


# ---------------------------------------------------------------------------------------------
# Plain LM calls at the depth limit
# ---------------------------------------------------------------------------------------------


async def run_plain_call(
    agent: Agent,
    trajectory: Trajectory,
    *,
    context: Any | None = None,
    deadline: float | None = None,
) -> Trajectory:
    """Answer a child's prompt with one completion, no REPL (the depth limit in "lm" mode).

    The record gets one Turn (exact ids and log-probs, no code) and the stripped text as its
    answer, so the call is a training sample like any other turn of the tree.
    """
    limits = agent.limits
    messages = plain_call_messages(
        trajectory.prompt, context, context_chars=limits.plain_call_context_chars
    )
    prompt_ids = agent.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if len(prompt_ids) > limits.max_prompt_tokens:
        trajectory.finish_reason = "context"
        return trajectory
    turn = Turn(prompt_ids=prompt_ids, completion_ids=[], sampler_logprobs=[], started=time.time())
    try:
        async with asyncio.timeout_at(deadline):
            completion = await agent.generate(
                prompt_ids, agent.params(trajectory, 0, stop_strings=[])
            )
    except TimeoutError:
        if deadline is None or asyncio.get_running_loop().time() < deadline:
            raise
        trajectory.finish_reason = "timeout"
        return trajectory
    turn.completion_ids = completion.token_ids
    turn.sampler_logprobs = completion.logprobs
    turn.weight_versions = completion.weight_versions
    turn.ended = time.time()
    trajectory.turns.append(turn)
    if completion.finish_reason == "abort":
        trajectory.finish_reason = "aborted"
        return trajectory
    trajectory.answer = agent.text_of(completion).strip()
    trajectory.finish_reason = "final"
    return trajectory
