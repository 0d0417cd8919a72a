"""The bridge of a split world: trainer rank 0 and the inference ranks (`rollout.inference_ranks`).

Two process groups of their own over the launch's store, so that the two kinds of traffic never
wait on each other: on one, trainer rank 0 broadcasts the policy's weights to every inference
rank after each update; on the other, each inference rank sends trainer rank 0 its share of
every step's groups, in step order. Bridge rank 0 is trainer rank 0; inference rank i is bridge
rank i + 1. Every call blocks, and each kind of traffic is driven by one thread at a time (the
inference rank calls from two threads, one per group, beside its event loop).

Objects travel pickled (a length, then the bytes) over gloo; weights as the tensors
themselves, after a header naming them, their shapes and dtypes, over a third group: gloo on a
CPU, NCCL on GPUs (GPU to GPU, never staged through the host, each inference rank receiving
into its own device, which its engine loads from). The header and every object go over gloo
first, so an NCCL broadcast is only ever posted once the sender is sending: NCCL's watchdog
never sees a receiver waiting through the trainers' SFT.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlmtrain import parallel

__all__ = ["Bridge"]

log = logging.getLogger("rlmtrain.train")

# A bridge call waits as long as the other side works: an inference rank waits for the first
# weights through the trainers' start, evaluation and SFT. A dead peer ends the run through the
# launcher, which stops every rank, not through this timeout.
_WAIT = datetime.timedelta(hours=24)
_GROUPS_TAG = 1


class Bridge:
    """This rank's end of the bridge (trainer rank 0 or an inference rank)."""

    def __init__(self, world: parallel.World, device: torch.device) -> None:
        if world.trains and world.rank != 0:
            raise ValueError("only trainer rank 0 is on the bridge")
        store = parallel.launch_store()
        self.rank = 0 if world.trains else world.rank + 1
        self.size = world.inference_ranks + 1
        self.device = device
        self._objects = self._gloo(store, "bridge/objects/")
        self._groups = self._gloo(store, "bridge/groups/")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _WAIT
            self._tensors = dist.ProcessGroupNCCL(
                dist.PrefixStore("bridge/tensors/", store), self.rank, self.size, options
            )
        else:
            self._tensors = self._gloo(store, "bridge/tensors/")
        if self.rank == 0:
            ranks = self.size - 1
            log.info(
                "bridge to %d inference rank%s: weights over %s",
                ranks,
                "" if ranks == 1 else "s",
                backend,
            )

    def _gloo(self, store: Any, prefix: str) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), self.rank, self.size, _WAIT)

    # -- objects, point to point (the groups' channel) ----------------------------------------

    def send(self, obj: Any, dst: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._groups.send(
            [torch.tensor([data.numel()], dtype=torch.int64)], dst, _GROUPS_TAG
        ).wait()
        self._groups.send([data], dst, _GROUPS_TAG).wait()

    def recv(self, src: int) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self._groups.recv([length], src, _GROUPS_TAG).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        self._groups.recv([data], src, _GROUPS_TAG).wait()
        return pickle.loads(data.numpy().tobytes())

    # -- broadcasts from trainer rank 0 (the weights' channel) -------------------------------

    def broadcast(self, obj: Any = None) -> Any:
        """Trainer rank 0's `obj` on every bridge rank."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        _broadcast(self._objects, length)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(int(length), dtype=torch.uint8)
        )
        _broadcast(self._objects, buffer)
        return obj if self.rank == 0 else pickle.loads(buffer.numpy().tobytes())

    def send_weights(
        self,
        header: list[tuple[str, tuple[int, ...], torch.dtype]],
        named: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        """Trainer rank 0: the tensors `header` names, in its order, to every inference rank,
        one at a time as `named` yields them (a rank holds one whole parameter, not the model)."""
        self.broadcast(header)
        for (name, shape, dtype), (sent, tensor) in zip(header, named, strict=True):
            if sent != name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"weights: {sent} {tuple(tensor.shape)} where {name} {shape}")
            _broadcast(self._tensors, tensor.detach().to(self.device).contiguous())

    def recv_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """An inference rank: the weights trainer rank 0 sends, as (name, tensor) pairs on this
        rank's device."""
        header = self.broadcast()
        for name, shape, dtype in header:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            _broadcast(self._tensors, tensor)
            yield name, tensor


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Bridge rank 0's `tensor` into every rank's; on CUDA the caller's stream waits for it."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
