"""Leak checks shared by the tests that start real REPL workers.

A zygote and its workers are processes below the test process, and every worker gets a
directory under the zygote's temporary root; when a test's zygotes are closed, both must be gone.
`descendants` reads the process tree from /proc (a zombie counts: an unreaped worker is a leak
too); the two context managers compare it before and after, and check the temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import clocks

__all__ = ["descendants", "leak_checked_temp_dir", "leak_checked_tempfile_root", "run_with_zygote"]


def descendants() -> set[int]:
    """Processes below this one, zombies included, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, stack = set(), [os.getpid()]
    while stack:
        for pid in children.get(stack.pop(), []):
            found.add(pid)
            stack.append(pid)
    return found


@contextlib.contextmanager
def leak_checked_temp_dir(prefix: str) -> Iterator[str]:
    """A fresh temporary directory to pass to `Zygote.start(temp_dir=...)`; on exit it must be
    empty (it is then removed) and no process started meanwhile may be left."""
    before = descendants()
    path = tempfile.mkdtemp(prefix=prefix)
    yield path
    leftover = os.listdir(path)
    shutil.rmtree(path)
    assert leftover == [], f"temporary directories left behind: {leftover}"
    assert descendants() - before == set(), "worker processes outlived their zygotes"


@contextlib.contextmanager
def leak_checked_tempfile_root(tmp_path: Path) -> Iterator[Path]:
    """Runs the body with `tmp_path / "tmp"` as tempfile's default directory, for code that
    starts zygotes without naming one; if the body returns, that directory must be empty and no
    process started meanwhile may be left."""
    before = descendants()
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    saved, tempfile.tempdir = tempfile.tempdir, str(temp_root)
    try:
        yield temp_root
    finally:
        tempfile.tempdir = saved
    assert descendants() - before == set(), "worker processes outlived their zygotes"
    assert list(temp_root.iterdir()) == [], "temporary directories left behind"


def run_with_zygote(body, temp_dir: str, *, context, tool_modules: list[str], limits):
    """`await body(zygote)` on a fresh zygote under `temp_dir`, run on a `clocks.SkippingLoop`;
    the zygote is then closed, and its temporary root must be gone."""
    from rlmtrain.rlm.repl import Zygote

    async def main():
        zygote = await Zygote.start(
            context=context, tool_modules=tool_modules, limits=limits, temp_dir=temp_dir
        )
        try:
            return await body(zygote)
        finally:
            await zygote.close()
            assert not os.path.exists(zygote.temp_root)

    return clocks.run(main())
