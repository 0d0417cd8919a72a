"""NativeEngine on the tiny random model on the CPU, in fp32 (and once in bf16).

Batching must not change what a request samples: greedy outputs under 64 concurrent requests
(more than the batch, more than the KV budget holds at once) equal the same requests run one by
one, and seeded sampling draws the same tokens alone or batched. The returned log-probs are
checked against the trainer's own computation, `kernels.fused_linear_logprob` over the packed
forward of the full sequence. Weight updates land between steps without losing a request. An
engine started for a sync (`build_engine(weights="sync")`) loads nothing, refuses requests until
every parameter has been sent, and then samples what an engine that loaded the weights samples.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from trainer_logprobs import completion_logprobs

import rlmtrain.model
from rlmtrain.config import Config, ModelConfig, RolloutConfig
from rlmtrain.model import CheckpointError, build_model, named_hf_tensors, save_hf
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rollout.engine import Engine, SamplingParams
from rlmtrain.rollout.engines import build_engine
from rlmtrain.rollout.engines.native import NativeEngine

GREEDY = SamplingParams(top_k=1, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(preset="tiny", seed=0, dtype="float32"))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 48, (n,), generator=gen).tolist()
    return [torch.randint(0, 256, (k,), generator=gen).tolist() for k in lengths]


def run(coroutine):
    return asyncio.run(coroutine)


async def generate_all(engine: NativeEngine, requests, params_of) -> list:
    results = await asyncio.gather(
        *(engine.generate(p, params_of(i)) for i, p in enumerate(requests))
    )
    await engine.wait_idle()
    return results


def test_is_an_engine(model) -> None:
    assert isinstance(NativeEngine(model), Engine)


@pytest.mark.slow
def test_greedy_batched_equals_one_by_one(model) -> None:
    requests = prompts(64)

    async def batched():
        # 16 slots and room for ~10 worst-case sequences: both limits queue requests.
        engine = NativeEngine(model, max_batch_size=16, kv_cache_tokens=640, page_size=16)
        results = await generate_all(engine, requests, lambda i: GREEDY)
        stats = engine.stats()
        free = engine.cache.free_tokens
        await engine.close()
        return results, stats, free

    async def one_by_one():
        engine = NativeEngine(model, max_batch_size=1, kv_cache_tokens=640)
        results = [await engine.generate(p, GREEDY) for p in requests]
        await engine.close()
        return results

    together, stats, free = run(batched())
    alone = run(one_by_one())
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        assert a.finish_reason == "length" and len(a.token_ids) == GREEDY.max_new_tokens
    assert stats.requests_done == 64 and stats.running == 0 and stats.waiting == 0
    assert stats.batch_slots_used > stats.steps  # steps really decoded several sequences
    assert free == 640  # every page went back to the cache


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainer(model, temperature: float) -> None:
    requests = prompts(6, seed=1)
    params = [
        SamplingParams(temperature=temperature, max_new_tokens=10, seed=100 + i)
        for i in range(len(requests))
    ]

    async def sample():
        engine = NativeEngine(model, max_batch_size=4, kv_cache_tokens=1024)
        results = await generate_all(engine, requests, lambda i: params[i])
        alone = [await engine.generate(requests[0], params[0])]
        await engine.close()
        return results, alone

    results, alone = run(sample())
    assert alone[0].token_ids == results[0].token_ids  # the seed, not the batch, decides
    for prompt, completion in zip(requests, results, strict=True):
        expected = completion_logprobs(model, prompt, completion.token_ids, temperature)
        got = torch.tensor(completion.logprobs)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_different_seeds_sample_differently(model) -> None:
    async def sample():
        engine = NativeEngine(model, max_batch_size=4, kv_cache_tokens=1024)
        out = await generate_all(
            engine, [[1, 2, 3]] * 4, lambda i: SamplingParams(max_new_tokens=16, seed=i % 2)
        )
        await engine.close()
        return out

    a, b, c, d = run(sample())
    assert a.token_ids == c.token_ids and b.token_ids == d.token_ids
    assert a.token_ids != b.token_ids


def test_top_k_and_top_p_stay_inside_the_kept_set(model) -> None:
    prompt = [5, 6, 7]
    with torch.no_grad():
        ids = torch.tensor(prompt)
        hidden = model(ids, torch.arange(3), torch.tensor([0, 3]))[-1]
        logits = hidden @ model.lm_head_weight.T
    top3 = set(torch.topk(logits, 3).indices.tolist())

    async def sample():
        engine = NativeEngine(model, max_batch_size=8, kv_cache_tokens=1024)
        out = await generate_all(
            engine,
            [prompt] * 16,
            lambda i: SamplingParams(max_new_tokens=1, top_k=3, temperature=5.0, seed=i),
        )
        nucleus = await engine.generate(
            prompt, SamplingParams(max_new_tokens=1, top_p=1e-6, temperature=5.0, seed=1)
        )
        await engine.close()
        return out, nucleus

    out, nucleus = run(sample())
    assert {c.token_ids[0] for c in out} <= top3
    assert nucleus.token_ids == [int(logits.argmax())]
    # The log-prob is the untruncated one: below log(1/3) although only 3 tokens could be drawn.
    assert all(c.logprobs[0] < -1.0 for c in out)


def test_stop_token_ends_the_completion(model) -> None:
    async def sample():
        engine = NativeEngine(model, max_batch_size=2, kv_cache_tokens=1024)
        first = await engine.generate([9, 9, 9], GREEDY)
        stop = first.token_ids[3]
        stopped = await engine.generate(
            [9, 9, 9], SamplingParams(top_k=1, max_new_tokens=12, stop_token_ids=[stop])
        )
        await engine.close()
        return first, stopped

    first, stopped = run(sample())
    cut = first.token_ids.index(first.token_ids[3]) + 1
    assert stopped.token_ids == first.token_ids[:cut]
    assert stopped.finish_reason == "stop"


def test_update_weights_mid_stream(model) -> None:
    other = build_model(ModelConfig(preset="tiny", seed=1, dtype="float32"))
    new_weights = [(name, tensor.clone()) for name, tensor in named_hf_tensors(other)]
    old_weights = [(name, tensor.clone()) for name, tensor in named_hf_tensors(model)]
    requests = prompts(24, seed=2)
    long = SamplingParams(top_k=1, max_new_tokens=24)

    async def generate(update: bool):
        engine = NativeEngine(model, max_batch_size=8, kv_cache_tokens=4096)
        pending = [asyncio.create_task(engine.generate(p, long)) for p in requests]
        if update:
            while engine.stats().steps < 6:
                await asyncio.sleep(0.001)
            await engine.update_weights(new_weights)
            assert engine.stats().waiting > 0  # requests were still queued at the update
        results = await asyncio.gather(*pending)
        stats = engine.stats()
        await engine.close()
        return results, stats

    try:
        before, _ = run(generate(update=False))
        after, stats = run(generate(update=True))
        with torch.no_grad():
            changed = torch.equal(
                model.layers[0].mlp.up_proj.weight, other.layers[0].mlp.up_proj.weight
            )
    finally:
        run(_restore(model, old_weights))
    assert changed
    assert stats.weight_version == 1 and stats.requests_done == len(requests)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in after)
    # Every token says which weights sampled it: the first request crossed the update (old, then
    # new), the last was admitted after it; without the update every token is version 0.
    assert all(c.weight_versions == [0] * 24 for c in before)
    crossed = after[0].weight_versions
    assert crossed == sorted(crossed) and crossed[0] == 0 and crossed[-1] == 1
    assert after[-1].weight_versions == [1] * 24
    # The first request started under the old weights: its first tokens agree, later ones not.
    assert after[0].token_ids[:3] == before[0].token_ids[:3]
    assert sum(a.token_ids != b.token_ids for a, b in zip(after, before, strict=True)) >= 20


async def _restore(model, weights) -> None:
    engine = NativeEngine(model, max_batch_size=1, kv_cache_tokens=64)
    await engine.update_weights(weights)
    await engine.close()


def test_bad_weight_update_fails_alone(model) -> None:
    async def attempt():
        engine = NativeEngine(model, max_batch_size=2, kv_cache_tokens=1024)
        with pytest.raises(CheckpointError, match="model.layers.0.nope"):
            await engine.update_weights([("model.layers.0.nope", torch.zeros(2))])
        completion = await engine.generate([1, 2], GREEDY)
        await engine.close()
        return completion

    assert len(run(attempt()).token_ids) == GREEDY.max_new_tokens


def test_cancelled_request_frees_its_pages(model) -> None:
    async def cancel():
        engine = NativeEngine(model, max_batch_size=4, kv_cache_tokens=2048)
        task = asyncio.create_task(engine.generate([1] * 40, SamplingParams(max_new_tokens=500)))
        while engine.stats().running == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.wait_idle()
        free = engine.cache.free_tokens
        done = await engine.generate([1, 2, 3], GREEDY)
        await engine.close()
        return free, done

    free, done = run(cancel())
    assert free == 2048
    assert len(done.token_ids) == GREEDY.max_new_tokens


def test_requests_it_cannot_serve_are_refused(model) -> None:
    async def refuse():
        engine = NativeEngine(model, max_batch_size=2, kv_cache_tokens=256)
        with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
            await engine.generate([1, 999], GREEDY)
        with pytest.raises(ValueError, match="exceeds the engine's KV budget of 256"):
            await engine.generate([1] * 250, GREEDY)
        with pytest.raises(ValueError, match="non-empty prompt"):
            await engine.generate([], GREEDY)
        await engine.close()

    run(refuse())


def test_close_aborts_requests_in_flight(model) -> None:
    async def close_early():
        engine = NativeEngine(model, max_batch_size=1, kv_cache_tokens=2048)
        tasks = [
            asyncio.create_task(engine.generate([1, 2], SamplingParams(max_new_tokens=1000)))
            for _ in range(2)
        ]
        while engine.stats().generated_tokens < 3:
            await asyncio.sleep(0.001)
        await engine.close()
        return await asyncio.gather(*tasks)

    running, queued = run(close_early())
    assert running.finish_reason == "abort" and 0 < len(running.token_ids) < 1000
    assert queued.finish_reason == "abort" and queued.token_ids == []


def test_bfloat16_model_samples_what_the_trainer_computes() -> None:
    """A bf16 policy (`model.dtype = "bfloat16"`): its cache holds bf16 keys and values, the
    attention and the logits run in fp32, and the log-probs match the trainer's bf16 forward
    within bf16's rounding; after a weight update the engine samples from the new head."""
    policy = build_model(ModelConfig(preset="tiny", seed=0, dtype="bfloat16"))
    other = build_model(ModelConfig(preset="tiny", seed=1, dtype="bfloat16"))
    requests = prompts(4, seed=3)
    params = [SamplingParams(max_new_tokens=8, seed=7 + i) for i in range(len(requests))]

    async def sample(update: bool):
        # Its own copy: an update must not change `policy`, the reference of the first run.
        engine = NativeEngine(copy.deepcopy(policy), max_batch_size=4, kv_cache_tokens=1024)
        assert engine.cache.keys.dtype == torch.bfloat16
        if update:
            await engine.update_weights(named_hf_tensors(other))
        results = await generate_all(engine, requests, lambda i: params[i])
        await engine.close()
        return results

    before = run(sample(update=False))
    after = run(sample(update=True))
    for served, results in ((other, after), (policy, before)):
        for prompt, completion in zip(requests, results, strict=True):
            expected = completion_logprobs(served, prompt, completion.token_ids)
            torch.testing.assert_close(
                torch.tensor(completion.logprobs), expected.float(), atol=0.02, rtol=0
            )
    assert [c.token_ids for c in before] != [c.token_ids for c in after]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["preset", "checkpoint"])
def test_an_engine_started_for_a_sync_serves_the_synced_weights_only(
    source: str, dtype: str, tmp_path, monkeypatch
) -> None:
    """weights="sync": the model gets storage in the engine dtype and no values (no init, no
    checkpoint read: only the shape), requests are refused until every parameter has arrived,
    and then greedy and seeded sampling give the tokens and log-probs, bit for bit, of an engine
    that loaded the same weights."""
    policy = ModelConfig(preset="tiny", seed=3, dtype=dtype)
    if source == "checkpoint":
        save_hf(build_model(policy), tmp_path / "policy")
        policy = ModelConfig(hf_dir=str(tmp_path / "policy"), dtype=dtype)
    config = Config(model=policy, rollout=RolloutConfig(max_batch_size=8, kv_cache_tokens=4096))
    loaded = build_engine(config, ByteTokenizer())
    weights = [(name, tensor.clone()) for name, tensor in named_hf_tensors(loaded.model)]

    def no_values(*args, **kwargs):
        raise AssertionError("an engine started for a sync built or loaded weights")

    monkeypatch.setattr(rlmtrain.model, "build_model", no_values)
    monkeypatch.setattr(rlmtrain.model, "load_hf", no_values)
    empty = build_engine(config, ByteTokenizer(), weights="sync")
    assert {(p.dtype, p.device.type) for p in empty.model.parameters()} == {
        (getattr(torch, dtype), "cpu")
    }
    requests = prompts(6, seed=4)
    params = [GREEDY if i % 2 else SamplingParams(max_new_tokens=12, seed=30 + i) for i in range(6)]

    async def sync_then_sample():
        with pytest.raises(RuntimeError, match="update_weights before generating"):
            await empty.generate(requests[0], GREEDY)
        # The embedding (sent first in training) missing: still refused, by name.
        await empty.update_weights(weights[1:])
        with pytest.raises(RuntimeError, match="'model.embed_tokens.weight'"):
            await empty.generate(requests[0], GREEDY)
        await empty.update_weights(weights[:1])
        synced = await generate_all(empty, requests, lambda i: params[i])
        reference = await generate_all(loaded, requests, lambda i: params[i])
        await empty.close()
        await loaded.close()
        return synced, reference

    synced, reference = run(sync_then_sample())
    assert [(c.token_ids, c.logprobs) for c in synced] == [
        (c.token_ids, c.logprobs) for c in reference
    ]


def test_build_engine_refuses_an_unknown_way_to_start() -> None:
    with pytest.raises(ValueError, match="weights must be 'load' or 'sync', got 'lazy'"):
        build_engine(Config(), ByteTokenizer(), weights="lazy")
