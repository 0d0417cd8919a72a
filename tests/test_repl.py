"""The REPL as the agent sees it: real zygotes, real jailed workers, real sockets.

Tool modules are stdlib modules with an `__all__` (pprint, textwrap): real importable tools,
one of which prints. After the module, no worker process and no temporary directory remains.
"""

from __future__ import annotations

import asyncio
import os

import clocks
import leaks
import msgspec
import pytest
from leaks import leak_checked_temp_dir

from rlmtrain.rlm.repl import ExecResult, ReplLimits, Zygote, _uid_block_start

# A generous exec timeout: no test here waits one out on the real clock.
LIMITS = ReplLimits(exec_timeout_s=30.0, memory_mb=1024, cpu_s=60, output_limit_chars=400)
TOOLS = ["pprint", "textwrap"]
CONTEXT = "The quick brown fox. " * 50


@pytest.fixture(scope="module")
def temp_dir():
    with leak_checked_temp_dir(prefix="test-repl-") as path:
        yield path


def run_with_zygote(body, temp_dir, *, limits=LIMITS, context=CONTEXT):
    return leaks.run_with_zygote(body, temp_dir, context=context, tool_modules=TOOLS, limits=limits)


def ok(result: ExecResult) -> ExecResult:
    assert not result.dead and result.error == "", result
    return result


def test_globals_persist_and_a_trailing_expression_is_shown(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        ok(await session.exec("total = len(context)\nwords = context.split()"))
        result = ok(await session.exec("print(total)\nlen(words)"))
        assert result.output == f"{len(CONTEXT)}\n{len(CONTEXT.split())}\n"
        assert result.final is None
        await session.close()
        await session.close()
        assert (await session.exec("1")).dead

    run_with_zygote(body, temp_dir)


def test_errors_come_back_as_text_and_the_session_goes_on(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        result = await session.exec("x = 1\ny = x / 0")
        assert not result.dead
        assert "ZeroDivisionError" in result.error and "y = x / 0" in result.error
        assert "builtins.py" not in result.error
        syntax = await session.exec("def broken(:\n  pass")
        assert "SyntaxError" in syntax.error and not syntax.dead
        assert ok(await session.exec("x")).output == "1\n"
        await session.close()

    run_with_zygote(body, temp_dir)


def test_final_counts_only_when_it_runs(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        text = ok(await session.exec("s = \"FINAL('fake')\"  # FINAL('also fake')\nprint(s)"))
        assert text.final is None and text.output == "FINAL('fake')\n"
        stops = ok(await session.exec("print('before')\nFINAL(42)\nprint('after')"))
        assert stops.final == "42" and stops.output == "before\n"
        caught = ok(await session.exec("try:\n    FINAL('first')\nexcept Exception:\n    pass"))
        assert caught.final == "first"
        assert ok(await session.exec("1 + 1")).final is None
        await session.close()

    run_with_zygote(body, temp_dir)


def test_final_var_of_a_missing_name_is_an_error_not_an_end(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        missing = await session.exec("FINAL_VAR('answer')")
        assert missing.final is None and not missing.dead
        assert "no variable named 'answer'" in missing.error
        wrong_type = await session.exec("answer = 7\nFINAL_VAR(answer)")
        assert wrong_type.final is None and "as a string" in wrong_type.error
        assert ok(await session.exec("answer = [1, 2]\nFINAL_VAR('answer')")).final == "[1, 2]"
        await session.close()

    run_with_zygote(body, temp_dir)


def test_tools_run_and_their_prints_are_captured(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        result = ok(await session.exec("pprint({'k': 1})\nprint(shorten(context, width=20))"))
        assert result.output == "{'k': 1}\nThe quick [...]\n"
        await session.close()

    run_with_zygote(body, temp_dir)


def test_output_is_clipped_head_and_tail(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        result = ok(await session.exec("print('A' * 1000, end='')\nprint('B' * 1000, end='')"))
        assert result.output.startswith("A" * 200) and result.output.endswith("B" * 200)
        assert "[1600 characters cut]" in result.output
        await session.close()

    run_with_zygote(body, temp_dir)


def test_rlm_query_round_trips_in_order(temp_dir):
    seen = []

    async def handler(prompts, contexts):
        # Contexts arrive as the worker encoded them; None is the parent's.
        seen.append((prompts, [c if c is None else msgspec.msgpack.decode(c) for c in contexts]))
        return [f"answer to {p}" for p in prompts]

    async def body(zygote):
        session = await zygote.session()
        one = ok(await session.exec("a = rlm_query('q1')\nprint(a)", handler))
        assert one.output == "answer to q1\n"
        batched = ok(
            await session.exec(
                "print(rlm_query_batched(['x', 'y', 'z'], [None, {'part': 2}, ['p', 3]]))", handler
            )
        )
        assert batched.output == "['answer to x', 'answer to y', 'answer to z']\n"
        assert seen == [(["q1"], [None]), (["x", "y", "z"], [None, {"part": 2}, ["p", 3]])]
        mismatch = await session.exec("rlm_query_batched(['a', 'b'], ['only one'])", handler)
        assert "2 prompts but 1 contexts" in mismatch.error
        unsendable = await session.exec("rlm_query('q', context=object())", handler)
        assert "plain data" in unsendable.error and not unsendable.dead
        no_handler = ok(await session.exec("print(rlm_query('q'))"))
        assert "not available" in no_handler.output
        await session.close()

    run_with_zygote(body, temp_dir)


def test_exec_timer_excludes_time_in_the_query_handler(temp_dir):
    # Time passes on the loop's clock by skips, so the worker's own run time (real, and slow on
    # a loaded machine) stays far under the timeout while each query takes a whole timeout.
    timeout_s = LIMITS.exec_timeout_s

    async def body(zygote):
        clock = asyncio.get_running_loop()

        async def slow_handler(prompts, contexts):
            clocks.skip(timeout_s)
            return ["late but fine"] * len(prompts)

        session = await zygote.session()
        started = clock.time()
        result = ok(
            await session.exec("print(rlm_query('slow'))\nprint(rlm_query('slow'))", slow_handler)
        )
        assert clock.time() - started >= 2 * timeout_s
        assert result.output == "late but fine\nlate but fine\n"
        # Without a query the timer runs on: once the worker loops, a timeout's skip ends it.
        looping = asyncio.create_task(
            session.exec("open('looping', 'w').close()\nwhile True:\n    pass")
        )
        marker = os.path.join(session.workdir, "looping")
        await clocks.until(lambda: os.path.exists(marker), "the worker to loop")
        clocks.skip(timeout_s)
        result = await looping
        assert result.dead and f"timed out after {timeout_s:g} s" in result.error
        await session.close()

    run_with_zygote(body, temp_dir)


def test_a_handler_returning_the_wrong_shape_raises_and_kills_the_worker(temp_dir):
    async def bad_handler(prompts, contexts):
        return ["one"]

    async def body(zygote):
        session = await zygote.session()
        with pytest.raises(TypeError, match="list of 2 str answers"):
            await session.exec("rlm_query_batched(['a', 'b'])", bad_handler)
        assert (await session.exec("1")).dead
        assert zygote.live_workers() == 0
        await session.close()

    run_with_zygote(body, temp_dir)


def test_sessions_inherit_or_replace_the_context(temp_dir):
    async def body(zygote):
        inherited = await zygote.session()
        replaced = await zygote.session(context={"doc": "other"})
        assert ok(await inherited.exec("len(context)")).output == f"{len(CONTEXT)}\n"
        assert ok(await replaced.exec("context['doc']")).output == "'other'\n"
        await inherited.close()
        await replaced.close()

    run_with_zygote(body, temp_dir)


def test_sessions_run_concurrently_and_are_isolated(temp_dir):
    async def body(zygote):
        sessions = [await zygote.session() for _ in range(4)]
        assert zygote.live_workers() == 4
        await asyncio.gather(*(s.exec(f"mine = {i}") for i, s in enumerate(sessions)))
        results = await asyncio.gather(
            *(s.exec("import time\ntime.sleep(0.3)\nmine") for s in sessions)
        )
        assert [r.output for r in results] == ["0\n", "1\n", "2\n", "3\n"]
        assert len({s.workdir for s in sessions}) == 4
        peek = await sessions[0].exec(f"open({sessions[1].workdir + '/x'!r}, 'w')")
        assert "PermissionError" in peek.error
        # Closing the zygote kills the workers left open.

    run_with_zygote(body, temp_dir)


def test_rebound_builtins_and_tools_are_restored_before_the_next_exec(temp_dir):
    async def handler(prompts, contexts):
        return ["from the handler"] * len(prompts)

    async def body(zygote):
        session = await zygote.session()
        ok(
            await session.exec(
                "FINAL = lambda x: None\nFINAL_VAR = None\nrlm_query = lambda p: 'forged'\n"
                "shorten = None\ncontext = 'replaced'\nimport builtins\nbuiltins.len = None",
                handler,
            )
        )
        result = ok(
            await session.exec(
                "print(rlm_query('q'), len(context), shorten('a b', 10))\nFINAL('real')", handler
            )
        )
        assert result.output == f"from the handler {len(CONTEXT)} a b\n"
        assert result.final == "real"
        assert ok(await session.exec("x = 5\nFINAL_VAR('x')")).final == "5"
        await session.close()

    run_with_zygote(body, temp_dir)


def test_zygote_refuses_a_bad_tool_module(temp_dir):
    async def main():
        with pytest.raises(RuntimeError, match="no_such_module"):
            await Zygote.start(context="", tool_modules=["no_such_module"], temp_dir=temp_dir)

    asyncio.run(main())


def test_closing_a_session_mid_query_cancels_the_handler(temp_dir):
    asked = asyncio.Event()
    handler_cancelled = asyncio.Event()

    async def never_answers(prompts, contexts):
        asked.set()
        try:
            await asyncio.Event().wait()
        finally:
            handler_cancelled.set()

    async def body(zygote):
        session = await zygote.session()
        running = asyncio.create_task(session.exec("rlm_query('forever')", never_answers))
        await asyncio.wait_for(asked.wait(), 30.0)
        await session.close()
        result = await running
        assert result.dead and "closed" in result.error
        assert handler_cancelled.is_set() and zygote.live_workers() == 0

    run_with_zygote(body, temp_dir)


def test_cancelling_an_exec_kills_its_worker(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        running = asyncio.create_task(
            session.exec("import time\nopen('sleeping', 'w').close()\ntime.sleep(60)")
        )
        marker = os.path.join(session.workdir, "sleeping")
        await clocks.until(lambda: os.path.exists(marker), "the worker to sleep")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert zygote.live_workers() == 0
        assert (await session.exec("1")).dead
        await session.close()

    run_with_zygote(body, temp_dir)


def test_a_dead_zygote_takes_its_workers_and_says_so(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        os.kill(zygote._process.pid, 9)
        # The kernel delivers the workers' parent-death signal asynchronously.
        await clocks.until(lambda: zygote.live_workers() == 0, "the workers to die with the zygote")
        result = await session.exec("1")
        assert result.dead and "zygote died" in result.error
        with pytest.raises(RuntimeError, match="zygote exited"):
            await zygote.session()
        await session.close()

    run_with_zygote(body, temp_dir)


def test_a_cancelled_exec_waits_for_its_handler_to_unwind(temp_dir):
    asked = asyncio.Event()
    unwound = []

    async def children_still_running(prompts, contexts):
        asked.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)  # e.g. closing the children's own sessions
            unwound.append(prompts)

    async def body(zygote):
        session = await zygote.session()
        running = asyncio.create_task(session.exec("rlm_query('child')", children_still_running))
        await asyncio.wait_for(asked.wait(), 30.0)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert unwound == [["child"]] and zygote.live_workers() == 0
        closing = asyncio.create_task(session.close())
        await asyncio.sleep(0)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await session.close()  # the cancelled close finished its cleanup all the same
        assert not os.path.exists(session.workdir)

    run_with_zygote(body, temp_dir)


def test_lone_surrogates_are_escaped_not_fatal(temp_dir):
    async def body(zygote):
        session = await zygote.session()
        printed = ok(await session.exec("print(chr(0xD800))"))
        assert printed.output == "\\ud800\n"
        final = ok(await session.exec("FINAL('a' + chr(0xDCFF))"))
        assert final.final == "a\\udcff"
        raised = await session.exec("raise ValueError(chr(0xD800))")
        assert "ValueError: \\ud800" in raised.error and not raised.dead
        await session.close()

    run_with_zygote(body, temp_dir)


@pytest.mark.parametrize(
    ("uid_map", "expected"),
    [
        ("0 0 4294967295", (1 << 30) + 7 * 4096),  # the whole range: far above real users
        ("0 1000 65536", 32768 + (7 % 8) * 4096),  # rootless container: upper half of its map
        ("0 0 1\n1 100000 65536", 1 + 32768 + (7 % 8) * 4096),
    ],
)
def test_worker_uids_stay_inside_the_user_namespace(tmp_path, uid_map, expected):
    path = tmp_path / "uid_map"
    path.write_text(uid_map + "\n")
    assert _uid_block_start(7, str(path)) == expected
    path.write_text("0 0 100\n")
    with pytest.raises(RuntimeError, match="maps no range"):
        _uid_block_start(7, str(path))
