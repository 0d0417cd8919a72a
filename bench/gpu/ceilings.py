"""The two ceilings every GPU figure is read against, measured on the card as found: device copy
bandwidth (bytes read + written) and a large bf16 matrix product's rate, on random data.

Run: `python3 bench/gpu/ceilings.py [out.json]`.
"""

from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

DATASHEET_BF16_DENSE_FLOPS = 989.4e12  # H100/H200 SXM, dense bf16
DATASHEET_HBM_BYTES = 4.8e12  # H200 HBM3e


def measure() -> dict[str, float]:
    src = torch.randn(1 << 30, device="cuda")  # 4 GiB: many times the L2
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=500, return_mode="median")
    copy_bytes = 2 * src.numel() * src.element_size()
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = do_bench(lambda: a @ b, warmup=50, rep=500, return_mode="median")
    return {
        "device": torch.cuda.get_device_name(),
        "copy_bytes_per_s": copy_bytes / (copy_ms * 1e-3),
        "bf16_matmul_flops": 2 * 8192**3 / (mm_ms * 1e-3),
        "datasheet_bf16_dense_flops": DATASHEET_BF16_DENSE_FLOPS,
        "datasheet_hbm_bytes_per_s": DATASHEET_HBM_BYTES,
    }


if __name__ == "__main__":
    found = measure()
    print(
        f"{found['device']}: copy {found['copy_bytes_per_s'] / 1e12:.2f} TB/s "
        f"(datasheet {DATASHEET_HBM_BYTES / 1e12:.1f}), bf16 8192^3 matmul "
        f"{found['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s (datasheet dense "
        f"{DATASHEET_BF16_DENSE_FLOPS / 1e12:.0f})"
    )
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(found, f, indent=1)
