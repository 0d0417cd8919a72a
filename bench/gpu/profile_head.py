"""Where the LM-head ops spend their time on a GPU, at the training shape (median of `do_bench`),
then the CUDA kernels of one call of the default path, by total time (torch.profiler).

`--op grpo`: the fused GRPO loss, forward+backward, with each row-gradient variant and several
logit-slab sizes. `--op logprob`: the log-prob op (autograd), forward alone, then forward+backward
with and without the forward's last logit slab kept for the backward, each with slabs of rows and
of vocabulary columns (`Variants.logprob_slabs`).

Run: `python3 bench/gpu/profile_head.py [--op grpo|logprob] [--n 16384] [--h 2560] [--out F]`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from rlmtrain_kernels import Variants, fused_linear_grpo_loss, fused_linear_logprob
from rlmtrain_kernels.logprob import LinearLogprobFunction
from triton.testing import do_bench

V = 151936


def inputs(n: int, h: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(V, h, generator=gen, device="cuda", dtype=torch.bfloat16) * h**-0.5
    return dict(
        x=x,
        w=w.requires_grad_(),
        t=torch.randint(0, V, (n,), generator=gen, device="cuda"),
        old=-12.0 + 0.3 * torch.randn(n, generator=gen, device="cuda"),
        adv=torch.randn(n, generator=gen, device="cuda"),
        weights=torch.full((n,), 1.0 / n, device="cuda"),
        g=torch.randn(n, generator=gen, device="cuda"),
    )


def grpo_cases(d: dict) -> list[tuple[str, int, Callable[[], None]]]:
    """(label, nominal FLOPs in units of NHV, step) for each variant; the default one last."""

    def step_with(variants: Variants) -> Callable[[], None]:
        def step():
            loss, _ = fused_linear_grpo_loss(
                d["x"], d["w"], d["t"], d["old"], d["adv"], d["weights"], impl="triton",
                variants=variants,
            )  # fmt: skip
            torch.autograd.grad(loss, (d["x"], d["w"]))

        return step

    cases = [("grpo fwd+bwd recompute", 8, step_with(Variants(row_grads="recompute")))]
    cases += [
        (f"grpo fwd+bwd stored, slab {gib} GiB", 8, step_with(Variants(logit_slab_bytes=gib << 30)))
        for gib in (1, 4)
    ]
    default_gib = Variants().logit_slab_bytes >> 30
    return [*cases, (f"grpo fwd+bwd stored, slab {default_gib} GiB (default)", 8, step_with(None))]


def logprob_cases(d: dict) -> list[tuple[str, int, Callable[[], None]]]:
    def forward(variants: Variants) -> Callable[[], None]:
        def run():
            with torch.no_grad():
                fused_linear_logprob(d["x"], d["w"], d["t"], impl="triton", variants=variants)

        return run

    def both(keep: bool, variants: Variants) -> Callable[[], None]:
        def run():
            logp, _ = LinearLogprobFunction.apply(
                d["x"], d["w"], d["t"], 1.0, -100, False, keep, "triton", variants.spec
            )
            torch.autograd.grad(logp, (d["x"], d["w"]), d["g"])

        return run

    default = Variants()
    other = "columns" if default.logprob_slabs == "rows" else "rows"
    cut_other = Variants(logprob_slabs=other)
    return [
        ("logprob forward", 2, forward(default)),
        (f"logprob forward, slabs of {other}", 2, forward(cut_other)),
        ("logprob fwd+bwd, nothing kept", 8, both(False, default)),
        (f"logprob fwd+bwd, slabs of {other}, last kept", 8, both(True, cut_other)),
        (f"logprob fwd+bwd, slabs of {default.logprob_slabs}, last kept (default)", 8,
         both(True, default)),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", choices=("grpo", "logprob"), default="grpo")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=2560)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    d = inputs(args.n, args.h)
    nhv = args.n * args.h * V
    rows = []
    cases = grpo_cases(d) if args.op == "grpo" else logprob_cases(d)
    for label, nominal, run in cases:
        torch.cuda.reset_peak_memory_stats()
        ms = do_bench(run, warmup=100, rep=1000, return_mode="median")
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(dict(case=label, ms=ms, tflops=nominal * nhv / ms / 1e9, peak_gib=peak))
        print(
            f"{label} N={args.n} H={args.h}: {ms:7.2f} ms {rows[-1]['tflops']:5.0f} TFLOP/s "
            f"({nominal}NHV), peak {peak:.1f} GiB",
            flush=True,
        )

    default = cases[-1][2]
    default()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=activities) as prof:
        start.record()
        default()
        end.record()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="device_time_total", row_limit=14, max_name_column_width=60
    )
    print(table)
    # Kernel time against the call's span: what is left is the GPU waiting for the host
    # (synchronisations, launches, allocations); the trace shows where.
    gpu = torch.autograd.DeviceType.CUDA
    kernels_ms = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == gpu)
    kernels_ms /= 1e3
    span_ms = start.elapsed_time(end)
    idle_ms = span_ms - kernels_ms
    print(f"kernels {kernels_ms:.2f} ms of the call's {span_ms:.2f} ms: GPU idle {idle_ms:.2f} ms")
    if args.out:
        prof.export_chrome_trace(args.out.removesuffix(".json") + ".trace.json")
        with open(args.out, "w") as f:
            summary = dict(kernels_ms=kernels_ms, span_ms=span_ms)
            json.dump({"op": args.op, "rows": rows, "kernels": table, **summary}, f, indent=1)


if __name__ == "__main__":
    main()
