"""The native engine's results are bitwise independent of the batch (`model/paged_attention.py`).

A row's hidden state, and so a request's sampled tokens and log-probs, must not depend on which
other rows share its step, on whether its prompt was prefilled or its tokens decoded, or on
whether its leading pages came from the prefix cache. Truncated importance sampling reads those
log-probs, so this is what makes a run reproduce itself when REPL timings change the batching.

The model-level tests use a small model with 4-token pages and 8-token attention chunks, so that
sequences span several chunks and a shared prefix is attended as a cascade; the engine tests use
the tiny preset with its defaults. Every comparison is `torch.equal`, not a tolerance.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from small_model import ARGS, make_model

from rlmtrain.config import ModelConfig
from rlmtrain.model import KVCache, build_model
from rlmtrain.model.kv_cache import decode, prefill
from rlmtrain.model.paged_attention import PagedQueries, invariant_rows
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines.native import NativeEngine

PAGE, CHUNK = 4, 8


@pytest.fixture(scope="module")
def small():
    return make_model()


@pytest.fixture
def one_thread():
    """The engine computes with one intra-op thread (`NativeEngine`); so do these tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, ARGS.vocab_size, (37,), generator=gen)
    tails = [torch.randint(0, ARGS.vocab_size, (n,), generator=gen) for n in (5, 13, 21, 2)]
    return [torch.cat([prefix, tail]) for tail in tails]


def hidden_by_position(model, order, prompt_lengths, *, warm_prefix: bool = False):
    """Prefill the first `prompt_lengths[i]` tokens of each sequence in `order`, as one batch,
    then decode the rest one token per step in one batch: {sequence: {position: hidden}}."""
    seqs = sequences()
    cache = KVCache.for_model(model, 2048, page_size=PAGE, attention_chunk_tokens=CHUNK)
    out: dict[int, dict[int, torch.Tensor]] = {i: {} for i in order}
    with torch.inference_mode():
        if warm_prefix:  # another sequence computed the shared prefix's pages first
            prefill(model, cache, [99], [seqs[0][:37]])
        hidden = prefill(model, cache, list(order), [seqs[i][: prompt_lengths[i]] for i in order])
        for row, i in enumerate(order):
            out[i][prompt_lengths[i] - 1] = hidden[row]
        at = {i: prompt_lengths[i] for i in order}
        while live := [i for i in order if at[i] < len(seqs[i])]:
            hidden = decode(model, cache, live, torch.stack([seqs[i][at[i]] for i in live]))
            for row, i in enumerate(live):
                out[i][at[i]] = hidden[row]
                at[i] += 1
    return out


def assert_same_bits(got, expected) -> int:
    compared = 0
    for seq, rows in got.items():
        for position, hidden in rows.items():
            if position in expected[seq]:
                assert torch.equal(hidden, expected[seq][position]), (seq, position)
                compared += 1
    return compared


PROMPTS = [40, 40, 40, 39]


def test_hidden_states_do_not_depend_on_the_batch(small, one_thread) -> None:
    reference = hidden_by_position(small, [0, 1, 2, 3], PROMPTS)
    assert assert_same_bits(hidden_by_position(small, [3, 1, 0, 2], PROMPTS), reference) == 34
    for seq in range(4):  # alone: no company, no cascade
        alone = hidden_by_position(small, [seq], PROMPTS)
        assert assert_same_bits(alone, reference) == len(reference[seq])


def test_prefilled_decoded_and_cached_rows_are_the_same_bits(small, one_thread) -> None:
    reference = hidden_by_position(small, [0, 1, 2, 3], PROMPTS)
    # Positions 38..57 are decoded in the reference and prefilled here, and the other way round.
    resplit = hidden_by_position(small, [0, 1, 2, 3], [38, 45, 41, 39])
    assert assert_same_bits(resplit, reference) == 28
    warm = hidden_by_position(small, [0, 1, 2, 3], PROMPTS, warm_prefix=True)
    assert assert_same_bits(warm, reference) == 34


def test_decode_behind_a_shared_prefix_runs_as_a_cascade(small, one_thread) -> None:
    # The premise of the tests above: the batched decode shares the prefix's chunks.
    cache = KVCache.for_model(small, 2048, page_size=PAGE, attention_chunk_tokens=CHUNK)
    seqs = sequences()
    with torch.inference_mode():
        prefill(small, cache, [0, 1, 2, 3], [s[:40] for s in seqs])
    spans = [(cache.pages(i), i, 39, 40) for i in range(4)]
    assert PagedQueries(cache, spans, heads_per_kv=2).cascaded_rows == 4
    assert PagedQueries(cache, spans[:1], heads_per_kv=2).cascaded_rows == 0


def test_rows_stay_exact(small, one_thread) -> None:
    reference = hidden_by_position(small, [0, 1, 2, 3], PROMPTS)
    with torch.no_grad():
        for seq, tokens in enumerate(sequences()):
            n = tokens.numel()
            full = small(tokens, torch.arange(n), torch.tensor([0, n]))
            for position, hidden in reference[seq].items():
                torch.testing.assert_close(hidden, full[position], atol=1e-5, rtol=0)


# -- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return build_model(ModelConfig(preset="tiny", seed=0, dtype="float32"))


def shared_prefix_requests() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 384, (600,), generator=gen).tolist()
    lengths = torch.randint(1, 300, (12,), generator=gen).tolist()
    return [prefix + torch.randint(0, 384, (n,), generator=gen).tolist() for n in lengths]


def sample_all(model, *, delays: int | None, **engine_kw):
    """Seeded temperature-1 completions of every request; with `delays`, the requests arrive
    at random moments (seeded by it), so they meet other company in other steps."""
    requests = shared_prefix_requests()

    async def main():
        engine = NativeEngine(model, **engine_kw)
        pause = random.Random(delays)

        async def one(i: int):
            if delays is not None:
                await asyncio.sleep(pause.uniform(0, 0.3))
            return await engine.generate(
                requests[i], SamplingParams(temperature=1.0, max_new_tokens=24, seed=7 + i)
            )

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        await engine.close()
        return results

    return asyncio.run(main())


@pytest.mark.slow
def test_sampled_logprobs_do_not_depend_on_company_or_the_prefix_cache(tiny) -> None:
    reference = sample_all(tiny, delays=None)
    variants = {
        "staggered": sample_all(tiny, delays=1, max_batch_size=5),
        "no prefix cache": sample_all(tiny, delays=2, prefix_caching=False),
        "one at a time": sample_all(tiny, delays=None, max_batch_size=1),
    }
    for name, results in variants.items():
        for want, got in zip(reference, results, strict=True):
            assert got.token_ids == want.token_ids, name
            assert got.logprobs == want.logprobs, name


@pytest.mark.parametrize(("dim", "chunk"), [(16, 8), (64, 256)])
def test_the_measured_threshold_holds_for_other_data(one_thread, dim, chunk) -> None:
    rows = invariant_rows(torch.device("cpu"), torch.float32, dim, chunk)
    gen = torch.Generator().manual_seed(1)
    keys, queries = (
        torch.randn(3, chunk, dim, generator=gen),
        torch.randn(3, 300, dim, generator=gen),
    )
    weights, values = (
        torch.rand(3, 300, chunk, generator=gen),
        torch.randn(3, chunk, dim, generator=gen),
    )
    scores, outputs = queries @ keys.transpose(1, 2), weights @ values
    for m in sorted({rows, rows + 1, 2 * rows + 3, 77, 299}):
        assert torch.equal(queries[:, :m].contiguous() @ keys.transpose(1, 2), scores[:, :m]), m
        assert torch.equal(weights[:, :m].contiguous() @ values, outputs[:, :m]), m
    assert invariant_rows(torch.device("meta"), torch.float32, dim, chunk) == 1  # off the CPU
