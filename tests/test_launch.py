"""The launch environment (`rlmtrain.launch`), with real processes where it counts:

- `python -m rlmtrain train` as one of several SLURM tasks without torchrun is refused in one
  line, exit 2, before it writes anything; one task, or torchrun's ranks, train;
- two torchrun ranks whose run folders differ (disks of their own) both raise the one line
  naming the rank rank 0 cannot see, a note of an earlier start in rank 0's folder included;
  sharing one folder they pass and leave no notes behind;
- `configs/slurm/train.sbatch` under fake `srun` and `scontrol` on this machine: two "nodes",
  one torchrun each, meet at the c10d rendezvous and train one world of two ranks to the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from clocks import RUN_HANG_S

from rlmtrain import launch, parallel
from rlmtrain.launch import LaunchError, check_launcher, check_shared_folder
from rlmtrain.run_folder import RunFolder

ROOT = Path(__file__).resolve().parents[1]
RANKS = ROOT / "tests" / "shared_folder_ranks.py"
SBATCH = ROOT / "configs" / "slurm" / "train.sbatch"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's, one thread per rank (two cores), and `extra`."""
    kept = {
        k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCH_ENV
    }
    return {**kept, "OMP_NUM_THREADS": "1", **extra}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- several SLURM tasks without torchrun ------------------------------------------------------


def test_slurm_tasks_without_torchrun_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "rlmtrain", "train", "--config", "configs/tiny-cpu.toml",
         f"--checkpoint.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=_env(**slurm),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "rlmtrain train: error: SLURM started this as task 0 of 2 without torchrun"
    )
    assert "configs/slurm/train.sbatch" in lines[0]
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("environ", "refused"),
    [
        ({}, False),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, False),  # salloc -n1
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, False),  # an allocation's shell: no task
        # srun -n1 inside a four-task allocation: the step's count is the one that says
        ({"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, False),
        # a batch script's own shell: one process, whatever the allocation's task count
        ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, False),
        ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5"}, True),
        # torchrun's ranks under srun: SLURM's task environment and torchrun's both
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "RANK": "3", "WORLD_SIZE": "4"},
         False),
    ],
    ids=["no-slurm", "one-task", "no-task", "srun-n1", "batch-shell", "step-tasks", "torchrun"],
)  # fmt: skip
def test_only_several_slurm_tasks_without_torchrun_are_refused(monkeypatch, environ, refused):
    for name in [*os.environ]:
        if name.startswith("SLURM_") or name in LAUNCH_ENV:
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if refused:
        with pytest.raises(LaunchError, match="without torchrun"):
            check_launcher()
    else:
        check_launcher()


# --- every rank sees the run folder -------------------------------------------------------------


def test_a_world_of_one_checks_nothing(tmp_path):
    folder = RunFolder(tmp_path / "run").make()
    check_shared_folder(folder, parallel.World())
    assert list(folder.root.iterdir()) == []


def test_the_verdict_names_each_unseen_rank_with_its_host(tmp_path, monkeypatch):
    """Rank 0 of four, with the others' collectives played: rank 1's note is there, ranks 2
    and 3 (one host) wrote theirs elsewhere, rank 4's is a note of an earlier start."""
    folder = RunFolder(tmp_path / "run").make()
    peers = [("node1", "t1"), ("node2", "t2"), ("node2", "t3"), ("node1", "t4")]
    folder.ranks.mkdir()
    folder.rank_note(1).write_text(json.dumps({"rank": 1, "host": "node1", "token": "t1"}))
    folder.rank_note(4).write_text(json.dumps({"rank": 4, "host": "node1", "token": "old"}))
    monkeypatch.setattr(parallel, "all_gather", lambda mine: [mine, *peers])
    monkeypatch.setattr(parallel, "broadcast", lambda verdict: verdict)
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "node1")
    with pytest.raises(LaunchError) as raised:
        check_shared_folder(folder, parallel.World(rank=0, size=5))
    assert str(raised.value) == (
        f"checkpoint.dir {folder.root}: what ranks 2, 3 (host node2), rank 4 (host node1) write "
        "there cannot be seen from rank 0 (host node1); the run folder must be on a filesystem "
        "every node shares"
    )
    assert not folder.ranks.exists()  # a later start, of any world size, finds no notes


def test_a_rank_that_could_not_write_its_note_is_named(tmp_path, monkeypatch):
    """Rank 1 of two failed to write (it sends no token) and left no note: it is unseen."""
    folder = RunFolder(tmp_path / "run").make()
    monkeypatch.setattr(parallel, "all_gather", lambda mine: [mine, ("node2", None)])
    monkeypatch.setattr(parallel, "broadcast", lambda verdict: verdict)
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "node1")
    with pytest.raises(LaunchError, match=r"what rank 1 \(host node2\) writes there cannot"):
        check_shared_folder(folder, parallel.World(rank=0, size=2))


def _two_ranks(base: Path, layout: str, out: Path) -> list[dict]:
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(_free_port())]  # fmt: skip
    result = subprocess.run(
        [*torchrun, str(RANKS), str(base), str(out), layout],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_ranks_that_see_different_folders_all_raise_one_line(tmp_path):
    base = tmp_path / "run"
    # A note of an earlier start on rank 0's disk under rank 1's name is not rank 1's.
    (base / "rank0" / "ranks").mkdir(parents=True)
    stale = {"rank": 1, "host": socket.gethostname(), "token": "earlier"}
    (base / "rank0" / "ranks" / "1.json").write_text(json.dumps(stale))
    host = socket.gethostname()
    expected = (
        f"checkpoint.dir {base / 'rank0'}: what rank 1 (host {host}) writes there cannot be "
        f"seen from rank 0 (host {host}); the run folder must be on a filesystem every node "
        "shares"
    )
    assert _two_ranks(base, "unshared", tmp_path / "out") == [{"error": expected}] * 2


@pytest.mark.slow
def test_ranks_that_share_the_folder_pass_and_leave_no_notes(tmp_path):
    base = tmp_path / "run"
    assert _two_ranks(base, "shared", tmp_path / "out") == [{"error": None}] * 2
    assert not RunFolder(base).ranks.exists()


# --- the SLURM script --------------------------------------------------------------------------

# srun: skip its own options, start the command once per node with that node's task environment,
# as SLURM does with one task per node, and fail as the first failing task does.
FAKE_SRUN = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=$SLURM_NNODES \\
        "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

# scontrol: the two nodes' names, both this machine's loopback addresses.
FAKE_SCONTROL = """#!/bin/bash
[[ "$*" == "show hostnames $SLURM_JOB_NODELIST" ]] || exit 1
printf '127.0.0.1\\n127.0.0.2\\n'
"""

SHORT = ("--data.sft_groups=3", "--data.synth_groups=2", "--data.eval_groups=1",
         "--train.sft_steps=1", "--train.steps=1", "--train.tasks_per_step=2",
         "--rollout.n_samples=2", "--rollout.max_new_tokens=48", "--eval.every=0",
         "--logging.progress=false")  # fmt: skip


@pytest.mark.slow
def test_the_slurm_script_starts_one_world_over_its_nodes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
             "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_GPUS_ON_NODE": "1",
             "SLURM_CPUS_ON_NODE": "2"}  # fmt: skip
    result = subprocess.run(
        ["bash", str(SBATCH), "configs/tiny-cpu.toml", *SHORT, f"--checkpoint.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S,
        env=_env(**slurm, PATH=path, RLMTRAIN_RDZV_PORT=str(_free_port())),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # One torchrun of one rank per node, and the model sharded over a world of two.
    assert "on 2 x cpu" in result.stderr
    assert (run_dir / "final" / "model.safetensors").is_file()
    (newest,) = (run_dir / "checkpoints").glob("rl-*")
    assert sorted(p.name for p in newest.glob("rng-*.pkl")) == ["rng-0.pkl", "rng-1.pkl"]
    assert not RunFolder(run_dir).ranks.exists()
