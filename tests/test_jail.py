"""Hostile model code against real jailed workers.

Each attack runs in its own session while a bystander session of the same zygote holds state;
after the attack the result must carry a clear error (or dead=True with the reason), the
bystander must still answer, a fresh session must still start, and the test process must be
untouched. After the module no worker process and no temporary directory is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import shutil
import socket
import tempfile
from pathlib import Path

import msgspec
import pytest
from leaks import leak_checked_temp_dir

from rlmtrain import _jail
from rlmtrain.rlm.protocol import Done, encode_frame
from rlmtrain.rlm.repl import DEFAULT_PRELOAD, ExecResult, ReplLimits, Zygote

# A generous exec timeout: an attack ends by its own error or limit, however slowly it runs on a
# loaded machine; only the infinite loop waits a (short) timeout out.
LIMITS = ReplLimits(
    exec_timeout_s=30.0,
    memory_mb=768,
    cpu_s=60,
    output_limit_chars=1000,
    max_file_bytes=1 << 20,
    max_threads=16,
)
# What an attacker would reach for, loaded before the jail so that it is really available.
PRELOAD = [*DEFAULT_PRELOAD, "ctypes", "subprocess", "socket", "signal", "os", "sys", "resource"]


@pytest.fixture(scope="module")
def temp_dir():
    with leak_checked_temp_dir(prefix="test-jail-") as path:
        yield path


def attack(
    code: str, temp_dir: str, *, followup: str | None = None, limits: ReplLimits = LIMITS
) -> tuple[ExecResult, ExecResult | None]:
    """Run code in a fresh session beside a bystander; returns the attack's result and, if the
    session survived, the result of `followup` in the same session."""

    async def main():
        zygote = await Zygote.start(
            context="ctx",
            tool_modules=[],
            limits=limits,
            preload_modules=PRELOAD,
            temp_dir=temp_dir,
        )
        try:
            bystander = await zygote.session()
            assert not (await bystander.exec("counter = 41")).error
            victim = await zygote.session()
            result = await victim.exec(code)
            after = None
            if followup is not None and not result.dead:
                after = await victim.exec(followup)
            check = await bystander.exec("counter += 1\nprint(counter)")
            assert check.output == "42\n" and not check.dead, check
            fresh = await zygote.session()
            assert (await fresh.exec("print('fresh')")).output == "fresh\n"
            for session in (victim, bystander, fresh):
                await session.close()
            assert zygote.live_workers() == 0
            return result, after
        finally:
            await zygote.close()
            assert not os.path.exists(zygote.temp_root)

    return asyncio.run(main())


def test_infinite_loop_is_killed_at_the_timeout(temp_dir):
    limits = msgspec.structs.replace(LIMITS, exec_timeout_s=3.0)
    result, _ = attack("while True:\n    pass", temp_dir, limits=limits)
    assert result.dead and "timed out after 3 s" in result.error


def test_memory_bomb_hits_the_address_space_limit(temp_dir):
    # Every block is written, so the bomb really takes memory; a small limit keeps it quick.
    limits = msgspec.structs.replace(LIMITS, memory_mb=256)
    code = "blocks = []\nwhile True:\n    blocks.append(b'x' * (16 << 20))"
    followup = "n = len(blocks)\ndel blocks\nprint(n)"
    result, after = attack(code, temp_dir, followup=followup, limits=limits)
    assert "MemoryError" in result.error and not result.dead
    assert 0 < int(after.output) * 16 <= limits.memory_mb


def test_fork_bomb_cannot_fork(temp_dir):
    result, _ = attack("import os\nwhile True:\n    os.fork()", temp_dir)
    assert "PermissionError" in result.error and not result.dead


def test_thread_bomb_stops_at_the_thread_limit(temp_dir):
    code = (
        "import threading, time\nthreads = []\nwhile True:\n"
        "    t = threading.Thread(target=time.sleep, args=(30,), daemon=True)\n"
        "    t.start()\n    threads.append(t)"
    )
    result, after = attack(code, temp_dir, followup="print(threading.active_count())")
    assert "can't start new thread" in result.error and not result.dead
    assert int(after.output) <= LIMITS.max_threads


def test_tcp_connect_is_refused_and_the_listener_sees_nothing(temp_dir):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))"
        result, _ = attack(code, temp_dir)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert "PermissionError" in result.error and not result.dead


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('touch {marker}')",
        "import subprocess\nsubprocess.run(['touch', '{marker}'])",
        "import os\nos.execv('/bin/sh', ['sh', '-c', 'touch {marker}'])",
        "import os\nos.posix_spawn('/bin/touch', ['touch', '{marker}'], {{}})",
    ],
    ids=["os.system", "subprocess", "os.exec", "posix_spawn"],
)
def test_no_process_can_be_started(temp_dir, code, tmp_path):
    marker = tmp_path / "ran"
    os.chmod(tmp_path, 0o777)
    result, _ = attack(code.format(marker=marker), temp_dir)
    assert "PermissionError" in result.error and not result.dead
    assert not marker.exists()


def test_ctypes_libc_system_does_not_run(temp_dir, tmp_path):
    marker = tmp_path / "ran"
    os.chmod(tmp_path, 0o777)
    code = f"import ctypes\nstatus = ctypes.CDLL(None).system(b'touch {marker}')\nprint(status)"
    result, _ = attack(code, temp_dir)
    # glibc reports a shell that could not be started as exit status 127.
    assert result.output == f"{127 << 8}\n" and not result.dead
    assert not marker.exists()


def test_signals_to_the_zygote_or_the_trainer_are_refused(temp_dir):
    code = (
        "import os\nerrors = []\n"
        f"for pid, sig in [(os.getppid(), 9), ({os.getpid()}, 9), (-1, 9), (1, 0)]:\n"
        "    try:\n        os.kill(pid, sig)\n"
        "    except PermissionError as exc:\n        errors.append(exc.errno)\n"
        "print(errors)\nos.kill(os.getppid(), 9)"
    )
    result, _ = attack(code, temp_dir)
    assert result.output == "[1, 1, 1, 1]\n"
    assert "PermissionError" in result.error and not result.dead


@pytest.mark.skipif(_jail.landlock_abi() == 0, reason="the kernel has no Landlock")
def test_writes_outside_the_working_directory_are_refused(temp_dir, tmp_path):
    outside = tmp_path / "world-writable"
    outside.mkdir()
    os.chmod(outside, 0o1777)
    code = (
        f"import os\nopen('inside.txt', 'w').write('fine')\nopen({str(outside / 'escape')!r}, 'w')"
    )
    result, after = attack(code, temp_dir, followup="print(os.listdir('.'))")
    assert "PermissionError" in result.error and not result.dead
    assert after.output == "['inside.txt']\n"
    assert list(outside.iterdir()) == []


def test_a_huge_file_stops_at_the_file_size_limit(temp_dir):
    code = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)"
    result, after = attack(code, temp_dir, followup="import os\nprint(os.path.getsize('big'))")
    assert "File too large" in result.error and not result.dead
    assert int(after.output) <= LIMITS.max_file_bytes


def test_a_100mb_print_is_clipped(temp_dir):
    result, _ = attack("print('x' * 100_000_000)", temp_dir)
    assert not result.dead and result.error == ""
    assert "characters cut" in result.output and len(result.output) < 2 * LIMITS.output_limit_chars


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("import sys\nsys.exit(3)", "SystemExit(3)"),
        ("exit()", "SystemExit(None)"),
        ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ],
)
def test_exiting_is_reported_and_the_session_survives(temp_dir, code, message):
    result, after = attack("state = 'kept'\n" + code, temp_dir, followup="print(state)")
    assert message in result.error and not result.dead
    assert after.output == "kept\n"


def test_cpu_time_limit_ends_the_worker(temp_dir):
    limits = msgspec.structs.replace(LIMITS, cpu_s=1)
    result, _ = attack("while True:\n    pass", temp_dir, limits=limits)
    assert result.dead and "CPU time limit of 1 s" in result.error


def test_os_exit_ends_the_session_with_a_reason(temp_dir):
    result, _ = attack("import os\nos._exit(7)", temp_dir)
    assert result.dead and "exited with status 7" in result.error


def test_segfault_is_reported(temp_dir):
    result, _ = attack("import ctypes\nctypes.string_at(0)", temp_dir)
    assert result.dead and "SIGSEGV" in result.error


def test_deep_recursion_is_a_recursion_error(temp_dir):
    result, after = attack(
        "def f(n):\n    return f(n + 1)\nf(0)", temp_dir, followup="print('alive')"
    )
    assert "RecursionError" in result.error and not result.dead
    assert after.output == "alive\n"


def test_recursion_past_the_c_stack_is_a_crash_not_a_hang(temp_dir):
    # Through map(), every level also nests a C call: the C stack overflows before the heap.
    code = (
        "import sys\nsys.setrecursionlimit(10**8)\n"
        "def f(n):\n    return list(map(f, [n + 1]))\nf(0)"
    )
    result, _ = attack(code, temp_dir)
    assert result.dead and "SIGSEGV" in result.error


FORGED_DONE = encode_frame(Done(id=99, output="forged", error="", final="forged"))


@pytest.mark.parametrize(
    "payload",
    [b"\x00\x00\x00\x05garba", b"\xff\xff\xff\xff", b"\x00\x00\x00\x02\x81\xa1", FORGED_DONE],
    ids=["not-msgpack", "oversized", "truncated-msgpack", "well-formed-out-of-turn"],
)
def test_garbage_on_the_protocol_socket_kills_the_worker(temp_dir, payload):
    code = (
        "import os, stat, time\n"
        "for fd in range(64):\n"
        "    try:\n"
        "        if stat.S_ISSOCK(os.fstat(fd).st_mode):\n"
        f"            os.write(fd, {payload!r})\n"
        "    except OSError:\n"
        "        pass\n"
        "time.sleep(1)"
    )
    result, _ = attack(code, temp_dir)
    assert result.dead and "broke the protocol" in result.error


def test_redefined_final_and_rlm_query_are_restored(temp_dir):
    code = "FINAL = lambda answer: None\nrlm_query = lambda prompt: 'forged'\nFINAL('ignored')"
    result, after = attack(code, temp_dir, followup="print(rlm_query('q'))\nFINAL('real')")
    assert result.final is None and not result.dead
    assert after.final == "real" and "not available" in after.output


SYSCALLS = {
    # name: (x86_64 nr, aarch64 nr, args); args chosen so that an allowed call would fail
    # with something other than EPERM (EFAULT, EBADF...) or succeed.
    "ptrace": (101, 117, [3, "self", 0, 0]),
    "process_vm_readv": (310, 270, ["self", 0, 0, 0, 0, 0]),
    "unshare": (272, 97, [0]),
    "setns": (308, 268, [-1, 0]),
    "mount": (165, 40, [0, 0, 0, 0, 0]),
    "chroot": (161, 51, [0]),
    "bpf": (321, 280, [0, 0, 0]),
    "perf_event_open": (298, 241, [0, 0, -1, -1, 0]),
    "keyctl": (250, 219, [0, -3, 0]),
    "add_key": (248, 217, [0, 0, 0, 0, 0]),
    "request_key": (249, 218, [0, 0, 0, 0]),
    "personality": (135, 92, [0xFFFFFFFF]),
    "io_uring_setup": (425, 425, [0, 0]),
    "userfaultfd": (323, 282, [1]),
    "seccomp": (317, 277, [2, 0, 0]),
    "pidfd_send_signal": (424, 424, [-1, 0, 0, 0]),
    "pidfd_getfd": (438, 438, [-1, 0, 0]),
    "setuid": (105, 146, ["uid"]),
    "execveat": (322, 281, [-1, 0, 0, 0, 0]),
    "socket": (41, 198, [1, 1, 0]),
    "connect": (42, 203, [-1, 0, 0]),
    "bind": (49, 200, [-1, 0, 0]),
    "listen": (50, 201, [-1, 0]),
    "kill(-1)": (62, 129, [-1, 0]),
    "tkill": (200, 130, ["self", 0]),
    "rt_sigqueueinfo": (129, 138, ["self", 0, 0]),
    "prctl(PR_SET_SECCOMP)": (157, 167, [22, 2, 0]),
    "clone(CLONE_NEWUSER)": (56, 220, [0x10000000 | 0x10000 | 0x800 | 0x100, 0, 0, 0, 0]),
    "clone3": (435, 435, [0, 0]),
    # IPC objects outlive the worker and escape its memory limit (0o1600 = IPC_CREAT | 0600).
    "shmget": (29, 194, [0, 4096, 0o1600]),
    "shmat": (30, 196, [0, 0, 0]),
    "msgget": (68, 186, [0, 0o1600]),
    "semget": (64, 190, [0, 1, 0o1600]),
    "mq_open": (240, 180, [0, 0o100, 0o600, 0]),
    "memfd_create": (319, 279, [0, 0]),
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="no syscall table here")
def test_the_seccomp_filter_refuses_each_escape_syscall(temp_dir):
    column = 0 if platform.machine() == "x86_64" else 1
    probes = {name: (entry[column], entry[2]) for name, entry in SYSCALLS.items()}
    code = (
        "import ctypes, json, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\nout = {}\n"
        f"for name, (nr, args) in {probes!r}.items():\n"
        "    named = {'self': os.getpid(), 'uid': os.getuid()}\n"
        "    args = [named.get(a, a) for a in args]\n"
        "    ctypes.set_errno(0)\n"
        "    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])\n"
        "    out[name] = [rc, ctypes.get_errno()]\n"
        "print(json.dumps(out))"
    )
    result, _ = attack(code, temp_dir)
    assert not result.dead and result.error == "", result
    outcomes = json.loads(result.output)
    expected = {name: [-1, 38 if name == "clone3" else 1] for name in SYSCALLS}  # ENOSYS, EPERM
    assert outcomes == expected


def test_worker_identity_and_limits_seen_from_outside(temp_dir):
    async def main():
        zygote = await Zygote.start(
            context="", tool_modules=[], limits=LIMITS, preload_modules=PRELOAD, temp_dir=temp_dir
        )
        try:
            session = await zygote.session()
            code = (
                "import os, resource\n"
                "print(os.getuid(), os.getgid(), os.getgroups(), os.getpgid(0) == os.getpid())\n"
                "limit = lambda name: resource.getrlimit(getattr(resource, name))[1]\n"
                "print(limit('RLIMIT_AS'), limit('RLIMIT_NPROC'), limit('RLIMIT_CORE'))"
            )
            result = await session.exec(code)
            status = Path(f"/proc/{session.pid}/status").read_text()
            await session.close()
            return result, status
        finally:
            await zygote.close()

    result, status = asyncio.run(main())
    ids, limits = result.output.splitlines()
    uid, gid, groups, own_group = ids.split(" ", 3)
    assert int(uid) >= 1 << 30 and uid == gid and groups == "[]" and own_group == "True"
    assert limits == f"{LIMITS.memory_mb << 20} {LIMITS.max_threads} 0"
    assert re.search(r"NoNewPrivs:\t1\n", status) and re.search(r"Seccomp:\t2\n", status)
    assert re.search(r"CapEff:\t0+\n", status) and re.search(rf"Uid:\t{uid}\t{uid}\t{uid}", status)


@pytest.mark.skipif(_jail.landlock_abi() == 0, reason="the kernel has no Landlock")
def test_reads_outside_the_python_installation_are_refused(temp_dir):
    # World-readable by file permissions; only Landlock stands in the way.
    secret_dir = tempfile.mkdtemp(prefix="test-jail-answers-", dir="/tmp")
    try:
        os.chmod(secret_dir, 0o755)
        secret = Path(secret_dir) / "answers.jsonl"
        secret.write_text('{"answer": 42}\n')
        os.chmod(secret, 0o644)
        code = (
            "import json, os\nprint(len(json.dumps([1])), len(os.listdir('.')))\n"
            f"open({str(secret)!r}).read()"
        )
        result, after = attack(code, temp_dir, followup="open('/etc/hostname').read()")
    finally:
        shutil.rmtree(secret_dir)
    assert result.output == "3 0\n" and not result.dead
    assert "PermissionError" in result.error and "PermissionError" in after.error


def test_enter_refuses_root_as_the_target_uid():
    with pytest.raises(ValueError, match="unprivileged"):
        _jail.enter(
            uid=0,
            gid=0,
            parent_pid=os.getppid(),
            address_space=1 << 30,
            cpu_seconds=10,
            open_files=64,
            file_size=1 << 20,
            threads=8,
            readable=[],
        )
