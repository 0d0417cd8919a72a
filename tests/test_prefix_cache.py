"""Automatic prefix caching: ref-counted full pages shared by chained digest, in the KV cache and
in the native engine.

The cache tests check the bookkeeping (reference counts, which pages are shared, the LRU of
unreferenced cached pages, capacity) and, where sequences share pages, that their hidden states
still equal a full recomputation: evicting a sharer or recycling cached pages must never touch a
page another sequence reads. The engine tests run 16 requests behind one 1,000-token prefix on
the tiny preset (fp32, CPU) and compare every token id with the engine without prefix caching.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from small_model import ARGS, make_model

from rlmtrain.config import ModelConfig, load_config
from rlmtrain.model import CacheFull, KVCache, Transformer, build_model, named_hf_tensors
from rlmtrain.model.kv_cache import decode, prefill
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines import build_engine
from rlmtrain.rollout.engines.native import NativeEngine

PAGE = 4


@pytest.fixture(scope="module")
def small():
    return make_model()


def tokens(*values: int | list[int]) -> torch.Tensor:
    """A prompt from page-sized runs: an int k stands for PAGE copies of k."""
    out: list[int] = []
    for v in values:
        out += [v] * PAGE if isinstance(v, int) else v
    return torch.tensor(out)


def full_forward_last(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(ids.numel()), torch.tensor([0, ids.numel()]))[-1]


def assert_matches_recompute(model, cache, histories: dict[int, torch.Tensor]) -> None:
    """Decode one more token for each live sequence; its hidden equals the full forward."""
    seq_ids = sorted(histories)
    nxt = torch.tensor([(7 * s + 3) % ARGS.vocab_size for s in seq_ids])
    hidden = decode(model, cache, seq_ids, nxt)
    for row, seq in enumerate(seq_ids):
        histories[seq] = torch.cat([histories[seq], nxt[row : row + 1]])
        expected = full_forward_last(model, histories[seq])
        assert (hidden[row] - expected).abs().max().item() <= 1e-5, f"sequence {seq} changed"


# -- the KV cache -----------------------------------------------------------------------------


def test_full_pages_are_shared_and_ref_counted(small):
    cache = KVCache.for_model(small, capacity_tokens=64, page_size=PAGE)
    a = tokens(1, 2, 3, [4, 5])  # three full pages and a partial one
    b = tokens(1, 2, 9, [6])  # same first two pages
    prefill(small, cache, [0], [a])
    prefill(small, cache, [1], [b])
    pa, pb = cache.pages(0), cache.pages(1)
    assert pb[:2] == pa[:2] and not set(pb[2:]) & set(pa)
    assert cache.cached_tokens(0) == 0 and cache.cached_tokens(1) == 2 * PAGE
    assert [cache.refcount(p) for p in pa] == [2, 2, 1, 1]
    assert [cache.refcount(p) for p in pb] == [2, 2, 1, 1]
    assert cache.free_pages == 16 - 6
    assert_matches_recompute(small, cache, {0: a, 1: b})


def test_a_whole_cached_prompt_still_computes_its_last_page(small):
    cache = KVCache.for_model(small, capacity_tokens=64, page_size=PAGE)
    prompt = tokens(1, 2, 3)  # exactly three full pages
    prefill(small, cache, [0], [prompt])
    hidden = prefill(small, cache, [1, 2], [prompt, prompt[: 2 * PAGE + 1]])
    # The last token is recomputed for its logits, so the last full page is not shared ...
    assert cache.cached_tokens(1) == 2 * PAGE and cache.pages(1)[:2] == cache.pages(0)[:2]
    assert cache.pages(1)[2] != cache.pages(0)[2]
    # ... and a partial last page never is.
    assert cache.cached_tokens(2) == 2 * PAGE and cache.pages(2)[2] not in cache.pages(0)
    for row, ids in enumerate([prompt, prompt[: 2 * PAGE + 1]]):
        assert (hidden[row] - full_forward_last(small, ids)).abs().max().item() <= 1e-5
    # The recomputed duplicate stays private: evicting it leaves nothing else cached.
    cached = cache.cached_pages
    cache.evict(1)
    assert cache.cached_pages == cached == 3


def test_digests_chain_the_prefix(small):
    cache = KVCache.for_model(small, capacity_tokens=64, page_size=PAGE)
    a, b, c = tokens(1, 2, 3, [0]), tokens(9, 2, 3, [0]), tokens(1, 9, 3, [0])
    da, db, dc = (cache.page_digests(p.tolist()) for p in (a, b, c))
    assert len(da) == 3 and da[0] == dc[0]
    # Same page content after a different prefix: a different digest.
    assert da[1] != db[1] and da[2] != db[2] and da[2] != dc[2]
    prefill(small, cache, [0], [a])
    prefill(small, cache, [1, 2], [b, c])
    assert cache.cached_tokens(1) == 0 and not set(cache.pages(1)) & set(cache.pages(0))
    assert cache.cached_tokens(2) == PAGE and cache.pages(2)[0] == cache.pages(0)[0]
    assert not set(cache.pages(2)[1:]) & set(cache.pages(0))
    assert_matches_recompute(small, cache, {0: a, 1: b, 2: c})


def test_prompts_of_one_batch_share_what_an_earlier_one_computes(small):
    cache = KVCache.for_model(small, capacity_tokens=64, page_size=PAGE)
    prompts = [tokens(5, 6, [1, 2]), tokens(7, [3]), tokens(5, 6, 8, [9]), tokens(5, [4, 4])]
    hidden = prefill(small, cache, [0, 1, 2, 3], prompts)
    assert [cache.cached_tokens(s) for s in range(4)] == [0, 0, 2 * PAGE, PAGE]
    assert cache.pages(2)[:2] == cache.pages(0)[:2] and cache.pages(3)[0] == cache.pages(0)[0]
    for row, ids in enumerate(prompts):
        assert (hidden[row] - full_forward_last(small, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "evicted", [s for k in range(1, 4) for s in itertools.combinations(range(4), k)]
)
def test_evicting_any_subset_leaves_the_others_intact(small, evicted):
    cache = KVCache.for_model(small, capacity_tokens=80, page_size=PAGE)
    gen = torch.Generator().manual_seed(len(evicted))
    prefix = tokens(11, 12, 13)
    histories = {
        s: torch.cat([prefix, torch.randint(0, ARGS.vocab_size, (2 + 3 * s,), generator=gen)])
        for s in range(4)
    }
    prefill(small, cache, [0], [histories[0]])
    prefill(small, cache, [1, 2, 3], [histories[s] for s in (1, 2, 3)])
    shared = cache.pages(0)[:3]
    assert all(cache.refcount(p) == 4 for p in shared)
    for seq in evicted:
        cache.evict(seq)
        del histories[seq]
    assert all(cache.refcount(p) == len(histories) for p in shared)
    # Pressure: unrelated prompts take every free page, recycling all that nobody holds.
    filler = [
        torch.randint(0, ARGS.vocab_size, (PAGE,), generator=gen) for _ in range(cache.free_pages)
    ]
    prefill(small, cache, list(range(100, 100 + len(filler))), filler)
    assert cache.free_pages == 0
    assert all(cache.refcount(p) == len(histories) for p in shared)
    for k in range(2):  # sharers keep decoding as the fillers leave
        cache.evict(100 + k)
        assert_matches_recompute(small, cache, histories)
    assert all(cache.refcount(p) == len(histories) for p in shared)


def test_decode_attends_each_groups_shared_pages_once_and_exactly(small):
    # Two groups behind different prefixes (3 and 1 shared pages), a loner, and a sequence
    # whose whole table but its last page is shared: one decode batch, each hidden state equal
    # to the full forward.
    cache = KVCache.for_model(small, capacity_tokens=400, page_size=PAGE)
    gen = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, ARGS.vocab_size, (n,), generator=gen)
    histories = {
        0: torch.cat([tokens(11, 12, 13), rand(5)]),
        1: torch.cat([tokens(11, 12, 13), rand(9)]),
        2: torch.cat([tokens(11, 12, 13), rand(1)]),
        3: torch.cat([tokens(21), rand(6)]),
        4: torch.cat([tokens(21), rand(2)]),
        5: rand(7),
    }
    prefill(small, cache, [0, 3], [histories[0], histories[3]])
    prefill(small, cache, [1, 2, 4, 5], [histories[s] for s in (1, 2, 4, 5)])
    for _ in range(PAGE + 1):  # across a page boundary
        assert_matches_recompute(small, cache, histories)


def test_unreferenced_cached_pages_are_reused_then_recycled_tail_first(small):
    cache = KVCache.for_model(small, capacity_tokens=32, page_size=PAGE)  # 8 pages
    prompt = tokens(1, 2, 3, [4])
    prefill(small, cache, [0], [prompt])
    first = cache.pages(0)
    cache.evict(0)
    assert cache.free_pages == 8 and cache.cached_pages == 3
    assert all(cache.refcount(p) == 0 for p in first)
    # A reused prefix revives its cached pages, kept after its sequence left.
    prefill(small, cache, [1], [prompt])
    assert cache.cached_tokens(1) == 3 * PAGE and cache.pages(1)[:3] == first[:3]
    cache.evict(1)
    # Pressure takes the never-used pages first (five), then cached ones, the prefix's tail first.
    filler = torch.arange(100, 100 + 5 * PAGE + 2)  # six pages, its last one partial
    prefill(small, cache, [2], [filler])
    assert first[2] in cache.pages(2) and not set(first[:2]) & set(cache.pages(2))
    assert cache.cached_pages == 2 + 5
    assert_matches_recompute(small, cache, {2: filler})
    cache.evict(2)
    prefill(small, cache, [3], [prompt])
    assert cache.cached_tokens(3) == 2 * PAGE and cache.pages(3)[:2] == first[:2]
    assert_matches_recompute(small, cache, {3: prompt})


def test_capacity_counts_cached_pages_as_free_and_revived_ones_as_taken(small):
    cache = KVCache.for_model(small, capacity_tokens=32, page_size=PAGE)  # 8 pages
    prefill(small, cache, [0], [tokens(1, 2, 3, 4)])
    prefill(small, cache, [1], [tokens(5, 6, 7, 8)])
    assert cache.free_pages == 0 and not cache.can_admit(1)
    cache.evict(0)
    assert cache.free_tokens == 4 * PAGE and cache.can_admit(4 * PAGE)
    plan = cache.plan()
    assert plan.add(tokens(1, 2, 9, 9).tolist()) == 2 * PAGE
    assert plan.pages == 4  # two revived cached pages and two new ones
    assert plan.add(tokens(1, 2, 3, 4).tolist()) == 3 * PAGE
    assert plan.pages == 6  # one more revived page (the third), one new page
    live = cache.plan()  # sharing pages that sequence 1 holds costs no free page
    assert live.add(tokens(5, 6, 7, [0]).tolist()) == 3 * PAGE and live.pages == 1
    refs = [cache.refcount(p) for p in range(8)]
    with pytest.raises(CacheFull, match="needs 6 pages, 4 are free"):
        prefill(small, cache, [2, 3], [tokens(1, 2, 9, 9), tokens(1, 2, 3, 4)])
    assert 2 not in cache and 3 not in cache
    assert [cache.refcount(p) for p in range(8)] == refs and cache.free_pages == 4
    prefill(small, cache, [2], [tokens(1, 2, 9, 9)])
    assert cache.free_pages == 0 and cache.cached_tokens(2) == 2 * PAGE


def test_pages_filled_by_decode_are_shared(small):
    cache = KVCache.for_model(small, capacity_tokens=64, page_size=PAGE)
    prompt = tokens(1, [2, 3])
    prefill(small, cache, [0], [prompt])
    generated = [5, 6, 7, 8, 9, 10]
    for token in generated:
        decode(small, cache, [0], torch.tensor([token]))
    # prompt + generated fills three pages; the third was filled by decoding.
    follow_up = torch.cat([prompt, torch.tensor(generated), tokens([4])])
    prefill(small, cache, [1], [follow_up])
    assert cache.cached_tokens(1) == 3 * PAGE and cache.pages(1)[:3] == cache.pages(0)[:3]
    assert_matches_recompute(
        small, cache, {0: torch.cat([prompt, torch.tensor(generated)]), 1: follow_up}
    )


def test_reset_forgets_every_prefix(small):
    cache = KVCache.for_model(small, capacity_tokens=64, page_size=PAGE)
    prompt = tokens(1, 2, [3])
    prefill(small, cache, [0], [prompt])
    prefill(small, cache, [1], [tokens(4, 5, [6])])
    cache.evict(1)
    cache.reset_prefix_cache()
    assert cache.cached_pages == 0 and cache.free_pages == 16 - 3
    for token in range(2 * PAGE):  # sequence 0 fills pages after the reset: none is registered
        decode(small, cache, [0], torch.tensor([token]))
    prefill(small, cache, [2], [prompt])
    assert cache.cached_tokens(2) == 0 and cache.cached_pages == 2  # sequence 2's own pages


def test_without_prefix_caching_nothing_is_shared(small):
    cache = KVCache.for_model(small, capacity_tokens=64, page_size=PAGE, prefix_caching=False)
    prompt = tokens(1, 2, [3])
    prefill(small, cache, [0, 1], [prompt, prompt])
    prefill(small, cache, [2], [prompt])
    assert [cache.cached_tokens(s) for s in range(3)] == [0, 0, 0]
    assert cache.cached_pages == 0 and len({*cache.pages(0), *cache.pages(1), *cache.pages(2)}) == 9


# -- the native engine ------------------------------------------------------------------------

PREFIX_TOKENS, REQUESTS = 1000, 16
GREEDY = SamplingParams(top_k=1, max_new_tokens=12)
LONG = SamplingParams(top_k=1, max_new_tokens=24)


@pytest.fixture(scope="module")
def tiny():
    return build_model(ModelConfig(preset="tiny", seed=0, dtype="float32"))


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 384, (PREFIX_TOKENS,), generator=gen).tolist()
    lengths = torch.randint(1, 40, (REQUESTS,), generator=gen).tolist()
    return [prefix + torch.randint(0, 384, (n,), generator=gen).tolist() for n in lengths]


def generate(model, prompts, params_of, *, prefix_caching: bool, cancel=(), **engine_kw):
    """Completions of `prompts`, with the requests in `cancel` cancelled mid-generation, and the
    engine's stats and free pages at the end."""

    async def main():
        engine = NativeEngine(model, prefix_caching=prefix_caching, **engine_kw)
        tasks = [
            asyncio.create_task(engine.generate(p, params_of(i))) for i, p in enumerate(prompts)
        ]
        if cancel:
            while engine.stats().generated_tokens < len(prompts) * 6:
                await asyncio.sleep(0.001)
            for i in cancel:
                tasks[i].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await engine.wait_idle()
        stats, free = engine.stats(), engine.cache.free_tokens
        refs = [engine.cache.refcount(p) for p in range(engine.cache.num_pages)]
        await engine.close()
        return results, stats, free, refs

    return asyncio.run(main())


@pytest.fixture(scope="module")
def uncached(tiny):
    prompts = shared_prefix_prompts()
    greedy, *_ = generate(tiny, prompts, lambda i: LONG, prefix_caching=False)
    return prompts, greedy


@pytest.mark.slow
def test_shared_prefix_is_prefilled_once_and_greedy_is_unchanged(tiny, uncached):
    prompts, reference = uncached
    results, stats, free, _ = generate(
        tiny, prompts, lambda i: LONG, prefix_caching=True, max_batch_size=16
    )
    shared = (PREFIX_TOKENS // 16) * 16  # full pages of the prefix
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.prefix_cache_hit_tokens == (REQUESTS - 1) * shared
    assert stats.prefill_tokens == stats.prompt_tokens - (REQUESTS - 1) * shared
    assert [c.token_ids for c in results] == [c.token_ids for c in reference]
    for a, b in zip(results, reference, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert free == 65536


@pytest.mark.slow
@pytest.mark.parametrize("cancel", [(0,), (0, 3, 4, 9, 15), tuple(range(1, 16))])
def test_aborting_any_subset_leaves_the_others_unchanged(tiny, uncached, cancel):
    prompts, reference = uncached
    results, stats, free, refs = generate(
        tiny, prompts, lambda i: LONG, prefix_caching=True, cancel=cancel, max_batch_size=16
    )
    for i, (got, want) in enumerate(zip(results, reference, strict=True)):
        if i in cancel:
            assert isinstance(got, asyncio.CancelledError)
        else:
            assert got.token_ids == want.token_ids, f"request {i} changed"
    assert free == 65536 and not any(refs)


@pytest.mark.slow
def test_a_prefix_outlives_its_first_request(tiny, uncached):
    prompts, reference = uncached

    async def main():
        engine = NativeEngine(tiny, max_batch_size=4)
        first = await engine.generate(prompts[0], LONG)
        hits = engine.stats().prefix_cache_hit_tokens
        later = await asyncio.gather(*(engine.generate(p, LONG) for p in prompts[1:4]))
        stats = engine.stats()
        await engine.close()
        return [first, *later], hits, stats

    results, hits_before, stats = asyncio.run(main())
    assert hits_before == 0 and stats.prefix_cache_hit_tokens == 3 * 992
    assert [c.token_ids for c in results] == [c.token_ids for c in reference[:4]]


@pytest.mark.slow
def test_seeded_sampling_is_unchanged(tiny):
    prompts = shared_prefix_prompts(seed=1)
    params = lambda i: SamplingParams(temperature=1.0, max_new_tokens=12, seed=40 + i)
    with_cache, stats, *_ = generate(tiny, prompts, params, prefix_caching=True)
    without, *_ = generate(tiny, prompts, params, prefix_caching=False)
    assert stats.prefix_cache_hit_tokens > 0
    assert [c.token_ids for c in with_cache] == [c.token_ids for c in without]
    for a, b in zip(with_cache, without, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_admission_counts_shared_pages_once(tiny):
    # Room for the prefix and 16 suffixes with their completions, not for 16 whole prompts.
    prompts = shared_prefix_prompts(seed=2)
    kw = {"max_batch_size": 16, "kv_cache_tokens": 2304}
    cached, stats, *_ = generate(tiny, prompts, lambda i: GREEDY, prefix_caching=True, **kw)
    uncached, slow, *_ = generate(tiny, prompts, lambda i: GREEDY, prefix_caching=False, **kw)
    assert [c.token_ids for c in cached] == [c.token_ids for c in uncached]
    assert stats.steps == GREEDY.max_new_tokens  # all 16 admitted in the first step
    assert stats.batch_slots_used == REQUESTS * GREEDY.max_new_tokens
    assert slow.steps >= REQUESTS * GREEDY.max_new_tokens // 2  # at most two fit at once


def test_weight_update_resets_the_prefix_cache(tiny):
    prompts = shared_prefix_prompts(seed=3)[:2]
    weights = [(name, tensor.clone()) for name, tensor in named_hf_tensors(tiny)]

    async def main():
        engine = NativeEngine(tiny, max_batch_size=2)
        await engine.generate(prompts[0], GREEDY)
        await engine.update_weights(weights)
        await engine.generate(prompts[1], GREEDY)
        stats = engine.stats()
        await engine.close()
        return stats

    stats = asyncio.run(main())
    assert stats.weight_version == 1
    assert stats.prefix_cache_hit_tokens == 0
    assert stats.prefill_tokens == stats.prompt_tokens == sum(map(len, prompts))


def test_build_engine_caches_prefixes_by_default():
    engine = build_engine(load_config(None, []), ByteTokenizer())
    assert isinstance(engine, NativeEngine) and engine.cache.prefix_caching
    asyncio.run(engine.close())
