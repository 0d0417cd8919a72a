"""Memory cgroups of REPL workers (`rlm/memcg.py`): finding the trainer's own memory cgroup from
/proc, and, where this machine lets the tests make cgroups, a worker whose memory lies outside
its address space (tmpfs pages: no swap, nothing to reclaim) ended by its cgroup's limit."""

from __future__ import annotations

import os
from pathlib import Path

import leaks
import msgspec
import pytest

from rlmtrain.rlm import memcg
from rlmtrain.rlm.repl import ReplLimits

# ---------------------------------------------------------------------------------------------
# Finding the cgroup
# ---------------------------------------------------------------------------------------------


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> tuple[str, str]:
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


def test_v1_memory_hierarchy_is_found_below_its_mount(tmp_path):
    mount = tmp_path / "memory"
    (mount / "pod" / "box").mkdir(parents=True)
    files = _proc(
        tmp_path,
        "5:cpu,cpuacct:/\n4:memory:/pod/box\n0::/\n",
        f"30 25 0:27 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
        f"31 25 0:28 / {mount} rw,relatime - cgroup cgroup rw,memory\n",
    )
    assert memcg.own_memory_cgroup(*files) == (mount / "pod" / "box", 1)


def test_a_mount_of_a_subtree_maps_the_path_relative_to_its_root(tmp_path):
    mount = tmp_path / "memory"
    (mount / "box").mkdir(parents=True)
    files = _proc(
        tmp_path,
        "4:memory:/pod/box\n",
        f"31 25 0:28 /pod {mount} rw - cgroup cgroup rw,memory\n",
    )
    assert memcg.own_memory_cgroup(*files) == (mount / "box", 1)


def test_v2_needs_the_memory_controller_delegated(tmp_path):
    mount = tmp_path / "unified"
    own = mount / "user.slice" / "job"
    own.mkdir(parents=True)
    files = _proc(
        tmp_path, "0::/user.slice/job\n", f"40 25 0:30 / {mount} rw - cgroup2 cgroup2 rw\n"
    )
    (own / "cgroup.subtree_control").write_text("cpu io\n")
    assert memcg.own_memory_cgroup(*files) is None
    (own / "cgroup.subtree_control").write_text("cpu io memory pids\n")
    assert memcg.own_memory_cgroup(*files) == (own, 2)


def test_no_memory_controller_and_unreadable_proc_give_none(tmp_path):
    files = _proc(tmp_path, "3:cpu:/\n", f"30 25 0:27 / {tmp_path} rw - cgroup cgroup rw,cpu\n")
    assert memcg.own_memory_cgroup(*files) is None
    assert memcg.own_memory_cgroup(str(tmp_path / "absent"), files[1]) is None


# ---------------------------------------------------------------------------------------------
# On this machine's kernel
# ---------------------------------------------------------------------------------------------


def _pool_or_skip() -> memcg.PoolCgroup:
    pool = memcg.PoolCgroup.create()
    if pool is None:
        pytest.skip("no writable memory cgroup here (needs root in a v1 container or delegation)")
    return pool


def test_a_worker_limit_is_set_and_its_directory_removed():
    pool = _pool_or_skip()
    try:
        worker = pool.worker(3, 96 << 20)
        name = "memory.max" if (worker.path / "memory.max").exists() else "memory.limit_in_bytes"
        assert int((worker.path / name).read_text()) == 96 << 20
        assert not worker.oom_killed()
        worker.remove()
        assert not worker.path.exists()
    finally:
        pool.remove()
    assert not pool.path.exists()


def test_pools_of_a_dead_trainer_are_removed_by_the_next():
    pool = _pool_or_skip()
    pool.remove()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid that no longer runs
    stale = pool.path.parent / f"rlmtrain-{pid}-0"
    (stale / "w0").mkdir(parents=True)
    fresh = memcg.PoolCgroup.create()
    assert fresh is not None
    try:
        assert not stale.exists()
    finally:
        fresh.remove()


HOARD = (
    "chunk = b'x' * (16 << 20)\n"
    "for i in range(12):\n"
    "    with open(f'hoard{i}', 'wb') as f:\n"
    "        f.write(chunk)\n"
    "print('hoarded', 12 * 16, 'MiB')"
)
"""192 MiB of tmpfs pages: not in the worker's address space, and without swap nothing the kernel
can reclaim."""

LIMITS = ReplLimits(exec_timeout_s=20.0, memory_mb=128, disk_mb=1024, output_limit_chars=400)


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs")
    with leaks.leak_checked_temp_dir(prefix="test-repl-memcg-") as path:
        # The workers' directories on tmpfs, where written files are memory.
        shm = Path("/dev/shm") / Path(path).name
        shm.mkdir()
        try:
            yield str(shm)
        finally:
            leftover = os.listdir(shm)
            shm.rmdir()
            assert leftover == [], f"temporary directories left behind: {leftover}"


def _hoard(shm_dir: str, limits: ReplLimits):
    async def body(zygote):
        session = await zygote.session()
        cgroup = session._cgroup
        result = await session.exec(HOARD)
        await session.close()
        after = await zygote.session()  # the zygote serves on
        follow_up = await after.exec("print(6 * 7)")
        await after.close()
        return result, follow_up, cgroup

    return leaks.run_with_zygote(body, shm_dir, context="ctx", tool_modules=[], limits=limits)


def test_memory_outside_the_address_space_is_bounded_by_the_cgroup(shm_dir):
    _pool_or_skip().remove()
    result, follow_up, cgroup = _hoard(shm_dir, LIMITS)
    assert result.dead
    assert "memory limit of 128 MiB" in result.error
    assert follow_up.output.strip() == "42"
    assert cgroup is not None and not cgroup.path.exists()
    assert not cgroup.path.parent.exists()


def test_without_the_cgroup_the_same_hoard_goes_through(shm_dir):
    """What the cgroup adds: the address-space limit alone lets the hoard through."""
    _pool_or_skip().remove()
    limits = msgspec.structs.replace(LIMITS, memory_cgroup=False)
    result, _, cgroup = _hoard(shm_dir, limits)
    assert not result.dead, result.error
    assert "hoarded 192 MiB" in result.output
    assert cgroup is None
