"""Starting the REPL's zygote: a real child process awaited on its pidfd, under asyncio's loop
and the trainer's uvloop alike, and started with vfork(), never a fork() of the trainer (whose
page tables the kernel would copy, about 90 ms a zygote at 1.7 GB resident)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import uvloop

from rlmtrain.rlm.repl import Zygote
from rlmtrain.rlm.spawn import Child

LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("loop", LOOPS)
def test_wait_gives_the_exit_status(loop):
    async def body():
        child = Child.start(python("raise SystemExit(3)"))
        assert child.pid > 0
        return await child.wait(), await child.wait()

    assert LOOPS[loop](body()) == (3, 3)


@pytest.mark.parametrize("loop", LOOPS)
def test_kill_ends_it_and_a_reaped_child_cannot_be_signalled(loop):
    async def body():
        child = Child.start(python("import time; time.sleep(60)"))
        child.kill()
        status = await child.wait()
        with pytest.raises(ProcessLookupError):
            child.kill()
        return status

    assert LOOPS[loop](body()) == -9


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cancelled_waiter_leaves_the_others_waiting(loop):
    async def body():
        # The child exits once the pipe on its stdin closes: no clock decides who comes first.
        read_end, write_end = os.pipe()
        child = Child.start(
            python("import sys; sys.stdin.read(); raise SystemExit(7)"), stdin=read_end
        )
        os.close(read_end)
        first = asyncio.ensure_future(child.wait())
        second = asyncio.ensure_future(child.wait())
        await asyncio.sleep(0)
        first.cancel()
        os.close(write_end)
        status = await second
        assert first.cancelled()
        return status

    assert LOOPS[loop](body()) == 7


# A zygote started under uvloop by a process that holds 200 MB; the process prints its pid so
# that strace's lines of the trainer itself can be told from the zygote's (which forks workers).
ZYGOTE_UNDER_UVLOOP = textwrap.dedent(
    """
    import os, uvloop
    from rlmtrain.rlm.repl import ReplLimits, Zygote

    held = bytearray(os.urandom(1 << 20) * 200)

    async def main():
        zygote = await Zygote.start(context="x", tool_modules=["textwrap"],
                                    limits=ReplLimits(memory_mb=1024))
        session = await zygote.session()
        assert (await session.exec("print(len(context))")).output == "1\\n"
        await session.close()
        await zygote.close()

    print("trainer pid", os.getpid(), flush=True)
    uvloop.run(main())
    """
)


def test_the_zygote_starts_with_vfork_under_uvloop(tmp_path):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "trace.txt"
    done = subprocess.run(
        ["strace", "-f", "-e", "trace=fork,vfork,clone,clone3", "-o", str(trace)]
        + python(ZYGOTE_UNDER_UVLOOP),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    trainer = re.search(r"trainer pid (\d+)", done.stdout).group(1)
    starts = re.compile(rf"^{trainer} +(fork|vfork|clone|clone3)\(")
    ours = [line for line in trace.read_text().splitlines() if starts.match(line)]
    processes = [line for line in ours if "CLONE_THREAD" not in line]
    assert any("vfork()" in line for line in processes), processes
    assert not [line for line in processes if "vfork()" not in line], processes


def _children() -> set[int]:
    pids = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids.update(int(pid) for pid in f.read().split())
    return pids


def test_a_zygote_whose_start_fails_leaves_no_process_and_no_descriptor(tmp_path):
    """Its temporary root cannot be made (the folder is missing): no interpreter is left and no
    descriptor stays open (an interpreter that cannot start: test_repl_temp_roots)."""

    async def body():
        with pytest.raises(FileNotFoundError):
            await Zygote.start(context="x", tool_modules=[], temp_dir=str(tmp_path / "missing"))

    children, descriptors = _children(), set(os.listdir("/proc/self/fd"))
    asyncio.run(body())
    assert _children() == children
    assert set(os.listdir("/proc/self/fd")) <= descriptors


def test_kill_now_reaps_at_once_and_refuses_a_child_being_waited_for():
    async def body():
        child = Child.start(python("import time; time.sleep(60)"))
        child.kill_now()
        assert await child.wait() == -9
        child.kill_now()  # reaped already: nothing to do
        waited = Child.start(python("import time; time.sleep(60)"))
        waiting = asyncio.ensure_future(waited.wait())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="being waited for"):
            waited.kill_now()
        waited.kill()
        assert await waiting == -9

    asyncio.run(body())
