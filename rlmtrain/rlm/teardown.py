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

import os

__all__ = ["remove_tree"]

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_PROBLEMS = 8


def remove_tree(path: str) -> list[str]:
    """Remove the directory `path` and everything below it; the problems met, [] when all is
    gone (a missing `path` is no problem). Only use on a tree nobody else writes meanwhile."""
    problems: list[str] = []
    try:
        fd = os.open(path, _DIRECTORY)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{path}: {exc.strerror}"]
    names: list[str] = []
    """The names from `path` down to the directory `fd` is open on."""
    resisted: list[set[str]] = [set()]
    """Per level, the entries that could not be removed: skipped from then on."""
    try:
        while True:
            below = _clear_files(fd, resisted[-1], problems)
            if below is not None:
                child = _enter(fd, below)
                if isinstance(child, OSError):
                    resisted[-1].add(below)
                    _note(problems, below, child)
                    continue
                os.close(fd)
                fd = child
                names.append(below)
                resisted.append(set())
                continue
            if not names:
                break
            parent = os.open("..", _DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            name = names.pop()
            resisted.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as exc:
                resisted[-1].add(name)
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


def _clear_files(fd: int, resisted: set[str], problems: list[str]) -> str | None:
    """Unlink every non-directory in the directory `fd`; the name of a subdirectory still to
    remove, or None once only resisted entries are left."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.name in resisted:
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    return entry.name
                os.unlink(entry.name, dir_fd=fd)
            except OSError as exc:
                resisted.add(entry.name)
                _note(problems, entry.name, exc)
    return None


def _enter(fd: int, name: str) -> int | OSError:
    try:
        return os.open(name, _DIRECTORY, dir_fd=fd)
    except PermissionError:
        pass
    except OSError as exc:
        return exc
    try:  # made unreadable by its owner: ours to undo
        os.chmod(name, 0o700, dir_fd=fd)  # a directory, not a link: checked by the caller
        return os.open(name, _DIRECTORY, dir_fd=fd)
    except OSError as exc:
        return exc


def _note(problems: list[str], name: str, exc: OSError) -> None:
    if len(problems) < _MAX_PROBLEMS:
        problems.append(f"{name}: {exc.strerror or exc}")
