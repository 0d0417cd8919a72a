"""Packing 100k per-turn samples: plan time, efficiency, rank imbalance, collation throughput.

The length mix is what RLM rollouts produce: 90% child turns (log-normal around budget/12) and
10% root turns carrying a long history (0.35..1 x budget), budget 8192, 8 data-parallel ranks.
Samples share one token buffer through numpy views, so 100k samples (~125M tokens) cost no
memory; packing reads lengths, collation copies the tokens of the micro-batches it builds.

    python -m pytest bench/bench_packing.py --benchmark-only -s
"""

from __future__ import annotations

import numpy as np
import pytest

from rlmtrain.algo import Sample, pack

N_SAMPLES = 100_000
BUDGET = 8192
WORLD_SIZE = 8


def _lengths(rng: np.random.Generator) -> np.ndarray:
    n_root = N_SAMPLES // 10
    child = np.exp(rng.normal(np.log(BUDGET / 12), 0.5, N_SAMPLES - n_root))
    root = rng.uniform(0.35 * BUDGET, BUDGET, n_root)
    return rng.permutation(np.clip(np.r_[child, root], 16, BUDGET).astype(np.int64))


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 151_936, BUDGET)
    per_token = rng.random(BUDGET, dtype=np.float32)
    out = []
    for i, length in enumerate(_lengths(rng).tolist()):
        prompt = max(1, length * 3 // 4)
        completion = length - prompt
        out.append(
            Sample(
                task_id=f"task{i // 64}",
                root_id=f"root{i // 8}",
                trajectory_id=f"traj{i // 3}",
                depth=i % 3,
                turn=i % 3,
                input_ids=tokens[:length],
                prompt_len=prompt,
                sampler_logp=per_token[:completion],
                advantages=per_token[:completion],
                weights=per_token[:completion],
            )
        )
    return out


def test_pack_100k_samples(benchmark, samples):
    packed = benchmark.pedantic(
        pack, args=(samples, BUDGET), kwargs={"world_size": WORLD_SIZE}, rounds=5, iterations=1
    )
    stats = packed.stats
    seconds = benchmark.stats.stats.mean
    figures = {
        "samples": stats.samples,
        "tokens": stats.tokens,
        "budget": BUDGET,
        "world_size": WORLD_SIZE,
        "micro_batches": stats.micro_batches,
        "efficiency": stats.efficiency,
        "rank_imbalance": stats.rank_imbalance,
        "split_micro_batches": stats.split_micro_batches,
        "empty_micro_batches": stats.empty_micro_batches,
        "seconds": seconds,
        "samples_per_s": stats.samples / seconds,
    }
    benchmark.extra_info.update(figures)
    print(
        f"\npack {stats.samples} samples ({stats.tokens / 1e6:.1f}M tokens) into "
        f"{stats.micro_batches} micro-batches of {BUDGET} over {WORLD_SIZE} ranks: "
        f"{seconds:.3f} s, efficiency {stats.efficiency:.2%}, "
        f"rank imbalance {stats.rank_imbalance:.3%}, "
        f"{stats.split_micro_batches} split / {stats.empty_micro_batches} empty"
    )
    assert stats.samples == N_SAMPLES


def test_collate_rank0(benchmark, samples):
    packed = pack(samples, BUDGET, world_size=WORLD_SIZE)
    n_batches = 200

    def collate_some() -> int:
        tokens = 0
        for i, batch in enumerate(packed.micro_batches(0)):
            tokens += batch.num_tokens
            if i + 1 == n_batches:
                break
        return tokens

    tokens = benchmark.pedantic(collate_some, rounds=3, iterations=1)
    seconds = benchmark.stats.stats.mean
    # Bytes written per token: input_ids, position_ids, targets (int64) + 3 fp32 tensors.
    gbytes = tokens * (3 * 8 + 3 * 4) / 1e9
    benchmark.extra_info.update(
        {
            "micro_batches": n_batches,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "GB_per_s_written": gbytes / seconds,
        }
    )
    print(
        f"\ncollate {n_batches} micro-batches ({tokens / 1e6:.2f}M tokens): {seconds:.3f} s, "
        f"{tokens / seconds / 1e6:.1f}M tokens/s, {gbytes / seconds:.2f} GB/s written"
    )
