"""NativeEngine decode throughput on the `tiny` preset (fp32, CPU): batch 1 against batch 32.

B concurrent requests, each a 128-token prompt and 64 greedy new tokens, through the engine's
continuous-batching loop (prefill of all B in one step, then 63 decode steps). Figures: generated
tokens/s, prefill + decode wall time, and the speed-up of batching. On a shared 2-core machine
the absolute numbers move with the neighbours' load; the ratio is the point.

    python -m pytest bench/bench_native_engine.py --benchmark-only -s
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlmtrain.config import ModelConfig
from rlmtrain.model import build_model
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines.native import NativeEngine

PROMPT_TOKENS, NEW_TOKENS = 128, 64
_measured: dict[int, float] = {}


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(preset="tiny", dtype="float32"))


async def _generate(model, batch: int) -> tuple[float, int]:
    engine = NativeEngine(model, max_batch_size=batch, kv_cache_tokens=batch * 256)
    gen = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(0, 256, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(batch)
    ]
    params = SamplingParams(top_k=1, max_new_tokens=NEW_TOKENS)
    began = time.perf_counter()
    completions = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    seconds = time.perf_counter() - began
    await engine.close()
    return seconds, sum(len(c.token_ids) for c in completions)


@pytest.mark.parametrize("batch", [1, 32])
def test_native_engine_tokens_per_s(benchmark, model, batch: int) -> None:
    seconds, tokens = benchmark.pedantic(
        lambda: asyncio.run(_generate(model, batch)), rounds=3, iterations=1, warmup_rounds=1
    )
    tokens_per_s = tokens / benchmark.stats.stats.min
    _measured[batch] = tokens_per_s
    benchmark.extra_info.update(
        {
            "model": "tiny (4 layers, H=256, V=384), fp32",
            "device": "cpu",
            "batch": batch,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "generated_tokens": tokens,
            "tokens_per_s": tokens_per_s,
        }
    )
    line = f"\nbatch {batch:2d}: {tokens} tokens, {tokens_per_s:8.0f} tokens/s (best of 3)"
    if batch == 32 and 1 in _measured:
        speedup = tokens_per_s / _measured[1]
        benchmark.extra_info["speedup_over_batch_1"] = speedup
        line += f", {speedup:.1f}x batch 1"
    print(line)
