"""Times the log-prob kernels' candidate tile shapes at one training shape and keeps the fastest
correct one per kernel.

Each candidate replaces `CUDA_TILES[kernel]`, is checked against the chunked torch backend on the
same inputs (relative error under 1e-4 for log-probs, 1e-2 for the gradients, whose dot operands
are rounded to bf16; a tile shape that computes something else is dropped, as is one that does not
compile, e.g. for shared memory), then timed (median of `do_bench`). Prints a table and writes the
winners as JSON, which `bench/bench_kernels.py` loads when `BENCH_TILES_JSON` names the file.

Run: `python3 bench/gpu/sweep_tiles.py [--n 16384] [--h 2560] [--out tiles.json]`.
"""

from __future__ import annotations

import argparse
import json

import torch
from rlmtrain.kernels import logprob, reference
from triton.testing import do_bench

V = 151936

FORWARD = [
    dict(BLOCK_N=256, BLOCK_V=128, BLOCK_H=32, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, num_warps=4, num_stages=4),
    dict(BLOCK_N=256, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=64, BLOCK_V=256, BLOCK_H=64, num_warps=4, num_stages=4),
]
BACKWARD = [
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=32, BLOCK_H_OUT=64, num_warps=4, num_stages=4),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, BLOCK_H_OUT=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, BLOCK_H_OUT=128, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=32, BLOCK_H_OUT=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=256, BLOCK_V=128, BLOCK_H=32, BLOCK_H_OUT=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=64, BLOCK_H_OUT=64, num_warps=4, num_stages=4),
]
OPTIONS = dict(temperature=1.0, ignore_index=-100)


def inputs(n: int, h: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(V, h, generator=gen, device="cuda", dtype=torch.bfloat16) * h**-0.5
    t = torch.randint(0, V, (n,), generator=gen, device="cuda")
    g = torch.randn(n, generator=gen, device="cuda")
    return dict(x=x, w=w, t=t, g=g)


def forward(d):
    return logprob.logprob_forward_triton(d["x"], d["w"], d["t"], with_entropy=False, **OPTIONS)


def backward(d, lse):
    return logprob.logprob_backward_triton(
        d["x"], d["w"], d["t"], lse, None, d["g"], None,
        need_grad_hidden=True, need_grad_weight=True, **OPTIONS,
    )  # fmt: skip


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def torch_backend(d: dict) -> dict[str, torch.Tensor]:
    logp, _, lse = reference.linear_logprob_forward(d["x"], d["w"], d["t"], with_entropy=False,
                                                    **OPTIONS)  # fmt: skip
    dx, dw = reference.linear_logprob_backward(
        d["x"], d["w"], d["t"], lse, None, d["g"], None, need_grad_weight=True, **OPTIONS
    )
    return dict(logp=logp, lse=lse, dx=dx, dw=dw)


def sweep(kernel: str, candidates: list[dict], d: dict, ref: dict, flops: float) -> list[dict]:
    committed = dict(logprob.CUDA_TILES[kernel])
    lse = ref["lse"]
    rows = []
    for tiles in candidates:
        logprob.CUDA_TILES[kernel] = dict(tiles)
        row = dict(kernel=kernel, **tiles)
        try:
            if kernel == "forward":
                logp, _, _ = forward(d)
                row["rel_err"] = rel_err(logp, ref["logp"])
                run, tolerance = (lambda: forward(d)), 1e-4
            else:
                dx, dw = backward(d, lse)
                row["rel_err"] = max(rel_err(dx, ref["dx"]), rel_err(dw, ref["dw"]))
                run, tolerance = (lambda: backward(d, lse)), 1e-2
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
            row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, ok=row["rel_err"] < tolerance)
        except Exception as exc:  # a shape that does not compile or launch is reported, not fatal
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:120]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    logprob.CUDA_TILES[kernel] = committed
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=2560)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    d = inputs(args.n, args.h)
    ref = torch_backend(d)
    nhv = args.n * args.h * V
    results = sweep("forward", FORWARD, d, ref, 2 * nhv)
    results += sweep("backward", BACKWARD, d, ref, 6 * nhv)
    best = {}
    print(f"\ntile sweep N={args.n} H={args.h} V={V} bf16 (first row of each kernel: committed)")
    for kernel in ("forward", "backward"):
        good = [r for r in results if r["kernel"] == kernel and r["ok"]]
        for r in results:
            if r["kernel"] == kernel:
                shape = {k: v for k, v in r.items() if k.isupper() or k.startswith("num_")}
                timing = f"{r['ms']:8.2f} ms {r['tflops']:5.0f} TFLOP/s" if "ms" in r else "failed"
                print(f"{kernel:>8} {shape} {timing} {r.get('error', '')}")
        if good:
            fastest = min(good, key=lambda r: r["ms"])
            best[kernel] = {k: v for k, v in fastest.items() if k.isupper() or k.startswith("num_")}
            print(f"{kernel:>8} best: {best[kernel]} {fastest['tflops']:.0f} TFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"best": best, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
