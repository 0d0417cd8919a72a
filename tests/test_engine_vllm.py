"""VLLMEngine against the native engine on the same tiny checkpoint (GPU only).

The tiny random model is saved with `save_hf`, served by vLLM in fp32 with no tokenizer (token
ids only), and compared with NativeEngine on CUDA: same greedy tokens, log-probs equal to the
trainer's within fp32 noise, weight updates in place, sleep and wake.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlmtrain.config import Config, ModelConfig, RolloutConfig
from rlmtrain.devices import HAS_VLLM
from rlmtrain.model import build_model, named_hf_tensors, save_hf
from rlmtrain.rollout.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
]

GREEDY = SamplingParams(top_k=1, max_new_tokens=16)
PROMPTS = [[1, 2, 3, 4], [200, 17], [5] * 33, list(range(10, 60))]


def vllm_engine(directory: Path):
    from rlmtrain.rollout.engines.vllm import VLLMEngine

    config = Config(
        model=ModelConfig(preset="tiny", hf_dir=str(directory), dtype="float32"),
        rollout=RolloutConfig(max_batch_size=8, max_prompt_tokens=256, max_new_tokens=64),
    )
    return VLLMEngine.from_config(
        config, skip_tokenizer_init=True, gpu_memory_utilization=0.2, enforce_eager=True
    )


def test_vllm_matches_native_and_updates_weights(tmp_path: Path) -> None:
    from rlmtrain.rollout.engines.native import NativeEngine

    model = build_model(ModelConfig(preset="tiny", seed=0))
    save_hf(model, tmp_path / "tiny")
    other = build_model(ModelConfig(preset="tiny", seed=1))

    async def main():
        engine = vllm_engine(tmp_path / "tiny")
        native = NativeEngine(model.cuda(), max_batch_size=8, kv_cache_tokens=4096)
        try:
            ours = await asyncio.gather(*(native.generate(p, GREEDY) for p in PROMPTS))
            theirs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
            await engine.update_weights(named_hf_tensors(other))
            updated = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
            await engine.sleep(level=1)
            await engine.wake()
            after_wake = await engine.generate(PROMPTS[0], GREEDY)
        finally:
            await engine.close()
            await native.close()
        return ours, theirs, updated, after_wake

    ours, theirs, updated, after_wake = asyncio.run(main())
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    for a, b in zip(theirs, ours, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-3, rtol=0)
    assert [c.token_ids for c in updated] != [c.token_ids for c in theirs]
    assert after_wake.token_ids == updated[0].token_ids
