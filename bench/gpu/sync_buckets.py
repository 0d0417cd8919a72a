"""A Qwen3-4B-shaped weight sync through the vLLM engine's bucket path into a spawned process:
seconds per sync, and GB/s of bf16 weights, at buckets of 64 MiB and 1 GiB.

vLLM is not in the GPU machine's image (bench/gpu/NOTES.md), so this measures the transport
the engine's update is built on, with a stand-in for vLLM's worker at the far end. Included,
as the code does it:
- the trainer's side (`VLLMEngine._send`, `_buckets`): every fp32 master cast to bf16, the
  tensors grouped by Hugging Face name into buckets of about `--bucket-mb` (a larger tensor goes
  alone), each bucket laid into one flat buffer (`vllm_worker.concat_bucket`), the stream
  synchronised, the buffer's CUDA IPC handle taken (`share_cuda`) and sent, one bucket at a time,
  waiting for each reply; `torch.cuda.ipc_collect()` at the end;
- the far side (`WeightSync.rlmtrain_load_cuda_bucket`), in a process of its own started by
  spawn: the handle opened (`open_cuda_share`), the buffer cloned and the stream synchronised,
  cut back into tensors (`cut_bucket`), each copied into a preallocated bf16 parameter of its
  name; at the end a synchronise and a check that every parameter received its tensor.
Not included: vLLM's RPC (AsyncLLM to its engine core over ZMQ; here one multiprocessing pipe
message each way per bucket), `load_weights`' renaming into fused parameters (qkv_proj,
gate_up_proj) and the layerwise reload's processing, the pause, resume and prefix-cache reset
around an update, and the FSDP all-gather a sharded trainer does per parameter (here every
parameter is whole on the one GPU).

Figures per bucket size: the median seconds of `--repeats` syncs after a warm-up one, the far
side's share of them (its calls; the copies finish by the last synchronise), GB/s of bf16
weights, and the trainer's memory above its masters while syncing (one bucket's casts and its
buffer: what the bucket size costs). The far side's first and last tensors are checked against
the sender's. On a CPU the path is the CPU's (`rlmtrain_load_bucket`): each bucket
`pack_bucket`'s bytes through the pipe, `unpack_bucket`, the copies.

    python3 bench/gpu/sync_buckets.py [--preset qwen3-4b] [--bucket-mb 64 1024] [--out sync.json]
    python bench/gpu/sync_buckets.py --device cpu --preset tiny --bucket-mb 1 64   # checks it runs
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import time
from pathlib import Path

import torch

from rlmtrain.config import ModelConfig
from rlmtrain.model import model_skeleton, named_hf_tensors
from rlmtrain.rollout.engines.vllm_worker import (
    buckets,
    concat_bucket,
    cut_bucket,
    open_cuda_share,
    pack_bucket,
    share_cuda,
    unpack_bucket,
)

ENGINE_DTYPE = torch.bfloat16


def engine(connection, layout: list[tuple[str, list[int]]], device: str) -> None:
    """The far side: parameters of `layout` on `device`, filled bucket by bucket; "begin" and
    "finish" frame an update, "check" asks for sums, None ends."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    params = {name: torch.empty(shape, dtype=ENGINE_DTYPE, device=device) for name, shape in layout}
    loaded: set[str] = set()
    connection.send("ready")
    while (message := connection.recv()) is not None:
        if message == "begin":
            loaded.clear()
        elif message == "finish":
            if cuda:
                torch.cuda.synchronize(device)
            connection.send(sorted(set(params) - loaded))
        elif message == "check":  # sums of the first and last tensors, for the sender to compare
            ends = (layout[0][0], layout[-1][0])
            connection.send({name: params[name].double().sum().item() for name in ends})
        else:
            connection.send(load(message, params, device))
            loaded.update(message[0])


def load(message, params: dict[str, torch.Tensor], device: torch.device) -> float:
    """One bucket into `params`, as `WeightSync` takes it; the seconds it took."""
    names, dtypes, shapes, payload = message
    began = time.perf_counter()
    if device.type == "cuda":
        shared = open_cuda_share(payload, device.index)
        buffer = shared.clone()
        torch.cuda.current_stream(device).synchronize()
        del shared
        named = cut_bucket(buffer, names, dtypes, shapes)
    else:
        named = unpack_bucket(names, dtypes, shapes, payload)
    for name, tensor in named:
        params[name].copy_(tensor)
    return time.perf_counter() - began


def sync(connection, named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict:
    """One whole update through the pipe; its seconds, the far side's share, the bucket count."""
    cuda = named[0][1].is_cuda
    far, count = 0.0, 0
    began = time.perf_counter()
    connection.send("begin")
    for bucket in buckets(named, bucket_bytes, ENGINE_DTYPE):
        if cuda:
            names, dtypes, shapes, buffer = concat_bucket(bucket)
            torch.cuda.current_stream(buffer.device).synchronize()
            connection.send((names, dtypes, shapes, share_cuda(buffer)))
            far += connection.recv()
            del buffer  # the far side has its copy: freed now, as `_send` does
        else:
            connection.send(pack_bucket(bucket))
            far += connection.recv()
        count += 1
    connection.send("finish")
    missing = connection.recv()
    if cuda:
        torch.cuda.ipc_collect()
    seconds = time.perf_counter() - began
    if missing:
        raise RuntimeError(f"{len(missing)} parameters received nothing, e.g. {missing[0]}")
    return {"seconds": seconds, "far_side_s": far, "buckets": count}


def check(connection, named: list[tuple[str, torch.Tensor]]) -> None:
    """The far side's first and last tensors hold what was sent."""
    connection.send("check")
    sent = dict(named)
    for name, total in connection.recv().items():
        if not math.isclose(total, sent[name].to(ENGINE_DTYPE).double().sum().item(), rel_tol=1e-9):
            raise RuntimeError(f"{name} arrived with other values")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 1024])
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per size")
    parser.add_argument("--out", type=Path, help="also write the summary here as JSON")
    options = parser.parse_args()
    device = torch.device(options.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    # The trainer's fp32 masters, whole, by their Hugging Face names, with random values.
    skeleton = model_skeleton(ModelConfig(preset=options.preset))
    generator = torch.Generator(device).manual_seed(0)
    named = [
        (name, torch.randn(p.shape, generator=generator, device=device))
        for name, p in named_hf_tensors(skeleton)
    ]
    layout = [(name, list(t.shape)) for name, t in named]
    weight_bytes = sum(t.numel() for _, t in named) * ENGINE_DTYPE.itemsize

    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    far = spawn.Process(target=engine, args=(there, layout, str(device)), daemon=True)
    far.start()
    assert here.recv() == "ready"
    results = []
    try:
        for mb in options.bucket_mb:
            bucket_bytes = int(mb * 2**20)
            sync(here, named, bucket_bytes)  # warm-up: the far side's first opens and copies
            check(here, named)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                resting = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            runs = [sync(here, named, bucket_bytes) for _ in range(options.repeats)]
            # What the trainer held beside its masters while syncing: one bucket and its casts.
            extra = (
                torch.cuda.max_memory_allocated(device) - resting if device.type == "cuda" else 0
            )
            seconds = statistics.median(r["seconds"] for r in runs)
            results.append(
                {
                    "bucket_mb": mb,
                    "buckets": runs[0]["buckets"],
                    "seconds": seconds,
                    "far_side_s": statistics.median(r["far_side_s"] for r in runs),
                    "gb_per_s": weight_bytes / seconds / 1e9,
                    "trainer_extra_gib": extra / 2**30,
                    "all_seconds": [r["seconds"] for r in runs],
                }
            )
    finally:
        here.send(None)
        far.join(timeout=60)
    summary = {
        "bench": "sync_buckets",
        "preset": options.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "path": "CUDA IPC" if device.type == "cuda" else "bytes through the pipe",
        "tensors": len(named),
        "weight_gb": weight_bytes / 1e9,
        "results": results,
    }
    print(f"\nweight sync, {options.preset} ({summary['weight_gb']:.2f} GB of bf16 in "
          f"{len(named)} tensors) on {summary['device']}, {summary['path']}, median of "
          f"{options.repeats}")  # fmt: skip
    print("bucket MiB  buckets  s/sync  far side s    GB/s  trainer extra GiB")
    for r in results:
        cells = [r[key] for key in ("bucket_mb", "buckets", "seconds", "far_side_s", "gb_per_s")]
        cells.append(r["trainer_extra_gib"])
        print("{:>10g} {:>8} {:>7.3f} {:>11.3f} {:>7.2f} {:>18.3f}".format(*cells))
    print(json.dumps(summary))
    if options.out:
        options.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
