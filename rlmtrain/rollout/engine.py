"""The Engine contract: token ids in, sampled token ids and their log-probs out.

Every engine (native, vLLM, simulated) implements `Engine`; the scheduler and the RLM runtime see
nothing else. The request and result types live in `rlm.generation` (the runtime knows no engine)
and are re-exported here as the contract.

Log-probs. An engine returns, for each sampled token, its log-prob under the temperature-scaled
full-vocabulary distribution `log_softmax(logits / temperature)`: exactly what the trainer
computes with `kernels.fused_linear_logprob(..., temperature=T)`, so pi_old / pi_sampler compares
like with like. Top-p or top-k sampling draws from a truncated, renormalised distribution whose
log-probs are higher by log(1 / kept mass); we still return the untruncated log-prob, because the
trainer can only compute that one. The ratio the trainer sees is then biased (tokens are drawn
from a distribution other than the one the log-probs describe) and truncated importance sampling
does not correct it; keep top_p = 1 and top_k = 0 for on-policy RL.

Stopping. A completion ends after a stop token id (kept as the last token), after the decoded
completion first contains a stop string (the token completing it is kept, as vLLM does), or at
`max_new_tokens`. `StopCheck` is that rule for the engines that sample themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from rlmtrain.rlm.generation import Completion, EngineFinishReason, GenerateFn, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "Completion",
    "Engine",
    "EngineFinishReason",
    "EngineStats",
    "GenerateFn",
    "SamplingParams",
    "StopCheck",
]


class EngineStats(msgspec.Struct, kw_only=True):
    """Counters since the engine started; the scheduler samples them to plot occupancy."""

    running: int = 0
    """Sequences in the batch now."""
    waiting: int = 0
    """Requests queued inside the engine (admission full: batch size or KV-cache budget)."""
    max_batch_size: int = 0
    requests_done: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of the admitted requests."""
    prefill_tokens: int = 0
    """Prompt tokens the prefill computed: prompt_tokens less the prefix-cache hits (native
    engine; 0 from engines that do not count it)."""
    prefix_cache_hit_tokens: int = 0
    """Prompt tokens served from the prefix cache instead of computed (native engine)."""
    generated_tokens: int = 0
    steps: int = 0
    """Forward steps run (a step prefills newly admitted requests and decodes the running ones)."""
    batch_slots_used: int = 0
    """Sum over steps of sequences decoded in that step; / (steps * max_batch_size) = occupancy."""
    busy_s: float = 0.0
    """Seconds spent inside steps; / wall time = how busy the engine was."""
    weight_version: int = 0
    """How many weight updates have been applied."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine serving many concurrent `generate` calls (continuous batching)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """One completion of `prompt_ids`; cancelling the call frees its batch slot."""
        ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy (Hugging Face name, tensor) pairs into the live model between steps; requests
        in flight continue with the new weights (their cached keys and values are kept)."""
        ...

    def stats(self) -> EngineStats: ...

    async def close(self) -> None:
        """Stop the step loop; requests still in flight end with finish_reason "abort"."""
        ...


class StopCheck:
    """Whether a growing completion has hit a stop token or a stop string.

    Checking is O(1) per token: a new token can only complete a stop string if its own text
    holds that string's last character (or is a partial character, U+FFFD), which the text of
    the token alone tells (memoised per token id in `pieces`, shared by an engine's requests);
    only then are the last few tokens decoded together and searched. Since the check runs after
    every token, a stop string is found at the token that completes it.
    """

    def __init__(
        self,
        params: SamplingParams,
        decode: Callable[[Sequence[int]], str] | None,
        pieces: dict[int, str] | None = None,
    ) -> None:
        if params.stop_strings and decode is None:
            raise ValueError(
                f"stop strings {params.stop_strings!r} need a tokenizer to decode completions"
            )
        self._stop_ids = frozenset(params.stop_token_ids)
        self._strings = params.stop_strings
        self._last_chars = frozenset(s[-1] for s in self._strings if s) | {"\ufffd"}
        self._decode = decode
        self._pieces = {} if pieces is None else pieces
        # A token decodes to at least one character except for special tokens and partial UTF-8
        # sequences; a margin of 8 tokens covers both in practice.
        self._window = max((len(s) for s in self._strings), default=0) + 8
        self._max_new_tokens = params.max_new_tokens

    def __call__(self, token_ids: Sequence[int]) -> EngineFinishReason | None:
        """The finish reason after the last token of `token_ids` was appended, or None."""
        last = token_ids[-1]
        if last in self._stop_ids:
            return "stop"
        if self._strings and self._may_complete(last):
            tail = self._decode(token_ids[-self._window :])
            if any(s in tail for s in self._strings):
                return "stop"
        if len(token_ids) >= self._max_new_tokens:
            return "length"
        return None

    def _may_complete(self, token: int) -> bool:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._decode([token])
        return any(char in piece for char in self._last_chars)
