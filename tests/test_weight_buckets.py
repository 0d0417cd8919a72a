"""The wire forms of a bucket of weights on its way to a vLLM worker (`vllm_worker`): tensors of
mixed dtypes and awkward shapes, laid one after another at aligned offsets, come back bit for
bit, as bytes (the CPU's way), as one flat tensor (CUDA's way), and on a GPU through a CUDA IPC
handle opened by another process, as vLLM's worker opens it.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from rlmtrain.rollout.engines.vllm_worker import (
    ALIGN,
    concat_bucket,
    cut_bucket,
    pack_bucket,
    share_cuda,
    unpack_bucket,
)


def mixed() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 3, generator=gen).to(torch.bfloat16)),
        ("b.bias", torch.randn(5, generator=gen)),
        ("c.scalar", torch.tensor(2.5, dtype=torch.float16)),
        ("d.empty", torch.empty(0, 4)),
        ("e.strided", torch.randn(6, 4, generator=gen).t()),  # not contiguous
        ("f.ids", torch.arange(9, dtype=torch.int64).reshape(3, 3)),
    ]


def assert_same(got: list[tuple[str, torch.Tensor]], sent: list[tuple[str, torch.Tensor]]):
    assert [name for name, _ in got] == [name for name, _ in sent]
    for (name, back), (_, tensor) in zip(got, sent, strict=True):
        assert back.dtype == tensor.dtype and back.shape == tensor.shape, name
        assert torch.equal(back.cpu(), tensor.cpu()), name


def test_bytes_come_back_bit_for_bit() -> None:
    sent = mixed()
    assert_same(unpack_bucket(*pack_bucket(sent)), sent)


def test_a_flat_tensor_comes_back_bit_for_bit() -> None:
    sent = mixed()
    names, dtypes, shapes, buffer = concat_bucket(sent)
    padded = [-(-t.nbytes // ALIGN) * ALIGN for _, t in sent]  # every tensor starts aligned
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(padded) > sum(
        t.nbytes for _, t in sent
    )
    assert_same(cut_bucket(buffer, names, dtypes, shapes), sent)


def test_a_buffer_of_another_size_is_refused() -> None:
    names, dtypes, shapes, buffer = concat_bucket(mixed())
    with pytest.raises(ValueError, match="bytes whose tensors need"):
        cut_bucket(buffer[:-1], names, dtypes, shapes)
    with pytest.raises(ValueError, match="names"):
        cut_bucket(buffer, names[:-1], dtypes, shapes)


# The child reads the share (plain data, as vLLM's RPC carries it) from stdin and writes back
# the bytes of the buffer it opened.
OPEN_AND_READ = """
import pickle, sys
from rlmtrain.rollout.engines.vllm_worker import open_cuda_share
share, device = pickle.loads(sys.stdin.buffer.read())
sys.stdout.buffer.write(open_cuda_share(share, device).cpu().numpy().tobytes())
"""


@pytest.mark.gpu
def test_another_process_reads_a_shared_cuda_buffer() -> None:
    """The child opens the handle on the parent's GPU and reads the very bytes written there,
    which cut back into the tensors sent."""
    sent = [(name, tensor.cuda()) for name, tensor in mixed()]
    names, dtypes, shapes, buffer = concat_bucket(sent)
    torch.cuda.synchronize()
    child = subprocess.run(
        [sys.executable, "-c", OPEN_AND_READ],
        input=pickle.dumps((share_cuda(buffer), torch.cuda.current_device())),
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr.decode()[-3000:]
    assert child.stdout == buffer.cpu().numpy().tobytes()
    assert_same(unpack_bucket(names, dtypes, shapes, child.stdout), sent)
