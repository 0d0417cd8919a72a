"""Memory cgroups for REPL workers: a bound on the memory a worker makes the kernel hold.

The address-space limit (RLIMIT_AS) counts what a worker maps, not what it makes the kernel
keep: page cache of the files it writes, shared memory, pipe and socket buffers. A memory cgroup
charges all of it to the worker, so where the trainer may create cgroups every worker gets one
of its own, limited to `ReplLimits.memory_mb` with no swap on top; past it the kernel's OOM
killer ends that worker alone, and the session reports it as such.

Layout: one directory per zygote (`rlmtrain-<trainer pid>-<n>`) under the trainer's own memory
cgroup, one `w<slot>` per live worker inside it, made before the worker is forked and entered by
the worker itself before it jails itself or loads its context (so nothing it allocates is
charged elsewhere), removed once it has exited. A trainer killed outright leaves empty
directories; the next zygote of any trainer removes those whose trainer is gone.

Where it works: cgroup v1 with a writable memory hierarchy (containers that run as root), and
cgroup v2 where the trainer's cgroup already passes the memory controller to its children
(`memory` in its `cgroup.subtree_control`; cgroup v2 allows that only for a cgroup without
processes of its own or the root, so rarely). `PoolCgroup.create` proves it by limiting a probe
cgroup; anywhere else it returns None and the rlimits, the disk quota and seccomp's refusal of
memfd and SysV/POSIX IPC are the whole memory bound (README, "The REPL sandbox"). Without swap
accounting (v1 with no `memory.memsw.*`) a worker's swappiness is 0 instead.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["PoolCgroup", "WorkerCgroup", "own_memory_cgroup"]

_POOL_NAME = re.compile(r"^rlmtrain-(\d+)-\d+$")
_pool_numbers = itertools.count()
_warned = False


class WorkerCgroup:
    """One worker's cgroup: the worker writes itself into `procs` before it jails itself;
    `remove` once it exited."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.procs = str(path / "cgroup.procs")
        self._version = version
        self._oom_before = self._oom_count()

    def oom_killed(self) -> bool:
        """Whether the OOM killer ended a process of this cgroup since it was handed out."""
        return self._oom_count() > self._oom_before

    def _oom_count(self) -> int:
        name = "memory.events" if self._version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        _rmdir(self.path)


class PoolCgroup:
    """The cgroup of one zygote's workers; `worker(slot, limit)` makes each worker's."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self._version = version

    @classmethod
    def create(cls) -> PoolCgroup | None:
        """A new pool directory under the trainer's own memory cgroup, or None (logged once)
        where the kernel does not let the trainer make limited child cgroups (tried on a probe
        worker cgroup, removed again)."""
        found = own_memory_cgroup()
        if found is None:
            _warn_once("no writable memory cgroup for this process")
            return None
        parent, version = found
        _remove_stale_pools(parent)
        path = parent / f"rlmtrain-{os.getpid()}-{next(_pool_numbers)}"
        pool = cls(path, version)
        try:
            path.mkdir()
            if version == 2:
                (path / "cgroup.subtree_control").write_text("+memory")
            pool.worker(-1, 64 << 20).remove()
        except OSError as exc:
            pool.remove()
            _warn_once(f"cannot make a limited cgroup in {parent}: {exc.strerror or exc}")
            return None
        return pool

    def worker(self, slot: int, limit_bytes: int) -> WorkerCgroup:
        """A fresh cgroup for the worker in `slot`, limited to `limit_bytes` of memory and no
        swap. Raises OSError when the kernel refuses the directory or its limit."""
        path = self.path / f"w{slot}"
        with contextlib.suppress(FileExistsError):  # left by a worker that outlived its session
            path.mkdir()
        try:
            if self._version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                _write_if_present(path / "memory.swap.max", "0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                # memory + swap may not go below memory alone: set after it, equal to it.
                if (path / "memory.memsw.limit_in_bytes").exists():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                else:  # no swap accounting: keep the worker's pages out of swap instead
                    _write_if_present(path / "memory.swappiness", "0")
        except OSError:
            _rmdir(path)
            raise
        return WorkerCgroup(path, self._version)

    def remove(self) -> None:
        """Remove the pool and any worker directory left in it (their workers have exited)."""
        _remove_pool(self.path)


def own_memory_cgroup(
    proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> tuple[Path, int] | None:
    """(this process's memory cgroup directory, cgroup version) when children made in it can be
    memory-limited; None otherwise."""
    try:
        memberships = Path(proc_cgroup).read_text().splitlines()
        mounts = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    for line in memberships:
        _, controllers, cgroup_path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = _mounted(mounts, cgroup_path, "cgroup", "memory")
            if directory is not None and os.access(directory, os.W_OK):
                return directory, 1
    for line in memberships:
        hierarchy, controllers, cgroup_path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            directory = _mounted(mounts, cgroup_path, "cgroup2", None)
            if directory is None or not os.access(directory, os.W_OK):
                return None
            with contextlib.suppress(OSError):
                if "memory" in (directory / "cgroup.subtree_control").read_text().split():
                    return directory, 2
    return None


def _mounted(mounts: list[str], cgroup_path: str, fstype: str, option: str | None) -> Path | None:
    """Where `cgroup_path` of the hierarchy mounted as `fstype` (with super option `option`)
    is visible, from /proc/self/mountinfo lines."""
    for line in mounts:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if fields[dash + 1] != fstype:
            continue
        if option is not None and option not in fields[dash + 3].split(","):
            continue
        root, mount_point = fields[3], fields[4]
        relative = os.path.relpath(cgroup_path, root)
        if relative.startswith(".."):
            continue  # this mount does not show our cgroup
        return Path(mount_point) / relative if relative != "." else Path(mount_point)
    return None


def _remove_stale_pools(parent: Path) -> None:
    """Remove pool directories whose trainer process no longer exists."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            match = _POOL_NAME.match(entry.name)
            if match and not _alive(int(match[1])):
                _remove_pool(entry)


def _remove_pool(path: Path) -> None:
    with contextlib.suppress(OSError):
        for entry in path.iterdir():
            if entry.is_dir():
                _rmdir(entry)
    _rmdir(path)


def _rmdir(path: Path) -> None:
    """rmdir a cgroup: its files are the kernel's, only the directory goes. A cgroup whose
    last process is still exiting is busy for a moment; anything else is logged."""
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            log.debug("cgroup %s still busy; left for the next cleanup", path)
        else:
            log.warning("could not remove cgroup %s: %s", path, exc.strerror)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_if_present(path: Path, value: str) -> None:
    """Swap limits exist only where the kernel accounts swap."""
    with contextlib.suppress(FileNotFoundError):
        path.write_text(value)


def _warn_once(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "REPL workers get no memory cgroup (%s): their memory is bounded by the address-space "
            "limit, the disk quota and seccomp only",
            why,
        )
