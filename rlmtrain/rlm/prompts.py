"""The per-turn prompt of docs/algorithm.md §1, as chat messages.

Every turn the prompt is rebuilt from scratch:

    system     environment strategy + tool docs + REPL/builtin docs (with the code-block rule)
    assistant  turn 1's code          } the history of this trajectory, one pair per past turn,
    user       turn 1's REPL output   } older outputs shortened first when over budget
    ...
    user       last turn's REPL output, then the fresh query message for this turn

The last user message restates the query with the turn number and is rewritten every turn, not
accumulated, so turn t+1's prompt is not a prefix-extension of turn t's and each turn is its own
training sample. The newest REPL output and the fresh message share one user message because some
chat templates (Gemma's, Mistral's) refuse two user messages in a row.

A prompt is a pure function of (env, task or query, the trajectory's past `Turn` records, limits,
history budget): history is rendered from the records alone (an assistant turn shows the code that
ran, not the prose around it). Training never rebuilds prompts (each Turn keeps its exact ids),
but teachers, evaluation and tests can.

Budget: the history is kept under a character budget by shortening, oldest turn first, first
the outputs to a head and tail, then the outputs entirely, then the code; the newest turn is
never shortened (its output is already cut by the REPL's own limit). The agent shrinks the budget
further when the chat-templated prompt is still over its token limit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from rlmtrain.rlm.builtins import clip_text
from rlmtrain.rlm.extract import CLOSE_FENCE, CODE_BLOCK_RULE, OPEN_FENCE
from rlmtrain.rlm.records import Turn
from rlmtrain.rlm.tools import load_tools

__all__ = [
    "Message",
    "PromptStyle",
    "RLMEnv",
    "SubcallMode",
    "builtin_docs",
    "compact_query_message",
    "fenced",
    "history_messages",
    "plain_call_messages",
    "query_message",
    "system_prompt",
    "tool_docs",
    "turn_messages",
]

Message = dict[str, str]
"""{"role": "system" | "user" | "assistant", "content": str}"""

PromptStyle = Literal["full", "compact"]
"""full: strategy, every tool's docstring and the builtins at length (for pretrained models);
compact: the strategy and a line per builtin in a few hundred tokens, the env's own strategy
naming its tools (for small models trained from scratch, whose cost grows with every token)."""

SubcallMode = Literal["repl", "plain", "none"]
"""What rlm_query does from this trajectory: runs a child with its own REPL, makes a plain LM
call (the depth limit in "lm" mode), or only returns an error (depth limit in "error" mode)."""

SHORT_OUTPUT_CHARS = 400
"""What an old output is cut to (head + tail) in the first stage of fitting the budget."""


@runtime_checkable
class RLMEnv(Protocol):
    """What the RLM runtime needs from an environment (`rlmtrain.envs.base.Env` implements it)."""

    def system_prompt(self) -> str:
        """The task strategy; the runtime appends tool and builtin docs."""
        ...

    def user_prompt(self, task: Any, turn: int, max_turns: int) -> str:
        """The fresh user message of turn `turn` (0-based) of a root trajectory."""
        ...

    def context(self, task: Any) -> Any: ...

    def tool_modules(self) -> list[str]: ...


# ---------------------------------------------------------------------------------------------
# System prompt
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def tool_docs(module_names: tuple[str, ...]) -> str:
    """One entry per tool: `name(signature)` and its docstring, indented.

    The tools are resolved by the `load_tools` the worker uses, so the docs list exactly the
    names the REPL injects.
    """
    entries = []
    for name, tool in load_tools(list(module_names)).items():
        doc = inspect.getdoc(tool) or "(undocumented)"
        body = "\n".join("    " + line if line else "" for line in doc.splitlines())
        entries.append(f"{name}{inspect.signature(tool)}\n{body}")
    return "\n\n".join(entries)


def builtin_docs(
    *,
    output_limit_chars: int,
    subcalls: SubcallMode,
    max_children_per_call: int,
    max_children_per_trajectory: int,
    style: PromptStyle = "full",
) -> str:
    """The REPL and its builtins, as this trajectory sees them (its limits and depth)."""
    if style == "compact":
        return _compact_builtin_docs(subcalls, max_children_per_call)
    lines = [
        "You work in a persistent Python REPL. The input to study is the variable `context`: "
        "it is not shown to you, so inspect it with code (its type, size, parts). The variable "
        "`query` holds the query as text. Variables and imports persist between turns.",
        CODE_BLOCK_RULE,
        f"Example:\n{OPEN_FENCE}\nprint(type(context), len(context))\n{CLOSE_FENCE}",
        f"What the code prints (cut to {output_limit_chars} characters) and any error are shown "
        "to you next turn; print only what you need.",
        "",
        "Builtins:",
        "FINAL(answer)  end the task with `answer` (a string). Only a call that runs counts; the "
        "word in a comment or string does nothing.",
        "FINAL_VAR(name)  end the task with the value of the REPL variable called `name` "
        "(pass the name as a string).",
    ]
    if subcalls == "none":
        lines.append(
            "rlm_query and rlm_query_batched are not available here: calling them returns an "
            "error string."
        )
    else:
        who = (
            "a helper with its own REPL, whose `context` is the one you pass or, by default, yours"
            if subcalls == "repl"
            else "a helper without a REPL, who sees only the prompt and the context you pass"
        )
        lines += [
            f"rlm_query(prompt, context=None) -> str  ask {who}; returns its final answer.",
            "rlm_query_batched(prompts, context_list=None) -> list[str]  several such queries run "
            "concurrently; answers in the order of `prompts`.",
            f"At most {max_children_per_call} prompts per call and {max_children_per_trajectory} "
            "queries in all; a query that fails or is over a limit returns a string saying why.",
        ]
    return "\n".join(lines)


def _compact_builtin_docs(subcalls: SubcallMode, max_children_per_call: int) -> str:
    lines = [
        f"Reply with one {OPEN_FENCE} block a turn; what it prints is shown next turn. "
        "FINAL(answer) or FINAL_VAR(name) ends the task."
    ]
    if subcalls != "none":
        lines.append(
            "rlm_query(prompt, context) and rlm_query_batched(prompts, contexts) ask helpers "
            f"(at most {max_children_per_call} a call)."
        )
    return "\n".join(lines)


def system_prompt(env: RLMEnv, *, builtins: str) -> str:
    """The environment's strategy, its tools' docs, then the builtin docs. An env whose strategy
    is compact (`prompt_style = "compact"`) names its tools itself, so their docstrings are left
    out; an env without a compact strategy keeps them whatever the builtins' style."""
    parts = [env.system_prompt().strip()]
    compact = getattr(env, "prompt_style", "full") == "compact"
    docs = "" if compact else tool_docs(tuple(env.tool_modules()))
    if docs:
        parts.append("Tools (already defined in the REPL):\n\n" + docs)
    parts.append(builtins)
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------
# History and the per-turn messages
# ---------------------------------------------------------------------------------------------


def fenced(code: str) -> str:
    return f"{OPEN_FENCE}\n{code}\n{CLOSE_FENCE}"


def _report(output: str, error: str) -> str:
    text = "REPL output:\n" + (output if output else "(nothing printed)")
    if error:
        text += "\n\nREPL error:\n" + error
    return text


def history_messages(turns: Sequence[Turn], budget_chars: int) -> list[Message]:
    """Assistant/user pairs for past turns, fitted under `budget_chars` (module docstring).

    The last user message (the newest output) is returned on its own so the caller can append
    the fresh query message to it.
    """
    codes = [fenced(t.code) if t.code else "(no code ran this turn)" for t in turns]
    reports = [_report(t.output, t.error) for t in turns]
    older = range(len(turns) - 1)

    def total() -> int:
        return sum(map(len, codes)) + sum(map(len, reports))

    stages: list[tuple[list[str], Callable[[int, str], str]]] = [
        (reports, lambda i, text: clip_text(text, SHORT_OUTPUT_CHARS)),
        (reports, lambda i, text: f"[REPL output of turn {i + 1} omitted]"),
        (codes, lambda i, text: f"[code of turn {i + 1} omitted]"),
    ]
    for parts, replace in stages:
        for i in older:
            if total() <= budget_chars:
                break
            parts[i] = replace(i, parts[i])
    messages: list[Message] = []
    for code, report in zip(codes, reports, strict=True):
        messages.append({"role": "assistant", "content": code})
        messages.append({"role": "user", "content": report})
    return messages


def query_message(query: str, turn: int, max_turns: int, style: PromptStyle = "full") -> str:
    """The fresh user message of a child trajectory (roots use the env's `user_prompt`)."""
    if style == "compact":
        return compact_query_message(query, turn, max_turns)
    left = max_turns - turn
    return (
        f"Query: {query}\n\n"
        f"This is turn {turn + 1} of {max_turns} ({left} left, this one included). "
        f"Answer with one {OPEN_FENCE} block; end with FINAL(answer) or FINAL_VAR(name)."
    )


def compact_query_message(query: str, turn: int, max_turns: int) -> str:
    """The compact style's fresh message: the query and the turn, nothing the model must skip."""
    return f"Query: {query}\nTurn {turn + 1} of {max_turns}."


def turn_messages(
    system: str, turns: Sequence[Turn], fresh_query: str, *, budget_chars: int
) -> list[Message]:
    """The whole prompt of the next turn: system, fitted history, fresh query message last."""
    messages: list[Message] = [{"role": "system", "content": system}]
    messages += history_messages(turns, budget_chars)
    if turns:
        last = messages[-1]
        last["content"] = f"{last['content']}\n\n{fresh_query}"
    else:
        messages.append({"role": "user", "content": fresh_query})
    return messages


# ---------------------------------------------------------------------------------------------
# Plain LM calls (rlm_query at the depth limit in "lm" mode)
# ---------------------------------------------------------------------------------------------

PLAIN_CALL_SYSTEM = (
    "You answer a sub-question from another assistant. Reply with the answer only, in plain "
    "text, without code and without restating the question."
)


_DECODE_BUDGET_BYTES = 64 << 20
"""What decoding a still-encoded context to show it in a plain call may cost the trainer."""
_CONTAINER_HEADERS = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
"""msgpack's map and array headers: each decodes to a container object of 56+ bytes."""


def _decoded_size_bound(encoded: bytes) -> int:
    """An upper bound on what `encoded` decodes to: a pointer (8 bytes) per byte, and 64 more
    per byte that can start a map or an array (string bytes counted too: a bound, cheap)."""
    containers = len(encoded) - len(encoded.translate(None, _CONTAINER_HEADERS))
    return 8 * len(encoded) + 64 * containers


def _context_text(context: Any) -> str:
    """What a plain call shows of a context: a string as is, anything else as its repr; one
    still encoded by a worker (`msgspec.Raw`) is decoded only within `_DECODE_BUDGET_BYTES`
    (nesting multiplies what msgpack decodes to: some 60x for empty lists)."""
    if isinstance(context, msgspec.Raw):
        encoded = bytes(context)
        is_string = bool(encoded) and (
            0xA0 <= encoded[0] <= 0xBF or encoded[0] in (0xD9, 0xDA, 0xDB)
        )
        if not is_string and _decoded_size_bound(encoded) > _DECODE_BUDGET_BYTES:
            return f"[a context of {len(encoded)} encoded bytes, too large to show without a REPL]"
        try:
            context = msgspec.msgpack.decode(encoded)
        except (msgspec.DecodeError, RecursionError) as exc:
            return f"[a context that could not be decoded: {exc}]"
    return context if isinstance(context, str) else repr(context)


def plain_call_messages(prompt: str, context: Any | None, *, context_chars: int) -> list[Message]:
    """A single-turn prompt: the question and, when one was passed, the context cut to size."""
    content = prompt
    if context is not None:
        content += "\n\nContext:\n" + clip_text(_context_text(context), context_chars)
    return [
        {"role": "system", "content": PLAIN_CALL_SYSTEM},
        {"role": "user", "content": content},
    ]
