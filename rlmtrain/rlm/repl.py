"""The REPL, trainer side: a zygote per task context and one jailed worker per session.

Why one file: the zygote and the sessions it forks are one protocol (spawn, exec, reap, close)
whose states are read together; the worker side is `rlm/worker.py`.

    zygote = await Zygote.start(context=text, tool_modules=["my_env.tools"], limits=ReplLimits())
    session = await zygote.session()
    result = await session.exec("print(len(context))", on_query=handler)
    await session.close(); await zygote.close()

What model code sees (details in `rlmtrain.rlm.builtins`): globals that persist across execs;
a trailing expression is echoed like a REPL; FINAL / FINAL_VAR record the answer and stop the
exec; `sys.exit`, `exit()` and KeyboardInterrupt come back as errors and the session lives on;
`os._exit`, a crash or a limit ends the worker and the result says dead=True and why.

Design (process side in `rlmtrain.rlm.worker`, jail in `csrc/jail.c`):
- The zygote is a fresh interpreter (`python -I -m rlmtrain.rlm.worker`), never a fork of the
  multithreaded trainer, and started with vfork() (`rlm/spawn.py`): a fork() would first copy
  the page tables of the whole trainer. It loads the tools and the context once; every session
  is a fork of it, so workers share the context copy-on-write. The zygote gets a scrubbed
  environment: the trainer's API keys never reach model code.
- Everything here is asyncio-native, with no thread per worker: the zygote's control socket is
  read by a loop reader (it carries pidfds as SCM_RIGHTS), each worker's socket is a
  StreamReader/StreamWriter pair, and a worker's exit is awaited on its pidfd.
- Every frame a worker sends is checked (size cap, typed msgpack decoder, exec id, turn order);
  anything else kills the worker. Workers are signalled through pidfds, so a recycled pid can
  never be hit.
- The exec timer stops while `on_query` answers a query (child RLM calls): that time is not
  counted, though threads the worker started may run meanwhile (bounded by its CPU limit and
  its query budget). A timeout kills the worker; the session is then dead (`ExecResult.dead`).
  Every wait on a worker has a deadline: sending it answers it does not read counts against the
  exec's time, and a worker that closes its socket is killed after a short grace rather than
  waited for.
- What model code sends is bounded before it costs the trainer work: at most
  MAX_PROMPTS_PER_QUERY prompts per frame (checked at decode), at most
  `max_query_prompts_per_exec` prompts handed to `on_query` per exec; past that, the REPL answers
  each query itself without the handler, and that time counts against the exec.
- Closing never raises and never leaves anything: a session's or zygote's directory is removed
  by `teardown.remove_tree` in a thread (however deep or wide model code made it), and a failing
  step of a close does not skip the steps after it.
- The zygote dies with the thread that started it (PR_SET_PDEATHSIG follows the parent
  thread): start zygotes from the thread that runs the event loop. A trainer killed without
  closing its zygotes leaves nothing: each zygote then kills its workers and removes its
  temporary root itself. A job killed as a whole (zygotes included) leaves its roots, which the
  next zygote started under that temp folder removes (`temp_roots`: a root is locked while its
  trainer or zygote lives).
- Each worker runs as its own unprivileged uid (`uid_base + slot`, the base derived from the
  zygote's pid so that concurrent zygotes do not share uids) in its own empty directory under
  the zygote's temporary root; both are released when the worker is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rlmtrain.config import ROLLOUT_DEFAULTS, RolloutConfig
from rlmtrain.rlm.builtins import clip_text
from rlmtrain.rlm.control import ControlChannel
from rlmtrain.rlm.memcg import PoolCgroup, WorkerCgroup
from rlmtrain.rlm.protocol import (
    HEADER,
    Answers,
    Boot,
    Booted,
    BootFailed,
    Done,
    Exec,
    Exited,
    Query,
    Ready,
    Shutdown,
    Spawn,
    Spawned,
    SpawnFailed,
    WorkerLimits,
    encode_frame,
)
from rlmtrain.rlm.spawn import Child
from rlmtrain.rlm.teardown import disk_usage, remove_tree, unlinked_open_bytes
from rlmtrain.rlm.temp_roots import TempRoot

__all__ = ["DEFAULT_PRELOAD", "ExecResult", "QueryHandler", "ReplLimits", "Session", "Zygote"]

log = logging.getLogger("rlmtrain")

DEFAULT_PRELOAD = [
    *("re", "json", "math", "cmath", "collections", "itertools", "functools", "operator"),
    *("string", "textwrap", "difflib", "statistics", "random", "datetime", "time", "heapq"),
    *("bisect", "copy", "pprint", "dataclasses", "typing", "fractions", "decimal", "hashlib"),
    *("base64", "unicodedata", "csv", "io", "threading", "struct", "array", "enum"),
    *("contextvars", "fnmatch", "glob", "html", "shlex", "urllib.parse", "zlib"),
    # Imported lazily by functions of the modules above (time.strptime, str.encode).
    *("_strptime", "encodings.idna", "encodings.latin_1", "encodings.cp1252", "encodings.utf_16"),
]
"""Stdlib modules imported in the zygote so that model code can import them after the jail
(the interpreter's own directory may be unreadable to a worker's uid)."""

_UID_FLOOR = 1 << 30
_MAX_SLOTS = 1 << 12
_READY_TIMEOUT_S = 30.0
_EXIT_REPORT_TIMEOUT_S = 2.0
_DISK_POLL_S = 1.0
"""How often a session's disk use is measured against its limits."""
_NIL = msgspec.Raw(msgspec.msgpack.encode(None))
_EOF_GRACE_S = 1.0
"""How long a worker whose socket closed may take to exit on its own before it is killed."""


class ReplLimits(msgspec.Struct, kw_only=True):
    """A worker's limits. Those a run configures (`rollout.repl_timeout_s`, `repl_memory_mb`,
    `output_limit_chars`) default to the config's; the rest are the REPL's own."""

    exec_timeout_s: float = ROLLOUT_DEFAULTS.repl_timeout_s
    """Wall clock per exec; time waiting for child rlm_query calls is excluded."""
    memory_mb: int = ROLLOUT_DEFAULTS.repl_memory_mb
    """RLIMIT_AS of a worker, and the limit of its memory cgroup (`memory_cgroup`)."""
    memory_cgroup: bool = True
    """Give each worker a memory cgroup of `memory_mb` (page cache, shared memory and kernel
    buffers included, no swap) where the kernel lets the trainer make one (`rlm/memcg.py`)."""
    cpu_s: int = 600
    """RLIMIT_CPU of a worker (its whole life)."""
    output_limit_chars: int = ROLLOUT_DEFAULTS.output_limit_chars
    """Printed output kept per exec (head + tail, with a note of what was cut)."""
    max_file_bytes: int = 64 << 20
    """RLIMIT_FSIZE."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_frame_bytes: int = 64 << 20
    """A bigger frame from a worker is a protocol violation: the worker is killed."""
    max_threads: int = 32
    """RLIMIT_NPROC of the worker's own uid: the threads it may run, its main thread included."""
    disk_mb: int = 256
    """What a session may hold on disk (allocated bytes): its directory, and files its worker
    unlinked but keeps open. Checked every second for the session's whole life (a background
    thread writes between execs too) and when each exec ends; past it the worker is killed."""
    disk_entries: int = 10_000
    """Files and directories a session may hold in its directory, checked likewise."""
    max_query_prompts_per_exec: int = 4096
    """rlm_query prompts per exec handed to the query handler (a call counts at least one);
    later calls in the same exec are answered with a refusal by the REPL itself."""

    @classmethod
    def from_config(cls, config: RolloutConfig) -> ReplLimits:
        """The REPL limits a run's rollout section sets; the others at their defaults."""
        return cls(
            exec_timeout_s=config.repl_timeout_s,
            memory_mb=config.repl_memory_mb,
            output_limit_chars=config.output_limit_chars,
        )

    def for_worker(self) -> WorkerLimits:
        return WorkerLimits(
            address_space=self.memory_mb << 20,
            cpu_seconds=self.cpu_s,
            open_files=self.max_open_files,
            file_size=self.max_file_bytes,
            threads=self.max_threads,
            output_limit_chars=self.output_limit_chars,
            max_frame_bytes=self.max_frame_bytes,
        )


class ExecResult(msgspec.Struct, kw_only=True):
    output: str
    """Captured stdout+stderr, truncated."""
    error: str
    """'' or the error text shown to the model (traceback tail, timeout, killed...)."""
    final: str | None
    """The answer if FINAL/FINAL_VAR executed in this exec, else None."""
    dead: bool
    """The worker is gone (timeout, limit, crash, protocol violation); the session is unusable."""


QueryHandler = Callable[[list[str], list[Any | None]], Awaitable[list[str]]]
"""(prompts, contexts) -> answers in order; a context of None means the parent's context, any
other is a `msgspec.Raw` still encoded as the worker sent it (`protocol` docstring). It never
raises: failures are answer strings."""


class _ProtocolViolation(Exception):
    pass


class _WorkerGone(Exception):
    pass


class _OutOfTime(Exception):
    """The exec's run time is used up while waiting on its worker."""


_worker_decoder = msgspec.msgpack.Decoder(Ready | Query | Done)


def _worker_env() -> dict[str, str]:
    return {
        "PATH": os.defpath,
        "HOME": "/",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        # A BLAS thread pool started in the zygote would not survive the fork into workers.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal has no name
        return f"signal {sig}"


def _describe_exit(status: int, limits: ReplLimits) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGSEGV:
            return (
                "the worker crashed with a segmentation fault (SIGSEGV), "
                "e.g. from ctypes or a C stack overflow"
            )
        if sig == signal.SIGXCPU:
            return f"the worker used up its CPU time limit of {limits.cpu_s} s (SIGXCPU)"
        if sig == signal.SIGKILL:
            return "the worker was killed (SIGKILL), e.g. out of memory or past its CPU hard limit"
        return f"the worker died from {_signal_name(sig)}"
    code = os.waitstatus_to_exitcode(status)
    return f"the worker exited with status {code} (os._exit or a fatal interpreter error)"


def _uid_block_start(zygote_pid: int, uid_map: str = "/proc/self/uid_map") -> int:
    """First uid of a zygote's block of _MAX_SLOTS worker uids (used as gids too).

    Far above real users (from 2**30) when the user namespace maps such uids, else in the upper
    half of its largest mapped range (a rootless container maps only a few); the block is
    picked by zygote pid so that concurrent zygotes rarely share one.
    """
    best_start, best_blocks = 0, 0
    with open(uid_map) as f:
        for line in f:
            inside, _, length = (int(x) for x in line.split())
            end = min(inside + length, (1 << 32) - 1)  # (uid_t)-1 is no uid
            start = max(inside, min(_UID_FLOOR, inside + (end - inside) // 2), 1)
            blocks = (end - start) // _MAX_SLOTS
            if blocks > best_blocks:
                best_start, best_blocks = start, blocks
    if best_blocks == 0:
        raise RuntimeError(f"{uid_map} maps no range of {_MAX_SLOTS} uids for REPL workers")
    return best_start + (zygote_pid % best_blocks) * _MAX_SLOTS


class Zygote:
    """One per task context: tools imported and context loaded once, then a fork per session."""

    def __init__(self, *, process: Child, limits: ReplLimits, root: TempRoot):
        self._process = process
        self.limits = limits
        self._root = root
        self.temp_root = root.path
        self._channel: ControlChannel | None = None
        self._booted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._spawns: dict[int, asyncio.Future] = {}
        self._by_pid: dict[int, Session] = {}
        self._free_slots = list(range(_MAX_SLOTS - 1, -1, -1))
        self._sessions: set[Session] = set()
        self._counter = itertools.count()
        self._uid_base = 0
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._cgroup: PoolCgroup | None = None

    @classmethod
    async def start(
        cls,
        *,
        context: Any,
        tool_modules: list[str],
        limits: ReplLimits | None = None,
        preload_modules: list[str] | None = None,
        temp_dir: str | None = None,
    ) -> Zygote:
        """Start a zygote. preload_modules defaults to DEFAULT_PRELOAD; temp_dir is where the
        zygote's temporary root goes (default: the system's)."""
        limits = limits or ReplLimits()
        if os.geteuid() != 0:
            log.warning(
                "REPL workers run as the trainer's uid (not root): no per-worker uid isolation"
            )
        root = await asyncio.to_thread(TempRoot.claim, temp_dir)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = Child.start(
                [
                    sys.executable,
                    "-I",
                    "-m",
                    "rlmtrain.rlm.worker",
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                # The root's lock goes with the zygote: held until both of us are gone.
                pass_fds=[theirs.fileno(), root.lock_fd],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=_worker_env(),
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            root.remove()
            raise
        finally:
            theirs.close()
        zygote = cls(process=process, limits=limits, root=root)
        try:
            zygote._channel = ControlChannel(ours, zygote._on_message, zygote._on_eof)
            await zygote._channel.send(
                Boot(
                    sys_path=[os.path.abspath(p) for p in sys.path],
                    preload_modules=list(
                        DEFAULT_PRELOAD if preload_modules is None else preload_modules
                    ),
                    tool_modules=list(tool_modules),
                    context=pickle.dumps(context, protocol=pickle.HIGHEST_PROTOCOL),
                    limits=limits.for_worker(),
                    temp_root=zygote.temp_root,
                )
            )
            booted = await zygote._booted
            zygote._uid_base = _uid_block_start(booted.pid)
            if limits.memory_cgroup:
                zygote._cgroup = PoolCgroup.create()
        except BaseException:
            if zygote._channel is None:  # the socket never reached a channel that closes it
                ours.close()
            await zygote.close()
            raise
        if booted.landlock_abi == 0:
            log.warning("no Landlock in this kernel: REPL workers can write wherever their uid may")
        return zygote

    # ---- control channel --------------------------------------------------------------------

    def _on_message(self, message: Any, fds: list[int]) -> None:
        if isinstance(message, (Booted, BootFailed)):
            if self._booted.done():
                return
            if isinstance(message, Booted):
                self._booted.set_result(message)
            else:
                self._booted.set_exception(
                    RuntimeError(f"REPL zygote failed to start: {message.error}")
                )
        elif isinstance(message, Spawned):
            pidfd = fds.pop(0)
            future = self._spawns.pop(message.slot, None)
            if future is None or future.done():
                os.close(pidfd)
            else:
                future.set_result((message.pid, pidfd))
        elif isinstance(message, SpawnFailed):
            future = self._spawns.pop(message.slot, None)
            if future is not None and not future.done():
                future.set_exception(
                    RuntimeError(f"REPL zygote could not fork a worker: {message.error}")
                )
        elif isinstance(message, Exited):
            # Dropped if the session is already released: a pid is reused only after the zygote
            # reaped it, and it reports that reap before any later Spawned.
            session = self._by_pid.pop(message.pid, None)
            if session is not None and not session._status.done():
                session._status.set_result(message.status)

    def _on_eof(self) -> None:
        error = RuntimeError("the REPL zygote exited")
        for future in [self._booted, *self._spawns.values()]:
            if not future.done():
                future.set_exception(error)
        self._spawns.clear()
        # Its workers die with it (PR_SET_PDEATHSIG); nobody is left to report how.
        for session in self._by_pid.values():
            if not session._status.done():
                session._status.set_result(None)
        self._by_pid.clear()

    # ---- sessions ---------------------------------------------------------------------------

    async def session(self, *, context: Any | None = None) -> Session:
        """Fork a jailed worker. context=None inherits the zygote's context (shared, not copied);
        a `msgspec.Raw` (a context as another worker encoded it) is decoded by the new worker
        once it is jailed; anything else is pickled here and loaded by the worker."""
        if self._closed or self._channel is None:
            raise RuntimeError("the REPL zygote is closed")
        if self._channel.closed:
            raise RuntimeError("the REPL zygote exited; start a new one")
        if not self._free_slots:
            raise RuntimeError(f"the REPL zygote already runs {_MAX_SLOTS} workers")
        slot = self._free_slots.pop()
        uid = self._uid_base + slot
        workdir = os.path.join(self.temp_root, f"w{next(self._counter)}")
        os.mkdir(workdir, 0o700)
        pidfd = -1
        cgroup: WorkerCgroup | None = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.geteuid() == 0:
                os.chown(workdir, uid, uid)
            spawn = Spawn(slot=slot, uid=uid, gid=uid, workdir=workdir)
            if self._cgroup is not None:
                try:
                    cgroup = self._cgroup.worker(slot, self.limits.memory_mb << 20)
                except OSError as exc:
                    raise RuntimeError(f"REPL worker's memory cgroup was refused: {exc}") from None
                spawn.cgroup_procs = cgroup.procs
            spawned = self._spawns[slot] = asyncio.get_running_loop().create_future()
            if isinstance(context, msgspec.Raw):
                spawn.context_msgpack = bytes(context)
            elif context is not None:
                spawn.context = pickle.dumps(context, protocol=pickle.HIGHEST_PROTOCOL)
            await self._channel.send(spawn, theirs.fileno())
            theirs.close()
            pid, pidfd = await spawned
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            session = Session(
                zygote=self,
                slot=slot,
                pid=pid,
                pidfd=pidfd,
                workdir=workdir,
                reader=reader,
                writer=writer,
                cgroup=cgroup,
            )
        except BaseException:
            theirs.close()
            ours.close()
            if pidfd >= 0:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
            remove_tree(workdir)  # still empty: no worker ran in it
            if cgroup is not None:
                cgroup.remove()  # busy while the killed worker exits: then the pool's close
            self._free_slots.append(slot)
            raise
        self._sessions.add(session)
        self._by_pid[pid] = session
        try:
            await session._await_ready()
        except BaseException:
            await session.close()
            raise
        return session

    def live_workers(self) -> int:
        return sum(1 for s in self._sessions if not s._gone.done())

    def _release(self, session: Session) -> None:
        self._sessions.discard(session)
        if self._by_pid.get(session.pid) is session:
            del self._by_pid[session.pid]
        self._free_slots.append(session._slot)

    async def close(self) -> None:
        """Kill the zygote and every live worker, and remove their directories; idempotent.
        The cleanup runs to its end even if the caller is cancelled meanwhile."""
        self._closed = True
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        # Each step runs whatever the one before it met: a zygote left running or a directory
        # left behind would outlive the rollout that tried to close them.
        for session in list(self._sessions):
            try:
                await session.close()
            except Exception:
                log.exception("closing REPL worker %d failed; it is killed anyway", session.pid)
        if self._channel is not None and not self._channel.closed:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._channel.send(Shutdown())
        try:
            async with asyncio.timeout(5.0):
                await self._process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()
        if self._channel is not None:
            self._channel.close()
        problems = await asyncio.to_thread(self._root.remove)
        if problems:
            log.warning("could not remove all of %s: %s", self.temp_root, "; ".join(problems))
        if self._cgroup is not None:
            self._cgroup.remove()


async def _remove_directory(path: str) -> None:
    """Off the event loop: a worker can leave many thousands of files."""
    problems = await asyncio.to_thread(remove_tree, path)
    if problems:
        log.warning("could not remove all of %s: %s", path, "; ".join(problems))


class Session:
    """One jailed worker; its globals persist across execs. Execs run one at a time."""

    def __init__(
        self,
        *,
        zygote: Zygote,
        slot: int,
        pid: int,
        pidfd: int,
        workdir: str,
        reader,
        writer,
        cgroup: WorkerCgroup | None = None,
    ):
        self._zygote = zygote
        self._cgroup = cgroup
        self._limits = zygote.limits
        self._slot = slot
        self.pid = pid
        self._pidfd = pidfd
        self.workdir = workdir
        self._reader: asyncio.StreamReader = reader
        self._writer: asyncio.StreamWriter = writer
        self._lock = asyncio.Lock()
        self._exec_ids = itertools.count(1)
        self._death: str | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        self._status: asyncio.Future[int | None] = loop.create_future()
        """The worker's wait status once the zygote reaped it; None if the zygote died first."""
        self._gone: asyncio.Future[None] = loop.create_future()
        """Done once the worker process has exited: its pidfd turns readable."""
        loop.add_reader(pidfd, self._on_exit)
        self._watchdog = loop.create_task(self._watch_disk())

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        if not self._gone.done():
            self._gone.set_result(None)

    @property
    def dead(self) -> bool:
        return self._death is not None

    async def _read_frame(self):
        try:
            header = await self._reader.readexactly(HEADER.size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise _WorkerGone from exc
        (size,) = HEADER.unpack(header)
        if size > self._limits.max_frame_bytes:
            raise _ProtocolViolation(
                f"a {size}-byte frame, over the {self._limits.max_frame_bytes}-byte cap"
            )
        try:
            body = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise _WorkerGone from exc
        try:
            return _worker_decoder.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError too: e.g. over a length cap
            raise _ProtocolViolation(f"a malformed frame ({exc})") from None
        except RecursionError:
            raise _ProtocolViolation("a frame nested too deeply to decode") from None

    # Every wait on a worker here is bounded by asyncio.timeout, never asyncio.wait_for: on
    # Python 3.11 wait_for loses a cancellation that arrives in the loop step where the awaited
    # frame does (CPython gh-86296, fixed in 3.12), and a cancelled rollout's exec then ran on to
    # its full timeout (tests/test_scheduler.py, the cancel that meets a worker's frame).
    async def _read_frame_within(self, timeout_s: float):
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await self._read_frame()
        except TimeoutError:
            raise _OutOfTime from None

    async def _send(self, message: msgspec.Struct, timeout_s: float) -> None:
        """Raises _OutOfTime if the worker does not take the frame within `timeout_s`."""
        try:
            self._writer.write(encode_frame(message))
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._writer.drain()
        except TimeoutError:
            raise _OutOfTime from None
        except (ConnectionError, RuntimeError) as exc:
            raise _WorkerGone from exc

    async def _await_ready(self) -> None:
        try:
            async with asyncio.timeout(_READY_TIMEOUT_S):
                message = await self._read_frame()
        except _WorkerGone:
            raise RuntimeError(
                f"REPL worker failed to start: {await self._explain_death()}"
            ) from None
        except (_ProtocolViolation, TimeoutError) as exc:
            raise RuntimeError(f"REPL worker failed to start: {exc!r}") from None
        if not isinstance(message, Ready):
            raise RuntimeError(f"REPL worker failed to start: sent {type(message).__name__} first")
        if message.error:
            raise RuntimeError(f"REPL worker failed to start: {message.error}")

    async def _kill(self, reason: str) -> None:
        if self._death is None:
            self._death = reason
        if not self._gone.done():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        await asyncio.shield(self._gone)

    async def _explain_death(self) -> str:
        """The worker's socket closed: wait briefly for its exit (a worker that closed its
        socket and lives on is killed) and say why it died."""
        try:
            async with asyncio.timeout(_EOF_GRACE_S):
                await asyncio.shield(self._gone)
        except TimeoutError:
            await self._kill(
                "REPL worker closed its channel to the trainer and kept running; "
                "it was killed and this session is over."
            )
        if self._death is None:
            try:
                async with asyncio.timeout(_EXIT_REPORT_TIMEOUT_S):
                    status = await asyncio.shield(self._status)
            except TimeoutError:
                reason = "the worker is gone (the zygote did not report how)"
            else:
                if status is None:
                    reason = "the REPL zygote died and took the worker with it"
                elif self._cgroup is not None and self._cgroup.oom_killed():
                    reason = (
                        f"the worker went over its memory limit of {self._limits.memory_mb} MiB "
                        "(its memory cgroup's OOM killer ended it)"
                    )
                else:
                    reason = _describe_exit(status, self._limits)
            if self._death is None:
                self._death = f"REPL worker died: {reason}; this session is over."
        return self._death

    def _dead_result(self) -> ExecResult:
        return ExecResult(output="", error=self._death or "", final=None, dead=True)

    async def exec(self, code: str, on_query: QueryHandler | None = None) -> ExecResult:
        """Run code in the worker. Returns dead=True (with the reason in error) if the worker is
        or becomes unusable; raises only if on_query misbehaves. If the exec is cancelled or
        on_query raises, the worker is killed (after on_query was cancelled and has unwound)."""
        async with self._lock:
            if self._closed:
                return ExecResult(
                    output="", error="this REPL session is closed", final=None, dead=True
                )
            if self._death is not None:
                return self._dead_result()
            exec_id = next(self._exec_ids)
            prompts_left = self._limits.max_query_prompts_per_exec
            loop = asyncio.get_running_loop()
            # Moved later by the time on_query takes: that time is not the worker's.
            deadline = loop.time() + self._limits.exec_timeout_s
            try:
                await self._send(Exec(id=exec_id, code=code), deadline - loop.time())
                while True:
                    message = await self._read_frame_within(deadline - loop.time())
                    if isinstance(message, Done) and message.id == exec_id:
                        if await self._over_disk():
                            return self._dead_result()
                        return ExecResult(
                            output=clip_text(message.output, self._limits.output_limit_chars + 100),
                            error=clip_text(message.error, self._limits.output_limit_chars + 100),
                            final=message.final,
                            dead=False,
                        )
                    if (
                        isinstance(message, Query)
                        and message.id == exec_id
                        and len(message.contexts) == len(message.prompts)
                    ):
                        prompts_left -= max(len(message.prompts), 1)
                        if prompts_left >= 0:
                            paused = loop.time()
                            answers = await self._answer_while_alive(message, on_query)
                            deadline += loop.time() - paused
                        else:
                            answers = [self._over_query_budget] * len(message.prompts)
                            await asyncio.sleep(0)  # a query loop must not hold the event loop
                        await self._send(
                            Answers(id=exec_id, answers=answers), deadline - loop.time()
                        )
                        continue
                    raise _ProtocolViolation(f"an unexpected {type(message).__name__} frame")
            except _OutOfTime:
                await self._kill(
                    f"exec timed out after {self._limits.exec_timeout_s:g} s of run time "
                    "(time waiting for rlm_query not counted); "
                    "the worker was killed and this session is over."
                )
                return self._dead_result()
            except _ProtocolViolation as exc:
                await self._kill(
                    f"REPL worker broke the protocol ({exc}); "
                    "it was killed and this session is over."
                )
                return self._dead_result()
            except _WorkerGone:
                await self._explain_death()
                return self._dead_result()
            except BaseException:
                await self._kill("the exec was abandoned by the trainer")
                raise

    async def _watch_disk(self) -> None:
        while not self._gone.done():
            await asyncio.sleep(_DISK_POLL_S)
            if self._gone.done() or await self._over_disk():
                return

    async def _over_disk(self) -> bool:
        """Measure the session's directory; past a limit, kill the worker and say so."""
        limits = self._limits
        cap_bytes = limits.disk_mb << 20
        used = await asyncio.to_thread(
            disk_usage, self.workdir, stop_bytes=cap_bytes, stop_entries=limits.disk_entries
        )
        held = used.bytes + await asyncio.to_thread(unlinked_open_bytes, self.pid)
        if held <= cap_bytes and used.entries <= limits.disk_entries and not used.hidden:
            return False
        await self._kill(
            f"the session holds over {limits.disk_mb} MiB on disk (its directory and files it "
            f"unlinked but keeps open) or {limits.disk_entries} files and directories, or hides "
            "part of its directory from being measured (its disk limit); the worker was killed "
            "and this session is over."
        )
        return True

    @property
    def _over_query_budget(self) -> str:
        limit = self._limits.max_query_prompts_per_exec
        return f"[rlm_query not run: this exec has used all {limit} of its sub-query prompts]"

    async def _answer_while_alive(self, query: Query, on_query: QueryHandler | None) -> list[str]:
        """Run the handler; if the worker dies meanwhile (e.g. the session is closed while its
        children run), the handler is cancelled: nobody is left to read its answers."""
        answering = asyncio.ensure_future(self._answer(query, on_query))
        try:
            await asyncio.wait({answering, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled: the handler's children are cleaned up before the exec gives up.
            answering.cancel()
            await asyncio.wait({answering})
            raise
        if not answering.done():
            answering.cancel()
            await asyncio.wait({answering})
            raise _WorkerGone
        return answering.result()

    async def _answer(self, query: Query, on_query: QueryHandler | None) -> list[str]:
        if on_query is None:
            return ["rlm_query is not available in this session"] * len(query.prompts)
        contexts = [None if c == _NIL else c.copy() for c in query.contexts]
        answers = await on_query(list(query.prompts), contexts)
        if (
            not isinstance(answers, list)
            or len(answers) != len(query.prompts)
            or not all(isinstance(a, str) for a in answers)
        ):
            raise TypeError(
                f"QueryHandler must return a list of {len(query.prompts)} str answers, "
                f"got {answers!r:.200}"
            )
        return answers

    async def close(self) -> None:
        """Kill the worker and remove its directory; idempotent. The cleanup runs to its end
        even if the caller is cancelled meanwhile."""
        self._closed = True
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        # Kill first: an exec in progress then sees its worker gone and returns.
        await self._kill("this REPL session is closed")
        self._watchdog.cancel()
        await asyncio.wait({self._watchdog})
        if not self._watchdog.cancelled() and self._watchdog.exception() is not None:
            log.warning(
                "disk watchdog of REPL worker %d failed: %r", self.pid, self._watchdog.exception()
            )
        async with self._lock:
            pass
        # Until the zygote has reaped it, the worker still counts against its uid's thread limit.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_EXIT_REPORT_TIMEOUT_S):
                await asyncio.shield(self._status)
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()
        os.close(self._pidfd)
        await _remove_directory(self.workdir)
        if self._cgroup is not None:
            self._cgroup.remove()
        self._zygote._release(self)
