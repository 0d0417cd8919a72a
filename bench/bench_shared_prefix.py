"""Training step time with shared prefixes laid out once against every sample carrying its own.

A batch of per-turn samples behind one system prompt, as RLM rollouts produce them: the compact
prompt of the embedded default (~310 tokens, ~130 own tokens per sample) and the full prompt of
the GPU configs (~5.5k tokens, ~250 own tokens). One forward and backward of the tiny preset
through the GRPO loss per round; the figure is sample tokens per second (every sample's full
length, what the plain layout forwards) and the speed-up of sharing.

    python -m pytest bench/bench_shared_prefix.py --benchmark-only -s
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlmtrain.algo import Sample, pack
from rlmtrain.config import ModelConfig
from rlmtrain.kernels import fused_linear_grpo_loss
from rlmtrain.model import build_model

SHAPES = {
    "compact-310": (310, 130, 48, 8192),
    "full-5500": (5500, 250, 16, 16384),
}
"""name: (system prompt tokens, mean own tokens per sample, samples, micro-batch budget)."""
_MEASURED: dict[tuple[str, bool], float] = {}


def _batch(system: int, own: int, count: int, vocab: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, vocab, system)
    samples = []
    for i in range(count):
        length = int(np.clip(rng.lognormal(np.log(own), 0.4), 24, 4 * own))
        completion = min(48, length // 3)
        tokens = np.concatenate([prefix, rng.integers(0, vocab, length)])
        samples.append(
            Sample(
                task_id="t",
                root_id=f"r{i}",
                trajectory_id=f"traj{i}",
                depth=0,
                turn=0,
                input_ids=tokens,
                prompt_len=tokens.shape[0] - completion,
                sampler_logp=np.zeros(completion, np.float32),
                advantages=rng.normal(size=completion).astype(np.float32),
                weights=np.full(completion, 1.0 / (count * completion), np.float32),
            )
        )
    return samples


def _step(model, packed) -> None:
    model.zero_grad(set_to_none=True)
    for mb in packed.micro_batches():
        hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.prefix_of)
        loss, _ = fused_linear_grpo_loss(
            hidden, model.lm_head_weight, mb.targets, None, mb.advantages, mb.weights
        )
        loss.backward()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("shared", [False, True], ids=["copied", "shared"])
def test_train_step(benchmark, shape, shared):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"))
    system, own, count, budget = SHAPES[shape]
    samples = _batch(system, own, count, model.args.vocab_size)
    packed = pack(samples, budget, shared_prefix_tokens=64 if shared else 0)
    benchmark.pedantic(_step, args=(model, packed), rounds=3, iterations=1, warmup_rounds=1)
    sample_tokens = sum(s.length for s in samples)
    per_second = sample_tokens / benchmark.stats.stats.mean
    benchmark.extra_info.update(
        sample_tokens=sample_tokens,
        laid_out_tokens=packed.stats.tokens,
        micro_batches=packed.stats.micro_batches,
        sample_tokens_per_s=per_second,
    )
    print(
        f"\n{shape} {'shared' if shared else 'copied'}: {sample_tokens} sample tokens laid out "
        f"as {packed.stats.tokens} in {packed.stats.micro_batches} micro-batches, "
        f"{per_second:,.0f} sample tokens/s"
    )
    _MEASURED[shape, shared] = per_second
    if len({key for key in _MEASURED if key[0] == shape}) == 2:
        speedup = _MEASURED[shape, True] / _MEASURED[shape, False]
        benchmark.extra_info["speedup"] = speedup
        print(f"{shape}: sharing is {speedup:.2f}x the copied layout")
