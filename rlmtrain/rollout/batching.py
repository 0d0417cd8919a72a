"""Continuous batching: one step loop that admits, steps and retires sequences.

`BatchingEngine` is the part the native and simulated engines share. Requests wait in a FIFO
queue (priority is the scheduler's job, in front of the engine); a single background task runs
steps, and between two steps it

1. applies pending weight updates, so a step never sees half-copied weights;
2. drops sequences whose `generate` call was cancelled, releasing their cache;
3. admits queued requests in order while the batch has room (`max_batch_size`) and the KV budget
   holds each admitted sequence's worst case (prompt + max_new_tokens). Reserving the worst case
   means a running sequence never runs out of cache, so nothing is ever preempted or recomputed;
   the price is admitting fewer sequences when most completions stop early. A step admits at most
   `max_prefill_tokens` of prompt to compute (but always one request) so that a burst of long
   prompts does not stall the sequences already decoding for one giant prefill. How much cache
   and prefill a request costs is the engine's to say (`_admission_round`): by default its whole
   prompt and worst case, less for the native engine where a prefix is cached;
4. runs one step (`_step`): newly admitted sequences are prefilled and get their first token,
   running ones get one more token;
5. retires every sequence that hit a stop token, stop string or max_new_tokens at once and
   resolves its `generate` call.

Subclasses implement `_step`, `_release` and `_apply_weights`; a step may run in a thread (the
native engine does, so the event loop stays responsive during model compute).
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rlmtrain.rollout.engine import Completion, EngineStats, SamplingParams, StopCheck

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["BatchingEngine", "EngineClosed", "Request"]


class EngineClosed(RuntimeError):
    """`generate` or `update_weights` on an engine after `close()`."""


class Request:
    """One sequence in the engine: its prompt, what it has generated, how it ends."""

    __slots__ = (
        "cancelled",
        "finished",
        "future",
        "logprobs",
        "params",
        "prompt_ids",
        "reserved_tokens",
        "seq_id",
        "state",
        "stop",
        "token_ids",
        "weight_versions",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: StopCheck,
        future: asyncio.Future[Completion],
    ) -> None:
        self.seq_id = seq_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.stop = stop
        self.future = future
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.weight_versions: list[int] = []
        """The engine's weight version at each appended token (set by the step loop)."""
        self.reserved_tokens = 0
        """KV-cache tokens held back for this sequence's worst case while it runs."""
        self.cancelled = False
        self.finished: str | None = None
        """The finish reason once the last appended token ended the sequence."""
        self.state: Any = None
        """Engine-specific per-sequence data (sampling generator, scripted tokens)."""

    def append(self, token: int, logprob: float) -> None:
        """Record a sampled token and check the stop conditions at once, inside the engine's
        step, so that the per-token check overlaps the step's device work."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.finished = self.stop(self.token_ids)


class BatchingEngine(abc.ABC):
    """The step loop and the admission policy; see the module docstring."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        kv_budget_tokens: int,
        max_prefill_tokens: int | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if kv_budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens must be >= 1, got {kv_budget_tokens}")
        self.max_batch_size = max_batch_size
        self.kv_budget_tokens = kv_budget_tokens
        self.max_prefill_tokens = max_prefill_tokens or kv_budget_tokens
        self._decode = decode
        self._pieces: dict[int, str] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._reserved = 0
        self._pending_weights: list[tuple[list[tuple[str, Tensor]], asyncio.Future[None]]] = []
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self._stats = EngineStats(max_batch_size=max_batch_size)

    # -- subclass hooks ---------------------------------------------------------------------

    @abc.abstractmethod
    async def _step(self, admitted: list[Request], running: list[Request]) -> None:
        """Prefill `admitted` and decode `running`: append one token and its log-prob to each."""

    @abc.abstractmethod
    def _release(self, request: Request) -> None:
        """Free whatever the sequence holds (cache pages); it will not be stepped again."""

    @abc.abstractmethod
    async def _apply_weights(self, named_tensors: list[tuple[str, Tensor]]) -> None:
        """Copy the tensors into the model; called between steps only."""

    def _admission_round(self) -> Callable[[Request], int | None]:
        """Start one round of admissions. The function returned is called on the queued
        requests in order until it refuses one (the round then ends, as it may for other
        reasons after any call): it returns the prompt tokens the request's prefill computes, or
        None when the request's worst case does not fit in the KV budget beside the running
        sequences and those it accepted before in this round."""
        reserved = self._reserved

        def take(request: Request) -> int | None:
            nonlocal reserved
            if reserved + request.reserved_tokens > self.kv_budget_tokens:
                return None
            reserved += request.reserved_tokens
            return len(request.prompt_ids)

        return take

    def _reservation(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """KV-cache tokens a sequence may need at most: its prompt and every new token."""
        return len(prompt_ids) + params.max_new_tokens

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request this engine can never serve."""
        needed = self._reservation(prompt_ids, params)
        if needed > self.kv_budget_tokens:
            raise ValueError(
                f"request of {len(prompt_ids)} prompt + {params.max_new_tokens} new tokens "
                f"exceeds the engine's KV budget of {self.kv_budget_tokens} tokens"
            )

    # -- the Engine protocol ----------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        if self._closed:
            raise EngineClosed("generate() on a closed engine")
        if not prompt_ids:
            raise ValueError("generate() needs a non-empty prompt")
        self._check_request(prompt_ids, params)
        future = asyncio.get_running_loop().create_future()
        request = Request(
            next(self._ids),
            list(prompt_ids),
            params,
            StopCheck(params, self._decode, self._pieces),
            future,
        )
        request.reserved_tokens = self._reservation(request.prompt_ids, params)
        self._waiting.append(request)
        self._kick()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
            self._kick()
            raise

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        if self._closed:
            raise EngineClosed("update_weights() on a closed engine")
        done = asyncio.get_running_loop().create_future()
        self._pending_weights.append((list(named_tensors), done))
        self._kick()
        await done

    def stats(self) -> EngineStats:
        self._stats.running = sum(not r.cancelled for r in self._running)
        self._stats.waiting = len(self._waiting)
        return self._stats

    async def wait_idle(self) -> None:
        """Return once no request is queued or running (cancelled ones released included)."""
        while self._waiting or self._running or self._pending_weights:
            self._idle.clear()
            self._kick()
            await self._idle.wait()

    async def close(self) -> None:
        self._closed = True
        if self._loop_task is not None:
            # Let the loop finish the step it is in (a step thread may be using the cache).
            self._wake.set()
            await self._loop_task
        for request in self._running:
            self._free(request)
            self._finish(request, "abort")
        for request in self._waiting:
            self._finish(request, "abort")
        self._running.clear()
        self._waiting.clear()
        for _, done in self._pending_weights:
            if not done.done():
                done.set_exception(EngineClosed("the engine closed before the weight update"))
        self._pending_weights.clear()

    # -- the step loop ----------------------------------------------------------------------

    def _kick(self) -> None:
        if self._closed:
            return
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine")
        self._wake.set()

    async def _run(self) -> None:
        while not self._closed:
            await self._apply_pending_weights()
            self._drop_cancelled()
            admitted = self._admit()
            running = list(self._running)
            if not admitted and not running:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            began = time.perf_counter()
            try:
                await self._step(admitted, running)
            except Exception as exc:  # a failed step fails its requests, not the whole engine
                self._fail([*admitted, *running], exc)
                continue
            self._stats.busy_s += time.perf_counter() - began
            # A step appends one token to each of its requests, all under one weight version:
            # updates are applied between steps only.
            for request in (*admitted, *running):
                request.weight_versions.append(self._stats.weight_version)
            self._stats.steps += 1
            self._stats.batch_slots_used += len(admitted) + len(running)
            self._stats.generated_tokens += len(admitted) + len(running)
            self._stats.prompt_tokens += sum(len(r.prompt_ids) for r in admitted)
            self._running.extend(admitted)
            self._retire()

    async def _apply_pending_weights(self) -> None:
        while self._pending_weights:
            named, done = self._pending_weights.pop(0)
            try:
                await self._apply_weights(named)
            except Exception as exc:  # the caller gets the error; the loop serves on
                done.set_exception(exc)
            else:
                self._stats.weight_version += 1
                done.set_result(None)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._running if r.cancelled]:
            self._running.remove(request)
            self._free(request)

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        prefill = 0
        take = self._admission_round()
        while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
            request = self._waiting[0]
            computed = take(request)
            if computed is None or (admitted and prefill + computed > self.max_prefill_tokens):
                break
            self._waiting.popleft()
            self._reserved += request.reserved_tokens
            prefill += computed
            admitted.append(request)
        return admitted

    def _retire(self) -> None:
        still: list[Request] = []
        for request in self._running:
            if request.cancelled:
                self._free(request)
                continue
            if request.finished is None:
                still.append(request)
            else:
                self._free(request)
                self._finish(request, request.finished)
        self._running = still

    def _free(self, request: Request) -> None:
        self._reserved -= request.reserved_tokens
        self._release(request)

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        for request in requests:
            if request in self._running:
                self._running.remove(request)
            self._free(request)
            if not request.cancelled and not request.future.done():
                request.future.set_exception(exc)

    def _finish(self, request: Request, reason: str) -> None:
        if request.future.done():
            return
        self._stats.requests_done += 1
        request.future.set_result(
            Completion(
                token_ids=request.token_ids,
                logprobs=request.logprobs,
                finish_reason=reason,
                weight_versions=request.weight_versions,
            )
        )
