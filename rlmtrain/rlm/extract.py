"""Which code of a completion runs: the first ```python block, and nothing else.

The rule, stated once here and quoted verbatim into the system prompt (`CODE_BLOCK_RULE`), is:
the block opens with a line that is exactly ```python and closes at the next line that is
exactly ``` (surrounding spaces allowed); text before and after it is ignored, and any later
block is never run. Public RLM code tells the model "the first block runs" and then runs the last
one, or scans the whole completion, fences and prose included, for FINAL with a regex; here the
prompt and this module cannot disagree because the prompt quotes this module. Whether FINAL
ran is decided by the REPL executing it, never by looking at text.

Stopping. A turn ends at the closing fence: the engine is given `STOP_STRINGS`, "\\n```\\n", the
closing fence with its line break. It cannot match the opening fence (```python carries a word
after the backticks) and it needs no end-of-text: a model that writes the fence and then its end
token stops on the token instead. Engines differ in whether the matched stop string is in the
returned ids (vLLM keeps the token that completed it; others trim it), so an unterminated final
block is read by the engine's finish reason:

- finish "stop": the stop string was trimmed, the block is complete: it runs;
- finish "length" (or "abort"): the block was cut off mid-code: nothing runs, and the model is
  told so, since half a program may well run and do half of something.

A completion with no block gets a feedback message as the turn's output, not a crash; the
trajectory goes on and the turn still counts.
"""

from __future__ import annotations

import re

import msgspec

from rlmtrain.rlm.generation import EngineFinishReason

__all__ = [
    "CODE_BLOCK_RULE",
    "CLOSE_FENCE",
    "OPEN_FENCE",
    "STOP_STRINGS",
    "Extraction",
    "extract_code",
]

OPEN_FENCE = "```python"
CLOSE_FENCE = "```"
STOP_STRINGS = ["\n" + CLOSE_FENCE + "\n"]

CODE_BLOCK_RULE = (
    f"Reply with exactly one code block: a line {OPEN_FENCE}, your code, then a line "
    f"{CLOSE_FENCE}. Only the first such block runs; text outside it is ignored and any later "
    "block never runs."
)

_OPEN = re.compile(r"^[ \t]*```python[ \t]*$", re.MULTILINE)
_CLOSE = re.compile(r"^[ \t]*```[ \t]*$", re.MULTILINE)


class Extraction(msgspec.Struct, kw_only=True, frozen=True):
    code: str
    """The code to run; '' when nothing runs."""
    feedback: str
    """'' when code runs; otherwise the message shown to the model as this turn's output."""


def extract_code(text: str, *, finish_reason: EngineFinishReason = "stop") -> Extraction:
    """The code of the first ```python block of `text`, by the rule in the module docstring.

    `finish_reason` is the engine's ("stop" | "length" | "abort"): it decides whether a block
    left open at the end of the text was stopped at its fence or cut off.
    """
    opened = _OPEN.search(text)
    if opened is None:
        return Extraction(
            code="",
            feedback=f"[no code ran: the reply had no {OPEN_FENCE} block. {CODE_BLOCK_RULE}]",
        )
    body_start = opened.end() + 1  # the line break after the opening fence
    closed = _CLOSE.search(text, min(body_start, len(text)))
    if closed is not None:
        code = text[body_start : closed.start()]
    elif finish_reason == "stop":
        code = text[body_start:]
    else:
        return Extraction(
            code="",
            feedback=(
                "[no code ran: the reply ended inside the code block before its closing "
                f"{CLOSE_FENCE} (the turn's token limit was reached). Write shorter code.]"
            ),
        )
    code = code.rstrip("\n")
    if not code.strip():
        return Extraction(code="", feedback=f"[no code ran: the {OPEN_FENCE} block was empty.]")
    return Extraction(code=code, feedback="")
