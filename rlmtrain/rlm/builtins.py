"""The names a REPL worker puts in front of model code, and how it captures what the code prints.

Runs inside the jailed worker. `Toolbox` holds `FINAL`, `FINAL_VAR`, `rlm_query`,
`rlm_query_batched`, the environment's tools and `context`; the worker writes them back into
the model's globals before every exec, so rebinding `FINAL = None` lasts one exec at most.

A final answer exists only when FINAL or FINAL_VAR runs: the text of the completion is never
searched (a FINAL inside a string or comment means nothing). FINAL records the answer and stops
the exec by raising `FinalAnswer`, a BaseException so that model code's `except Exception` does
not swallow it; the first answer of an exec wins. FINAL_VAR of a name that does not exist raises
NameError: the model sees an error and the trajectory goes on.

`rlm_query` / `rlm_query_batched` hand prompts to an `ask` callable (the worker's channel to the
trainer) and block until the answers come back; only one query is in flight at a time, and
only while an exec runs (a thread left behind by an earlier exec gets an error, not a channel).

These rules hold for code that uses the REPL as documented. Model code owns its worker's
interpreter, so code that reaches past them (the worker's socket, this toolbox, the builtins
snapshot) can forge them for its own session: report a final answer without calling FINAL, keep
a patched tool for its later execs. That crosses no boundary (the jail holds, and the session is
its own), and the trainer trusts nothing a worker says about itself but the text it returns:
tool calls are read off the code the trainer sent (`rlmtrain.rlm.code_calls`).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any

from rlmtrain.rlm.protocol import MAX_PROMPTS_PER_QUERY

__all__ = ["FinalAnswer", "OutputCapture", "Toolbox", "clip_text"]


def cut_note(count: int) -> str:
    """What stands between the head and the tail of a clipped text: the one marker the model
    sees for a cut, whether the REPL or the prompt builder made it."""
    return f"\n... [{count} characters cut] ...\n"


def clip_text(text: str, limit: int) -> str:
    """Keep the head and tail of text (limit chars in all) and say how much was cut between."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}{cut_note(len(text) - limit)}{text[len(text) - tail :]}"


class OutputCapture(io.TextIOBase):
    """sys.stdout and sys.stderr during an exec: keeps the first and last `limit // 2` chars and
    counts the rest, so a 100 MB print costs no more memory than a short one."""

    def __init__(self, limit: int):
        self._head_limit = limit // 2
        self._tail_limit = limit - self._head_limit
        self._head: list[str] = []
        self._head_len = 0
        self._tail = ""
        self._total = 0
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        n = len(s)
        with self._lock:
            self._total += n
            room = self._head_limit - self._head_len
            if room > 0:
                self._head.append(s[:room])
                self._head_len += min(room, len(s))
                s = s[room:]
            if s:
                self._tail = (self._tail + s[-self._tail_limit :])[-self._tail_limit :]
        return n

    def getvalue(self) -> str:
        with self._lock:
            head = "".join(self._head)
            cut = self._total - len(head) - len(self._tail)
            if cut <= 0:
                return head + self._tail
            return f"{head}{cut_note(cut)}{self._tail}"


class FinalAnswer(BaseException):
    """Raised by FINAL / FINAL_VAR to stop the exec once the answer is recorded."""


AskFn = Callable[[list[str], list[Any]], list[str]]


class Toolbox:
    """The builtins and tools of one worker. It records nothing about the calls made: what a
    worker says of its own run is model code's to forge, so the trainer reads the tool calls off
    the code it sent (`rlmtrain.rlm.code_calls`)."""

    def __init__(
        self, *, tools: dict[str, Callable], context: Any, ask: AskFn, model_globals: dict
    ):
        self._ask = ask
        self._globals = model_globals
        self._query_lock = threading.Lock()
        self._exec_running = False
        self.final: str | None = None
        self.names: dict[str, Any] = dict(tools)
        self.names.update(
            context=context,
            FINAL=self.FINAL,
            FINAL_VAR=self.FINAL_VAR,
            rlm_query=self.rlm_query,
            rlm_query_batched=self.rlm_query_batched,
        )

    # ---- exec bookkeeping (called by the worker) --------------------------------------------

    def begin_exec(self) -> None:
        self.final = None
        self._globals.update(self.names)
        with self._query_lock:
            self._exec_running = True

    def end_exec(self) -> None:
        with self._query_lock:
            self._exec_running = False

    # ---- the builtins model code sees -------------------------------------------------------

    def FINAL(self, answer: Any) -> None:
        """End the trajectory with `answer` (converted to str)."""
        if self.final is None:
            self.final = str(answer)
        raise FinalAnswer

    def FINAL_VAR(self, name: str) -> None:
        """End the trajectory with the value of the REPL variable called `name`."""
        if not isinstance(name, str):
            raise TypeError(
                f"FINAL_VAR takes the variable's name as a string, e.g. FINAL_VAR('answer'); "
                f"got {type(name).__name__}"
            )
        if name not in self._globals:
            raise NameError(f"FINAL_VAR: no variable named {name!r} in the REPL; assign it first")
        self.FINAL(self._globals[name])

    def rlm_query(self, prompt: str, context: Any = None) -> str:
        """Ask a sub-model `prompt` about `context` (default: this REPL's context); returns
        its answer."""
        if not isinstance(prompt, str):
            raise TypeError(f"rlm_query: prompt must be a str, got {type(prompt).__name__}")
        return self._query([prompt], [context])[0]

    def rlm_query_batched(
        self, prompts: list[str], context_list: list[Any] | None = None
    ) -> list[str]:
        """Ask several sub-queries concurrently; returns their answers in order."""
        prompts = list(prompts)
        if not all(isinstance(p, str) for p in prompts):
            raise TypeError("rlm_query_batched: prompts must be a list of str")
        contexts = [None] * len(prompts) if context_list is None else list(context_list)
        if len(contexts) != len(prompts):
            raise ValueError(
                f"rlm_query_batched: {len(prompts)} prompts but {len(contexts)} contexts; "
                "pass one context per prompt or none"
            )
        if len(prompts) > MAX_PROMPTS_PER_QUERY:
            raise ValueError(
                f"rlm_query_batched: {len(prompts)} prompts, over the limit of "
                f"{MAX_PROMPTS_PER_QUERY} per call"
            )
        if not prompts:
            return []
        return self._query(prompts, contexts)

    def _query(self, prompts: list[str], contexts: list[Any]) -> list[str]:
        with self._query_lock:
            if not self._exec_running:
                raise RuntimeError("rlm_query can only be called while the REPL runs your code")
            return self._ask(prompts, contexts)
