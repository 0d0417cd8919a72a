"""Model throughput on packed batches: tokens/s and achieved GFLOP/s, forward+backward and forward.

Run: `python -m pytest bench/bench_model.py -q -s` (add `--benchmark-json out.json` to keep them).

Shapes: `tiny` and a Qwen3-0.6B-shaped model (H=1024, 16/8 heads of 128, I=3072, V=151936) on one
packed batch of T=2048 tokens in 7 sequences, fp32 on the CPU (bf16 on CUDA). On a CPU the 0.6B
shape keeps 2 of its 28 layers (`extra_info["layers"]`): all 28 take minutes per step on a small
shared box; per-layer cost is uniform, so tokens/s scale as about 2/28 of the full model's,
less the embedding share.

Layers: fwd+bwd runs each shape with eager layers and with `compile_layers` (each layer's work
around attention in two torch.compile'd regions; the warm-up round compiles;
`extra_info["compiled_layers"]`).

Backends: fwd+bwd uses per-sequence SDPA on CPU, because torch 2.13 has no flex_attention
backward on CPU; flex is compared with SDPA on the forward (inference) pass there. On CUDA all
available backends run both.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from rlmtrain import devices
from rlmtrain.model import KVCache, ModelArgs, Transformer, preset
from rlmtrain.model.kv_cache import decode, prefill

DEVICE = "cuda" if devices.HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if devices.HAS_CUDA else torch.float32
LENGTHS = (512, 384, 300, 256, 200, 220, 176)  # T = 2048
CPU_LAYERS_06B = 2


def model_args(name: str) -> ModelArgs:
    args = preset(name)
    if name == "qwen3-0.6b" and DEVICE == "cpu":
        return msgspec.structs.replace(args, num_layers=CPU_LAYERS_06B)
    return args


def matmul_flops_per_token(args: ModelArgs) -> int:
    """Forward FLOPs of the weight matmuls per token (2 per multiply-add); no LM head."""
    attn = args.hidden_size * args.head_dim * (2 * args.num_heads + 2 * args.num_kv_heads)
    mlp = 3 * args.hidden_size * args.intermediate_size
    return 2 * args.num_layers * (attn + mlp)


def attention_flops(args: ModelArgs) -> int:
    """Forward FLOPs of causal QK^T and PV over the packed sequences."""
    pairs = sum(n * (n + 1) // 2 for n in LENGTHS)
    return 4 * args.num_layers * args.num_heads * args.head_dim * pairs


def packed_batch(vocab: int):
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    ids = torch.randint(0, vocab, (total,), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).to(DEVICE)
    cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0).to(DEVICE)
    return ids, positions, cu_seqlens


def build(name: str, attention: str, compile_layers: bool = False) -> Transformer:
    with torch.device("meta"):
        model = Transformer(model_args(name), attention=attention, compile_layers=compile_layers)
    model = model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.to(device=DEVICE, dtype=DTYPE)


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def report(
    benchmark, name: str, attention: str, mode: str, args: ModelArgs, layers: str = "eager"
) -> None:
    # Median and best rather than mean: on a shared CPU one slow round dominates a mean.
    seconds, best = benchmark.stats.stats.median, benchmark.stats.stats.min
    tokens = sum(LENGTHS)
    forward = matmul_flops_per_token(args) * tokens + attention_flops(args)
    flops = forward * (3 if mode == "fwd+bwd" else 1)
    info = {
        "model": name,
        "layers": args.num_layers,
        "full_layers": preset(name).num_layers,
        "attention": attention,
        "compiled_layers": layers == "compiled",
        "mode": mode,
        "device": DEVICE if DEVICE == "cpu" else torch.cuda.get_device_name(),
        "dtype": str(DTYPE).removeprefix("torch."),
        "tokens": tokens,
        "sequences": len(LENGTHS),
        "tokens_per_s": round(tokens / seconds, 1),
        "best_tokens_per_s": round(tokens / best, 1),
        "gflop_per_s": round(flops / seconds / 1e9, 2),
        "threads": torch.get_num_threads(),
    }
    benchmark.extra_info.update(info)
    print(
        f"\n{name} ({args.num_layers}/{preset(name).num_layers} layers, {layers}) {attention} "
        f"{mode}: "
        f"{info['tokens_per_s']} tokens/s (best {info['best_tokens_per_s']}), "
        f"{info['gflop_per_s']} GFLOP/s, {seconds * 1e3:.0f} ms per step (median)"
    )


def training_backends() -> list[str]:
    backends = ["sdpa"]
    if DEVICE == "cuda":
        backends.append("flex")
        if devices.HAS_FLASH_ATTN:
            backends.append("flash")
    return backends


@pytest.mark.parametrize("layers", ["eager", "compiled"])
@pytest.mark.parametrize("attention", training_backends())
@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b"])
def test_forward_backward(benchmark, name, attention, layers):
    torch._dynamo.reset()
    model = build(name, attention, compile_layers=layers == "compiled")
    ids, positions, cu_seqlens = packed_batch(model.args.vocab_size)

    def step():
        model.zero_grad(set_to_none=True)
        hidden = model(ids, positions, cu_seqlens)
        hidden.float().square().mean().backward()
        synchronize()

    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
    report(benchmark, name, attention, "fwd+bwd", model.args, layers)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b"])
def test_forward(benchmark, name, attention):
    model = build(name, attention)
    ids, positions, cu_seqlens = packed_batch(model.args.vocab_size)

    def step():
        with torch.no_grad():
            model(ids, positions, cu_seqlens)
        synchronize()

    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
    report(benchmark, name, attention, "fwd", model.args)


def test_decode_step(benchmark):
    """One ragged decode step of `tiny` for 16 cached sequences of 64..544 tokens."""
    model = build("tiny", "sdpa")
    prompt_lengths = [64 + 32 * i for i in range(16)]
    cache = KVCache.for_model(model, capacity_tokens=16384)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=gen) for n in prompt_lengths]
    seq_ids = list(range(len(prompts)))
    prefill(model, cache, seq_ids, prompts)
    tokens = torch.zeros(len(seq_ids), dtype=torch.long, device=DEVICE)

    def step():
        decode(model, cache, seq_ids, tokens)
        synchronize()

    benchmark.pedantic(step, rounds=5, iterations=1, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    info = {
        "model": "tiny",
        "mode": "decode",
        "device": DEVICE,
        "sequences": len(seq_ids),
        "context_tokens": sum(prompt_lengths),
        "tokens_per_s": round(len(seq_ids) / seconds, 1),
        "ms_per_step": round(seconds * 1e3, 2),
    }
    benchmark.extra_info.update(info)
    print(
        f"\ntiny decode, 16 ragged sequences: {info['tokens_per_s']} tokens/s, "
        f"{info['ms_per_step']} ms per step"
    )
