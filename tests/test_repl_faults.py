"""Worker code that attacks the runtime around the jail, not the jail itself.

Model code owns its worker's interpreter: it can build a directory tree too deep to remove
recursively, close or stop reading its end of the protocol, forge frames the trainer must decode,
die from any signal, and push sub-queries in a loop. Each test runs one such worker on a real
zygote and checks that the damage stays inside that session: the exec ends with an error result
within a stated bound, the session and zygote close cleanly, nothing is left behind.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import tracemalloc

import clocks
import leaks
import msgspec
import pytest
from leaks import leak_checked_temp_dir

from rlmtrain.rlm.protocol import MAX_PROMPTS_PER_QUERY
from rlmtrain.rlm.repl import ReplLimits

# A generous exec timeout for the tests whose exec must not time out; those that wait a timeout
# out (a worker that hangs, so it fires whatever the load) use the short one.
LIMITS = ReplLimits(exec_timeout_s=30.0, memory_mb=1024, cpu_s=60, output_limit_chars=400)
SHORT = msgspec.structs.replace(LIMITS, exec_timeout_s=2.0)
ALONE = msgspec.structs.replace(LIMITS, exec_timeout_s=8.0)
"""The stall test's timeout: see there."""
HANG_MARGIN_S = 30.0
"""What an exec may take past its timeout when a worker refuses to cooperate: the kill, the
zygote's reap report, and a loaded machine's scheduling noise. Well under the 120 s the hanging
workers below sleep, so one waited for rather than killed still fails."""

# The worker's end of its protocol socket (see `rlmtrain.rlm.worker`), which model code can reach.
FORGE = (
    "import socket, struct, msgspec\n"
    "wire = socket.socket(fileno=3)\n"
    "def send(obj):\n"
    "    body = msgspec.msgpack.encode(obj)\n"
    "    wire.sendall(struct.pack('>I', len(body)) + body)\n"
)


@pytest.fixture(scope="module")
def temp_dir():
    with leak_checked_temp_dir(prefix="test-repl-faults-") as path:
        yield path


def run_with_zygote(body, temp_dir, *, limits=LIMITS):
    return leaks.run_with_zygote(
        body, temp_dir, context="ctx", tool_modules=["textwrap"], limits=limits
    )


async def timed_exec(session, code, on_query=None):
    began = time.perf_counter()
    result = await session.exec(code, on_query=on_query)
    return result, time.perf_counter() - began


def test_a_tree_too_deep_for_recursion_is_removed(temp_dir):
    depth = 3000  # past the interpreter's recursion limit and, as one path, past PATH_MAX

    async def body(zygote):
        session = await zygote.session()
        result = await session.exec(
            f"import os\nfor _ in range({depth}):\n    os.mkdir('d')\n    os.chdir('d')\n"
            "open('leaf', 'w').write('x')"
        )
        assert not result.dead and result.error == "", result
        workdir = session.workdir
        await session.close()
        assert not os.path.exists(workdir)
        survivor = await zygote.session()
        assert (await survivor.exec("print(1 + 1)")).output == "2\n"

    run_with_zygote(body, temp_dir)


def test_a_deep_tree_left_at_zygote_close_is_removed(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        await session.exec("import os\nfor _ in range(2500):\n    os.mkdir('d')\n    os.chdir('d')")
        # No session.close(): the zygote's close must take the session and its tree down.

    run_with_zygote(body, temp_dir)


def test_a_worker_that_closes_its_socket_and_sleeps_is_killed(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        result, took = await timed_exec(session, "import os, time\nos.close(3)\ntime.sleep(120)")
        assert result.dead and "channel" in result.error, result
        assert took < HANG_MARGIN_S  # a grace, then the kill: no exec timeout involved
        await session.close()

    run_with_zygote(body, temp_dir)


def test_a_worker_that_never_reads_its_answers_times_out(temp_dir):
    async def answer_big(prompts, contexts):
        return ["y" * 4_000_000 for _ in prompts]  # far over any socket buffer

    async def body(zygote):
        session = await zygote.session()
        code = FORGE + (
            "import time\n"
            "send({'type': 'Query', 'id': 1, 'prompts': ['a'], 'contexts': [None]})\n"
            "time.sleep(120)"
        )
        result, took = await timed_exec(session, code, on_query=answer_big)
        assert result.dead and "timed out" in result.error, result
        assert took < SHORT.exec_timeout_s + HANG_MARGIN_S
        await session.close()

    run_with_zygote(body, temp_dir, limits=SHORT)


def test_a_deeply_nested_frame_is_a_protocol_violation(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        code = FORGE + (
            "body = msgspec.msgpack.encode("
            "{'type': 'Query', 'id': 1, 'prompts': ['a'], 'contexts': ['HOLE']})\n"
            "body = body.replace(msgspec.msgpack.encode('HOLE'), b'\\x91' * 5000 + b'\\xc0')\n"
            "wire.sendall(struct.pack('>I', len(body)) + body)\n"
            "import time\ntime.sleep(60)"
        )
        result = await session.exec(code, on_query=None)
        assert result.dead and "protocol" in result.error, result
        await session.close()

    run_with_zygote(body, temp_dir)


def test_death_by_a_real_time_signal_is_described(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        result = await session.exec("import os, signal\nos.kill(os.getpid(), 40)")
        assert result.dead and "signal 40" in result.error, result
        await session.close()

    run_with_zygote(body, temp_dir)


def test_a_forged_query_with_a_million_prompts_is_refused_at_decode(temp_dir):
    calls = []

    async def count(prompts, contexts):
        calls.append(len(prompts))
        return ["" for _ in prompts]

    async def body(zygote):
        session = await zygote.session()
        code = FORGE + (
            "send({'type': 'Query', 'id': 1, 'prompts': [''] * 1_000_000, "
            "'contexts': [None] * 1_000_000})\n"
            "import time\ntime.sleep(60)"
        )
        result = await session.exec(code, on_query=count)
        assert result.dead and "protocol" in result.error, result
        assert calls == []
        await session.close()

    run_with_zygote(body, temp_dir)


def test_honest_code_over_the_prompt_cap_gets_a_python_error(temp_dir):
    cap = MAX_PROMPTS_PER_QUERY

    async def body(zygote):
        session = await zygote.session()
        result = await session.exec(f"rlm_query_batched(['p'] * {cap + 1})")
        assert not result.dead and "ValueError" in result.error, result
        assert str(cap) in result.error
        await session.close()

    run_with_zygote(body, temp_dir)


def test_a_sub_query_loop_cannot_stall_the_event_loop(temp_dir):
    """Model code calling rlm_query_batched in a tight loop: once the exec has used its prompts,
    the REPL answers on its own (no handler), and that time counts against the exec's budget,
    so the loop ends at the exec timeout; meanwhile the event loop keeps ticking."""
    handled = []
    handled_at: list[float] = []

    async def handler(prompts, contexts):
        handled.append(len(prompts))
        handled_at.append(time.perf_counter())
        return ["no" for _ in prompts]

    async def body(zygote):
        session = await zygote.session()
        ticks: list[float] = []

        async def ticker():
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.perf_counter())

        ticking = asyncio.create_task(ticker())
        result, took = await timed_exec(
            session, "while True:\n    rlm_query_batched([''] * 100)", on_query=handler
        )
        ended = time.perf_counter()
        ticking.cancel()
        assert result.dead and "timed out" in result.error, result
        assert took < ALONE.exec_timeout_s + HANG_MARGIN_S
        assert sum(handled) <= ReplLimits().max_query_prompts_per_exec
        # After the handler's last call the REPL answers alone until the timeout. Had it held
        # the loop, one gap would span that whole stretch; scheduling noise stays far shorter.
        alone = handled_at[-1]
        stretch = [alone, *(t for t in ticks if alone < t < ended), ended]
        stall = max(b - a for a, b in itertools.pairwise(stretch))
        assert stall < (ended - alone) / 2, f"the event loop stalled {stall:.2f} s"
        await session.close()

    # Long enough that the handler's ~40 calls, however slow on a loaded machine, leave the
    # REPL a stretch alone far longer than any scheduling hiccup.
    run_with_zygote(body, temp_dir, limits=ALONE)


TRAINER = """
import asyncio, sys
from rlmtrain.rlm.repl import Zygote

async def main():
    zygote = await Zygote.start(context="ctx", tool_modules=["textwrap"], temp_dir=sys.argv[1])
    session = await zygote.session()
    await session.exec("import os\\nos.makedirs('a/b/c')\\nopen('a/b/c/f', 'w').write('x')")
    print(zygote.temp_root, zygote._process.pid, session.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("signum", [9, 15])
def test_a_killed_trainer_leaves_no_zygote_worker_or_directory(temp_dir, signum):
    import subprocess
    import sys

    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, temp_dir], stdout=subprocess.PIPE, text=True
    )
    temp_root, *pids = trainer.stdout.readline().split()
    assert os.path.isdir(temp_root)
    trainer.send_signal(signum)
    trainer.wait(10)
    trainer.stdout.close()
    # The zygote and the worker were the trainer's; orphaned, they are no descendants of this
    # process any more, so they are looked for by pid (a zombie reaped by init counts as gone).
    deadline = time.monotonic() + 30.0  # only bounds a hang
    while time.monotonic() < deadline and (
        os.path.exists(temp_root) or any(_alive(int(pid)) for pid in pids)
    ):
        time.sleep(0.05)
    assert not os.path.exists(temp_root)
    assert not [pid for pid in pids if _alive(int(pid))]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "code",
    [
        "import os\nfor i in range(100):\n    open(f'f{i}', 'wb').write(os.urandom(1 << 20))",
        "for i in range(5000):\n    open(f'f{i}', 'w').close()",
        "import os, time\nopen('big', 'wb').write(os.urandom(40 << 20))\ntime.sleep(120)",
        "import os\nkept = open('gone', 'wb')\nos.unlink('gone')\n"
        "kept.write(os.urandom(40 << 20))\nkept.flush()",
    ],
    ids=["many-megabytes", "many-files", "hoard-then-wait", "unlinked-but-open"],
)
def test_a_disk_hoard_past_the_limit_ends_the_exec(temp_dir, code):
    limits = msgspec.structs.replace(LIMITS, disk_mb=32, disk_entries=1000)

    async def body(zygote):
        session = await zygote.session()
        result, took = await timed_exec(session, code)
        assert result.dead and "disk limit" in result.error, result
        # The watchdog ended it, long before the exec timeout or the hoarder's sleep could.
        assert took < limits.exec_timeout_s / 2
        await session.close()

    run_with_zygote(body, temp_dir, limits=limits)


def test_a_hoard_written_between_execs_ends_the_session_while_idle(temp_dir):
    limits = msgspec.structs.replace(LIMITS, disk_mb=32)
    # The thread writes once the test says go, after the exec and its own disk check are over.
    code = (
        "import os, threading, time\n"
        "def later():\n"
        "    while not os.path.exists('go'):\n"
        "        time.sleep(0.01)\n"
        "    open('late', 'wb').write(os.urandom(40 << 20))\n"
        "threading.Thread(target=later, daemon=True).start()\n"
        "print('started')"
    )

    async def body(zygote):
        session = await zygote.session()
        result = await session.exec(code)
        assert result.output == "started\n" and not result.dead, result
        open(os.path.join(session.workdir, "go"), "w").close()
        # No exec runs: the session's own watchdog must see it.
        await clocks.until(lambda: session.dead, "the watchdog to end the session")
        after = await session.exec("print(1)")
        assert after.dead and "disk limit" in after.error, after
        await session.close()

    run_with_zygote(body, temp_dir, limits=limits)


def recording_handler():
    """A query handler answering "ok" to every prompt, and the list of contexts it was given."""
    received = []

    async def handler(prompts, contexts):
        received.extend(contexts)
        return ["ok"] * len(prompts)

    return handler, received


def test_a_query_context_stays_encoded_in_the_trainer(temp_dir):
    """1 MB of empty lists decodes to ~60 MiB of objects: the trainer keeps the bytes, and only
    the child's own worker decodes them, under its own limits."""
    handler, received = recording_handler()

    async def body(zygote):
        session = await zygote.session()
        tracemalloc.start()
        try:
            result = await session.exec("print(rlm_query('q', context=[[]] * 1_000_000))", handler)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert result.output == "ok\n", result
        [context] = received
        assert isinstance(context, msgspec.Raw) and len(context) > 1_000_000
        assert peak < 16 << 20, f"the trainer held {peak >> 20} MiB while answering"
        child = await zygote.session(context=context)
        seen = await child.exec("print(len(context), context[0])")
        assert seen.output == "1000000 []\n", seen
        await child.close()
        await session.close()

    run_with_zygote(body, temp_dir)


def test_a_context_too_big_for_the_child_fails_that_child_alone(temp_dir):
    handler, received = recording_handler()

    async def body(zygote):
        session = await zygote.session()
        result = await session.exec("rlm_query('q', context=[[]] * 8_000_000)", handler)
        assert not result.error, result
        with pytest.raises(RuntimeError, match="context could not be decoded: MemoryError"):
            await zygote.session(context=received[0])
        again = await session.exec("print(6 * 7)")
        assert again.output == "42\n"
        await session.close()

    small = msgspec.structs.replace(LIMITS, memory_mb=256)
    run_with_zygote(body, temp_dir, limits=small)
