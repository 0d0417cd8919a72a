"""A short table of bench_kernels.py's CUDA figures from pytest-benchmark's JSON, fastest first
within each workload, so that the end of a device run's output holds the comparison.

Run: `python3 bench/gpu/summarize.py bench.json`.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        runs = [b["extra_info"] for b in json.load(f)["benchmarks"]]
    workloads = defaultdict(list)
    for info in runs:
        if "name" not in info:
            continue
        words = info["name"].split()  # "<workload> <impl> [<phase>]"
        impl_free = " ".join(words[:1] + words[2:])
        workloads[(impl_free, info.get("N"), info.get("H"))].append(info)
    print(
        f"{'workload':<22} {'N':>8} {'H':>5} {'impl':<16} {'ms':>9} {'TFLOP/s':>8} "
        f"{'%sheet':>6} {'GB/s':>6} {'extra GiB':>9}"
    )
    for (work, n, h), infos in sorted(workloads.items(), key=lambda kv: str(kv[0])):
        for info in sorted(infos, key=lambda i: i["median_s"]):
            impl = info["name"].split()[1] if len(info["name"].split()) > 1 else info["name"]
            print(
                f"{work:<22} {n:>8} {h or '':>5} {impl:<16} {info['median_s'] * 1e3:>9.2f} "
                f"{info.get('tflops', 0):>8.0f} {info.get('pct_of_datasheet_peak', 0):>6.1f} "
                f"{info.get('gb_per_s', 0):>6.0f} {info.get('peak_extra_bytes', 0) / 2**30:>9.2f}"
            )


if __name__ == "__main__":
    main(sys.argv[1])
