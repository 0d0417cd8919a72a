"""The bridge of a split world: trainer rank 0 and the inference ranks (`rollout.inference_ranks`).

Two process groups of their own over the launch's store, so that the two kinds of traffic never
wait on each other: on one, trainer rank 0 broadcasts the policy's weights to every inference
rank after each update; on the other, each inference rank sends trainer rank 0 its share of
every step's groups, in step order. Bridge rank 0 is trainer rank 0; inference rank i is bridge
rank i + 1. Every call blocks, and each kind of traffic is driven by one thread at a time (the
inference rank calls from two threads, one per group, beside its event loop).

Objects travel pickled (a length, then the bytes); weights as the tensors themselves, after a
header naming them, their shapes and dtypes. Gloo on either device: over a GPU world the
weights are staged through the host.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlmtrain import parallel

__all__ = ["Bridge"]

# A bridge call waits as long as the other side works: an inference rank waits for the first
# weights through the trainers' start, evaluation and SFT. A dead peer ends the run through the
# launcher, which stops every rank, not through this timeout.
_WAIT = datetime.timedelta(hours=24)
_GROUPS_TAG = 1


class Bridge:
    """This rank's end of the bridge (trainer rank 0 or an inference rank)."""

    def __init__(self, world: parallel.World) -> None:
        if world.trains and world.rank != 0:
            raise ValueError("only trainer rank 0 is on the bridge")
        store = parallel.launch_store()
        self.rank = 0 if world.trains else world.rank + 1
        self.size = world.inference_ranks + 1
        self._weights = dist.ProcessGroupGloo(
            dist.PrefixStore("bridge/weights/", store), self.rank, self.size, _WAIT
        )
        self._groups = dist.ProcessGroupGloo(
            dist.PrefixStore("bridge/groups/", store), self.rank, self.size, _WAIT
        )

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
        self._broadcast(length)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(int(length), dtype=torch.uint8)
        )
        self._broadcast(buffer)
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
            self._broadcast(tensor.detach().cpu().contiguous())

    def recv_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """An inference rank: the weights trainer rank 0 sends, as (name, tensor) pairs."""
        header = self.broadcast()
        for name, shape, dtype in header:
            tensor = torch.empty(shape, dtype=dtype)
            self._broadcast(tensor)
            yield name, tensor

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._weights.broadcast([tensor], options).wait()
