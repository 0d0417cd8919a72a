"""The launch environment: who started the ranks and what they share.

Two mistakes of a multi-node launch cost a run without failing it, so both are refused at the
start, in one line each (`LaunchError`, which the command line prints, exit 2):

- `srun python -m rlmtrain train` without torchrun: SLURM starts one process per task, none
  with torchrun's environment (RANK, WORLD_SIZE; `parallel.launched`), so each would train as a
  world of one into the same run folder, overwriting the others' checkpoints. `check_launcher`
  refuses it before a process group starts and names the way that works: torchrun once per node
  (`configs/slurm/train.sbatch`). One task (an `salloc` shell, `srun -n1`) is one run and trains.
- a run folder on node-local disk: every rank reads what rank 0 writes there (the task sets,
  the tokenizer) and checkpoints go there from every rank, so ranks that each see their own
  folder fail hours later or resume from a mix. `check_shared_folder` has each rank write a note
  into `RunFolder.ranks`, then rank 0 looks for them all and every rank raises on its verdict.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid

from rlmtrain import parallel
from rlmtrain.errors import UserError
from rlmtrain.run_folder import RunFolder

SLURM_SCRIPT = "configs/slurm/train.sbatch"


class LaunchError(UserError, RuntimeError):
    """The ranks were started in a way the run cannot train under; the message says how to."""


def check_launcher() -> None:
    """Refuse several SLURM tasks of this command that torchrun did not start.

    srun's tasks say how many tasks their step has (SLURM_STEP_NUM_TASKS) and which one this is
    (SLURM_PROCID); torchrun's children have RANK and WORLD_SIZE besides, and pass. The
    allocation's count (SLURM_NTASKS) is not read: a batch script's own shell, or an salloc
    shell, is one process whatever the allocation holds."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or "1"
    task = os.environ.get("SLURM_PROCID")
    if task is None or not tasks.isdigit() or int(tasks) <= 1 or parallel.launched():
        return
    raise LaunchError(
        f"SLURM started this as task {task} of {tasks} without torchrun, which makes {tasks} "
        "separate one-process runs writing into one run folder; run torchrun once per node "
        f"instead (`sbatch {SLURM_SCRIPT} CONFIG`), or one task (`srun -n1 ...`)"
    )


def check_shared_folder(folder: RunFolder, world: parallel.World) -> None:
    """Refuse, on every rank, a run folder that some rank does not share with rank 0.

    Each rank writes a note (its rank, host and a token of this start) into `folder.ranks`;
    the gather of hosts and tokens that follows is the barrier after which rank 0 reads every
    note. A note left by an earlier start, on rank 0's disk under another rank's name, holds
    another token and counts as missing. Rank 0 decides and broadcasts, so all ranks raise
    together instead of the others waiting at the next collective; then it removes the notes,
    so a later start with another world size finds none. A collective (all ranks call it); in
    a world of one there is nothing to compare and it does nothing."""
    if world.size == 1:
        return
    host = socket.gethostname()
    # A rank that cannot write its note does not raise alone (the others would wait for it):
    # it sends no token, and rank 0 names it with the unseen.
    written = parallel.all_gather((host, _write_note(folder, world.rank, host)))
    verdict = None
    if world.is_main:
        missing = [
            r for r, (_, wanted) in enumerate(written)
            if wanted is None or _read_token(folder, r) != wanted
        ]  # fmt: skip
        shutil.rmtree(folder.ranks, ignore_errors=True)
        if missing:
            verdict = _unseen(folder, missing, [host for host, _ in written])
    verdict = parallel.broadcast(verdict)
    if verdict is not None:
        raise LaunchError(verdict)


def _write_note(folder: RunFolder, rank: int, host: str) -> str | None:
    """This rank's note of this start, written into the run folder; its token, or None when it
    could not be written."""
    token = uuid.uuid4().hex
    note = folder.rank_note(rank)
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(json.dumps({"rank": rank, "host": host, "token": token}))
    except OSError:
        return None
    return token


def _read_token(folder: RunFolder, rank: int) -> str | None:
    try:
        return json.loads(folder.rank_note(rank).read_text()).get("token")
    except (OSError, ValueError, AttributeError):
        return None


def _unseen(folder: RunFolder, missing: list[int], hosts: list[str]) -> str:
    """The one line naming the ranks whose notes rank 0 cannot see, grouped by host."""
    by_host: dict[str, list[int]] = {}
    for rank in missing:
        by_host.setdefault(hosts[rank], []).append(rank)
    who = ", ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} (host {host})"
        for host, ranks in by_host.items()
    )
    verb = "writes" if len(missing) == 1 else "write"
    return (
        f"checkpoint.dir {folder.root}: what {who} {verb} there cannot be seen from rank 0 "
        f"(host {hosts[0]}); the run folder must be on a filesystem every node shares"
    )
