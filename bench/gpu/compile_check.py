"""Compiles the log-prob kernels for a Hopper GPU (sm_90) on a machine without one, and reports
what each tile shape costs: shared memory against the 227 KB a block may take, registers, and
the stack (spilled registers). A shape that does not compile, or does not fit, fails here
instead of in a scarce GPU run.

Triton's ahead-of-time path does this: the real kernels, specialised as a launch would
specialise them (pointers 16-byte aligned, the unit strides of contiguous tensors folded to 1),
lowered through ptxas for sm_90. Numbers are from this machine's Triton; another version may
differ by a stage's worth.

Run with the interpreter off: `TRITON_INTERPRET=0 python bench/gpu/compile_check.py` for the
committed tiles (bf16 and fp32), `... --sweep` for every candidate of bench/gpu/sweep_tiles.py.
Prints one JSON object per kernel (with the SASS's count of Hopper MMAs and vector reductions);
exits 1 when any does not compile or does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from rlmtrain_kernels import Variants, logit_slabs, logprob, logprob_slabs, tiles
from rlmtrain_kernels.grpo_loss import BLOCK as GRPO_BLOCK
from rlmtrain_kernels.grpo_loss import NUM_METRIC_SUMS, _grpo_loss_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER_SHARED_BYTES = 232_448  # 227 KB, the most one block may opt into on sm_90
KERNELS = {
    "forward": logprob._logprob_fwd_kernel,
    "backward": logprob._logprob_bwd_kernel,
    "dlogits": logprob_slabs._dlogits_kernel,
    "grpo_loss": _grpo_loss_kernel,
    "row_stats": logit_slabs._row_stats_kernel,
    "row_dlogits": logit_slabs._row_dlogits_kernel,
}
TRITON_TYPES = {"bfloat16": "bf16", "float32": "fp32"}
# Flags as training launches them, with every option on: entropy in the forward, both gradients
# in the backward, and the GRPO loss's KL, dual clip and truncated importance sampling.
FLAGS = dict(
    WITH_ENTROPY=True, NEED_DX=True, NEED_DW=True, UPCAST_DOT=False, HAS_REF=True,
    KL_IN_LOSS=True, HAS_DUAL=True, HAS_SAMPLER=True, HAS_CAP=True,
    NUM_SUMS=NUM_METRIC_SUMS,
)  # fmt: skip
FLOAT_ARGS = ("inv_t", "beta", "clip_low", "clip_high", "dual_clip", "tis_cap")
UNIT_STRIDES = ("stride_xh", "stride_wh")  # contiguous inputs: a launch folds these to 1
# Integers a training launch passes as multiples of 16 (H = 2560 or 4096, V = 151936, and the
# row strides they make), which a launch marks so that loads vectorise and pipeline.
ALIGNED_INTS = ("H", "V", "stride_xn", "stride_wv", "stride_dz", "stride_z")
INPUT_POINTERS = ("X_ptr", "W_ptr", "DZ_ptr")


def compile_for_sm90(entry: str, shape: dict, dtype: str) -> dict:
    fn = KERNELS[entry]
    launch = {k: v for k, v in shape.items() if k in ("num_warps", "num_stages")}
    constexprs = {k: v for k, v in shape.items() if k not in launch}
    constexprs |= dict(FLAGS, GROUP_N=tiles.GROUP_N)
    constexprs["DOT_PRECISION"] = "ieee" if dtype == "float32" else "tf32"
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name in UNIT_STRIDES:
            signature[name] = "constexpr"
            constants[(i,)] = constexprs.get(name, 1)
        elif name.endswith("_ptr"):
            elem = TRITON_TYPES[dtype] if name in INPUT_POINTERS else "fp32"
            signature[name] = "*i64" if name == "T_ptr" else f"*{elem}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
            if name in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    report = dict(kernel=entry, dtype=dtype, tiles=shape)
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch)
    except Exception as exc:  # a shape that does not compile is the finding, not a crash
        return report | dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    shared = compiled.metadata.shared
    report |= dict(shared_bytes=shared, **_resource_usage(compiled.asm["cubin"]))
    return report | dict(ok=shared <= HOPPER_SHARED_BYTES)


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes per thread, and the instructions that say which path the
    matrix work and the atomics took, from the cuobjdump that ships with Triton: HGMMA is
    Hopper's warpgroup MMA (HMMA alone would be the older, slower path), REDG...F32x4 a 16-byte
    vector reduction (REDG...F32 a scalar one)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (
            subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout
            for flag in ("--dump-resource-usage", "--dump-sass")
        )
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", usage))
    return {
        "registers": int(found.get("REG", -1)),
        "stack_bytes": int(found.get("STACK", -1)),
        "hgmma": len(re.findall(r"\bHGMMA\.", sass)),
        "hmma": len(re.findall(r"\bHMMA\.", sass)),
        "vector_reductions": len(re.findall(r"\bREDG\.\S*F32x4", sass)),
        "scalar_reductions": len(re.findall(r"\bREDG\.\S*F32\.", sass)),
    }


def committed_shapes() -> list[tuple[str, dict, str]]:
    cuda = torch.device("cuda")  # only names the table to read; no device is touched
    linear = [
        (entry, tiles.tiles_for(cuda, entry, getattr(torch, dtype), Variants()), dtype)
        for entry in ("forward", "backward", "dlogits")
        for dtype in TRITON_TYPES
    ]
    grpo = dict(BLOCK=GRPO_BLOCK, num_warps=4, num_stages=3)  # Triton's launch defaults
    # The stored-logits row passes: fp32 logits in; the gradients out in a 16-bit dtype.
    rows = dict(BLOCK_V=logit_slabs.ROW_BLOCK_V, num_warps=logit_slabs.ROW_WARPS)
    stored = [("row_stats", rows, "float32"), ("row_dlogits", rows, "bfloat16")]
    return [*linear, ("grpo_loss", grpo, "float32"), *stored]


def sweep_shapes() -> list[tuple[str, dict, str]]:
    sys.path.insert(0, str(Path(__file__).parent))
    from sweep_tiles import CANDIDATES

    return [(entry, shape, "bfloat16") for _, _, entry, shape in CANDIDATES if entry is not None]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="the sweep's candidates too")
    args = parser.parse_args()
    failed = 0
    for shape in committed_shapes() + (sweep_shapes() if args.sweep else []):
        report = compile_for_sm90(*shape)
        failed += not report["ok"]
        print(json.dumps(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
