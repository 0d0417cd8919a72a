"""Times the log-prob kernels' candidate tile shapes, and the forward and backward variants, at
one training shape, and keeps the fastest correct choice for the forward and for the backward.

Each candidate is a `Variants`: its stage's choice (`forward`: "kernel" or "stored"; `backward`:
"atomic" tiles the "backward" kernel, "slabs" the "dlogits" one, "stored" has no tiles) and, where
it has one, the tile shape of that kernel (`Variants.tiles`). It is
checked against the chunked torch backend on the same inputs (relative error under 1e-4 for
log-probs, 1e-2 for the gradients, whose dot operands are rounded to bf16); a candidate that
computes something else is dropped, as is one that does not compile (shared memory, say). Then
it is timed (median of `do_bench`). Prints a table and writes the winners as JSON, which
`bench/bench_kernels.py` loads when `BENCH_TILES_JSON` names the file.

Run: `python3 bench/gpu/sweep_tiles.py [--n 16384] [--h 2560] [--out tiles.json]`.
"""

from __future__ import annotations

import argparse
import json

import torch
from rlmtrain_kernels import Variants, logprob, reference
from triton.testing import do_bench

V = 151936
OPTIONS = dict(temperature=1.0, ignore_index=-100)


def tile(n: int, v: int, h: int, warps: int, stages: int, h_out: int | None = None) -> dict:
    shape = dict(BLOCK_N=n, BLOCK_V=v, BLOCK_H=h, num_warps=warps, num_stages=stages)
    return shape if h_out is None else {**shape, "BLOCK_H_OUT": h_out}


# (stage, variant, tiled kernel or None, tile shape or None); a variant's first shape is its
# default one (tiles.CUDA_TILES).
CANDIDATES = [
    *(("forward", "kernel", "forward", tile(*t)) for t in [
        (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3),
    ]),
    ("forward", "stored", None, None),
    *(("backward", "atomic", "backward", tile(*t)) for t in [(128, 128, 64, 8, 3, 64)]),
    *(("backward", "slabs", "dlogits", tile(*t)) for t in [
        (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3),
    ]),
    ("backward", "stored", None, None),
]  # fmt: skip


def inputs(n: int, h: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(V, h, generator=gen, device="cuda", dtype=torch.bfloat16) * h**-0.5
    t = torch.randint(0, V, (n,), generator=gen, device="cuda")
    g = torch.randn(n, generator=gen, device="cuda")
    return dict(x=x, w=w, t=t, g=g)


def forward(d, variants: Variants):
    return logprob.logprob_forward_triton(
        d["x"], d["w"], d["t"], with_entropy=False, variants=variants, **OPTIONS
    )


def backward(d, lse, variants: Variants):
    return logprob.logprob_backward_triton(
        d["x"], d["w"], d["t"], lse, None, d["g"], None,
        need_grad_hidden=True, need_grad_weight=True, variants=variants, **OPTIONS,
    )  # fmt: skip


def torch_backend(d: dict) -> dict[str, torch.Tensor]:
    logp, _, lse = reference.linear_logprob_forward(
        d["x"], d["w"], d["t"], with_entropy=False, **OPTIONS
    )
    dx, dw = reference.linear_logprob_backward(
        d["x"], d["w"], d["t"], lse, None, d["g"], None, need_grad_weight=True, **OPTIONS
    )
    return dict(logp=logp, lse=lse, dx=dx, dw=dw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def try_candidate(stage, variant, entry, shape, d, ref, flops) -> dict:
    variants = Variants(**{stage: variant}, tiles={entry: shape} if entry is not None else {})
    row = dict(stage=stage, variant=variant, entry=entry, tiles=shape)
    try:
        if stage == "forward":
            logp, _, _ = forward(d, variants)
            row["rel_err"] = rel_err(logp, ref["logp"])
            run, tolerance = (lambda: forward(d, variants)), 1e-4
        else:
            dx, dw = backward(d, ref["lse"], variants)
            row["rel_err"] = max(rel_err(dx, ref["dx"]), rel_err(dw, ref["dw"]))
            run, tolerance = (lambda: backward(d, ref["lse"], variants)), 1e-2
        ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, ok=row["rel_err"] < tolerance)
    except Exception as exc:  # a shape that does not compile or launch is reported, not fatal
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:120]}")
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=2560)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    d = inputs(args.n, args.h)
    ref = torch_backend(d)
    nhv = args.n * args.h * V
    flops = {"forward": 2 * nhv, "backward": 6 * nhv}
    results = []
    for candidate in CANDIDATES:
        results.append(try_candidate(*candidate, d, ref, flops[candidate[0]]))
        if args.out:  # after each candidate: a run cut short still leaves what it measured
            write(args.out, choose(results), results)
    chosen = choose(results)
    print(f"\ntile sweep N={args.n} H={args.h} V={V} bf16 (a variant's first shape: its default)")
    for stage in ("forward", "backward"):
        for r in (r for r in results if r["stage"] == stage):
            timing = f"{r['ms']:8.2f} ms {r['tflops']:5.0f} TFLOP/s" if "ms" in r else "failed"
            flag = "" if r["ok"] else "  REJECTED " + r.get("error", f"error {r.get('rel_err')}")
            print(f"{stage:>8} {r['variant']:<6} {r['tiles'] or ''} {timing}{flag}")
        best = chosen["best"].get(stage)
        if best:
            print(f"{stage:>8} best: {best['variant']} {best['tiles'] or ''} "
                  f"{best['tflops']:.0f} TFLOP/s")  # fmt: skip
    if args.out:
        write(args.out, chosen, results)


def choose(results: list[dict]) -> dict:
    """The fastest correct candidate of each stage, as the tile entries and variant to use."""
    chosen = {
        "tiles": {},
        "forward_variant": Variants().forward,
        "backward_variant": Variants().backward,
        "best": {},
    }
    for stage in ("forward", "backward"):
        good = [r for r in results if r["stage"] == stage and r["ok"]]
        if good:
            fastest = min(good, key=lambda r: r["ms"])
            chosen["best"][stage] = fastest
            chosen[f"{stage}_variant"] = fastest["variant"]
            if fastest["entry"] is not None:
                chosen["tiles"][fastest["entry"]] = fastest["tiles"]
    return chosen


def write(path: str, chosen: dict, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({**chosen, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
