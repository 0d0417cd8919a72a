"""Wire messages between the trainer, the zygote and the REPL workers.

Every message is one frame: a 4-byte big-endian length, then a msgpack body encoding one of the
tagged Structs below. Both directions are typed: the trainer decodes what a worker sends with a
decoder that accepts only `WorkerMessage` and refuses frames over its size cap, so a worker that
writes garbage (or something well-formed but out of turn) is a protocol violation and gets
killed, never believed. The trainer <-> zygote channel carries pickled contexts: that direction is
trusted (the trainer made them); nothing a worker sends is ever unpickled.

The contexts of a worker's `Query` are arbitrary nested data, and nesting multiplies what a frame
decodes to (a 1 MB frame of empty lists is some 60 MiB of Python objects). The trainer keeps each
one as the worker encoded it (`msgspec.Raw`) and hands those bytes on: the child's own worker
decodes them once it is jailed (`Spawn.context_msgpack`), under its own memory limits.
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated

import msgspec

__all__ = [
    "HEADER",
    "MAX_PROMPTS_PER_QUERY",
    "Answers",
    "Boot",
    "Booted",
    "BootFailed",
    "Done",
    "Exec",
    "Exited",
    "Query",
    "Ready",
    "Shutdown",
    "Spawn",
    "SpawnFailed",
    "Spawned",
    "WorkerLimits",
    "encode_frame",
    "recv_frame",
    "send_frame",
]

HEADER = struct.Struct(">I")

MAX_PROMPTS_PER_QUERY = 1024
"""Prompts in one `rlm_query_batched` call. The builtin refuses more with a ValueError; a frame
with more is forged, and the trainer's decoder refuses it by its length header, before it has
built a single prompt (a 64 MiB frame could otherwise hold ~33M empty prompts)."""


class WorkerLimits(msgspec.Struct, kw_only=True, frozen=True):
    """What the jail enforces on a worker (see `rlmtrain._jail.enter`)."""

    address_space: int
    cpu_seconds: int
    open_files: int
    file_size: int
    threads: int
    output_limit_chars: int
    max_frame_bytes: int


# ---- trainer -> zygote ------------------------------------------------------------------------


class Boot(msgspec.Struct, tag=True, kw_only=True):
    sys_path: list[str]
    preload_modules: list[str]
    tool_modules: list[str]
    context: bytes
    """The pickled context, loaded once in the zygote and shared copy-on-write by its workers."""
    limits: WorkerLimits
    temp_root: str
    """The directory holding the workers' directories: the zygote removes it if the trainer
    dies without closing it."""


class Spawn(msgspec.Struct, tag=True, kw_only=True):
    """Fork a worker; the worker's end of its socketpair travels with this frame (SCM_RIGHTS)."""

    slot: int
    uid: int
    gid: int
    workdir: str
    context: bytes | None = None
    """A pickled context replacing the zygote's for this worker only; None = inherit."""
    context_msgpack: bytes | None = None
    """A context as another worker encoded it (msgpack), replacing the zygote's for this worker
    only; decoded by the worker after it is jailed, never by the trainer or the zygote."""
    cgroup_procs: str = ""
    """The `cgroup.procs` file of the worker's memory cgroup (`rlm/memcg.py`), which the worker
    writes itself into before anything else; "" = none."""


class Shutdown(msgspec.Struct, tag=True):
    pass


# ---- zygote -> trainer ------------------------------------------------------------------------


class Booted(msgspec.Struct, tag=True, kw_only=True):
    pid: int
    landlock_abi: int


class BootFailed(msgspec.Struct, tag=True, kw_only=True):
    error: str


class Spawned(msgspec.Struct, tag=True, kw_only=True):
    """A worker was forked; a pidfd for it travels with this frame."""

    slot: int
    pid: int


class SpawnFailed(msgspec.Struct, tag=True, kw_only=True):
    slot: int
    error: str


class Exited(msgspec.Struct, tag=True, kw_only=True):
    """A worker was reaped; status is the raw wait status."""

    pid: int
    status: int


# ---- trainer -> worker ------------------------------------------------------------------------


class Exec(msgspec.Struct, tag=True, kw_only=True):
    id: int
    code: str


class Answers(msgspec.Struct, tag=True, kw_only=True):
    id: int
    answers: list[str]


# ---- worker -> trainer ------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, kw_only=True):
    """The worker is jailed and waiting for code; error is set if jailing failed (it then exits)."""

    error: str = ""


class Query(msgspec.Struct, tag=True, kw_only=True):
    id: int
    prompts: Annotated[list[str], msgspec.Meta(max_length=MAX_PROMPTS_PER_QUERY)]
    contexts: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_PROMPTS_PER_QUERY)]
    """One per prompt, left encoded (module docstring); msgpack nil = the parent's context.
    The worker builds a Query from the objects themselves."""


class Done(msgspec.Struct, tag=True, kw_only=True):
    id: int
    output: str
    error: str
    final: str | None


_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, message: msgspec.Struct, fds: list[int] | None = None) -> None:
    """Blocking send of one frame, with file descriptors attached to its first byte if given."""
    frame = encode_frame(message)
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    sock.sendall(frame)


def _recv_exactly(sock: socket.socket, n: int, fds: list[int] | None) -> bytearray | None:
    """n bytes into one preallocated buffer (a 100 MB context is received without copies)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if fds is not None and got == 0:
            chunk, received, _, _ = socket.recv_fds(sock, n, 4)
            fds.extend(received)
            view[: len(chunk)] = chunk
            count = len(chunk)
        else:
            count = sock.recv_into(view[got:])
        if count == 0:
            return None
        got += count
    return buf


def recv_frame(
    sock: socket.socket,
    decoder: msgspec.msgpack.Decoder,
    max_bytes: int,
    fds: list[int] | None = None,
):
    """Blocking receive of one frame; None at end of stream. Passing a list collects any file
    descriptors sent with the frame. Raises ValueError for an oversized or malformed frame."""
    header = _recv_exactly(sock, HEADER.size, fds)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > max_bytes:
        raise ValueError(f"frame of {size} bytes exceeds the {max_bytes}-byte cap")
    body = _recv_exactly(sock, size, None)
    if body is None:
        raise ValueError("stream ended inside a frame")
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed frame: {exc}") from None
