"""SimEngine and the shared continuous-batching loop: stopping, admission, counters, close.

Also the priority gate the scheduler puts in front of the engine and the REPL.
"""

from __future__ import annotations

import asyncio

import pytest

from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rollout.engine import Engine, SamplingParams
from rlmtrain.rollout.engines.sim import LatencyModel, SimEngine, hashed_script, text_script
from rlmtrain.rollout.gate import PriorityGate

TOKENIZER = ByteTokenizer()


def echo_engine(**kwargs) -> SimEngine:
    """Replies with the prompt text reversed."""
    return SimEngine(
        script=text_script(TOKENIZER, lambda prompt: prompt[::-1]),
        eos_id=TOKENIZER.eos_id,
        decode=TOKENIZER.decode,
        **kwargs,
    )


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 64, "stop_token_ids": [TOKENIZER.eos_id], **kwargs})


def test_is_an_engine() -> None:
    assert isinstance(echo_engine(), Engine)


def test_scripted_reply_then_eos() -> None:
    async def main():
        engine = echo_engine()
        completion = await engine.generate(TOKENIZER.encode("abc"), params())
        await engine.close()
        return completion

    completion = asyncio.run(main())
    assert completion.token_ids == [*TOKENIZER.encode("cba"), TOKENIZER.eos_id]
    assert completion.finish_reason == "stop"
    assert len(completion.logprobs) == 4 and all(lp < 0 for lp in completion.logprobs)


def test_stop_string_keeps_the_token_that_completes_it() -> None:
    async def main():
        engine = echo_engine()
        prompt = TOKENIZER.encode("tail\n```\nhead")  # reversed: "daeh\n```\nliat"
        completion = await engine.generate(prompt, params(stop_strings=["\n```\n"]))
        length = await engine.generate(prompt, params(max_new_tokens=3))
        await engine.close()
        return completion, length

    completion, length = asyncio.run(main())
    assert TOKENIZER.decode(completion.token_ids) == "daeh\n```\n"
    assert completion.finish_reason == "stop"
    assert TOKENIZER.decode(length.token_ids) == "dae" and length.finish_reason == "length"


def test_stop_string_ending_in_a_multibyte_character() -> None:
    """The completing byte decodes alone to U+FFFD, never to the string's last character."""

    async def main():
        engine = echo_engine()
        prompt = TOKENIZER.encode("rest éfac")  # reversed: "café tser"
        completion = await engine.generate(prompt, params(stop_strings=["café"]))
        await engine.close()
        return completion

    completion = asyncio.run(main())
    assert TOKENIZER.decode(completion.token_ids) == "café"
    assert completion.finish_reason == "stop"


def test_stop_strings_need_a_decoder() -> None:
    engine = SimEngine(script=hashed_script(10), eos_id=0)
    with pytest.raises(ValueError, match="need a tokenizer"):
        asyncio.run(engine.generate([1], SamplingParams(stop_strings=["x"])))


def test_batch_size_and_kv_budget_bound_admission() -> None:
    async def main():
        engine = SimEngine(
            script=hashed_script(200, min_tokens=20, max_tokens=20),
            eos_id=999,
            latency=LatencyModel(a=0.001),
            max_batch_size=4,
            kv_budget_tokens=100,
        )
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, engine.stats().running)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        # Each request reserves 10 + 30 = 40 tokens: the budget of 100 admits 2, not 4.
        out = await asyncio.gather(
            *(
                engine.generate(
                    [i + 1] * 10, SamplingParams(max_new_tokens=30, stop_token_ids=[999])
                )
                for i in range(6)
            )
        )
        watcher.cancel()
        stats = engine.stats()
        await engine.close()
        return out, peak, stats

    out, peak, stats = asyncio.run(main())
    assert [len(c.token_ids) for c in out] == [21] * 6  # 20 scripted, then the stop token
    assert peak == 2
    assert stats.requests_done == 6 and stats.generated_tokens == 126
    assert stats.batch_slots_used == 126 and stats.steps == 63  # 3 waves of 2 x 21 tokens


def test_failed_step_fails_its_requests_and_the_engine_serves_on() -> None:
    def script(prompt: list[int], params: SamplingParams) -> list[int]:
        if prompt == [13]:
            raise RuntimeError("scripted failure")
        return [1, 2, 3]

    async def main():
        engine = SimEngine(script=script, eos_id=0, max_batch_size=1)
        with pytest.raises(RuntimeError, match="scripted failure"):
            await engine.generate([13], params())
        after = await engine.generate([14], params(stop_token_ids=[0]))
        await engine.wait_idle()
        stats = engine.stats()
        await engine.close()
        return after, stats

    after, stats = asyncio.run(main())
    assert after.token_ids == [1, 2, 3, 0] and stats.running == stats.waiting == 0


def test_latency_model_counts_batch_and_prefill() -> None:
    model = LatencyModel(a=0.01, b=0.001, c=0.0001)
    assert model.step_s(sequences=8, prefill_tokens=100) == pytest.approx(0.01 + 0.008 + 0.01)
    cached = LatencyModel(cached_prefix_tokens=10)
    assert (cached.prefill_tokens(25), cached.prefill_tokens(5)) == (15, 0)


def test_close_aborts_and_refuses_new_requests() -> None:
    async def main():
        engine = echo_engine(max_batch_size=1, latency=LatencyModel(a=0.001))
        long = params(max_new_tokens=1000)
        tasks = [asyncio.create_task(engine.generate([65] * 500, long)) for _ in range(2)]
        while engine.stats().generated_tokens < 2:
            await asyncio.sleep(0.001)
        await engine.close()
        with pytest.raises(RuntimeError, match="closed engine"):
            await engine.generate([65], long)
        return await asyncio.gather(*tasks)

    running, queued = asyncio.run(main())
    assert running.finish_reason == "abort" and len(running.token_ids) >= 2
    assert queued.finish_reason == "abort" and queued.token_ids == []


def test_update_weights_counts_versions_between_steps() -> None:
    async def main():
        engine = echo_engine(latency=LatencyModel(a=0.001))
        pending = asyncio.create_task(engine.generate([65] * 30, params()))
        while engine.stats().steps < 3:
            await asyncio.sleep(0.001)
        await engine.update_weights([])
        await engine.update_weights([])
        completion = await pending
        await engine.close()
        return completion, engine.stats().weight_version

    completion, version = asyncio.run(main())
    assert version == 2 and completion.finish_reason == "stop"
    # Its tokens name the versions they were sampled under, in order, from 0 to 2.
    versions = completion.weight_versions
    assert len(versions) == len(completion.token_ids)
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 2


# ---------------------------------------------------------------------------------------------
# PriorityGate
# ---------------------------------------------------------------------------------------------


def test_gate_serves_by_priority_then_arrival() -> None:
    async def main():
        gate = PriorityGate(1, "test")
        served: list[str] = []
        release = asyncio.Event()

        async def holder():
            async with gate.slot((0, 0)):
                await release.wait()

        async def waiter(name: str, priority):
            async with gate.slot(priority):
                served.append(name)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiters = [
            asyncio.create_task(waiter("root-old", (0, 1))),
            asyncio.create_task(waiter("root-new", (0, 2))),
            asyncio.create_task(waiter("child", (-1, 2))),
            asyncio.create_task(waiter("root-old-2", (0, 1))),
        ]
        await asyncio.sleep(0)
        assert gate.waiting == 4
        release.set()
        await asyncio.gather(first, *waiters)
        return served, gate

    served, gate = asyncio.run(main())
    assert served == ["child", "root-old", "root-old-2", "root-new"]
    assert gate.held == 0 and gate.waiting == 0


def test_gate_reserve_keeps_slots_for_deeper_levels() -> None:
    async def main():
        gate = PriorityGate(3, "workers")
        async with gate.slot((0, 0), reserve=2):
            shallow = asyncio.create_task(_take(gate, reserve=2))  # would leave 1 < 2 free
            await asyncio.sleep(0)
            assert not shallow.done()
            # Depth 1 leaves 1 free (its reserve): allowed; depth 2 takes the last slot.
            async with gate.slot((-1, 0), reserve=1), gate.slot((-2, 0), reserve=0):
                assert gate.held == 3
            assert not shallow.done()
        await shallow
        return gate.held

    assert asyncio.run(main()) == 0


async def _take(gate: PriorityGate, reserve: int) -> None:
    async with gate.slot((0, 1), reserve=reserve):
        pass


def test_gate_cancelled_waiter_leaks_no_slot() -> None:
    async def main():
        gate = PriorityGate(1, "test")
        async with gate.slot(0):
            stuck = asyncio.create_task(_take(gate, reserve=0))
            await asyncio.sleep(0)
            stuck.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stuck
        async with gate.slot(0):
            held = gate.held
        return held, gate.held, gate.waiting

    assert asyncio.run(main()) == (1, 0, 0)


def test_gate_refuses_an_impossible_reserve() -> None:
    async def main():
        async with PriorityGate(2, "workers").slot(0, reserve=2):
            pass

    with pytest.raises(ValueError, match="workers: a reserve of 2 slots leaves none of 2"):
        asyncio.run(main())
