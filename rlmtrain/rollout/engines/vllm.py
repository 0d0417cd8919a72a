"""vLLM behind the `Engine` contract: `AsyncLLM` in this process, token ids in and out.

vLLM does the continuous batching, paged attention and prefix caching; this adapter maps the
contract onto it:

- prompts go in as `TokensPrompt(prompt_token_ids=...)`, so no text is re-tokenised; the
  completion's `token_ids` are vLLM's, stop token or the token completing a stop string included
  (`include_stop_str_in_output`);
- log-probs: `logprobs=0` asks for the sampled token's log-prob only, and the engine is started
  with `logprobs_mode="processed_logprobs"`, i.e. after temperature scaling, as the contract
  requires (the default "raw_logprobs" is before temperature). vLLM's processed log-probs are
  also after top-k / top-p truncation, so with top_p < 1 or top_k > 0 they are the renormalised
  ones, unlike the native engine's (see `engine.py`); keep both off for RL;
- prefix caching is on (`enable_prefix_caching`): every turn's prompt starts with the same system
  prompt and a trajectory's history grows by appending;
- `update_weights` sends the named tensors (Hugging Face names, as `model.hf` writes them) to
  every worker with `collective_rpc`, where the model's own `load_weights` copies them in place
  (sharding them for tensor parallelism), then resets the prefix cache, whose blocks were computed
  under the old weights. The engine core runs the RPC between two steps, so requests in flight
  continue with the new weights, as on the native engine. Tensors travel pickled through vLLM's
  IPC: fine for small policies; large ones want CUDA-IPC or NCCL buckets;
- `sleep()` waits for the requests in flight to finish and holds new ones back before calling
  vLLM's `sleep(level)` (a child request reaching a half-woken engine during weight sync crashed
  public RLM trainers); `wake()` resumes them. Level 1 offloads the weights to CPU memory and
  drops the KV cache; level 2 drops the weights too (an `update_weights` must follow).

Import this module only when `rlmtrain.devices.HAS_VLLM` is true.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rlmtrain.devices import HAS_VLLM, BackendUnavailable
from rlmtrain.rollout.engine import Completion, EngineStats, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

    from rlmtrain.config import Config

if not HAS_VLLM:
    raise BackendUnavailable("rlmtrain.rollout.engines.vllm needs CUDA and the vllm package")

from vllm import SamplingParams as VLLMSamplingParams  # noqa: E402
from vllm import TokensPrompt  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

__all__ = ["VLLMEngine", "engine_args"]


def engine_args(config: Config, **overrides: Any) -> AsyncEngineArgs:
    """The `AsyncEngineArgs` a run's config implies (checkpoint `model.hf_dir`)."""
    if not config.model.hf_dir:
        raise BackendUnavailable(
            "rollout.engine='vllm' serves a Hugging Face checkpoint: set model.hf_dir "
            "(save a random-init model with rlmtrain.model.save_hf first if needed)"
        )
    rollout = config.rollout
    args: dict[str, Any] = {
        "model": config.model.hf_dir,
        "dtype": config.model.dtype,
        "seed": config.train.seed,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "max_num_seqs": rollout.max_batch_size,
        "max_model_len": rollout.max_prompt_tokens + rollout.max_new_tokens,
        "enable_sleep_mode": True,
    }
    if config.model.tokenizer not in ("", "byte"):
        args["tokenizer"] = config.model.tokenizer
    args.update(overrides)
    return AsyncEngineArgs(**args)


def _load_weights(worker: Any, named: list[tuple[str, Tensor]]) -> None:
    """Runs inside each vLLM worker: copy the tensors into its model in place."""
    worker.model_runner.model.load_weights(weights=named)


class VLLMEngine:
    """The `Engine` contract over a running `AsyncLLM` (see the module docstring)."""

    def __init__(self, llm: AsyncLLM, *, max_batch_size: int) -> None:
        self.llm = llm
        self._stats = EngineStats(max_batch_size=max_batch_size)
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._awake = asyncio.Event()
        self._awake.set()
        self._weights = asyncio.Lock()

    @classmethod
    def from_config(cls, config: Config, **overrides: Any) -> VLLMEngine:
        llm = AsyncLLM.from_engine_args(engine_args(config, **overrides))
        return cls(llm, max_batch_size=config.rollout.max_batch_size)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        await self._awake.wait()
        request = VLLMSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings),
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            seed=params.seed,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._in_flight += 1
        self._drained.clear()
        final = None
        try:
            async for output in self.llm.generate(
                TokensPrompt(prompt_token_ids=list(prompt_ids)), request, uuid.uuid4().hex
            ):
                final = output
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()
        sample = final.outputs[0]
        token_ids = list(sample.token_ids)
        logprobs = [
            float(step[token].logprob)
            for step, token in zip(sample.logprobs, token_ids, strict=True)
        ]
        reason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
        self._stats.requests_done += 1
        self._stats.prompt_tokens += len(prompt_ids)
        self._stats.generated_tokens += len(token_ids)
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=reason)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        named = [(name, tensor.detach().cpu()) for name, tensor in named_tensors]
        async with self._weights:
            await self.llm.collective_rpc(_load_weights, args=(named,))
            await self.llm.reset_prefix_cache()
        self._stats.weight_version += 1

    def stats(self) -> EngineStats:
        self._stats.running = self._in_flight
        return self._stats

    async def sleep(self, level: int = 1) -> None:
        """Hold new requests, let those in flight finish, then free the GPU memory."""
        self._awake.clear()
        await self._drained.wait()
        await self.llm.sleep(level=level)

    async def wake(self) -> None:
        await self.llm.wake_up()
        self._awake.set()

    async def close(self) -> None:
        self.llm.shutdown()
