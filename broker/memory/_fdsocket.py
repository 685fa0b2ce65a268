"""The fd socket: engines upload buffer file descriptors here (SCM_RIGHTS).

A unix ``SOCK_SEQPACKET`` socket beside the gRPC server, created with
owner/group-only permissions (0660). One connection (:class:`FdConnection`)
serves one engine rank for as long as it lives:

1. the engine sends one ``FdUpload`` datagram with its buffers' fds attached;
2. the broker answers ``FdUploadReply`` with the connection's token (the
   ``session_token`` field on the wire);
3. the engine calls ``RegisterEngine`` with that token, which claims the fds;
4. the engine keeps the connection open while it lives. When it closes
   (clean exit or a killed process: the kernel closes it either way), the
   broker drops the connection: unclaimed fds are closed and a registered
   engine is unregistered (``on_close``).

(Not to be confused with the engine's session stream, ``TransferBroker.Session``,
which carries its room commands over gRPC.)

Everything runs on the broker's event loop (``add_reader``); nothing blocks.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from kvbroker.v1 import common_pb2, fdsocket_pb2

__all__ = ["MAX_FDS_PER_UPLOAD", "FdConnection", "FdSocketServer"]

#: More fds than this in one upload is refused.
MAX_FDS_PER_UPLOAD = 256
_MAX_DATAGRAM = 1 << 20

log = structlog.get_logger(__name__)


@dataclass
class FdConnection:
    """One engine's connection to the fd socket, once it uploaded its fds."""

    token: str
    pid: int
    uid: int
    specs: list[common_pb2.BufferSpec] = field(default_factory=list)
    #: Uploaded fds not yet claimed by RegisterEngine (closed if never claimed),
    #: one per buffer in ``specs`` order; -1 for a buffer without one (CUDA IPC).
    fds: list[int] = field(default_factory=list)
    #: Set once RegisterEngine claimed the fds (the engine owns them then).
    engine_id: str | None = None
    closed: bool = False


class FdSocketServer:
    """Accepts fd uploads; calls ``on_close(connection)`` when an engine's connection closes."""

    def __init__(self, path: str, on_close: Callable[[FdConnection], None]) -> None:
        self.path = path
        self._on_close = on_close
        self._sock: socket.socket | None = None
        self._conns: dict[int, tuple[socket.socket, FdConnection | None]] = {}
        self.by_token: dict[str, FdConnection] = {}

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old_umask = os.umask(0o117)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o660)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    def claim(self, token: str, engine_id: str) -> tuple[FdConnection, list[int]] | None:
        """Hand the unclaimed fds of the connection with ``token`` to engine ``engine_id``.

        The caller owns the returned fds from then on. None if the token is
        unknown, its connection closed, or its fds were already claimed.
        """
        connection = self.by_token.get(token)
        if connection is None or connection.closed or connection.engine_id is not None or not connection.fds:
            return None
        fds, connection.fds = connection.fds, []
        connection.engine_id = engine_id
        return connection, fds

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            if os.path.exists(self.path):
                os.unlink(self.path)
        for fileno in list(self._conns):
            self._drop(fileno)

    # -- internals ------------------------------------------------------
    def _accept(self) -> None:
        assert self._sock is not None
        try:
            sock, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        self._conns[sock.fileno()] = (sock, None)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable, sock.fileno())

    def _readable(self, fileno: int) -> None:
        sock, connection = self._conns[fileno]
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_DATAGRAM, MAX_FDS_PER_UPLOAD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("fd_socket_read_failed", error=str(exc))
            self._drop(fileno)
            return
        if not data and not fds:
            self._drop(fileno)
            return
        if connection is not None:
            for fd in fds:
                os.close(fd)
            self._reply(sock, error="one upload per connection: open a new connection for another engine rank")
            return
        try:
            upload = fdsocket_pb2.FdUpload.FromString(data)
        except Exception:
            for fd in fds:
                os.close(fd)
            self._reply(sock, error="the datagram is not an FdUpload message")
            return
        # A buffer that names a CUDA IPC handle comes without an fd.
        with_fd = [not b.cuda_ipc_handle for b in upload.buffers]
        if sum(with_fd) != len(fds) or not upload.buffers:
            for fd in fds:
                os.close(fd)
            self._reply(sock, error=f"{sum(with_fd)} buffers need an fd but {len(fds)} fds are attached")
            return
        received = iter(fds)
        fds = [next(received) if has_fd else -1 for has_fd in with_fd]
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        connection = FdConnection(token=secrets.token_hex(16), pid=pid, uid=uid, specs=list(upload.buffers), fds=list(fds))
        self.by_token[connection.token] = connection
        self._conns[fileno] = (sock, connection)
        self._reply(sock, token=connection.token)
        log.debug("fd_upload", pid=pid, buffers=len(fds))

    def _reply(self, sock: socket.socket, *, token: str = "", error: str = "") -> None:
        try:
            sock.send(fdsocket_pb2.FdUploadReply(session_token=token, error=error).SerializeToString())
        except OSError as exc:
            log.warning("fd_socket_reply_failed", error=str(exc))

    def _drop(self, fileno: int) -> None:
        sock, connection = self._conns.pop(fileno)
        asyncio.get_running_loop().remove_reader(fileno)
        sock.close()
        if connection is None:
            return
        connection.closed = True
        for fd in connection.fds:
            if fd >= 0:
                os.close(fd)
        connection.fds = []
        self.by_token.pop(connection.token, None)
        self._on_close(connection)
