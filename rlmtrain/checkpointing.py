"""Resumable checkpoints: what a killed run needs to go on exactly where it stopped.

A checkpoint is a folder `<checkpoint.dir>/checkpoints/<phase>-<step>` holding

- `state/`: the model's and the optimizer's sharded state, written and read by every rank
  through `torch.distributed.checkpoint` (`get_state_dict` / `set_state_dict`), so a run of N
  ranks writes N shards and never gathers the whole model on one;
- `trainer.json`: the phase, the steps of it taken, the LR in force, the run's seed and world
  size, the config values the LR, exploration-bonus and tool-credit schedules follow, and those
  its synthesised tasks and their order follow (the data cursors and the schedules' positions
  are functions of the phase and step);
- `rng-<rank>.pkl`: every rank's python, numpy and torch (and CUDA) generator states;
- `COMPLETE`: written last, a manifest of every other file's size and CRC-32 (each rank sums
  the files it wrote: its own shards and generator states; rank 0 the rest).

It is written into a hidden temporary folder and renamed into place only once complete, so a
kill at any moment leaves either the whole checkpoint or none (the temporary folder is ignored
and swept by the next save). The newest `checkpoint.keep` are kept. Resuming takes the newest;
one that is incomplete or whose files do not match the manifest is refused with one line
naming it, never skipped for an older one: which step a run resumes from is the user's call.
Sizes are checked wherever a checkpoint is found; the sums when it is loaded (each rank the
files it would have written), so a file damaged in place into other finite values is refused
too instead of being trained on. CRC-32 because it is the fastest sum at hand (7 GB/s on one
core here, against 2 GB/s for SHA-256: `bench/bench_checkpoint.py`) and the damage it is for
(a bad disk, a partial copy) is not chosen to collide with it.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlmtrain import parallel
from rlmtrain.model.hf import CheckpointError
from rlmtrain.run_folder import RunFolder

__all__ = [
    "TrainerState", "check", "crc32", "latest", "load", "load_frozen", "names", "save",
    "trainer_state",
]  # fmt: skip

COMPLETE = "COMPLETE"
_NAME = re.compile(r"^(sft|rl)-(\d{6})$")
_PHASES = ("sft", "rl")


class TrainerState(msgspec.Struct, kw_only=True):
    phase: str
    """"sft" or "rl": the phase the next step belongs to."""
    step: int
    """Steps of `phase` already taken (the next step's 0-based index)."""
    lr: float
    seed: int
    world_size: int
    schedules: dict[str, float | int | str] = msgspec.field(default_factory=dict)
    """The config values the schedules follow, by dotted key (`resume.SCHEDULE_KEYS`); empty in
    a checkpoint written before they were recorded."""
    data: dict[str, float | int | str] = msgspec.field(default_factory=dict)
    """The config values the synthesised tasks and their order follow (`resume.DATA_KEYS`);
    empty in a checkpoint written before they were recorded."""
    optimizer_stepped: bool | None = None
    """Whether the optimizer had taken a step (and so holds state) when this was written. An
    RL phase whose first steps found nothing to learn from checkpoints a fresh optimizer, and a
    resume must leave it fresh: Adam started by a zero step would count one step more. None in
    a checkpoint written before it was recorded: `load` then reads it off the saved keys."""


def save(
    run_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    *,
    keep: int,
    frozen: dict[str, torch.nn.Module] | None = None,
) -> Path:
    """Write one checkpoint (all ranks call this together); its final path. `frozen`: models
    that are not trained but must come back too (the KL reference), by name."""
    root = RunFolder(run_dir).checkpoints
    name = f"{state.phase}-{state.step:06d}"
    final = root / name
    temporary = root / f".{name}.partial"
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        temporary.mkdir()
    parallel.barrier()
    # torch's get_state_dict would start an empty optimizer with a zero step (or not, when
    # stale gradients are about): which would change the run being saved and give a resume
    # different keys to look for. A fresh optimizer is recorded as fresh instead.
    state = msgspec.structs.replace(state, optimizer_stepped=bool(optimizer.state))
    if state.optimizer_stepped:
        model_state, optim_state = get_state_dict(model, optimizer)
        everything = {"model": model_state, "optim": optim_state}
    else:
        everything = {"model": get_model_state_dict(model)}
    everything.update({name: get_model_state_dict(m) for name, m in (frozen or {}).items()})
    dcp.save(everything, checkpoint_id=str(temporary / "state"))
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    _write_atomically(temporary / f"rng-{dist.get_rank()}.pkl", pickle.dumps(rng))
    if dist.get_rank() == 0:
        _write_atomically(temporary / "trainer.json", msgspec.json.encode(state))
    parallel.barrier()
    files = sorted(str(p.relative_to(temporary)) for p in temporary.rglob("*") if p.is_file())
    summed = parallel.all_gather(_sums(temporary, files))
    if dist.get_rank() == 0:
        manifest = {name: entry for share in summed for name, entry in share.items()}
        if len([p for p in manifest if p.startswith("rng-")]) != world:
            raise CheckpointError(f"{temporary}: not every rank wrote its generator states")
        _write_atomically(temporary / COMPLETE, json.dumps(manifest, indent=1).encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
        _fsync_dir(root)
        complete = [name for name in names(run_dir) if (root / name / COMPLETE).is_file()]
        for old in complete[:-keep]:
            shutil.rmtree(root / old, ignore_errors=True)
    parallel.barrier()
    return final


def latest(run_dir: Path) -> Path | None:
    """The newest checkpoint folder in the run, None when there is none; the newest one
    incomplete or damaged is a CheckpointError naming it."""
    found = names(run_dir)
    if not found:
        return None
    newest = RunFolder(run_dir).checkpoints / found[-1]
    check(newest)
    return newest


def names(run_dir: Path) -> list[str]:
    """The names of the run's checkpoint folders, complete or not, oldest first."""
    root = RunFolder(run_dir).checkpoints
    if not root.is_dir():
        return []
    return sorted((p.name for p in root.iterdir() if _NAME.match(p.name)), key=_order)


def check(path: Path) -> dict[str, dict[str, int]]:
    """Refuse a checkpoint folder that is not whole: no completion mark, or a file missing or
    of another size than the manifest says. Its manifest, every entry as {"bytes", "crc32"}
    (no "crc32" in a checkpoint written before the sums were recorded)."""
    mark = path / COMPLETE
    if not mark.is_file():
        raise CheckpointError(
            f"{path}: incomplete checkpoint (no {COMPLETE} mark); remove it to resume from an "
            "older one"
        )
    try:
        manifest = json.loads(mark.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: unreadable {COMPLETE} manifest") from None
    try:
        manifest = msgspec.convert(manifest, dict[str, int | dict[str, int]], strict=True)
    except msgspec.ValidationError:
        raise CheckpointError(f"{path}: {COMPLETE} is not a manifest of file sizes") from None
    manifest = {
        name: entry if isinstance(entry, dict) else {"bytes": entry}
        for name, entry in manifest.items()
    }
    if not all("bytes" in entry for entry in manifest.values()):
        raise CheckpointError(f"{path}: {COMPLETE} is not a manifest of file sizes")
    if "trainer.json" not in manifest or not any(n.startswith("state/") for n in manifest):
        raise CheckpointError(f"{path}: damaged checkpoint: its manifest lists no trainer state")
    for name, entry in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: damaged checkpoint: {name} is missing")
        if file.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"{path}: damaged checkpoint: {name} has {file.stat().st_size} bytes, "
                f"the manifest says {entry['bytes']}"
            )
    return manifest


def _sums(folder: Path, files: list[str]) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the `files` of `folder` this rank sums (`_summed_here`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    entries = {}
    for name in files:
        if _summed_here(name, rank, world):
            entries[name] = {"bytes": (folder / name).stat().st_size, "crc32": crc32(folder / name)}
    return entries


def _summed_here(name: str, rank: int, world: int) -> bool:
    """Each rank sums the files it wrote (`dcp`'s shards are named `__<rank>_<n>.distcp`, the
    generator states `rng-<rank>.pkl`), out of its page cache; rank 0 also every other one."""
    owner = next(
        (r for r in range(world) if name.startswith(f"state/__{r}_") or name == f"rng-{r}.pkl"),
        0,
    )
    return owner == rank


def crc32(path: Path, chunk: int = 1 << 24) -> int:
    """The CRC-32 of a file's bytes, read a chunk at a time."""
    value = 0
    with path.open("rb") as file:
        while block := file.read(chunk):
            value = zlib.crc32(block, value)
    return value


def _check_sums(path: Path, manifest: dict[str, dict[str, int]]) -> None:
    """Every rank sums the files it would have written (`_sums`) and learns every rank's
    verdict: a file whose bytes changed in place, sizes unchanged, is refused on all of them
    together."""
    summed = _sums(path, [name for name, entry in manifest.items() if "crc32" in entry])
    wrong = next(
        (name for name, entry in summed.items() if entry["crc32"] != manifest[name]["crc32"]), None
    )
    found = next((name for name in parallel.all_gather(wrong) if name), None)
    if found is not None:
        raise CheckpointError(
            f"{path}: damaged checkpoint: the bytes of {found} are not those saved (its CRC-32 "
            "differs from the manifest's); remove it to resume from an older one"
        )


def trainer_state(path: Path) -> TrainerState:
    """The trainer state of the checkpoint at `path` (`check` it first: `latest` and `load`
    do)."""
    try:
        return msgspec.json.decode((path / "trainer.json").read_bytes(), type=TrainerState)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{path}/trainer.json: {exc}") from None


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore model, optimizer and this rank's generators from `path` (all ranks together);
    the trainer state to continue from."""
    manifest = check(path)
    state = trainer_state(path)
    if state.world_size != dist.get_world_size():
        raise CheckpointError(
            f"{path}: written by {state.world_size} ranks, resumed on {dist.get_world_size()}; "
            "resume with the same number of ranks"
        )
    if optimizer.state:
        raise ValueError("checkpointing.load restores into a freshly built optimizer only")
    _check_sums(path, manifest)
    if state.optimizer_stepped is None:
        state = msgspec.structs.replace(state, optimizer_stepped=_holds_optimizer_state(path))
    if state.optimizer_stepped:
        model_state, optim_state = get_state_dict(model, optimizer)
        wanted = {"model": model_state, "optim": optim_state}
        _read(path, wanted, "model/optimizer")
        set_state_dict(
            model, optimizer, model_state_dict=wanted["model"], optim_state_dict=wanted["optim"]
        )
    else:
        load_frozen(path, "model", model)
    _check_finite(path, model, optimizer)
    try:
        rng: dict[str, Any] = pickle.loads((path / f"rng-{dist.get_rank()}.pkl").read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise CheckpointError(f"{path}: unreadable generator states: {exc}") from None
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def _check_finite(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse loaded states that hold a NaN or an infinity: a checkpoint damaged in place (its
    sizes, all the manifest records, unchanged) would otherwise train on, or be exported, with
    them. Each rank looks at its own shards; every rank learns the verdict and all raise."""
    names = {id(p): name for name, p in model.named_parameters()}
    found = None
    for name, parameter in model.named_parameters():
        if not torch.isfinite(parallel.local_shard(parameter.detach())).all():
            found = f"parameter {name}"
            break
    for parameter, moments in optimizer.state.items():
        if found is not None:
            break
        for key, value in moments.items():
            if torch.is_tensor(value) and not torch.isfinite(parallel.local_shard(value)).all():
                found = f"the optimizer's {key} of {names.get(id(parameter), '?')}"
                break
    verdicts = parallel.all_gather(found)
    bad = next(((rank, what) for rank, what in enumerate(verdicts) if what), None)
    if bad is not None:
        raise CheckpointError(
            f"{path}: damaged checkpoint: {bad[1]} holds NaN or infinite values (rank {bad[0]}'s "
            "shard); remove it to resume from an older one"
        )


def load_frozen(path: Path, name: str, module: torch.nn.Module) -> None:
    """Restore the frozen model saved as `name` (see `save`) into `module`."""
    wanted = {name: get_model_state_dict(module)}
    _read(path, wanted, name)
    set_model_state_dict(module, wanted[name])


def _holds_optimizer_state(path: Path) -> bool:
    """Whether the checkpoint's saved keys include optimizer state (moments, step counts)."""
    try:
        keys = dcp.FileSystemReader(str(path / "state")).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any reader failure means a damaged checkpoint
        raise CheckpointError(f"{path}: unreadable state metadata: {_first_cause(exc)}") from None
    return any(key.startswith("optim.state.") for key in keys)


def _read(path: Path, wanted: dict[str, Any], what: str) -> None:
    try:
        dcp.load(wanted, checkpoint_id=str(path / "state"))
    # CheckpointException, which dcp raises for a failure on any rank, is a BaseException.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any reader failure
        raise CheckpointError(f"{path}: unreadable {what} state: {_first_cause(exc)}") from None


def _first_cause(exc: BaseException) -> str:
    """One line saying why dcp failed: the first failing rank's own error where it wraps one."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _order(name: str) -> tuple[int, int]:
    match = _NAME.match(name)
    assert match is not None
    return _PHASES.index(match.group(1)), int(match.group(2))


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".tmp")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
