"""Methods added to every vLLM worker (`worker_extension_cls`), called by `collective_rpc` name.

vLLM runs its workers in another process and refuses to ship Python functions to them (its
serializer takes plain data only, unless insecure pickling is switched on), so what a trainer
needs done inside a worker is a method of a class named by its import path. Tensors in an RPC's
arguments reach the worker as undecoded tuples, so a bucket of weights travels as one flat buffer
with each tensor's name, dtype and shape beside it, and is cut back into tensors here: on the CPU
the buffer's bytes themselves (`pack_bucket`), on CUDA a CUDA IPC handle of a buffer on the
trainer's GPU (`share_cuda`), which the worker opens and copies, so the weights go from GPU
memory to GPU memory without crossing the host. This module is imported inside vLLM's worker
process and so imports nothing of the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

__all__ = [
    "WeightSync",
    "concat_bucket",
    "open_cuda_share",
    "pack_bucket",
    "share_cuda",
    "unpack_bucket",
]


ALIGN = 16
"""Each tensor of a bucket starts at a multiple of this many bytes, so a view of any dtype fits
(and a CUDA copy out of the buffer runs on aligned addresses)."""


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The trainer's side: (name, tensor) pairs cast to the engine's `dtype` and grouped into
    buckets of at most `bucket_bytes` (a larger tensor goes alone), in order."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach().to(dtype)
        # A bucket travels one way: CUDA tensors as a shared GPU buffer, others as bytes.
        if bucket and (
            size + tensor.nbytes > bucket_bytes or tensor.is_cuda != bucket[0][1].is_cuda
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
    if bucket:
        yield bucket


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def concat_bucket(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]], torch.Tensor]:
    """(names, dtypes, shapes, buffer): the tensors laid one after another, each at a multiple
    of `ALIGN` bytes, in one flat uint8 tensor on their own device."""
    names, dtypes, shapes, pieces = [], [], [], []
    for name, tensor in named:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
        pieces.append(flat)
        if _padded(flat.numel()) > flat.numel():
            pieces.append(flat.new_zeros(_padded(flat.numel()) - flat.numel()))
    return names, dtypes, shapes, torch.cat(pieces)


def pack_bucket(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]], bytes]:
    """`concat_bucket`'s layout as raw bytes (from tensors on any device)."""
    names, dtypes, shapes, buffer = concat_bucket([(n, t.to("cpu")) for n, t in named])
    return names, dtypes, shapes, buffer.numpy().tobytes()


def unpack_bucket(
    names: list[str], dtypes: list[str], shapes: list[list[int]], data: bytes
) -> list[tuple[str, torch.Tensor]]:
    """`pack_bucket` undone: the named tensors, viewing one writable copy of `data`."""
    return cut_bucket(torch.frombuffer(bytearray(data), dtype=torch.uint8), names, dtypes, shapes)


def cut_bucket(
    buffer: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, torch.Tensor]]:
    """`concat_bucket` undone: the named tensors as views of the flat uint8 `buffer`."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"a weight bucket of {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes"
        )
    kinds = [getattr(torch, name) for name in dtypes]
    sizes = [math.prod(shape) * kind.itemsize for kind, shape in zip(kinds, shapes, strict=True)]
    needed = sum(_padded(size) for size in sizes)
    if needed != buffer.numel():
        raise ValueError(f"a weight bucket of {buffer.numel()} bytes whose tensors need {needed}")
    out, offset = [], 0
    for name, kind, shape, size in zip(names, kinds, shapes, sizes, strict=True):
        out.append((name, buffer[offset : offset + size].view(kind).reshape(shape)))
        offset += _padded(size)
    return out


def share_cuda(buffer: torch.Tensor) -> list[Any]:
    """A CUDA IPC handle of the flat uint8 CUDA `buffer` as plain data (bytes, ints, a bool),
    which vLLM's RPC serializer carries; `open_cuda_share` opens it in another process. The
    buffer must stay alive, unchanged, until the other process is done with it."""
    _, args = reduce_tensor(buffer)
    # torch's rebuild arguments, less the classes, the dtype and the device, which the
    # receiving side knows: a uint8 buffer, opened on the receiver's own GPU.
    (_, _, _, offset, _, _, _, handle, storage_bytes, storage_offset, _, *counter_and_event) = args
    return [offset, buffer.numel(), handle, storage_bytes, storage_offset, *counter_and_event]


def open_cuda_share(share: list[Any], device_index: int) -> torch.Tensor:
    """The flat uint8 buffer `share_cuda` shared, mapped into this process on its CUDA device
    `device_index` (the same GPU, which this process may number otherwise)."""
    offset, numel, handle, storage_bytes, storage_offset, *counter_and_event = share
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([numel]),
        (1,),
        offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device_index,
        handle,
        storage_bytes,
        storage_offset,
        False,
        *counter_and_event,
    )


class WeightSync:
    """Mixed into vLLM's worker: an in-place weight update in three calls, as vLLM's own reload
    does it (begin, any number of buckets, finish), and the weights read back.

    Between `begin` and `finish` each layer is rebuilt from the tensors it receives and
    processed into the kernel's layout (vLLM's layerwise reload) once all of its weights have
    arrived, so a bucket may end in the middle of a layer; `finish` checks that every parameter
    received its tensors. The caller pauses vLLM's scheduler around the three: a layer is empty
    while it waits for its tensors.
    """

    model_runner: Any
    vllm_config: Any
    device: torch.device

    def rlmtrain_begin_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._rlmtrain_loaded: set[str] = set()
        initialize_layerwise_reload(self.model_runner.get_model())

    def rlmtrain_load_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], data: bytes
    ) -> int:
        """Load one bucket (`pack_bucket`'s four parts) of Hugging Face-named tensors; the
        model's own `load_weights` maps the names onto its fused and sharded parameters.
        Returns how many tensors it loaded, so the caller can check nothing was dropped."""
        return self._rlmtrain_load(unpack_bucket(names, dtypes, shapes, data))

    def rlmtrain_load_cuda_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], share: list[Any]
    ) -> int:
        """`rlmtrain_load_bucket` for a bucket in a CUDA buffer of the trainer's (`share_cuda`'s
        handle). The buffer is copied once, GPU to GPU, before this returns and the trainer
        frees it: vLLM's layerwise reload holds on to the tensors a layer has received until
        all of its tensors have arrived, which may be in a later bucket."""
        shared = open_cuda_share(share, self.device.index)
        buffer = shared.clone()
        torch.cuda.current_stream(self.device).synchronize()
        del shared
        return self._rlmtrain_load(cut_bucket(buffer, names, dtypes, shapes))

    def _rlmtrain_load(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self._rlmtrain_loaded |= set(self.model_runner.get_model().load_weights(weights=named))
        return len(named)

    def rlmtrain_finish_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        # vLLM's reload only logs a layer that did not receive all of its weights (and keeps
        # its old ones): an update that left any parameter out is an error here.
        tied = getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False)
        expected = {
            name
            for name, _ in model.named_parameters()
            if not (tied and name.startswith("lm_head."))
        }
        missing = sorted(expected - self._rlmtrain_loaded)
        if missing:
            raise RuntimeError(
                f"weight update left {len(missing)} parameter(s) without a tensor, e.g. "
                f"{missing[0]!r}"
            )
        # On the CPU a layer that keeps its weight (the embedding, and an output head tied to
        # it) multiplies by a packed copy made when it was processed. A tied head receives no
        # tensor of its own, so the reload never processes it again and it would go on
        # computing logits with the old embedding: such copies are made again from the new
        # values (packing twice is harmless for the embedding itself).
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
                module.quant_method.process_weights_after_loading(module)

    def rlmtrain_parameters(self) -> tuple[list[str], list[str], list[list[int]], bytes]:
        """The served model's weights by vLLM's own names (fused qkv_proj, gate_up_proj), as
        `pack_bucket` parts, which travel back intact: what a test compares bit for bit with
        the tensors it sent. On the CPU vLLM multiplies by a copy of a layer's weight packed
        into its GEMM library's layout (and may empty the parameter), so such a weight is read
        back through the layer's own matmul of the identity (exact: each output is one product
        by 1.0): what is compared is what the kernel computes with."""
        named = []
        for module_name, module in self.model_runner.get_model().named_modules():
            for name, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                if name == "weight" and hasattr(module, "cpu_linear"):
                    param = _weight_through_matmul(module, param)
                named.append((full, param))
        return pack_bucket(named)


@torch.no_grad()
def _weight_through_matmul(module: Any, weight: torch.Tensor) -> torch.Tensor:
    columns = weight.shape[1] if weight.numel() else module.input_size_per_partition
    eye = torch.eye(columns, dtype=weight.dtype)
    return module.cpu_linear(eye, weight, None).t().contiguous()
