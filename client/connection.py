"""The connection from an engine rank to the broker on its host."""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable, Mapping
from typing import TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate

from kvbroker.client.engine import EngineHandle
from kvbroker.client.memory import EngineMemory, RankSpec
from kvbroker.client.tracecontext import TraceContextInterceptor
from kvbroker.errors import FailedPrecondition, InvalidArgument, Unavailable, from_rpc_error
from kvbroker.plan import RoomTimeouts
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import fdsocket_pb2, transfer_pb2, transfer_pb2_grpc

__all__ = ["BrokerClient"]


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    """A channel whose unary calls carry the current trace context."""
    if credentials is not None and not address.startswith("unix:"):
        channel = grpc.secure_channel(address, credentials, options=_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, options=_OPTIONS)
    return grpc.intercept_channel(channel, TraceContextInterceptor())

T = TypeVar("T")

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    # A broker that stops answering without closing the connection (a stopped
    # process) breaks the session stream within about three seconds, instead
    # of never: a ping a second, to be answered within two (the broker accepts
    # them: broker/server.py; gRPC's own threads answer, so a busy event loop
    # does not delay them), also while no call is open.
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
#: How long the broker may stay unreachable before the engine's open rooms fail.
DEFAULT_BROKER_LOST_AFTER_S = 5.0


class BrokerClient:
    """A connection to the local broker.

    ``BrokerClient("127.0.0.1:50051")`` asks the broker (GetBrokerInfo) where
    its engine unix socket and fd socket are, and switches to the unix socket
    when it can reach it. ``address`` may also be the engine socket itself
    (``"unix:/run/kvbroker/engine.sock"``), which is what engines use when the
    broker's TCP port requires mutual TLS (or pass ``credentials``). Thread-safety: one client may be shared by threads
    (gRPC channels are thread-safe); each engine rank registers once.
    """

    def __init__(
        self,
        address: str,
        *,
        prefer_unix_socket: bool = True,
        timeout_seconds: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        broker_lost_after_seconds: float = DEFAULT_BROKER_LOST_AFTER_S,
    ) -> None:
        self.address = address
        self.timeout_seconds = timeout_seconds
        #: How long the broker may stay unreachable (its session stream broken,
        #: no answer) before the open rooms of the engines registered through
        #: this client fail (BROKER_LOST) and new commands raise Unavailable
        #: (client/session.py).
        self.broker_lost_after_seconds = broker_lost_after_seconds
        #: Engines registered through this client (their sessions use its channel).
        self._handles: weakref.WeakSet[EngineHandle] = weakref.WeakSet()
        channel = _channel(address, credentials)
        try:
            stub = transfer_pb2_grpc.TransferBrokerStub(channel)
            self.info: transfer_pb2.BrokerInfo = self.call(
                stub.GetBrokerInfo, transfer_pb2.GetBrokerInfoRequest(), wait_for_ready=True
            )
        except BaseException:
            channel.close()
            raise
        if self.info.protocol_version != PROTOCOL_VERSION:
            channel.close()
            raise FailedPrecondition(
                f"the broker at {address} speaks protocol version {self.info.protocol_version}; this client speaks "
                f"{PROTOCOL_VERSION} (kvbroker {self.info.version} there): use matching releases"
            )
        path = self.info.engine_socket_path
        if prefer_unix_socket and path and os.access(path, os.R_OK | os.W_OK):
            channel.close()
            channel = _channel(f"unix:{path}", None)
            stub = transfer_pb2_grpc.TransferBrokerStub(channel)
        self._channel = channel
        self.stub = stub

    def call(
        self,
        method: Callable[..., T],
        request: object,
        *,
        wait_for_ready: bool = False,
        trace_context: Mapping[str, str] | None = None,
        timeout_seconds: float | None = None,
    ) -> T:
        """Call ``method``; a failure raises the matching ``kvbroker.errors`` class.

        The call carries the caller's current OpenTelemetry trace context, or
        ``trace_context`` (a W3C carrier such as ``{"traceparent": ...}``)
        when given: the broker's spans for the call join that trace.
        """
        token = otel_context.attach(propagate.extract(trace_context)) if trace_context else None
        try:
            timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
            return method(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            if token is not None:
                otel_context.detach(token)

    def register_engine(self, rank: RankSpec, memory: EngineMemory, *, timeouts: RoomTimeouts | None = None) -> EngineHandle:
        """Register an engine rank and its memory with the broker.

        Uploads the buffers' fds over the broker's fd socket, then calls
        RegisterEngine, and opens the engine's session stream. The returned
        handle keeps the fd connection open: the broker releases everything
        the engine registered when it closes (``EngineHandle.close`` or
        process exit). The memory keeps its own fds, so the handle can
        register again if the broker restarts. ``timeouts``: the rank's own
        bounds on its rooms' waits (unset ones: the broker's flags).
        """
        timeouts = timeouts or RoomTimeouts()
        engine_id, fd_sock = self.upload_and_register(rank, memory, timeouts)
        handle = EngineHandle(self, engine_id, rank, memory, fd_sock, self.info.broker_id, timeouts)
        self._handles.add(handle)
        return handle

    def refresh_info(self, *, timeout_seconds: float | None = None) -> transfer_pb2.BrokerInfo:
        """Ask the broker for its info again (after a restart: a new broker_id),
        waiting up to ``timeout_seconds`` (the client's timeout) for it to answer."""
        self.info = self.call(
            self.stub.GetBrokerInfo, transfer_pb2.GetBrokerInfoRequest(), wait_for_ready=True, timeout_seconds=timeout_seconds
        )
        return self.info

    def upload_and_register(self, rank: RankSpec, memory: EngineMemory, timeouts: RoomTimeouts) -> tuple[str, socket.socket]:
        """Upload ``memory``'s fds and call RegisterEngine: (engine_id, fd socket)."""
        fd_sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                fd_sock.connect(self.info.fd_socket_path)
            except OSError as exc:
                raise Unavailable(f"cannot reach the broker's fd socket {self.info.fd_socket_path}: {exc}") from exc
            buffers = memory.export_fds()
            try:
                upload = fdsocket_pb2.FdUpload(buffers=[spec for _, spec in buffers])
                # A buffer with a CUDA IPC handle has no fd (-1): none is attached for it.
                socket.send_fds(fd_sock, [upload.SerializeToString()], [fd for fd, _ in buffers if fd >= 0])
            finally:
                for fd, _ in buffers:
                    if fd >= 0:
                        os.close(fd)
            reply = fdsocket_pb2.FdUploadReply.FromString(fd_sock.recv(1 << 16))
            if reply.error:
                raise InvalidArgument(f"the broker refused the buffers: {reply.error}")
            response = self.call(
                self.stub.RegisterEngine,
                transfer_pb2.RegisterEngineRequest(
                    session_token=reply.session_token, rank=rank.to_proto(), layout=memory.layout, timeouts=timeouts.to_proto()
                ),
            )
        except BaseException:
            fd_sock.close()
            raise
        return response.engine_id, fd_sock

    def close(self) -> None:
        """Close the channel. The session streams of engines still registered
        through it stop first (their threads would otherwise call into a closed
        channel); closing does not unregister them (``EngineHandle.close`` does)."""
        for handle in list(self._handles):
            handle.session.close(1.0)
        self._channel.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
