"""REPL temporary roots left by jobs killed as a whole, and their removal by the next start.

A trainer killed alone leaves nothing (its zygote cleans up: test_repl_faults). Killed together
with its zygote, as a node failure or a cancelled job kills them, its root stays; the first
zygote a later process starts under the same temp folder removes it, and only it: a live
run's root, a root made a moment ago, another user's folder and a symlink under the prefix stay.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from rlmtrain.rlm.repl import Zygote
from rlmtrain.rlm.temp_roots import PREFIX, TempRoot, remove_abandoned

TRAINER = """
import asyncio, sys
from rlmtrain.rlm.repl import Zygote

async def main():
    zygote = await Zygote.start(context="ctx", tool_modules=[], temp_dir=sys.argv[1])
    session = await zygote.session()
    await session.exec("open('left.txt', 'w').write('x' * 1000)")
    print(zygote.temp_root, zygote._process.pid, session.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""

LONG_AGO_S = 3600.0


def start_trainer(parent) -> tuple[subprocess.Popen, str, list[int]]:
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(parent)], stdout=subprocess.PIPE, text=True
    )
    root, *pids = trainer.stdout.readline().split()
    assert os.path.isdir(root), "the trainer did not start its zygote"
    return trainer, root, [trainer.pid, *map(int, pids)]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].startswith("Z")
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30.0  # only bounds a hang
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.05)
    assert all(gone(pid) for pid in pids), "a killed process is still alive"


def age(path: str) -> None:
    then = time.time() - LONG_AGO_S
    os.utime(path, (then, then), follow_symlinks=False)


def test_a_job_killed_whole_leaves_its_root_and_the_next_start_removes_it_alone(tmp_path):
    killed, killed_root, killed_pids = start_trainer(tmp_path)
    live, live_root, live_pids = start_trainer(tmp_path)
    try:
        zygote = killed_pids[1]
        held = {os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote}/fd")}
        assert killed_root in held, "the zygote does not hold its root's lock"
        # Trainer, zygote and worker at once, as a node failure kills them: all stopped first,
        # so the zygote cannot act on its trainer's death before its own.
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in killed_pids:
                os.kill(pid, sig)
        killed.wait(10)
        wait_gone(killed_pids)
        assert os.path.exists(os.path.join(killed_root, "w0", "left.txt"))
        age(killed_root)
        age(live_root)

        async def start_and_close():
            zygote = await Zygote.start(context="ctx", tool_modules=[], temp_dir=str(tmp_path))
            await zygote.close()

        asyncio.run(start_and_close())
        assert not os.path.exists(killed_root)
        assert os.path.exists(os.path.join(live_root, "w0", "left.txt"))
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait(10)
        killed.stdout.close()
        live.stdout.close()
    wait_gone(live_pids)
    assert not os.path.exists(live_root)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_root_held_by_its_zygote_alone_stays(tmp_path):
    """The trainer is gone but its zygote, which inherited the lock, is still cleaning up."""
    root = TempRoot.claim(str(tmp_path))
    zygote = subprocess.Popen(["sleep", "60"], pass_fds=[root.lock_fd])
    try:
        os.close(root.lock_fd)
        age(root.path)
        assert remove_abandoned(str(tmp_path)) == 0
        assert os.path.isdir(root.path)
    finally:
        zygote.kill()
        zygote.wait()
    assert remove_abandoned(str(tmp_path)) == 1
    assert not os.path.exists(root.path)


def test_a_root_made_a_moment_ago_stays_though_nobody_holds_it_yet(tmp_path):
    fresh = tmp_path / f"{PREFIX}fresh"
    fresh.mkdir()
    assert remove_abandoned(str(tmp_path)) == 0
    age(str(fresh))
    assert remove_abandoned(str(tmp_path)) == 1
    assert not fresh.exists()


def test_symlinks_files_and_other_names_under_the_temp_folder_are_left_alone(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep")
    link = tmp_path / f"{PREFIX}link"
    link.symlink_to(elsewhere)
    plain = tmp_path / f"{PREFIX}file"
    plain.write_text("keep")
    other = tmp_path / "another-tool-tmp"
    other.mkdir()
    for path in (elsewhere, link, plain, other):
        age(str(path))
    assert remove_abandoned(str(tmp_path)) == 0
    assert (elsewhere / "precious").read_text() == "keep"
    assert link.is_symlink() and plain.read_text() == "keep" and other.is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_another_users_root_is_left_alone(tmp_path):
    theirs = tmp_path / f"{PREFIX}theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    age(str(theirs))
    assert remove_abandoned(str(tmp_path)) == 0
    assert theirs.is_dir()


def test_a_start_whose_interpreter_cannot_start_leaves_no_root_and_no_descriptor(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    descriptors = set(os.listdir("/proc/self/fd"))

    async def body():
        with pytest.raises(FileNotFoundError):
            await Zygote.start(context="x", tool_modules=[], temp_dir=str(tmp_path))

    asyncio.run(body())
    assert os.listdir(tmp_path) == []
    assert set(os.listdir("/proc/self/fd")) <= descriptors
