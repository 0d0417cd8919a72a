"""The engine-agnostic shape of one generation request and its result.

The RLM runtime asks for completions through a plain async function, `GenerateFn`, so that it
knows no engine and no torch (docs/architecture.md): the native engine, vLLM and the simulated
engine all adapt to it, and tests drive the agent with a scripted one. `rollout` re-exports these
types as the Engine contract.

Token ids go in and come out; nothing here decodes text. The completion's `token_ids` are the
ones the sampler drew, including the token that completed a stop string or was a stop token
(what vLLM does), and `logprobs` are the sampler's log-probs of exactly those tokens, so the
trainer can use them as pi_sampler without re-tokenising anything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec

from rlmtrain.config import ROLLOUT_DEFAULTS

__all__ = ["Completion", "EngineFinishReason", "GenerateFn", "SamplingParams"]

EngineFinishReason = Literal["stop", "length", "abort"]


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """How to sample one completion. Log-probs returned are those of this distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus mass; < 1 renormalises, which biases the trainer/sampler ratio."""
    top_k: int = 0
    """0 = no top-k cut."""
    max_new_tokens: int = ROLLOUT_DEFAULTS.max_new_tokens
    """Defaults to the config's `rollout.max_new_tokens`, where the limit is declared."""
    stop_token_ids: list[int] = []
    """Generation ends after any of these ids (end of turn / end of text)."""
    stop_strings: list[str] = []
    """Generation ends once the decoded completion contains one of these."""
    seed: int | None = None
    """Per-request sampling seed; None = the engine's own stream."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )


class Completion(msgspec.Struct, kw_only=True):
    """What the engine returned for one request."""

    token_ids: list[int]
    logprobs: list[float]
    """The sampler's log-prob of each token of `token_ids`; same length."""
    finish_reason: EngineFinishReason
    """stop: a stop token or string ended it; length: max_new_tokens reached; abort: the engine
    dropped the request (shutdown, weight update)."""
    weight_versions: list[int] = []
    """The engine's weight version (updates applied, `EngineStats.weight_version`) under which
    each token was sampled; same length, or empty from an engine that does not say. A request
    in flight across a weight update has tokens of both versions."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )
        if self.weight_versions and len(self.weight_versions) != len(self.token_ids):
            raise ValueError(
                f"Completion has {len(self.token_ids)} token ids but "
                f"{len(self.weight_versions)} weight versions"
            )


GenerateFn = Callable[[list[int], SamplingParams], Awaitable[Completion]]
"""`await generate(prompt_ids, params)`: one completion for one prompt."""
