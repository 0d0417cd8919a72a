"""What a checkpoint's CRC-32 sums cost: a save and a resume of a 64M-parameter policy with
AdamW state (768 MB of files) in one process, each timed whole and its sums alone, beside the
speed of CRC-32 and SHA-256 over 256 MB in memory (why the manifest holds CRC-32).

Printed and stored in `extra_info`: the checkpoint's bytes, the save's and the resume's
seconds, the seconds of the sums within each and their share, and each sum's GB/s.

    .venv/bin/python -m pytest bench/bench_checkpoint.py --benchmark-only -s
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import zlib

import pytest
import torch

from rlmtrain import checkpointing, parallel

PARAMETERS = 64 << 20
SUMMED_BYTES = 256 << 20


def _policy() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(4)))
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4096)).sum().backward()
    optimizer.step()  # the moments exist, as in any checkpoint after the first update
    return model, optimizer


def _gb_per_s(sum_of, data: bytes) -> float:
    began = time.perf_counter()
    sum_of(data)
    return len(data) / (time.perf_counter() - began) / 1e9


@pytest.fixture(scope="module")
def world():
    parallel.start("cpu")
    yield
    parallel.stop()


def test_checkpoint_sums(benchmark, world, tmp_path):
    model, optimizer = _policy()
    state = checkpointing.TrainerState(phase="rl", step=1, lr=1e-6, seed=0, world_size=1)

    def save_and_resume() -> dict[str, float]:
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        began = time.perf_counter()
        path = checkpointing.save(tmp_path / "run", model, optimizer, state, keep=1)
        saved = time.perf_counter() - began
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "COMPLETE")
        began = time.perf_counter()
        for file in files:
            checkpointing.crc32(file)
        summed = time.perf_counter() - began
        began = time.perf_counter()
        checkpointing.load(path, model, torch.optim.AdamW(model.parameters()))
        resumed = time.perf_counter() - began
        return {
            "bytes": sum(f.stat().st_size for f in files),
            "save_s": saved,
            "resume_s": resumed,
            "sums_s": summed,
        }

    figures = benchmark.pedantic(save_and_resume, rounds=3, iterations=1)
    data = os.urandom(SUMMED_BYTES)
    figures["crc32_gb_s"] = _gb_per_s(zlib.crc32, data)
    figures["sha256_gb_s"] = _gb_per_s(lambda b: hashlib.sha256(b).digest(), data)
    # Each is paid once per save (the writer's sums) and once per resume (the reader's).
    figures["sums_share_of_save"] = figures["sums_s"] / figures["save_s"]
    figures["sums_share_of_resume"] = figures["sums_s"] / figures["resume_s"]
    benchmark.extra_info.update(figures)
    print(
        f"\ncheckpoint of {figures['bytes'] / 1e6:.0f} MB: save {figures['save_s']:.2f} s, "
        f"resume {figures['resume_s']:.2f} s, sums {figures['sums_s']:.2f} s each "
        f"({figures['sums_share_of_save']:.0%} of the save, "
        f"{figures['sums_share_of_resume']:.0%} of the resume); CRC-32 "
        f"{figures['crc32_gb_s']:.1f} GB/s, SHA-256 {figures['sha256_gb_s']:.1f} GB/s"
    )
