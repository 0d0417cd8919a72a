"""vLLM (the CPU build) against the native engine on the default's RL step, and vLLM weight sync.

The RL step is the one `configs/tiny-cpu.toml` takes: 4 evidence tasks x G = 8 trees, up to 3
turns of 64 sampled tokens, through the real `Scheduler`, REPL workers and all, with a BPE of the
default's size trained on the tasks' text, from the tiny policy at random initialisation (what
it samples is noise; the engine's work is the same). Both engines serve the same weights at the
same seeds. Figures: generated tokens/s, occupancy (sequences per engine step / batch size),
wall seconds; and for vLLM the seconds `update_weights` takes to send every tensor of the tiny
model in buckets of the config's size (best of 3) and its start-up seconds. The engines draw
from different random streams, so the trees differ; the work per step is alike.

    python -m pytest bench/bench_vllm_engine.py --benchmark-only -s
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from rlmtrain.config import load_config
from rlmtrain.devices import HAS_VLLM
from rlmtrain.envs.base import get_env
from rlmtrain.model import build_model, named_hf_tensors
from rlmtrain.model.bpe import train_bpe
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines import build_engine
from rlmtrain.rollout.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

ROOT = Path(__file__).resolve().parents[1]
_measured: dict[str, dict] = {}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_vllm")
    cfg = load_config(ROOT / "configs" / "tiny-cpu.toml")
    cfg = msgspec.structs.replace(
        cfg, checkpoint=msgspec.structs.replace(cfg.checkpoint, dir=str(folder / "run"))
    )
    env = get_env(cfg.data.env, cfg)
    tasks = env.split_tasks(cfg, "rl")[: cfg.train.tasks_per_step]
    tokenizer = train_bpe(env.vocabulary_texts(tasks), cfg.model.bpe_vocab_size, folder / "bpe")
    model_cfg = msgspec.structs.replace(
        cfg.model, tokenizer=str(folder / "bpe"), vocab_size=tokenizer.vocab_size
    )
    cfg = msgspec.structs.replace(cfg, model=model_cfg)
    model = build_model(model_cfg)
    return cfg, env, tasks, tokenizer, model


async def _rl_step(cfg, env, tasks, tokenizer, engine) -> dict:
    sampling = SamplingParams(temperature=cfg.rollout.temperature, seed=cfg.train.seed)
    scheduler = Scheduler(engine, tokenizer, cfg.rollout, sampling=sampling)
    began = time.perf_counter()
    groups = await scheduler.rollout(tasks, env, cfg.rollout.n_samples)
    seconds = time.perf_counter() - began
    stats = engine.stats()
    return {
        "seconds": seconds,
        "generated_tokens": stats.generated_tokens,
        "tokens_per_s": stats.generated_tokens / seconds,
        "occupancy": stats.batch_slots_used / max(1, stats.steps * stats.max_batch_size),
        "trees": sum(len(g.roots) for g in groups),
    }


@pytest.mark.parametrize("engine_name", ["native", "vllm"])
def test_rl_step_tokens_per_s(benchmark, setting, engine_name: str) -> None:
    cfg, env, tasks, tokenizer, model = setting
    cfg = msgspec.structs.replace(
        cfg, rollout=msgspec.structs.replace(cfg.rollout, engine=engine_name)
    )
    info: dict = {"engine": engine_name, "model": "tiny, fp32, BPE 2048", "device": "cpu"}

    async def measure() -> dict:
        began = time.perf_counter()
        engine = build_engine(cfg, tokenizer)
        info["start_s"] = time.perf_counter() - began
        try:
            await engine.update_weights(named_hf_tensors(model))
            if engine_name == "vllm":
                syncs = []
                for _ in range(3):
                    began = time.perf_counter()
                    await engine.update_weights(named_hf_tensors(model))
                    syncs.append(time.perf_counter() - began)
                info["weight_sync_s"] = min(syncs)
            return await _rl_step(cfg, env, tasks, tokenizer, engine)
        finally:
            await engine.close()

    result = benchmark.pedantic(lambda: asyncio.run(measure()), rounds=1, iterations=1)
    _measured[engine_name] = result
    info.update(result)
    line = (
        f"\n{engine_name:>6}: {result['generated_tokens']} tokens in {result['seconds']:.1f} s, "
        f"{result['tokens_per_s']:.0f} tokens/s, occupancy {result['occupancy']:.0%}, "
        f"start {info['start_s']:.1f} s"
    )
    if engine_name == "vllm":
        line += f", weight sync {info['weight_sync_s']:.2f} s"
        native = _measured.get("native")
        if native is not None:
            info["vs_native"] = result["tokens_per_s"] / native["tokens_per_s"]
            line += f"; {info['vs_native']:.2f}x native"
    benchmark.extra_info.update(info)
    print(line)
