"""Removing what a REPL worker left on disk, whatever shape it has.

A worker's directory is built by model code, so it can be anything its limits allow: thousands
of levels deep (deeper than the interpreter's recursion limit, and as one path longer than
PATH_MAX), full of symlinks pointing elsewhere, or with directories made unreadable.
`shutil.rmtree` recurses, so a deep tree makes it raise `RecursionError`, which its
`ignore_errors` does not cover. `remove_tree` walks the tree with one open directory at a time
(down by name relative to the current directory, back up through `..`), never follows a symlink,
makes an unreadable directory readable again before entering it, and never raises: what it could
not remove comes back as a short list of problems for the caller to log.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import NamedTuple

__all__ = ["DiskUsage", "disk_usage", "remove_tree", "unlinked_open_bytes"]

log = logging.getLogger(__name__)

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_PROBLEMS = 8


def remove_tree(path: str) -> list[str]:
    """Remove the directory `path` and everything below it; the problems met, [] when all is
    gone (a missing `path` is no problem). Only use on a tree nobody else writes meanwhile.
    Each directory is read once (a wide directory costs its width, not its width squared)."""
    problems: list[str] = []
    try:
        fd = os.open(path, _DIRECTORY)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{path}: {exc.strerror}"]
    names: list[str] = []
    """The names from `path` down to the directory `fd` is open on."""
    try:
        pending = [_clear_files(fd, problems)]
        """Per level from `path` down, the subdirectories still to remove."""
        while pending:
            if pending[-1]:
                below = pending[-1].pop()
                child = _enter(fd, below)
                if isinstance(child, OSError):
                    _note(problems, below, child)
                    continue
                os.close(fd)
                fd = child
                names.append(below)
                pending.append(_clear_files(fd, problems))
                continue
            pending.pop()
            if not names:
                break
            parent = os.open("..", _DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            name = names.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as exc:
                _note(problems, name, exc)
    except OSError as exc:
        _note(problems, "/".join(names[-3:]) or path, exc)
    finally:
        os.close(fd)
    if not problems:
        try:
            os.rmdir(path)
        except OSError as exc:
            _note(problems, path, exc)
    return problems


def _clear_files(fd: int, problems: list[str]) -> list[str]:
    """Unlink every non-directory in the directory `fd`; its subdirectories' names."""
    subdirectories = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    subdirectories.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            except OSError as exc:
                _note(problems, entry.name, exc)
    return subdirectories


def _enter(fd: int, name: str) -> int | OSError:
    """Open the subdirectory `name`; one made unreadable by its owner is made readable first
    (ours to undo: the tree is quiescent, so `name` is still the directory the scan saw)."""
    try:
        return os.open(name, _DIRECTORY, dir_fd=fd)
    except PermissionError:
        pass
    except OSError as exc:
        return exc
    try:
        os.chmod(name, 0o700, dir_fd=fd)
        return os.open(name, _DIRECTORY, dir_fd=fd)
    except OSError as exc:
        return exc


class DiskUsage(NamedTuple):
    bytes: int
    """Allocated bytes (st_blocks), so a sparse file counts what it holds, not its length."""
    entries: int
    """Files, directories and links below the root."""
    hidden: bool = False
    """Part of the tree could not be measured: a directory the walk may not open, or one moved
    while the walk was inside it. A caller enforcing a limit treats this as over it."""


def unlinked_open_bytes(pid: int) -> int:
    """Bytes allocated to regular files that process `pid` keeps open after their last name was
    removed: space no directory walk sees. 0 when its descriptors cannot be read (it exited)."""
    fds = f"/proc/{pid}/fd"
    total = 0
    try:
        names = os.listdir(fds)
    except PermissionError:
        _warn_unreadable_fds(fds)
        return 0
    except OSError:
        return 0
    for name in names:
        try:
            if not os.readlink(f"{fds}/{name}").endswith(" (deleted)"):
                continue
            info = os.stat(f"{fds}/{name}")  # follows the descriptor to the file itself
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 0:
            total += info.st_blocks * 512
    return total


_fds_warned = False


def _warn_unreadable_fds(fds: str) -> None:
    """A worker under another uid is not dumpable: reading its descriptors needs CAP_SYS_PTRACE,
    which many containers drop. Then files it unlinks but keeps open go uncounted: said once."""
    global _fds_warned
    if not _fds_warned:
        _fds_warned = True
        log.warning(
            "cannot read %s (no CAP_SYS_PTRACE): files REPL workers unlink but keep open are not "
            "counted against their disk limit",
            fds,
        )


def disk_usage(path: str, *, stop_bytes: int, stop_entries: int) -> DiskUsage:
    """What the tree at `path` holds, walked as `remove_tree` walks (one directory open at a
    time, no link followed, any depth); the walk stops as soon as either figure is past its
    `stop_*` (the figures are then lower bounds). 0, 0 for a missing path. The tree may be live:
    each step back up through `..` is checked to land in the directory it came from, so a walk
    never leaves the tree, and one that cannot be finished says so (`hidden`)."""
    try:
        fd = os.open(path, _DIRECTORY)
    except OSError:
        return DiskUsage(0, 0)
    total = [0, 0]
    hidden = False

    def over() -> bool:
        return total[0] > stop_bytes or total[1] > stop_entries

    def subdirectories(directory: int) -> list[str]:
        found = []
        with os.scandir(directory) as entries:
            for entry in entries:
                total[1] += 1
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total[0] += info.st_blocks * 512
                if stat.S_ISDIR(info.st_mode):
                    found.append(entry.name)
                if over():
                    break
        return found

    try:
        levels = [subdirectories(fd)]
        """Per level from `path` down to `fd`'s directory, the subdirectories still to walk."""
        identities = [_identity(fd)]
        """Per level, the (device, inode) of its directory."""
        while levels and not over():
            if levels[-1]:
                try:
                    child = os.open(levels[-1].pop(), _DIRECTORY, dir_fd=fd)
                except FileNotFoundError:  # removed since the scan saw it
                    continue
                except OSError:
                    hidden = True
                    break
                os.close(fd)
                fd = child
                levels.append(subdirectories(fd))
                identities.append(_identity(fd))
            else:
                levels.pop()
                identities.pop()
                if levels:
                    parent = os.open("..", _DIRECTORY, dir_fd=fd)
                    os.close(fd)
                    fd = parent
                    if _identity(fd) != identities[-1]:  # moved while the walk was inside
                        hidden = True
                        break
    except OSError:
        hidden = True
    finally:
        os.close(fd)
    return DiskUsage(total[0], total[1], hidden)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _note(problems: list[str], name: str, exc: OSError) -> None:
    if len(problems) < _MAX_PROBLEMS:
        problems.append(f"{name}: {exc.strerror or exc}")
