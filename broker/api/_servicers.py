"""The gRPC servicers: thin. Hand the request to the call route each is given, map errors.

Errors map to statuses here and only here: a ``KvBrokerError`` becomes its
own status code and message; anything else is logged with its traceback and
becomes INTERNAL, so a bug never leaks a Python trace to the caller.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
import structlog

from kvbroker.broker.api._admin import Admin
from kvbroker.broker.api._peer_calls import PeerAnswers, unary_method
from kvbroker.broker.api._peer_stream import ServedStreams, serve_stream
from kvbroker.broker.peers import PEER_METHODS
from kvbroker.broker.runtime import EngineCalls, Sessions, SessionStream
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import Internal, InvalidArgument, KvBrokerError
from kvbroker.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    peer_pb2,
    peer_pb2_grpc,
    transfer_pb2,
    transfer_pb2_grpc,
)

__all__ = ["AdminService", "PeerService", "TransferService"]

log = structlog.get_logger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _unary(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        try:
            return await fn(self, request, context)
        except KvBrokerError as exc:
            await context.abort(exc.code, exc.message)
        except Exception:
            log.exception("rpc_failed", rpc=fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__} failed inside the broker; see its log")
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


class TransferService(transfer_pb2_grpc.TransferBrokerServicer):
    """``kvbroker.v1.TransferBroker``: engines on this host."""

    def __init__(
        self, engine_calls: EngineCalls, sessions: Sessions, broker_info: Callable[[], transfer_pb2.BrokerInfo]
    ) -> None:
        self._calls = engine_calls
        self._sessions = sessions
        self._broker_info = broker_info

    @_unary
    async def GetBrokerInfo(self, request: transfer_pb2.GetBrokerInfoRequest, context: Any) -> transfer_pb2.BrokerInfo:
        return self._broker_info()

    @_unary
    async def RegisterEngine(
        self, request: transfer_pb2.RegisterEngineRequest, context: Any
    ) -> transfer_pb2.RegisterEngineResponse:
        engine = await self._calls.register_engine(request)
        return transfer_pb2.RegisterEngineResponse(engine_id=engine.engine_id)

    @_unary
    async def UnregisterEngine(
        self, request: transfer_pb2.UnregisterEngineRequest, context: Any
    ) -> transfer_pb2.UnregisterEngineResponse:
        failed = await self._calls.unregister_engine(request.engine_id)
        return transfer_pb2.UnregisterEngineResponse(rooms_failed=failed)

    @_unary
    async def ExpectRoom(self, request: transfer_pb2.ExpectRoomRequest, context: Any) -> transfer_pb2.ExpectRoomResponse:
        return transfer_pb2.ExpectRoomResponse(status=self._calls.expect_room(request).status())

    @_unary
    async def BeginSend(self, request: transfer_pb2.BeginSendRequest, context: Any) -> transfer_pb2.BeginSendResponse:
        return transfer_pb2.BeginSendResponse(status=self._calls.begin_send(request).status())

    @_unary
    async def SendChunk(self, request: transfer_pb2.SendChunkRequest, context: Any) -> transfer_pb2.SendChunkResponse:
        index, source = self._calls.send_chunk(request)
        return transfer_pb2.SendChunkResponse(chunk_index=index, status=source.status())

    @_unary
    async def Poll(self, request: transfer_pb2.PollRequest, context: Any) -> transfer_pb2.PollResponse:
        return transfer_pb2.PollResponse(statuses=self._calls.poll(request))

    async def WatchRooms(
        self, request: transfer_pb2.WatchRoomsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.RoomStatus]:
        try:
            async for status in self._calls.watch(request):
                yield status
        except KvBrokerError as exc:
            await context.abort(exc.code, exc.message)

    @_unary
    async def Abort(self, request: transfer_pb2.AbortRequest, context: Any) -> transfer_pb2.AbortResponse:
        return transfer_pb2.AbortResponse(status=self._calls.abort(request))

    @_unary
    async def AnnounceRoom(self, request: transfer_pb2.AnnounceRoomRequest, context: Any) -> transfer_pb2.AnnounceRoomResponse:
        self._calls.announce_room(request)
        return transfer_pb2.AnnounceRoomResponse()

    async def Session(
        self, requests: AsyncIterator[transfer_pb2.SessionRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[transfer_pb2.SessionEvent]:
        try:
            first = await requests.__anext__()
            if not first.HasField("open"):
                raise InvalidArgument("the first request of a session stream must carry SessionOpen")
            engine, stream = self._sessions.open_session(first.open)
        except StopAsyncIteration:
            return
        except KvBrokerError as exc:
            await context.abort(exc.code, exc.message)
        # The reader applies the commands, the opening's first: whatever they
        # do, the stream ends below and lets go of the engine.
        reader = asyncio.get_running_loop().create_task(
            self._commands(engine, stream, first.commands, requests), name="session-reader"
        )
        try:
            while True:
                event = await stream.next_event()
                if event is None:
                    return
                yield event
        except KvBrokerError as exc:
            await context.abort(exc.code, exc.message)
        finally:
            reader.cancel()
            self._sessions.close_session(engine, stream)

    async def _commands(
        self,
        engine: Any,
        stream: SessionStream,
        opening: Iterable[transfer_pb2.SessionCommand],
        requests: AsyncIterator[transfer_pb2.SessionRequest],
    ) -> None:
        """Apply the stream's commands as they come (those of the opening first: they
        may come with it); end the stream when the engine half-closes."""
        try:
            self._sessions.apply_commands(engine, stream, opening)
            async for request in requests:
                if request.HasField("open"):
                    raise InvalidArgument("SessionOpen may only be the first request of a stream")
                self._sessions.apply_commands(engine, stream, request.commands)
        except KvBrokerError as exc:
            stream.end(exc)
            return
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            return  # the broker ended the stream itself (it stops): nothing more to read
        except Exception:
            log.exception("session_reader_failed", engine=engine.label)
            stream.end(Internal("the session failed inside the broker; see its log"))
            return
        stream.end()


class PeerService(peer_pb2_grpc.PeerBrokerServicer):
    """``kvbroker.v1.PeerBroker``: other brokers. Every call is a row of the
    table of peer calls (``peers.PEER_METHODS``), answered by its handler
    through one chain (``api._peer_calls``); the unary methods below are
    made from the table, and the stream carries those with a stream field."""

    def __init__(self, answers: PeerAnswers, broker_id: str, counters: Counters) -> None:
        self.answers = answers
        self._broker_id = broker_id
        self._counters = counters
        #: The peer streams answered now (ended by :meth:`end_streams` when the broker stops).
        self._streams = ServedStreams()

    async def Stream(
        self, requests: AsyncIterator[peer_pb2.PeerFrame], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[peer_pb2.PeerFrame]:
        self._counters.peer_calls_answered["Stream"] += 1
        async for frame in serve_stream(requests, context, self._broker_id, self.answers, self._streams):
            yield frame

    def end_streams(self) -> None:
        """End the peer streams answered now (the broker stops)."""
        self._streams.end_all()


for _name in PEER_METHODS:
    setattr(PeerService, _name, unary_method(_name))


class AdminService(admin_pb2_grpc.AdminServicer):
    """``kvbroker.v1.Admin``: operators."""

    def __init__(self, admin: Admin) -> None:
        self._admin = admin

    @_unary
    async def GetStats(self, request: admin_pb2.GetStatsRequest, context: Any) -> admin_pb2.Stats:
        return self._admin.stats()

    @_unary
    async def ListEngines(self, request: admin_pb2.ListEnginesRequest, context: Any) -> admin_pb2.ListEnginesResponse:
        return admin_pb2.ListEnginesResponse(engines=self._admin.list_engines(), fleet_groups=self._admin.fleet_groups())

    @_unary
    async def ListPeers(self, request: admin_pb2.ListPeersRequest, context: Any) -> admin_pb2.ListPeersResponse:
        return admin_pb2.ListPeersResponse(peers=self._admin.list_peers(), fleet=await self._admin.fleet())

    @_unary
    async def ProbeTransport(
        self, request: admin_pb2.ProbeTransportRequest, context: Any
    ) -> admin_pb2.ProbeTransportResponse:
        return admin_pb2.ProbeTransportResponse(peers=await self._admin.probe_transport(request.peer))

    @_unary
    async def ListRooms(self, request: admin_pb2.ListRoomsRequest, context: Any) -> admin_pb2.ListRoomsResponse:
        return admin_pb2.ListRoomsResponse(rooms=self._admin.list_rooms(request))

    @_unary
    async def GetRoom(self, request: admin_pb2.GetRoomRequest, context: Any) -> admin_pb2.GetRoomResponse:
        return self._admin.get_room(request.room)

    @_unary
    async def AbortRoom(
        self, request: admin_pb2.AdminAbortRoomRequest, context: Any
    ) -> admin_pb2.AdminAbortRoomResponse:
        return admin_pb2.AdminAbortRoomResponse(aborted=self._admin.abort_room(request.room, request.reason))

    @_unary
    async def ForgetPeer(self, request: admin_pb2.ForgetPeerRequest, context: Any) -> admin_pb2.ForgetPeerResponse:
        return self._admin.forget_peer(request.peer, request.reason)

    @_unary
    async def Drain(self, request: admin_pb2.DrainRequest, context: Any) -> admin_pb2.DrainResponse:
        return await self._admin.drain(request)
