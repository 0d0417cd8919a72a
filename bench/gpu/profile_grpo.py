"""Where the fused GRPO loss spends its time on a GPU, at the training shape: forward+backward
with each row-gradient variant and several logit-slab sizes (median of `do_bench`), then the
CUDA kernels of one call of the default path, by total time (torch.profiler).

Run: `python3 bench/gpu/profile_grpo.py [--n 16384] [--h 2560] [--out profile.json]`.
"""

from __future__ import annotations

import argparse
import json

import torch
from rlmtrain_kernels import fused_linear_grpo_loss, logit_slabs, tiles
from triton.testing import do_bench

V = 151936


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=2560)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, h = args.n, args.h
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(V, h, generator=gen, device="cuda", dtype=torch.bfloat16) * h**-0.5
    w.requires_grad_()
    t = torch.randint(0, V, (n,), generator=gen, device="cuda")
    old = -12.0 + 0.3 * torch.randn(n, generator=gen, device="cuda")
    adv = torch.randn(n, generator=gen, device="cuda")
    weights = torch.full((n,), 1.0 / n, device="cuda")

    def step():
        loss, _ = fused_linear_grpo_loss(x, w, t, old, adv, weights, impl="triton")
        torch.autograd.grad(loss, (x, w))

    flops = 8 * n * h * V  # the nominal count every implementation is credited with
    rows = []
    default_slab = logit_slabs.LOGIT_SLAB_BYTES
    for variant, slab_gib in (("recompute", None), ("stored", 1), ("stored", 2), ("stored", 4)):
        tiles.ROW_GRADS_VARIANT = variant
        if slab_gib is not None:
            logit_slabs.LOGIT_SLAB_BYTES = slab_gib << 30
        torch.cuda.reset_peak_memory_stats()
        ms = do_bench(step, warmup=100, rep=1000, return_mode="median")
        peak = torch.cuda.max_memory_allocated() / 2**30
        row = dict(variant=variant, slab_gib=slab_gib, ms=ms, tflops=flops / ms / 1e9, peak=peak)
        rows.append(row)
        print(
            f"grpo fwd+bwd N={n} H={h} {variant:<9} slab {slab_gib or '-'} GiB: {ms:7.2f} ms "
            f"{row['tflops']:5.0f} TFLOP/s (8NHV), peak {peak:.1f} GiB",
            flush=True,
        )
    tiles.ROW_GRADS_VARIANT, logit_slabs.LOGIT_SLAB_BYTES = "stored", default_slab

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="device_time_total", row_limit=12, max_name_column_width=60
    )
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "kernels": table}, f, indent=1)


if __name__ == "__main__":
    main()
