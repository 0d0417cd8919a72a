"""The zygote and the REPL worker: the process side of `rlmtrain.rlm.repl`.

`python -m rlmtrain.rlm.worker CONTROL_FD TRAINER_PID` is the zygote. It starts as a fresh
interpreter (never a fork of the multithreaded trainer), receives `Boot` on its control socket,
imports the preload and tool modules, unpickles the context, freezes the GC (so that collections
in the workers do not touch, and thereby copy, the zygote's objects) and then forks one worker
per `Spawn`. A fork shares the zygote's pages copy-on-write: a 100 MB context costs a worker
nothing until it writes to it. The zygote reaps its children and reports each exit status, and
when the trainer dies (PR_SET_PDEATHSIG delivers SIGTERM) or leaves without a Shutdown, it kills
its workers and removes the temporary root of their directories before it exits.

A worker, right after fork: joins its own process group, keeps only its socket to the trainer
(stdin/stdout/stderr become /dev/null), enters its working directory and the jail
(`rlmtrain._jail.enter`), says `Ready`, then serves `Exec` frames until its socket closes.
Model code runs on the worker's main thread with globals that persist across execs.
`SystemExit` and `KeyboardInterrupt` raised by model code are reported as errors and the
session continues; `os._exit` or a crash ends the worker and the trainer reports it dead.

After the jail a worker reads only beneath `readable_paths()` (Landlock) and only what its uid
may read: the interpreter may live in a directory that uid cannot enter (e.g. /root/.pyenv), so
modules that model code should be able to import are preloaded in the zygote.
"""

from __future__ import annotations

import ast
import builtins
import gc
import importlib
import linecache
import os
import pickle
import selectors
import signal
import socket
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

from rlmtrain import _jail
from rlmtrain.rlm import builtins as rlm_builtins
from rlmtrain.rlm.builtins import FinalAnswer, OutputCapture, Toolbox, clip_text
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
    recv_frame,
    send_frame,
)
from rlmtrain.rlm.teardown import remove_tree
from rlmtrain.rlm.tools import load_tools

__all__ = ["main", "readable_paths"]

_WORKER_FD = 3
_EXIT_PROTOCOL = 3
_RUNTIME_FILES = frozenset({rlm_builtins.__file__, __file__})
_TRUSTED_FRAME_BYTES = 1 << 40
_zygote_decoder = msgspec.msgpack.Decoder(Boot | Spawn | Shutdown)
_worker_decoder = msgspec.msgpack.Decoder(Exec | Answers)


_SYSTEM_READABLE = [
    *("/dev/null", "/dev/zero", "/dev/urandom", "/etc/localtime", "/etc/ld.so.cache"),
    *("/usr/share/zoneinfo", "/usr/lib", "/usr/lib64", "/lib", "/lib64"),
]


def readable_paths(module_names: list[str]) -> list[str]:
    """What a worker may read: the Python installation (stdlib, site-packages), the files of
    the loaded tool and preload packages, shared libraries and time zones. Not the trainer's
    working directory, datasets or checkpoints."""
    paths = list(_SYSTEM_READABLE)
    bases = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    for config_vars in (None, bases):
        installed = sysconfig.get_paths(vars=config_vars)
        paths += [installed[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    for name in module_names:
        top = sys.modules.get(name.partition(".")[0])
        package_dirs = getattr(top, "__path__", None)
        # Built-in modules have neither; a plain module grants its own file, not its directory.
        paths += list(package_dirs) if package_dirs else [getattr(top, "__file__", None)]
    unique = sorted({os.path.abspath(p) for p in paths if p})
    # One rule covers everything beneath it: drop paths inside another listed one.
    return [p for p in unique if not any(p.startswith(q + os.sep) for q in unique)]


# ---- worker ----------------------------------------------------------------------------------


class _Channel:
    """The worker's end of its socket: Exec in, Query/Answers round trips, Done out."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int):
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.exec_id = 0

    def send(self, message: msgspec.Struct) -> None:
        send_frame(self.sock, message)

    def receive(self):
        return recv_frame(self.sock, _worker_decoder, _TRUSTED_FRAME_BYTES)

    def ask(self, prompts: list[str], contexts: list[Any]) -> list[str]:
        query = Query(id=self.exec_id, prompts=prompts, contexts=contexts)
        try:
            body = msgspec.msgpack.encode(query)
        except TypeError as exc:
            raise TypeError(
                f"rlm_query: contexts must be plain data (str, numbers, lists, dicts): {exc}"
            ) from None
        except UnicodeEncodeError as exc:
            raise ValueError(f"rlm_query: prompts and contexts must be valid text: {exc}") from None
        if len(body) > self.max_frame_bytes:
            raise ValueError(
                f"rlm_query: prompts and contexts take {len(body)} bytes, "
                f"over the {self.max_frame_bytes}-byte limit"
            )
        self.sock.sendall(HEADER.pack(len(body)) + body)
        reply = self.receive()
        if (
            not isinstance(reply, Answers)
            or reply.id != self.exec_id
            or len(reply.answers) != len(prompts)
        ):
            os._exit(_EXIT_PROTOCOL)
        return reply.answers


def _split_last_expression(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    """A REPL shows the value of a trailing expression; split it off to evaluate separately."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body.pop()
        return tree, ast.Expression(last.value)
    return tree, None


def _format_error(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return (
            f"SystemExit({exc.code!r}) was raised; the REPL cannot be exited and keeps its state."
        )
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt was raised; the REPL keeps its state."
    if isinstance(exc, SyntaxError):
        # Raised by the parser: its frames are ours, not the model's.
        return "".join(traceback.format_exception_only(type(exc), exc))
    # Drop the frames of this runtime (the exec call, the builtins), so the traceback shows the
    # model's code, its tools and the message.
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename not in _RUNTIME_FILES]
    )
    return "".join(report.format())


def _wire_safe(text: str) -> str:
    """msgpack strings are UTF-8, which a lone surrogate (chr(0xD800), surrogateescape) is not;
    escape those rather than fail to report the exec."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _refuse_system(command: str) -> int:
    # libc's system() fails quietly (status 127) once the jail refuses the fork; say why.
    raise PermissionError(f"os.system({command!r}): the REPL cannot start processes")


class _Worker:
    def __init__(
        self, channel: _Channel, tools: dict[str, Callable], context: Any, limits: WorkerLimits
    ):
        self.channel = channel
        self.limits = limits
        self.globals: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.toolbox = Toolbox(
            tools=tools, context=context, ask=channel.ask, model_globals=self.globals
        )
        self.builtins_snapshot = dict(vars(builtins))
        self.real_streams = (sys.stdout, sys.stderr)

    def restore_builtins(self) -> None:
        current = vars(builtins)
        for name in [n for n in current if n not in self.builtins_snapshot]:
            del current[name]
        for name, value in self.builtins_snapshot.items():
            if current.get(name) is not value:
                current[name] = value
        self.globals["__builtins__"] = builtins

    def run(self, request: Exec) -> Done:
        self.channel.exec_id = request.id
        self.restore_builtins()
        self.toolbox.begin_exec()
        capture = OutputCapture(self.limits.output_limit_chars)
        sys.stdout = sys.stderr = capture
        error = ""
        try:
            filename = f"<repl-{request.id}>"
            linecache.cache[filename] = (
                len(request.code),
                None,
                request.code.splitlines(True),
                filename,
            )
            body, last = _split_last_expression(ast.parse(request.code, filename))
            exec(compile(body, filename, "exec"), self.globals)
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.globals)
                if value is not None:
                    print(repr(value))
        except FinalAnswer:
            pass
        except BaseException as exc:  # the model's error, whatever it is, goes back as text
            error = _format_error(exc)
        finally:
            sys.stdout, sys.stderr = self.real_streams
            # The worker's own code below needs the real builtins too.
            self.restore_builtins()
        self.toolbox.end_exec()
        final = self.toolbox.final
        # Four bytes per char at most in UTF-8, and room left for the rest of the frame.
        final_limit = self.limits.max_frame_bytes // 8
        if final is not None and len(final) > final_limit:
            error = (
                f"FINAL: the answer has {len(final)} characters, "
                f"over the limit of {final_limit}; give a shorter one."
            )
            final = None
        return Done(
            id=request.id,
            output=_wire_safe(capture.getvalue()),
            error=_wire_safe(clip_text(error, self.limits.output_limit_chars)),
            final=None if final is None else _wire_safe(final),
        )

    def serve(self) -> None:
        while True:
            request = self.channel.receive()
            if request is None:
                return
            if not isinstance(request, Exec):
                os._exit(_EXIT_PROTOCOL)
            try:
                done = self.run(request)
            except MemoryError:
                done = Done(id=request.id, output="", error="MemoryError", final=None)
            self.channel.send(done)


def _worker_main(
    sock: socket.socket,
    spawn: Spawn,
    zygote_pid: int,
    tools: dict[str, Callable],
    context: Any,
    limits: WorkerLimits,
    readable: list[str],
) -> None:
    """Runs in the forked child; never returns."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)
        os.dup2(sock.detach(), _WORKER_FD)
        os.closerange(_WORKER_FD + 1, os.sysconf("SC_OPEN_MAX"))
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        channel = _Channel(socket.socket(fileno=_WORKER_FD), limits.max_frame_bytes)
        try:
            if spawn.cgroup_procs:
                # First: whatever this worker allocates from here on is charged to its cgroup.
                with open(spawn.cgroup_procs, "w") as procs:
                    procs.write("0")
            if spawn.context is not None:
                context = pickle.loads(spawn.context)
            os.chdir(spawn.workdir)
            _jail.enter(
                uid=spawn.uid,
                gid=spawn.gid,
                parent_pid=zygote_pid,
                address_space=limits.address_space,
                cpu_seconds=limits.cpu_seconds,
                open_files=limits.open_files,
                file_size=limits.file_size,
                threads=limits.threads,
                readable=readable,
            )
        except Exception as exc:
            channel.send(Ready(error=f"{type(exc).__name__}: {exc}"))
            return
        if spawn.context_msgpack is not None:
            # Jailed first: what this context decodes to counts against this worker's limits.
            try:
                context = msgspec.msgpack.decode(spawn.context_msgpack)
            except (msgspec.DecodeError, MemoryError, RecursionError) as exc:
                channel.send(Ready(error=f"its context could not be decoded: {exc!r:.200}"))
                return
            spawn.context_msgpack = None
        os.system = _refuse_system
        worker = _Worker(channel, tools, context, limits)
        channel.send(Ready())
        worker.serve()
        status = 0
    finally:
        os._exit(status)


# ---- zygote ----------------------------------------------------------------------------------


class _Zygote:
    def __init__(
        self, control: socket.socket, boot: Boot, tools: dict[str, Callable], context: Any
    ):
        self.control = control
        self.boot = boot
        self.tools = tools
        self.context = context
        self.readable = readable_paths([*boot.preload_modules, *boot.tool_modules])
        self.children: set[int] = set()

    def spawn(self, spawn: Spawn, fds: list[int]) -> None:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            send_frame(
                self.control,
                SpawnFailed(slot=spawn.slot, error=f"expected 1 socket, got {len(fds)}"),
            )
            return
        worker_sock = socket.socket(fileno=fds[0])
        pid = os.fork()
        if pid == 0:
            self.control.close()
            _worker_main(
                worker_sock,
                spawn,
                os.getppid(),
                self.tools,
                self.context,
                self.boot.limits,
                self.readable,
            )
        worker_sock.close()
        self.children.add(pid)
        pidfd = os.pidfd_open(pid)
        try:
            send_frame(self.control, Spawned(slot=spawn.slot, pid=pid), fds=[pidfd])
        finally:
            os.close(pidfd)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            send_frame(self.control, Exited(pid=pid, status=status))

    def kill_all(self) -> None:
        for pid in self.children:
            os.kill(pid, signal.SIGKILL)
        for pid in self.children:
            os.waitpid(pid, 0)
        self.children.clear()

    def serve(self) -> None:
        """Spawn workers until Shutdown. If the trainer is gone instead (its death signal, or
        the control socket closed without Shutdown), the zygote also removes the temporary
        root: nobody else is left to."""
        orphaned = True
        try:
            orphaned = self._serve()
        finally:
            self.kill_all()
            if orphaned:
                remove_tree(self.boot.temp_root)

    def _serve(self) -> bool:
        """True when the trainer left without saying Shutdown."""
        wakeup_r, wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        selector = selectors.DefaultSelector()
        selector.register(self.control, selectors.EVENT_READ)
        selector.register(wakeup_r, selectors.EVENT_READ)
        while not _trainer_left.is_set():
            for key, _ in selector.select():
                if key.fileobj == wakeup_r:
                    while os.read(wakeup_r, 512) == 512:
                        pass
                    self.reap()
                    continue
                fds: list[int] = []
                message = recv_frame(self.control, _zygote_decoder, _TRUSTED_FRAME_BYTES, fds)
                if message is None:
                    return True
                if isinstance(message, Shutdown):
                    return False
                if isinstance(message, Spawn):
                    self.spawn(message, fds)
        return True


_trainer_left = threading.Event()
"""Set by the zygote's death signal: the trainer thread that started it has exited. A flag, not
an exception: the signal and the control socket's end come in either order, and the second
must not cut short the cleanup the first started."""


def _trainer_gone(signum: int, frame: Any) -> None:
    _trainer_left.set()


def main(argv: list[str]) -> int:
    control_fd, trainer_pid = int(argv[0]), int(argv[1])
    # SIGTERM, caught: the zygote outlives the trainer just long enough to clean up after it.
    signal.signal(signal.SIGTERM, _trainer_gone)
    _jail.set_parent_death_signal(signal.SIGTERM, trainer_pid)
    control = socket.socket(fileno=control_fd)
    boot = recv_frame(control, _zygote_decoder, _TRUSTED_FRAME_BYTES)
    if not isinstance(boot, Boot):
        return 2
    try:
        sys.path[:] = boot.sys_path
        for module_name in boot.preload_modules:
            importlib.import_module(module_name)
        tools = load_tools(boot.tool_modules)
        context = pickle.loads(boot.context)
        boot.context = b""  # the pickle is not needed once loaded; don't fork it into workers
    except Exception as exc:
        send_frame(control, BootFailed(error=f"{type(exc).__name__}: {exc}"))
        return 1
    gc.collect()
    gc.freeze()
    send_frame(control, Booted(pid=os.getpid(), landlock_abi=_jail.landlock_abi()))
    _Zygote(control, boot, tools, context).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
