"""Kernel benchmarks: the fused log-prob / GRPO loss against full logits, Liger and Cut
Cross-Entropy, in hardware units.

Run: `pytest bench/bench_kernels.py --benchmark-only -s` (every figure is printed and stored in
pytest-benchmark's `extra_info`; a table comparing the implementations prints at the end).

CPU part (fp32, V = 151936, H in {256, 1024}, N in {1024, 4096}; forward + backward of the GRPO
loss of a linear head): our chunked torch backend vs full logits (matmul, log_softmax, gather,
autograd) vs Liger's `LigerFusedLinearGRPOLoss` (its chunked torch path, compiled=False).
Peak memory on the CPU is measured from the kernel's own accounting, honestly and without
tracemalloc (which does not see torch's allocations): before each run the inputs exist,
`malloc_trim(0)` hands every free heap page back (so reusing one costs a page fault again) and
writing 5 to /proc/self/clear_refs resets the resident high-water mark VmHWM to the current
resident size; after the run, extra = VmHWM - resident size before - bytes of the returned
gradients. Targets: the memory ours adds from N=1024 to N=4096 <= 5% of what naive adds; ours'
extra at N=4096 <= 25% of naive's; time <= 1.2x naive's.

CUDA part (bf16, H in {2560, 4096} as Qwen3-4B/8B, V = 151936, N in {4096, 16384, 65536}):
Triton vs full logits vs Liger vs Cut Cross-Entropy (when installed): forward, backward and
both, TFLOP/s on the nominal counts 2·N·H·V forward and 6·N·H·V backward (logits recomputed),
the same for every implementation, % of the dense bf16 peak (the datasheet's and the measured
matmul rate's), peak memory above inputs and gradients (torch.cuda peak stats); the GRPO loss
alone in GB/s, per call and (replayed from a CUDA graph) for its kernels alone.
`BENCH_TILES_JSON=file` runs the Triton kernels with the tile shapes and variants a sweep chose
(bench/gpu/sweep_tiles.py), passed to each call as its `Variants`; every figure records them.
bench/gpu/run.sh runs all of it on a GPU machine in one call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os

import pytest
import torch
from rlmtrain_kernels import (
    Variants,
    fused_linear_grpo_loss,
    fused_linear_logprob,
    grpo_loss,
    tiles,
)

V = 151936
DATASHEET_BF16_PEAK_FLOPS = 989.4e12  # H100/H200 SXM dense bf16, the vendor's figure


def _measured_ceilings() -> tuple[float, float]:
    """(bf16 matmul FLOP/s, copy bytes/s) of the card: this run's own `bench/gpu/ceilings.py`
    output when BENCH_CEILINGS_JSON names it (bench/gpu/run.sh does), else an H200 earlier."""
    path = os.environ.get("BENCH_CEILINGS_JSON")
    if not path:
        return 790e12, 4.3e12  # an H200 of this workplace, 2026-10-28 (8192^3 random bf16)
    with open(path) as f:
        found = json.load(f)
    return found["bf16_matmul_flops"], found["copy_bytes_per_s"]


MEASURED_BF16_FLOPS, MEASURED_COPY_BYTES_PER_S = _measured_ceilings()
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
LIGER_SEQ = 512  # Liger takes padded [B, T] batches; N tokens become N / 512 sequences
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_CCE = importlib.util.find_spec("cut_cross_entropy") is not None


# --- workloads -----------------------------------------------------------------------------------


def grpo_inputs(n: int, h: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(V, h, generator=gen, device=device, dtype=dtype) * h**-0.5
    targets = torch.randint(0, V, (n,), generator=gen, device=device)
    old_logp = -12.0 + 0.3 * torch.randn(n, generator=gen, device=device)
    # One advantage per LIGER_SEQ-token sequence: Liger's contract, so all three compute one loss.
    advantages = torch.randn(n // LIGER_SEQ, generator=gen, device=device)
    advantages = advantages.repeat_interleave(LIGER_SEQ)
    weights = torch.full((n,), 1.0 / n, device=device)
    return dict(
        hidden=hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        targets=targets,
        old_logp=old_logp,
        advantages=advantages,
        weights=weights,
    )


def grads_of(loss: torch.Tensor, inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.autograd.grad(loss, (inp["hidden"], inp["weight"]))


def ours_grpo(inp: dict, impl: str, variants: Variants | None = None):
    loss, _ = fused_linear_grpo_loss(
        inp["hidden"], inp["weight"], inp["targets"], inp["old_logp"], inp["advantages"],
        inp["weights"], clip_low=CLIP_LOW, clip_high=CLIP_HIGH, impl=impl, variants=variants,
    )  # fmt: skip
    return grads_of(loss, inp)


def naive_grpo(inp: dict):
    logits = (inp["hidden"] @ inp["weight"].T).float()
    logp = torch.log_softmax(logits, -1).gather(1, inp["targets"][:, None]).squeeze(1)
    ratio = torch.exp(logp - inp["old_logp"])
    adv = inp["advantages"]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
    return grads_of((inp["weights"] * per_token).sum(), inp)


def liger_grpo(inp: dict, compiled: bool = False):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    n, h = inp["hidden"].shape
    b = n // LIGER_SEQ
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0, compiled=compiled, use_ref_model=False, epsilon_low=CLIP_LOW,
        epsilon_high=CLIP_HIGH, loss_type="bnpo",
    )  # fmt: skip
    loss, _ = loss_fn(
        inp["hidden"].view(b, LIGER_SEQ, h),
        inp["weight"],
        inp["targets"].view(b, LIGER_SEQ),
        torch.ones(b, LIGER_SEQ, dtype=torch.long, device=inp["hidden"].device),
        inp["advantages"].view(b, LIGER_SEQ)[:, 0].contiguous(),
        old_per_token_logps=inp["old_logp"].view(b, LIGER_SEQ),
    )
    return grads_of(loss, inp)


# --- CPU -----------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class HostPeak:
    """Resident-memory high-water mark of this process above its level at `start()`."""

    def start(self) -> None:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base_kib = _status_kib("VmRSS")

    def extra_bytes(self) -> int:
        return (_status_kib("VmHWM") - self.base_kib) * 1024


CPU_IMPLS = {
    "ours": lambda inp: ours_grpo(inp, "torch"),
    "naive": naive_grpo,
    "liger": liger_grpo,
}
CPU_CASES = [(n, h) for h in (256, 1024) for n in (1024, 4096)]


@pytest.fixture(scope="module")
def cpu_results():
    results: dict[tuple[str, int, int], dict] = {}
    yield results
    print_cpu_summary(results)


def print_cpu_summary(results: dict) -> None:
    if not results:
        return
    print("\nCPU GRPO forward+backward, fp32, V=151936")
    print(f"{'impl':>6} {'H':>5} {'N':>5} {'time s':>8} {'extra MiB':>10}")
    for (impl, h, n), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        print(f"{impl:>6} {h:>5} {n:>5} {r['seconds']:>8.2f} {r['extra_bytes'] / 2**20:>10.0f}")
    for h in (256, 1024):
        need = [("ours", h, 1024), ("ours", h, 4096), ("naive", h, 1024), ("naive", h, 4096)]
        if not all(k in results for k in need):
            continue
        ours_growth = results[need[1]]["extra_bytes"] - results[need[0]]["extra_bytes"]
        naive_growth = results[need[3]]["extra_bytes"] - results[need[2]]["extra_bytes"]
        mem_ratio = results[need[1]]["extra_bytes"] / results[need[3]]["extra_bytes"]
        time_ratio = results[need[1]]["seconds"] / results[need[3]]["seconds"]
        growth_ratio = ours_growth / naive_growth
        print(
            f"H={h}: growth 1024->4096 ours/naive {growth_ratio:.3%} (target <= 5%), "
            f"extra at N=4096 ours/naive {mem_ratio:.1%} (target <= 25%), "
            f"time at N=4096 ours/naive {time_ratio:.2f}x (target <= 1.2x)"
        )


@pytest.mark.parametrize("impl", list(CPU_IMPLS))
@pytest.mark.parametrize(("n", "h"), CPU_CASES)
def test_cpu_grpo_forward_backward(benchmark, cpu_results, impl, n, h):
    if impl.startswith("liger") and not HAS_LIGER:
        pytest.skip("liger-kernel is not installed")
    if impl == "liger-compiled" and (n, h) != (16384, 2560):
        pytest.skip("compiled Liger runs at N=16384, H=2560 only")
    inp = grpo_inputs(n, h, torch.float32, "cpu")
    run = CPU_IMPLS[impl]
    peak = HostPeak()
    # One warm-up round (first calls at a new shape pay for BLAS set-up and first-touch page
    # faults); setup runs before every round, so the peak is that of the measured round.
    grads = benchmark.pedantic(
        lambda: run(inp), setup=peak.start, rounds=1, iterations=1, warmup_rounds=1
    )
    seconds = benchmark.stats.stats.median
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    extra = peak.extra_bytes() - grad_bytes
    flops = 6 * n * h * V
    info = dict(
        device="cpu", impl=impl, dtype="float32", N=n, H=h, V=V, seconds=seconds,
        peak_extra_bytes=extra, gflops_per_s=flops / seconds / 1e9,
        memory_method="VmHWM after malloc_trim + clear_refs, minus returned gradients",
    )  # fmt: skip
    benchmark.extra_info.update(info)
    cpu_results[(impl, h, n)] = dict(seconds=seconds, extra_bytes=extra)
    print(
        f"\n[cpu] {impl} N={n} H={h}: {seconds:.2f} s, {flops / seconds / 1e9:.1f} GFLOP/s "
        f"(6NHV), peak extra {extra / 2**20:.0f} MiB"
    )


PACKED_N, PACKED_H = 4096, 1024


@pytest.fixture(scope="module")
def packed_results():
    results: dict[float, float] = {}
    yield results
    if 1.0 in results and 0.25 in results:
        print(
            f"\npacked batch N={PACKED_N} H={PACKED_H}: 25% trained rows take "
            f"{results[0.25] / results[1.0]:.2f}x the time of 100% (ignored rows skip the head)"
        )


@pytest.mark.parametrize("trained_fraction", [1.0, 0.25])
def test_cpu_packed_batch_cost_follows_trained_rows(benchmark, packed_results, trained_fraction):
    """A packed RL batch is mostly prompt (ignored targets); the head's time should follow the
    trained rows. The trained rows come in spans, as packing lays out completions."""
    inp = grpo_inputs(PACKED_N, PACKED_H, torch.float32, "cpu")
    span = 256
    keep = int(span * trained_fraction)
    prompt = (torch.arange(PACKED_N) % span) >= keep
    inp["targets"] = inp["targets"].masked_fill(prompt, -100)
    benchmark.pedantic(lambda: ours_grpo(inp, "torch"), rounds=1, iterations=1, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    packed_results[trained_fraction] = seconds
    benchmark.extra_info.update(
        device="cpu", N=PACKED_N, H=PACKED_H, V=V, trained_fraction=trained_fraction,
        seconds=seconds,
    )  # fmt: skip
    print(f"\n[cpu] packed N={PACKED_N} trained {trained_fraction:.0%}: {seconds:.2f} s")


# --- CUDA ----------------------------------------------------------------------------------------

CUDA_CASES = [(n, h) for h in (2560, 4096) for n in (4096, 16384, 65536)]
NOMINAL_FLOPS = {"forward": 2, "backward": 6, "both": 8}  # times N*H*V


def cuda_logprob_fn(impl: str, variants: Variants):
    """(hidden, weight, targets) -> per-token log-probs [N] for each implementation."""
    if impl == "triton":
        return lambda x, w, t: fused_linear_logprob(x, w, t, impl="triton", variants=variants)
    if impl == "naive":
        return lambda x, w, t: torch.log_softmax((x @ w.T).float(), -1).gather(1, t[:, None])[:, 0]
    if impl == "cce":
        if not HAS_CCE:
            pytest.skip("cut-cross-entropy is not installed")
        from cut_cross_entropy import linear_cross_entropy

        return lambda x, w, t: -linear_cross_entropy(x, w, t, reduction="none")
    raise ValueError(impl)


@pytest.fixture(scope="module")
def cuda_variants() -> Variants:
    """The Triton kernels' variants for this run: a sweep's winners when BENCH_TILES_JSON names
    its output, else the defaults."""
    path = os.environ.get("BENCH_TILES_JSON")
    if not path:
        return Variants()
    with open(path) as f:
        chosen = json.load(f)
    return Variants(
        forward=chosen["forward_variant"], backward=chosen["backward_variant"],
        tiles=chosen["tiles"],
    )  # fmt: skip


def described(variants: Variants) -> dict:
    """What a figure records of the variants it ran: each choice, and every bf16 kernel's tile
    shape (the call's own, or the default table's)."""
    cuda = torch.device("cuda")
    shapes = {
        k: tiles.tiles_for(cuda, k, torch.bfloat16, variants)
        for k in ("forward", "backward", "dlogits")
    }
    choices = {f.name: getattr(variants, f.name) for f in dataclasses.fields(variants)}
    return {**choices, "tiles": shapes}


def report_cuda(
    benchmark, name: str, n: int, h: int, flops_factor: int, extra: int, variants: Variants
) -> None:
    seconds = benchmark.stats.stats.median
    tflops = flops_factor * n * h * V / seconds / 1e12
    info = dict(
        device=torch.cuda.get_device_name(), dtype="bfloat16", N=n, H=h, V=V,
        median_s=seconds, tflops=tflops, peak_extra_bytes=extra,
        pct_of_bf16_peak=100 * tflops * 1e12 / MEASURED_BF16_FLOPS,
        pct_of_datasheet_peak=100 * tflops * 1e12 / DATASHEET_BF16_PEAK_FLOPS,
        name=name, variants=described(variants),
    )  # fmt: skip
    benchmark.extra_info.update(info)
    print(
        f"\n[cuda] {name} N={n} H={h}: {seconds * 1e3:.2f} ms, {tflops:.0f} TFLOP/s "
        f"({info['pct_of_datasheet_peak']:.0f}% of datasheet peak, "
        f"{info['pct_of_bf16_peak']:.0f}% of measured matmul), peak extra {extra / 2**30:.2f} GiB"
    )


def cuda_peak_extra(fn, baseline: int, grad_bytes: int) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline - grad_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("phase", list(NOMINAL_FLOPS))
@pytest.mark.parametrize("impl", ["triton", "naive", "cce"])
@pytest.mark.parametrize(("n", "h"), CUDA_CASES)
def test_cuda_logprob(benchmark, cuda_variants, impl, phase, n, h):
    logprob = cuda_logprob_fn(impl, cuda_variants)
    inp = grpo_inputs(n, h, torch.bfloat16, "cuda")
    x, w, t = inp["hidden"], inp["weight"], inp["targets"]
    upstream = torch.randn(n, device="cuda")
    grad_bytes = 0 if phase == "forward" else (x.numel() + w.numel()) * x.element_size()

    def forward():
        with torch.no_grad():
            logprob(x, w, t)
        torch.cuda.synchronize()

    def both():
        torch.autograd.grad(logprob(x, w, t), (x, w), upstream)
        torch.cuda.synchronize()

    def backward_setup():
        logp = logprob(x, w, t)
        torch.cuda.synchronize()  # else the forward's kernels run on into the timed backward
        return (logp,), {}

    def backward(logp):
        torch.autograd.grad(logp, (x, w), upstream)
        torch.cuda.synchronize()

    try:
        baseline = torch.cuda.memory_allocated()
        run = {"forward": forward, "both": both, "backward": lambda: backward(logprob(x, w, t))}
        extra = cuda_peak_extra(run[phase], baseline, grad_bytes)
        if phase == "backward":
            benchmark.pedantic(backward, setup=backward_setup, rounds=5, warmup_rounds=1)
        else:
            benchmark.pedantic(run[phase], rounds=5, warmup_rounds=1)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()  # so that the next case starts from an unfragmented pool
        benchmark.extra_info.update(N=n, H=h, impl=impl, phase=phase, result="out of memory")
        pytest.skip(f"{impl} {phase} N={n} H={h}: out of memory")
    report_cuda(
        benchmark, f"logprob {impl} {phase}", n, h, NOMINAL_FLOPS[phase], extra, cuda_variants
    )


def recompute_grpo(inp: dict, variants: Variants):
    """Ours with the logits formed twice (forward kernel, backward recompute): 8·N·H·V."""
    return ours_grpo(inp, "triton", dataclasses.replace(variants, row_grads="recompute"))


# (inputs, the run's variants) -> gradients; the variants choose among ours' Triton paths only.
CUDA_GRPO_IMPLS = {
    "triton": lambda inp, variants: ours_grpo(inp, "triton", variants),
    "triton-recompute": recompute_grpo,
    "naive": lambda inp, _: naive_grpo(inp),
    "liger": lambda inp, _: liger_grpo(inp),
    # Liger's loss as its users run it, under torch.compile: compiled at the key shape only, since
    # each shape costs a compilation.
    "liger-compiled": lambda inp, _: liger_grpo(inp, compiled=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("impl", list(CUDA_GRPO_IMPLS))
@pytest.mark.parametrize(("n", "h"), CUDA_CASES)
def test_cuda_fused_grpo_forward_backward(benchmark, cuda_variants, impl, n, h):
    if impl.startswith("liger") and not HAS_LIGER:
        pytest.skip("liger-kernel is not installed")
    if impl == "liger-compiled" and (n, h) != (16384, 2560):
        pytest.skip("compiled Liger runs at N=16384, H=2560 only")
    inp = grpo_inputs(n, h, torch.bfloat16, "cuda")
    grad_bytes = (inp["hidden"].numel() + inp["weight"].numel()) * 2

    def run():
        CUDA_GRPO_IMPLS[impl](inp, cuda_variants)
        torch.cuda.synchronize()

    try:
        extra = cuda_peak_extra(run, torch.cuda.memory_allocated(), grad_bytes)
        benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()  # so that the next case starts from an unfragmented pool
        benchmark.extra_info.update(N=n, H=h, impl=impl, result="out of memory")
        pytest.skip(f"{impl} N={n} H={h}: out of memory")
    report_cuda(
        benchmark, f"grpo {impl} fwd+bwd", n, h, NOMINAL_FLOPS["both"], extra, cuda_variants
    )


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch", "triton-graph"])
@pytest.mark.parametrize("n", [1 << 20, 1 << 24])
def test_cuda_grpo_loss_alone(benchmark, impl, n):
    """A call's wall time, host work included; "triton-graph" replays one call captured in a
    CUDA graph, so its figure is the kernels' alone."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = [torch.randn(n, generator=gen, device="cuda") - 3 for _ in range(6)]
    logp, old, adv, w, ref, sampler = tokens

    def call():
        grpo_loss(
            logp, old, adv, w, ref_logp=ref, beta=0.01, sampler_logp=sampler, tis_cap=2.0,
            dual_clip=3.0, impl=impl.removesuffix("-graph"),
        )  # fmt: skip

    step = call
    if impl.endswith("-graph"):
        side = torch.cuda.Stream()  # a capture needs its kernels built and run once, off-graph
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        step = graph.replay

    def run():
        step()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    seconds = benchmark.stats.stats.median
    moved = 7 * 4 * n  # six fp32 inputs read, the fp32 gradient written
    gb_per_s = moved / seconds / 1e9
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name(), N=n, impl=impl, median_s=seconds, gb_per_s=gb_per_s,
        pct_of_measured_copy=100 * gb_per_s * 1e9 / MEASURED_COPY_BYTES_PER_S,
        name=f"grpo_loss {impl}",
    )  # fmt: skip
    print(
        f"\n[cuda] grpo_loss {impl} N={n}: {seconds * 1e6:.0f} us, {gb_per_s:.0f} GB/s "
        f"({100 * gb_per_s * 1e9 / MEASURED_COPY_BYTES_PER_S:.0f}% of the measured copy bandwidth)"
    )
