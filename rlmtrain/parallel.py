"""The data-parallel world of a training run: one process, or the ranks torchrun starts.

Every run has a process group, so one code path trains at any size: under torchrun it comes from
the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); alone it is a group
of one over an in-memory store. Gloo on CPU, NCCL on CUDA with one device per local rank.

The policy is sharded with FSDP2 (`shard`): one unit per decoder block and the root unit holding
the embedding, the final norm and the LM head. Parameters and optimizer state stay fp32 (the
master weights); a bf16 `compute_dtype` is FSDP2's mixed-precision policy, which all-gathers
bf16 copies for the forward and backward and reduces gradients in fp32. Gradients are summed
over ranks, not averaged: every token weight already divides by the global batch
(docs/algorithm.md §4), so a rank's loss is its share of one objective.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlmtrain import watchdog
from rlmtrain.devices import resolve_device


@dataclass(frozen=True)
class World:
    """This process's side of the run: `rank` of `size` among the ranks that do what it does.
    A world split for `rollout.inference_ranks` has two sides, each its own process group: the
    first ranks train (`trains`), the last `inference_ranks` roll out."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    inference_ranks: int = 0
    trains: bool = True

    @property
    def is_main(self) -> bool:
        return self.trains and self.rank == 0


def launched() -> bool:
    """True under torchrun (or any launcher that sets the process-group environment)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def start(
    device_choice: str, *, timeout_s: float = 1800.0, inference_ranks: int = 0
) -> tuple[World, torch.device]:
    """Join (or, alone, make) the run's process group; the world and this rank's device.

    inference_ranks > 0 splits a launched world: the trainers' process group holds its first
    ranks, the inference ranks' its last, each numbered from 0 within its side, and the launch's
    store is kept for the bridge between them (`bridge.Bridge`)."""
    rank = int(os.environ.get("RANK", 0))
    size = int(os.environ.get("WORLD_SIZE", 1))
    if split_refused(inference_ranks):
        raise ValueError(split_refused(inference_ranks))
    trainers = size - inference_ranks
    trains = rank < trainers
    world = World(
        rank=rank if trains else rank - trainers,
        size=trainers if trains else inference_ranks,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        inference_ranks=inference_ranks,
        trains=trains,
    )
    device = resolve_device(device_choice)
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        raise RuntimeError("a process group is already running in this process")
    if launched():
        # Met through explicitly (as init_process_group's env:// would) to keep the store: the
        # bridge between a split world's sides and the watchdog speak through it.
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size, timeout=timeout))
        store.set_timeout(timeout)
        side = ("trainers/" if trains else "inference/") if inference_ranks else "default_pg"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(side, store),
            rank=world.rank,
            world_size=world.size,
            timeout=timeout,
        )
        _LAUNCH_STORE[:] = [store]
    else:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return world, device


# A gloo worker thread drops a finished collective's tensors a moment after the caller sees it
# complete, and freeing a tensor Python also knew takes the GIL. If the interpreter has begun to
# finalize by then, Python ends that thread inside a C++ destructor and the process aborts
# ("terminate called without an active exception", SIGABRT) after a run that succeeded.
# Joining those threads would be the event to wait on, but torch 2.13 gives no way to: only the
# group's C++ destructor joins them, and once a functional collective (FSDP2's) has run, C++ keeps
# the group alive until exit. Measured: a gloo group's worker threads are still there after
# destroy_process_group, after the backend's own shutdown() and after gc, and they go only when no
# functional collective ran. Nor can a rank see whether a worker still holds a tensor (a thread
# waiting for the GIL and one idle look alike from outside). So a rank that leaves hands them the
# GIL for a while: sleeping releases it, and a runnable thread is scheduled within milliseconds
# even on an oversubscribed machine, far inside this. It is paid once per process, at its end.
_GLOO_WORKERS_SETTLE_S = 0.25


def split_refused(inference_ranks: int) -> str:
    """Why a world cannot give `inference_ranks` ranks to rollouts ("" when it can)."""
    if not inference_ranks:
        return ""
    if not launched():
        return f"{inference_ranks} inference rank(s) need a world launched by torchrun"
    size = int(os.environ["WORLD_SIZE"])
    if inference_ranks >= size:
        return (
            f"{inference_ranks} inference rank(s) leave none of the {size} launched ranks to train"
        )
    return ""


# The launch's store, kept by `start` for the bridge between a split world's two sides and for
# the watchdog.
_LAUNCH_STORE: list[Any] = []


def launch_store() -> Any:
    """The store every launched rank met through (refused in a world of one process)."""
    if not _LAUNCH_STORE:
        raise RuntimeError("a world of one process has no launch store")
    return _LAUNCH_STORE[0]


def watch(stall_timeout_s: float) -> AbstractContextManager[Any]:
    """This rank's progress watched with every launched rank's (`watchdog`), each on a
    connection of its own to the launch's store; `stall_timeout_s` = 0: not watched."""
    if not stall_timeout_s:
        return nullcontext()
    if not launched():
        return watchdog.Watchdog(None, 0, 1, stall_timeout_s)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    connection = launch_store().clone()
    # A store that does not answer leaves the watchdog blind for this long, not the run's 30
    # minutes; a launch restarted by torchrun keeps its store, so each attempt has its own keys.
    connection.set_timeout(datetime.timedelta(seconds=max(60.0, stall_timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"rlmtrain/watchdog/{attempt}/", connection)
    return watchdog.Watchdog(store, rank, size, stall_timeout_s)


def stop() -> None:
    """Leave the process group; the last thing a rank does with it."""
    _LAUNCH_STORE.clear()
    if dist.is_initialized():
        uses_gloo = dist.get_backend() == "gloo"
        _OBJECTS.clear()  # destroyed with the rest
        dist.destroy_process_group()
        if uses_gloo:
            time.sleep(_GLOO_WORKERS_SETTLE_S)


def shard(
    model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype, replicate: int = 1
) -> Any:
    """FSDP2 over the world: each decoder block a unit, the root (embedding, final norm, LM
    head) the last; fp32 master weights, `compute_dtype` for the forward and backward.

    `replicate` > 1 is HSDP: the world is `replicate` groups of consecutive ranks (a node's
    ranks, as torchrun numbers them), each holding one whole copy of the model sharded over its
    own ranks; parameters are gathered inside a group and only gradients cross between groups.

    A model on the meta device is sharded as it is and then given storage on `device` for its
    own shards alone, left unset (`materialise.py` fills it); a model with weights is moved to
    `device` whole first."""
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        model.to(device=device, dtype=torch.float32)
    mesh = _mesh(device, replicate)
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.float32,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            # Summed, not averaged; plain SUM collectives, which gloo has (it lacks PREMUL_SUM).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    if on_meta:
        model.to_empty(device=device)
    return model


def _mesh(device: torch.device, replicate: int) -> DeviceMesh:
    world = size()
    if replicate < 1 or world % replicate:
        raise ValueError(f"{world} ranks do not split into {replicate} replicas")
    if replicate == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device.type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_rows(parameter: torch.Tensor) -> slice:
    """The rows of the whole parameter that this rank's shard of it holds (`_row_shards`: the
    last shards are shorter or empty)."""
    if not isinstance(parameter, DTensor) or not parameter.dim():
        return slice(0, parameter.shape[0] if parameter.dim() else 1)
    shards, per_shard, index = _row_shards(parameter)
    rows = parameter.shape[0]
    start = min(index * per_shard, rows)
    stop = min(start + per_shard, rows)
    local = parameter.to_local().shape[0]
    if stop - start != local:
        raise RuntimeError(
            f"FSDP2 holds {local} rows of a {rows}-row parameter here, not rows {start}:{stop}"
        )
    return slice(start, stop)


def _row_shards(parameter: DTensor) -> tuple[int, int, int]:
    """How FSDP2 cuts a parameter's rows, as `torch.chunk` does: (shards, rows a shard holds at
    most, this rank's shard), the shards over the mesh's last dimension."""
    mesh = parameter.device_mesh
    shards = mesh.size(mesh.ndim - 1)
    coordinate = mesh.get_coordinate()
    index = 0 if coordinate is None else coordinate[-1]
    return shards, -(-parameter.shape[0] // shards), index


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (a collective: all ranks call it together)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole parameter), one parameter at a time in the module's own order.

    A sharded parameter is gathered (`_whole`, a collective) only when the consumer asks
    for the next one, so the ranks gather in lockstep as long as each consumes the whole
    sequence, which the same order on every rank makes safe. A weight sync that streams it
    into buckets holds one bucket of whole weights at a time, where `full_state` would hold
    the whole model on every rank.
    """
    for name, parameter in model.named_parameters():
        # Yielded without a name of its own here, so that gathering the next one does not
        # find this one still held by the generator.
        yield name, _whole(parameter.detach())
        watchdog.mark()


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter whole, gathered straight into one buffer of its size: `full_tensor` would
    gather into a padded buffer and copy out of it, two whole parameters at its peak."""
    if not isinstance(parameter, DTensor):
        return parameter
    mesh = parameter.device_mesh
    sharded = [p for p in parameter.placements if not isinstance(p, Replicate)]
    if sharded != [Shard(0)] or not isinstance(parameter.placements[-1], Shard):
        return parameter.full_tensor()
    shards, per_shard, mine = _row_shards(parameter)
    if shards == 1:
        return parameter.full_tensor()
    local = parameter.to_local()
    rows = parameter.shape[0]
    if local.shape[0] < per_shard:  # the last shards are short or empty; the gather wants equal
        pad = local.new_zeros((per_shard - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, pad])
    whole = local.new_empty((per_shard * shards, *local.shape[1:]))
    group = mesh.get_group(mesh.ndim - 1)
    if dist.get_backend(group) == "gloo":
        # Gloo's gathers stage the whole output in a buffer of their own; its broadcast writes
        # in place, so each shard is sent from its owner into its rows of `whole`.
        for index in range(shards):
            rows_of = whole.narrow(0, index * per_shard, per_shard)
            if index == mine:
                rows_of.copy_(local)
            dist.broadcast(rows_of, group=group, group_src=index)
    else:
        dist.all_gather_into_tensor(whole, local.contiguous(), group=group)
    return whole[:rows]


def whole_on_main(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Every parameter whole, in `dtype` on the CPU, on rank 0 alone; None on the others (a
    collective: all ranks call it together). The parameters are gathered one at a time
    (`full_parameters`) and only rank 0 keeps them, so another rank holds its shards and one
    whole parameter, and no GPU ever holds more than one: an export written by rank 0."""
    kept: dict[str, torch.Tensor] = {}
    for name, whole in full_parameters(model):
        if rank() == 0:
            kept[name] = whole.to(device="cpu", dtype=dtype)
        del whole  # before the next gather: one whole parameter at a time
    return kept if rank() == 0 else None


# The collectives below are the identity in a world of one, with or without a process group,
# so the training steps also run on a plain module outside any run (as the tests drive them).


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over the ranks, in place (sum in the tensor's dtype; float64 keeps
    counts exact)."""
    if size() > 1:
        moved = values.to(_comm_device())
        with watchdog.waiting("all_sum"):
            dist.all_reduce(moved)
        values.copy_(moved)
    return values


def all_max(values: torch.Tensor) -> torch.Tensor:
    """`values`' elementwise maximum over the ranks, in place."""
    if size() > 1:
        moved = values.to(_comm_device())
        with watchdog.waiting("all_max"):
            dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        values.copy_(moved)
    return values


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (pickled; for samples and small records)."""
    if size() == 1:
        return [obj]
    out: list[Any] = [None] * size()
    with watchdog.waiting("all_gather"):
        dist.all_gather_object(out, obj, group=_objects_group())
    return out


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's `obj` in rank order on rank 0; None on the others."""
    if size() == 1:
        return [obj]
    out: list[Any] | None = [None] * size() if rank() == 0 else None
    with watchdog.waiting("gather_to_main"):
        dist.gather_object(obj, out, dst=0, group=_objects_group())
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if size() == 1:
        return obj
    box = [obj]
    with watchdog.waiting("broadcast"):
        dist.broadcast_object_list(box, src=0, group=_objects_group())
    return box[0]


# Pickled objects travel over gloo, between the hosts: over NCCL each would be staged on the GPU,
# world x the largest object on every rank (a step's trees, a few MB a rank), while a colocated
# engine holds the card. Made on first use, by every rank alike (the object collectives are).
_OBJECTS: list[Any] = []


def _objects_group() -> Any:
    if dist.get_backend() == "gloo":
        return None
    if not _OBJECTS:
        _OBJECTS.append(dist.new_group(backend="gloo"))
    return _OBJECTS[0]


def barrier() -> None:
    if size() > 1:
        with watchdog.waiting("barrier"):
            dist.barrier()


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
