"""The native engine: our Transformer behind continuous batching, on CPU or CUDA.

Each step of the shared loop (`rollout.batching`) prefills the newly admitted prompts as one
packed batch and decodes every running sequence by one token over the paged KV cache
(`model.kv_cache`), then samples. Steps run in a single worker thread: torch releases the GIL
inside its kernels, so the event loop keeps serving the scheduler and the REPL pipes while the
model computes, and one thread keeps steps strictly ordered.

Sampling is per request and independent of batching: logits are computed in fp32 from the final
hidden state and `lm_head_weight`, scaled by the request's temperature, and the token is drawn
with the request's own `torch.Generator` (seeded from `SamplingParams.seed`, or from the engine's
seed stream when it is None), so a request samples the same tokens alone or among 63 others.
top_k = 1 is greedy (argmax). The log-prob returned is that of the temperature-scaled full
distribution, as `engine.py` specifies.

Weight updates are applied by the step loop between two steps, so no step reads half-copied
weights and no queued or running request is dropped; sequences in flight keep the keys and values
they cached under the old weights (as vLLM does on an in-place update) and continue with the new.
An engine over a model built with storage and no values (`for_sync`: a trainer's, which sends
every weight before its first rollout) refuses requests until each parameter has arrived.

Prefix caching (on unless `prefix_caching=False`): every turn's prompt starts with the same
system prompt (~5.5k byte tokens for the evidence env) and repeats the trajectory's history, so
the KV cache (`kv_cache.py`) shares the full pages of prompt prefixes it already holds, by chained
page digest, and the prefill computes only the rest. Admission counts what that saves: a request
costs the free pages its admission takes (new pages, plus cached pages nobody holds that it
revives) plus the pages its worst case may still grow into, against the cache's free pages less
what the running sequences may still grow into; so running sequences never hit `CacheFull`, and
an evicted sequence's shared pages stay with the sequences reading them. `max_prefill_tokens`
limits the tokens actually computed. On the CPU the sampled tokens and their log-probs are the
same bits with the cache or without it, alone or in any batch (`model.paged_attention`); on a
GPU they agree up to the last bits the kernels' shape-dependent choices leave. A weight
update resets the prefix cache: keys and values cached under the old weights are not shared with
requests admitted after it.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlmtrain.model.hf import load_hf_tensors, named_hf_tensors
from rlmtrain.model.kv_cache import KVCache, decode, prefill
from rlmtrain.model.paged_attention import linear_min_rows
from rlmtrain.model.transformer import Transformer
from rlmtrain.rollout.batching import BatchingEngine, Request
from rlmtrain.rollout.engine import Completion, SamplingParams

__all__ = ["NativeEngine"]


class NativeEngine(BatchingEngine):
    """Continuous batching over `model` with a paged KV cache of `kv_cache_tokens` tokens.

    decode: the tokenizer's `decode`, needed only for requests with stop strings.
    max_prefill_tokens: prompt tokens computed per step at most (one request is always admitted).
    prefix_caching: share cached full prompt pages between requests (False: every prompt is
    prefilled whole, for comparison).
    seed: the stream that seeds requests whose `SamplingParams.seed` is None.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_batch_size: int = 32,
        kv_cache_tokens: int = 65536,
        page_size: int = 16,
        max_prefill_tokens: int | None = 4096,
        decode: Callable[[Sequence[int]], str] | None = None,
        seed: int = 0,
        prefix_caching: bool = True,
    ) -> None:
        cache = KVCache.for_model(
            model, kv_cache_tokens, page_size=page_size, prefix_caching=prefix_caching
        )
        super().__init__(
            max_batch_size=max_batch_size,
            kv_budget_tokens=cache.num_pages * cache.page_size,
            max_prefill_tokens=max_prefill_tokens,
            decode=decode,
        )
        self.model = model.eval()
        self.cache = cache
        self.device = model.embed_tokens.weight.device
        self._head = self._fp32_head()
        self._seeds = random.Random(seed)
        # Hugging Face names of the parameters no update has filled yet (`for_sync`).
        self._unfilled: set[str] = set()
        # On a CPU the engine's thread computes with one intra-op thread. A second OpenMP team
        # beside the trainer's (same process, same cores) makes libgomp stop spinning between
        # parallel regions, and every training step after the first rollout ran 1.8x slower
        # (0.35 -> 0.62 s per SFT step of the default, measured on 2 cores); the rollouts, bound
        # by REPL round trips and small batches, take the same time with one thread (41 s for
        # the default's 88-root evaluation either way).
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="native-engine",
            initializer=_one_intra_op_thread if self.device.type == "cpu" else None,
        )

    @classmethod
    def for_sync(cls, model: Transformer, **options: Any) -> NativeEngine:
        """An engine over `model` built with storage but no values, for a caller that sends
        every weight through `update_weights` before it generates (`build_engine(weights=
        "sync")`): requests are refused until every parameter has been filled."""
        engine = cls(model, **options)
        engine._unfilled = {name for name, _ in named_hf_tensors(model)}
        return engine

    # -- admission --------------------------------------------------------------------------

    def _reservation(self, prompt_ids: list[int], params: SamplingParams) -> int:
        # The last sampled token is never fed back, but whole pages are what the cache hands out.
        tokens = len(prompt_ids) + params.max_new_tokens
        return math.ceil(tokens / self.cache.page_size) * self.cache.page_size

    def _admission_round(self) -> Callable[[Request], int | None]:
        plan = self.cache.plan()
        page = self.cache.page_size
        # Pages the running sequences may still take before reaching their worst case.
        growth = sum(
            r.reserved_tokens // page - len(self.cache.pages(r.seq_id)) for r in self._running
        )

        def take(request: Request) -> int | None:
            nonlocal growth
            cached = plan.add(request.prompt_ids)
            growth += request.reserved_tokens // page - math.ceil(len(request.prompt_ids) / page)
            if plan.pages + growth > self.cache.free_pages:
                return None
            return len(request.prompt_ids) - cached

        return take

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        super()._check_request(prompt_ids, params)
        vocab = self.model.args.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        if self._unfilled:
            raise RuntimeError(
                f"the engine was started without weights and {len(self._unfilled)} "
                f"parameter(s) have received none yet (e.g. {min(self._unfilled)!r}): send "
                "every weight through update_weights before generating"
            )
        return await super().generate(prompt_ids, params)

    # -- the step -----------------------------------------------------------------------------

    async def _step(self, admitted: list[Request], running: list[Request]) -> None:
        for request in admitted:
            seed = request.params.seed
            if seed is None:
                seed = self._seeds.getrandbits(63)
            request.state = torch.Generator(device=self.device).manual_seed(seed)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._step_sync, admitted, running)

    @torch.inference_mode()
    def _step_sync(self, admitted: list[Request], running: list[Request]) -> None:
        hidden: list[Tensor] = []
        if admitted:
            prompts = [torch.tensor(r.prompt_ids, dtype=torch.long) for r in admitted]
            hidden.append(prefill(self.model, self.cache, [r.seq_id for r in admitted], prompts))
            cached = sum(self.cache.cached_tokens(r.seq_id) for r in admitted)
            self._stats.prefix_cache_hit_tokens += cached
            self._stats.prefill_tokens += sum(len(r.prompt_ids) for r in admitted) - cached
        if running:
            tokens = torch.tensor([r.token_ids[-1] for r in running], dtype=torch.long)
            hidden.append(decode(self.model, self.cache, [r.seq_id for r in running], tokens))
        requests = [*admitted, *running]
        # Padded like the linear layers, so each row's logits are the bits of any larger batch.
        rows = torch.cat(hidden).float()
        rows = F.pad(rows, (0, 0, 0, max(0, linear_min_rows(rows.device) - len(requests))))
        logits = (rows @ self._head.T)[: len(requests)]  # [B, V] fp32
        temperatures = torch.tensor([r.params.temperature for r in requests], device=self.device)
        logprobs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
        for row, request in enumerate(requests):
            token = _sample(logprobs[row], request.params, request.state)
            request.append(token, float(logprobs[row, token]))

    def _release(self, request: Request) -> None:
        # Runs on the event loop between steps, never while a step thread uses the cache.
        if request.seq_id in self.cache:
            self.cache.evict(request.seq_id)
        request.state = None

    async def _apply_weights(self, named_tensors: list[tuple[str, Tensor]]) -> None:
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(self._executor, self._load_weights_sync, named_tensors)
        self._unfilled -= loaded

    def _load_weights_sync(self, named_tensors: list[tuple[str, Tensor]]) -> set[str]:
        loaded = load_hf_tensors(self.model, named_tensors, source="update_weights")
        self._head = self._fp32_head()
        self.cache.reset_prefix_cache()
        return loaded

    def _fp32_head(self) -> Tensor:
        # The fp32 weight itself, or a copy of a bf16 one made once per weight version: casting
        # SmolLM2's [49152, 576] head took 73 ms a step on one core, the logits' matmul 22 ms.
        return self.model.lm_head_weight.float()

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)


def _sample(logprobs: Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `logprobs[V]` (temperature already applied) under top-k / top-p."""
    if params.top_k == 1:
        return int(logprobs.argmax())
    scores = logprobs
    if params.top_k > 1 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        mass_before = sorted_scores.softmax(-1).cumsum(-1) - sorted_scores.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = order[mass_before >= params.top_p]
        scores = scores.index_fill(0, drop, -math.inf)
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _one_intra_op_thread() -> None:
    torch.set_num_threads(1)  # per calling thread under OpenMP: the trainer's threads stay
