"""A zygote's temporary root, and the roots that runs killed as a whole left behind.

Each zygote keeps its workers' directories under one root in the temp folder. A closing
trainer removes it, and so does a zygote whose trainer died (its death signal); but when the
whole job is killed at once (a node failure, a cancelled job, an OOM kill of the container), the
zygote dies too and the root stays, with whatever its workers wrote, up to their disk quota.

So a root is held: the trainer takes an exclusive `flock` on the root directory itself and the
zygote inherits that descriptor, and the kernel drops the lock only when both are gone, however
they died. The first zygote a process starts under a temp folder removes the roots there that
nobody holds. A root is only taken once it has been still for a while, since it is created a
moment before it is locked, and only if it belongs to this user (the temp folder is shared).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
import time

from rlmtrain.rlm.teardown import remove_tree

__all__ = ["PREFIX", "TempRoot", "remove_abandoned"]

log = logging.getLogger(__name__)

PREFIX = "rlmtrain-repl-"
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_STILL_S = 60.0
"""How long an unheld root must have been unchanged before it counts as abandoned: the window
between its creation and its lock is far shorter."""

_swept: set[str] = set()
_swept_lock = threading.Lock()


class TempRoot:
    """A directory for one zygote's workers, locked for as long as `lock_fd` (and any process
    it was passed to) stays open."""

    def __init__(self, path: str, lock_fd: int) -> None:
        self.path = path
        self.lock_fd = lock_fd

    @classmethod
    def claim(cls, parent: str | None = None) -> TempRoot:
        """A new locked root under `parent` (default: the system's temp folder); the first
        claim under a folder in this process first removes the abandoned roots there."""
        parent = parent or tempfile.gettempdir()
        with _swept_lock:
            first = parent not in _swept
            _swept.add(parent)
        if first:
            removed = remove_abandoned(parent)
            if removed:
                log.info("removed %d REPL folders left in %s by killed runs", removed, parent)
        path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
        try:
            fd = os.open(path, _DIRECTORY)
        except BaseException:
            os.rmdir(path)
            raise
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new directory: nobody else can hold it yet
        return cls(path, fd)

    def remove(self) -> list[str]:
        """Remove the root and everything in it, then let go of it; the problems met."""
        problems = remove_tree(self.path)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        return problems


def remove_abandoned(parent: str, *, still_s: float = _STILL_S) -> int:
    """Remove the roots under `parent` that this user owns, nobody holds, and nobody has
    changed for `still_s` seconds; how many went."""
    removed = 0
    try:
        entries = [entry.name for entry in os.scandir(parent) if entry.name.startswith(PREFIX)]
    except OSError:
        return 0
    for name in entries:
        path = os.path.join(parent, name)
        try:
            fd = os.open(path, _DIRECTORY)  # a symlink or a file under the name: refused
        except OSError:
            continue
        try:
            status = os.fstat(fd)
            if status.st_uid != os.geteuid() or time.time() - status.st_mtime < still_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its trainer or its zygote is alive
            problems = remove_tree(path)
            if problems:
                log.warning("could not remove all of %s: %s", path, "; ".join(problems))
            else:
                removed += 1
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return removed
