"""The trainer's end of a zygote's control socket, read by an asyncio loop reader.

The zygote answers `Spawn` with `Spawned` and a pidfd for the new worker passed as SCM_RIGHTS,
which asyncio's streams cannot carry; so this reads the socket with `recvmsg` from a loop reader
(no thread), splits frames, collects descriptors in arrival order (a `Spawned` frame takes the
next one) and hands each decoded message to a callback. Sending a frame with a descriptor
attaches it to the frame's first bytes.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import msgspec

from rlmtrain.rlm.protocol import (
    HEADER,
    Booted,
    BootFailed,
    Exited,
    Spawned,
    SpawnFailed,
    encode_frame,
)

__all__ = ["ControlChannel"]

log = logging.getLogger("rlmtrain")

_zygote_decoder = msgspec.msgpack.Decoder(Booted | BootFailed | Spawned | SpawnFailed | Exited)


class ControlChannel:
    """The trainer's end of the zygote's control socket, read by an event-loop reader."""

    def __init__(
        self,
        sock: socket.socket,
        on_message: Callable[[Any, list[int]], None],
        on_eof: Callable[[], None],
    ):
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.on_message = on_message
        self.on_eof = on_eof
        self.buffer = bytearray()
        self.fds: list[int] = []
        self.send_lock = asyncio.Lock()
        self.closed = False
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data, ancdata, _, _ = self.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(4 * array.array("i").itemsize)
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancdata = b"", []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self.fds.extend(fds)
        if not data:
            self.close()
            self.on_eof()
            return
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buffer)
            if len(self.buffer) < HEADER.size + size:
                break
            try:
                message = _zygote_decoder.decode(self.buffer[HEADER.size : HEADER.size + size])
            except msgspec.DecodeError:
                log.error("the REPL zygote sent a malformed frame; dropping it")
                self.close()
                self.on_eof()
                return
            del self.buffer[: HEADER.size + size]
            self.on_message(message, self.fds)

    async def send(self, message: msgspec.Struct, fd: int | None = None) -> None:
        frame = encode_frame(message)
        async with self.send_lock:
            if self.closed:
                raise RuntimeError("the REPL zygote exited")
            if fd is not None:
                while True:
                    try:
                        sent = socket.send_fds(self.sock, [frame[: HEADER.size]], [fd])
                        break
                    except BlockingIOError:
                        writable = self.loop.create_future()
                        self.loop.add_writer(self.sock.fileno(), writable.set_result, None)
                        try:
                            await writable
                        finally:
                            self.loop.remove_writer(self.sock.fileno())
                frame = frame[sent:]
            await self.loop.sock_sendall(self.sock, frame)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
