"""Methods added to every vLLM worker (`worker_extension_cls`), called by `collective_rpc` name.

vLLM runs its workers in another process and refuses to ship Python functions to them (its
serializer takes plain data only, unless insecure pickling is switched on), so what a trainer
needs done inside a worker is a method of a class named by its import path. Tensors in an RPC's
arguments reach the worker as undecoded tuples, so a bucket of weights travels as one flat byte
string with each tensor's name, dtype and shape beside it (`WeightBucket`), and is cut back into
tensors here. This module is imported inside vLLM's worker process and so imports nothing of the
trainer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["WeightSync", "pack_bucket", "unpack_bucket"]


def pack_bucket(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]], bytes]:
    """(names, dtypes, shapes, bytes): the tensors laid end to end as raw bytes."""
    names, dtypes, shapes, chunks = [], [], [], []
    for name, tensor in named:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        names.append(name)
        dtypes.append(str(flat.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
        chunks.append(flat.view(torch.uint8).numpy().tobytes())
    return names, dtypes, shapes, b"".join(chunks)


def unpack_bucket(
    names: list[str], dtypes: list[str], shapes: list[list[int]], data: bytes
) -> list[tuple[str, torch.Tensor]]:
    """`pack_bucket` undone: the named tensors, viewing one writable copy of `data`."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"a weight bucket of {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes"
        )
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out, offset = [], 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        count = math.prod(shape)
        size = count * dtype.itemsize
        out.append((name, buffer[offset : offset + size].view(dtype).reshape(shape)))
        offset += size
    if offset != len(buffer):
        raise ValueError(f"a weight bucket of {len(buffer)} bytes whose tensors need {offset}")
    return out


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
        named = unpack_bucket(names, dtypes, shapes, data)
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
