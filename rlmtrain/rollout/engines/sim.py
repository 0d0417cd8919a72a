"""A simulated engine: scripted tokens, a latency model, the real continuous-batching loop.

`SimEngine` runs the same step loop as the native engine (`rollout.batching`) but a step costs

    step_s = a + b * sequences_in_step + c * prefill_tokens_in_step

of `asyncio.sleep` instead of a forward pass, so the scheduler can be tested and benchmarked
against an engine that behaves like a GPU server (a fixed per-step cost that batching amortises,
a per-sequence cost, prefill proportional to prompt tokens) without a model.

What a request generates is decided when it is admitted, by a script: a function of the prompt
ids (and the sampling params) returning the token ids the "model" would sample. The engine emits
them one per step and stops them as any engine would (stop token, stop string, max_new_tokens);
a script that runs out before a stop emits `eos_id` from then on. Log-probs are a fixed function
of the token and its position. `text_script` adapts a prompt-text -> reply-text function through
a tokenizer, which is how tests script tree shapes; `hashed_script` is the default, a
deterministic pseudo-random completion per prompt.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from rlmtrain.rollout.batching import BatchingEngine, Request
from rlmtrain.rollout.engine import SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["LatencyModel", "Script", "SimEngine", "hashed_script", "text_script"]

Script = Callable[[list[int], SamplingParams], Sequence[int]]
"""script(prompt_ids, params) -> the token ids the simulated model samples for this prompt."""


class LatencyModel(msgspec.Struct, kw_only=True, frozen=True):
    """Seconds per step: a + b * sequences + c * prefill tokens."""

    a: float = 0.0
    """Fixed cost of a step (weights read once per step, kernel launches)."""
    b: float = 0.0
    """Cost per sequence in the step (its KV-cache reads)."""
    c: float = 0.0
    """Cost per prompt token prefilled in the step."""
    cached_prefix_tokens: int = 0
    """Leading prompt tokens of every request served from a prefix cache, not prefilled
    (vLLM's prefix caching of the system prompt every turn shares)."""

    def prefill_tokens(self, prompt_tokens: int) -> int:
        return max(prompt_tokens - self.cached_prefix_tokens, 0)

    def step_s(self, sequences: int, prefill_tokens: int) -> float:
        return self.a + self.b * sequences + self.c * prefill_tokens


class _TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def text_script(tokenizer: _TextTokenizer, reply: Callable[[str], str]) -> Script:
    """A script from `reply(prompt text) -> completion text` (stop strings included by the
    reply; the engine appends nothing: end the reply with the stop token's text or let the
    engine's `eos_id` end it)."""

    def script(prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return tokenizer.encode(reply(tokenizer.decode(prompt_ids)))

    return script


def hashed_script(vocab_size: int, *, min_tokens: int = 1, max_tokens: int = 64) -> Script:
    """Pseudo-random tokens and length seeded by the prompt (and the request's seed)."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")

    def script(prompt_ids: list[int], params: SamplingParams) -> list[int]:
        key = zlib.crc32(repr((prompt_ids, params.seed)).encode())
        rng = random.Random(key)
        n = rng.randint(min_tokens, max_tokens)
        return [rng.randrange(vocab_size) for _ in range(n)]

    return script


_TIMER_SLACK_S = 0.002


def _logprob(token: int, position: int) -> float:
    return -0.05 - ((token * 31 + position * 7) % 97) / 50.0


class SimEngine(BatchingEngine):
    """Scripted completions at modelled latency; see the module docstring."""

    def __init__(
        self,
        *,
        script: Script,
        eos_id: int,
        latency: LatencyModel | None = None,
        max_batch_size: int = 32,
        kv_budget_tokens: int = 1 << 20,
        max_prefill_tokens: int | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        super().__init__(
            max_batch_size=max_batch_size,
            kv_budget_tokens=kv_budget_tokens,
            max_prefill_tokens=max_prefill_tokens,
            decode=decode,
        )
        self.script = script
        self.eos_id = eos_id
        self.latency = latency or LatencyModel()
        self._clock = 0.0
        self.requests_seen: list[tuple[list[int], SamplingParams]] = []
        """Every admitted request's prompt and params, in admission order (for tests)."""

    async def _step(self, admitted: list[Request], running: list[Request]) -> None:
        prefill = sum(self.latency.prefill_tokens(len(r.prompt_ids)) for r in admitted)
        # Steps run back to back on a modelled clock: a step that the event loop's timer ended
        # late (uvloop's resolution is 1 ms) makes the next one end earlier, so timer slack does
        # not add up over thousands of steps. After an idle gap the clock restarts from now.
        now = time.perf_counter()
        start = self._clock if now - self._clock < _TIMER_SLACK_S else now
        done_at = self._clock = start + self.latency.step_s(len(admitted) + len(running), prefill)
        for request in admitted:
            request.state = list(self.script(request.prompt_ids, request.params))
            self.requests_seen.append((request.prompt_ids, request.params))
        for request in [*admitted, *running]:
            position = len(request.token_ids)
            planned: list[int] = request.state
            token = planned[position] if position < len(planned) else self.eos_id
            request.append(token, _logprob(token, position))
        # The bookkeeping above overlaps the modelled step, as a GPU engine's CPU work overlaps
        # its kernels: a step lasts step_s, not step_s plus Python time (unless Python is slower).
        await asyncio.sleep(max(done_at - time.perf_counter(), 0.0))

    def _release(self, request: Request) -> None:
        request.state = None

    async def _apply_weights(self, named_tensors: list[tuple[str, Tensor]]) -> None:
        # No model to copy into; the update only counts in stats().weight_version.
        return None
