"""Every call this broker makes to other brokers, with its retry policy (room
registration's is the receiver's: ``execution._registration``).

Each call is a method of the table of peer calls (``peers._calls``), made
with the peer's :class:`~kvbroker.broker.peers.PeerCaller`: every one but
``Handshake`` and the probes goes on the peer's stream (``peers._stream``:
one per peer, opened by the handshake, calls batched per frame). Failures
come as the project's errors (``kvbroker.errors``) whichever way a call
went, and the policies below read those.

| call | when | retry policy |
| --- | --- | --- |
| ``Handshake`` | first contact, our engines changed, a restart suspected | none here; callers retry |
| (``find_sender``) | a receiving room bootstraps | handshake and look for the group, with backoff (10 ms doubling to 1 s) until ``--bootstrap-timeout``; the last try is at the deadline |
| ``RegisterRooms`` | the receiver's plan is made | none here: the receiver's registration policy decides per room (``execution._registration``); each waits for the address to answer up to the RPC timeout |
| ``ReserveStaging`` | before a staged write | none (the receiver waits up to ``staging_wait`` for room) |
| ``ReportCompletion`` | a source failed, settled, or will never come | while UNAVAILABLE or DEADLINE_EXCEEDED: 4 tries, 50 ms growing 4x |
| ``AbortRooms`` | a receiver failed | per room as ReportCompletion; ABORTED (the peer does not know us: it took us for lost while we were stopped, say): handshake again, then once more; unreachable: the caller remembers it for the successor |
| ``Ping`` | heartbeat (``liveness``), only while the peer's stream was idle for a heartbeat (an answer on it is the heartbeat) | none: the next heartbeat is the retry |
| ``RenewLeases`` | rooms this broker's decode engines announced, per sender broker when due | none: the next renewal pass is the retry |

Room registrations and aborts go on the peer's stream as they are made:
each joins the RegisterRooms (AbortRooms) call whose frame is not written
yet, or makes one (``PeerStream.submit_item``), so the rooms of one loop
pass go in one call of at most 512 rooms, written in the stream writer's
next pass, and a burst of thousands of rooms costs a few calls and frames.
A registration takes no task and no future (``submit_registration``). Each
registration carries its room's trace context, so the sender's room spans
join the room's trace as with a call of its own.

Channels reconnect at least once per heartbeat (gRPC's own backoff grows to
120 s, which would keep a restarted peer unreachable long after it is back).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

import grpc
import structlog
from opentelemetry import propagate
from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters

from kvbroker.broker import telemetry
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.peers._caller import PeerCaller, call_unary
from kvbroker.broker.peers._calls import (
    ABORT_ROOMS,
    GRANT_CREDITS,
    HANDSHAKE,
    PING,
    REGISTER_ROOMS,
    RELEASE_PROBE,
    RENEW_LEASES,
    REPORT_COMPLETION,
    RESERVE_PROBE,
    RESERVE_STAGING,
    RETURN_CREDITS,
    PeerMethod,
)
from kvbroker.broker.peers._stream import Ans, PeerStream, Req
from kvbroker.broker.peers._table import Peer, PeerTable, announced_staging
from kvbroker.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    GroupNotFound,
    Internal,
    KvBrokerError,
    Unavailable,
    from_status,
)
from kvbroker.plan import Layout, RoomTimeouts
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2, peer_pb2_grpc

__all__ = ["HandshakeMessage", "PeerClient", "channel_options", "reach_back", "server_options"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: Our side of a handshake: (NIXL metadata, engines, receive staging buffers, engine epoch).
HandshakeMessage = tuple[bytes, list[peer_pb2.EngineDescriptor], list[peer_pb2.RemoteBuffer], int]

def server_options(config: BrokerConfig) -> list[tuple[str, int]]:
    """The server's gRPC options: :func:`channel_options`, and keepalive pings
    from engines accepted once a second, also on idle connections (the client
    notices a broker that stopped answering by them: client/connection.py)."""
    return [
        *channel_options(config),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def channel_options(config: BrokerConfig) -> list[tuple[str, int]]:
    """gRPC options for channels and the server: message size limits, and a
    channel to a peer that went away tries to connect again at least once per
    heartbeat."""
    backoff_ms = max(100, int(config.peer_heartbeat_seconds * 1000))
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 1000)),
        ("grpc.min_reconnect_backoff_ms", min(backoff_ms, 1000)),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
    ]


class PeerClient:
    """Outbound PeerBroker calls. Control loop only."""

    def __init__(
        self,
        *,
        peers: PeerTable,
        config: BrokerConfig,
        handshake_message: Callable[[], Awaitable[HandshakeMessage]],
        epoch: Callable[[], int],
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._peers = peers
        self._handshake_message = handshake_message
        self._timeout = config.peer_rpc_timeout_seconds
        self._bootstrap_timeout = config.bootstrap_timeout_seconds
        self._staging_wait = config.staging_wait_seconds
        self._options = channel_options(config)
        self._credentials = credentials
        #: Our engine epoch now (``EngineTable.epoch``): a peer that saw an
        #: older one does not know all our engines yet.
        self._epoch = epoch

    @property
    def timeout(self) -> float:
        return self._timeout

    # -- handshakes ---------------------------------------------------------
    async def connect(self, address: str) -> Peer:
        """The peer at ``address``, handshaken with our current engines."""
        peer = self._peers.at(address)
        if self._stale(peer):
            await self.handshake(peer, only_if_stale=True)
        return peer

    def _stale(self, peer: Peer) -> bool:
        return peer.announced_epoch != self._epoch() or peer.broker_id is None

    async def handshake(self, peer: Peer, *, only_if_stale: bool = False) -> None:
        """(Re)do the handshake with ``peer``; ``Unavailable`` if it fails.
        ``only_if_stale``: not if one that finished while this call waited for
        the peer's lock already told it our current engines."""
        async with peer.lock:
            if only_if_stale and not self._stale(peer):
                return
            with telemetry.tracer().start_as_current_span("kvbroker.handshake", attributes={"kvbroker.peer": peer.address}):
                metadata, engines, staging, epoch = await self._handshake_message()
                request = peer_pb2.HandshakeRequest(
                    protocol_version=PROTOCOL_VERSION,
                    caller=self._peers.identity(),
                    nixl_agent_metadata=metadata,
                    engines=engines,
                    staging=_host(staging),
                    receive_staging=staging,
                )
                try:
                    response = await self.caller(peer).call(HANDSHAKE, request, timeout=self._timeout)
                except KvBrokerError as exc:
                    raise Unavailable(f"handshake with the broker at {peer.address} failed: {exc.message}") from exc
                if response.protocol_version != PROTOCOL_VERSION:
                    raise FailedPrecondition(
                        f"the broker at {peer.address} speaks protocol {response.protocol_version}, we speak {PROTOCOL_VERSION}"
                    )
                await self._peers.apply(
                    peer, response.callee, response.nixl_agent_metadata, response.engines, announced_staging(response)
                )
                peer.announced_epoch = epoch
                self.caller(peer).stream.open()  # the room calls' stream, opened now rather than by the first room
        log.info("peer_handshaken", peer=peer.address, broker=peer.broker_id, engines=len(peer.engines), side="caller")

    async def find_sender(
        self,
        address: str,
        group: str,
        stop: Callable[[], bool] = lambda: False,
        missed: Callable[[KvBrokerError], None] = lambda _e: None,
        timeouts: RoomTimeouts | None = None,
    ) -> tuple[Peer, list[Layout]]:
        """Handshake with the broker at ``address`` and find ``group`` there,
        retrying with backoff until the bootstrap timeout (the receiving
        engine's ``timeouts``, else the flag; the sender's broker or engines
        may still be starting). The last try is at the deadline; no retry
        once ``stop()`` says so (the room ended); ``missed`` hears why each
        try that will be retried failed."""

        async def attempt() -> tuple[Peer, list[Layout]]:
            peer = await self.connect(address)
            return peer, await self.group_layouts(peer, group)

        return await self.until_found(attempt, stop, missed, timeouts)

    async def group_layouts(self, peer: Peer, group: str, ranks: Collection[tuple[int, int]] = ()) -> list[Layout]:
        """The layouts of ``group``'s ranks at ``peer``, handshaking again when it
        lacks the group or one of ``ranks`` ((tp, pp)): they may have registered
        after our last handshake. :class:`GroupNotFound` if they still lack."""

        def missing() -> set[tuple[int, int]]:
            return set(ranks) - {(k.tp_rank, k.pp_rank) for k in peer.engines if k.group == group}

        if not peer.group_layouts(group) or missing():
            await self.handshake(peer)
        layouts = peer.group_layouts(group)
        if not layouts:
            raise GroupNotFound(f"no rank of engine group {group!r} is registered at the broker at {peer.address}")
        if lacking := missing():
            listed = ", ".join(f"tp{t}/pp{p}" for t, p in sorted(lacking))
            raise GroupNotFound(f"{listed} of engine group {group!r} is not registered at the broker at {peer.address}")
        return layouts

    async def until_found(
        self,
        attempt: Callable[[], Awaitable[T]],
        stop: Callable[[], bool] = lambda: False,
        missed: Callable[[KvBrokerError], None] = lambda _e: None,
        timeouts: RoomTimeouts | None = None,
    ) -> T:
        """``attempt()`` until it returns, retrying with backoff on Unavailable
        and :class:`GroupNotFound` until the bootstrap timeout (the engine's
        ``timeouts``, else the flag; the last try is at the deadline); no
        retry once ``stop()`` says so. ``missed`` hears each error that is
        retried; the last error says how long it waited, and why that long."""
        limit = (timeouts or RoomTimeouts()).limit("bootstrap_seconds", self._bootstrap_timeout)
        start = time.monotonic()
        deadline = start + limit.seconds
        delay = 0.01
        while True:
            try:
                return await attempt()
            except (Unavailable, GroupNotFound) as exc:
                error: KvBrokerError = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0 or stop():
                waited = time.monotonic() - start
                raise type(error)(
                    f"{error.message} (gave up after {waited:.3g} s: the bootstrap timeout is {limit.seconds:g} s, {limit.source})"
                )
            missed(error)
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)

    # -- room calls -----------------------------------------------------------
    def submit_registration(
        self, peer: Peer, request: peer_pb2.RegisterRoomRequest, then: Callable[[KvBrokerError | None], None]
    ) -> None:
        """Register a room with ``peer`` (with the sender's broker id as we know
        it, and the current trace context): it goes on the peer's stream in
        the RegisterRooms call not written yet, or in a new one, so the rooms
        registered in one loop pass go in one call and one frame. ``then``
        hears its outcome: None, or its own error, typed. No task and no
        future per room: a burst of rooms waits on the stream as items of a
        call."""
        request.sender_broker_id = peer.broker_id or ""
        request.trace_context.clear()
        propagate.inject(request.trace_context)
        # wait_for_ready: while the address does not answer (a broker
        # restarting there, or the channel still backing off from the old
        # process), wait for it up to the timeout instead of failing the
        # rooms at once; they are still bootstrapping.
        call, index = self.caller(peer).submit_item(
            REGISTER_ROOMS,
            peer_pb2.RegisterRoomsRequest(protocol_version=PROTOCOL_VERSION, rooms=[request]),
            "rooms",
            timeout=self._timeout,
            wait_for_ready=True,
        )
        call.add_done_callback(lambda call: then(_item_error(call, index, "RegisterRooms")))

    async def _abort_one(self, peer: Peer, request: peer_pb2.PeerAbortRequest) -> peer_pb2.PeerAbortResponse:
        """One room's abort, on the peer's stream, in the AbortRooms call not written yet or a new one."""
        call, index = self.caller(peer).submit_item(
            ABORT_ROOMS,
            peer_pb2.PeerAbortRoomsRequest(protocol_version=PROTOCOL_VERSION, aborts=[request]),
            "aborts",
            timeout=self._timeout,
        )
        with contextlib.suppress(KvBrokerError):  # raised again, for this item, below
            await asyncio.shield(call)  # (shared with the other rooms' aborts: never cancelled for one)
        error = _item_error(call, index, "AbortRooms")
        if error is not None:
            raise error
        return peer_pb2.PeerAbortResponse(settled=call.result().results[index].settled)

    async def reserve_staging(self, broker_id: str, request: peer_pb2.ReserveStagingRequest) -> peer_pb2.ReserveStagingResponse:
        """The prefetch: room for one staged part in the receiver's staging buffer."""
        return await self._room_call(broker_id, "reserve staging", RESERVE_STAGING, request)

    async def reserve_probe(self, broker_id: str, request: peer_pb2.ReserveProbeRequest) -> peer_pb2.ReserveProbeResponse:
        """A slot of the peer's receive buffer for the transport self-test."""
        return await self._room_call(broker_id, "reserve a probe slot", RESERVE_PROBE, request)

    async def grant_credits(self, broker_id: str, request: peer_pb2.GrantCreditsRequest) -> peer_pb2.GrantCreditsResponse:
        """Room in the peer's receive buffer for our packed parts (waits while it is full)."""
        return await self._room_call(broker_id, "grant credits", GRANT_CREDITS, request)

    async def _room_call(self, broker_id: str, what: str, method: PeerMethod[Req, Ans], request: Req) -> Ans:
        """A call for room in the peer's buffers: it may wait there up to the
        staging wait; its failure says what could not be had."""
        caller = self.caller(self._peers.get(broker_id))
        try:
            return await caller.call(method, request, timeout=self._staging_wait + self._timeout)
        except KvBrokerError as exc:
            raise type(exc)(f"the receiver could not {what}: {exc.message}") from exc

    async def return_credits(self, broker_id: str, grant_ids: list[str]) -> None:
        """Give whole grants back to the peer."""
        request = peer_pb2.ReturnCreditsRequest(protocol_version=PROTOCOL_VERSION, sender_broker_id=self._peers.broker_id, grant_ids=grant_ids)
        await self.caller(self._peers.get(broker_id)).call(RETURN_CREDITS, request, timeout=self._timeout)

    async def release_probe(self, broker_id: str, probe_id: str) -> None:
        """Give back a probe slot (the peer's lease frees it anyway)."""
        request = peer_pb2.ReleaseProbeRequest(protocol_version=PROTOCOL_VERSION, probe_id=probe_id)
        await self.caller(self._peers.get(broker_id)).call(RELEASE_PROBE, request, timeout=self._timeout)

    async def report_completion(self, broker_id: str, report: peer_pb2.CompletionReport) -> None:
        await self.deliver(
            broker_id,
            f"ReportCompletion(room {report.room})",
            lambda peer: self.caller(peer).call(REPORT_COMPLETION, report, timeout=self._timeout),
        )

    async def abort_room(
        self, broker_id: str, request: peer_pb2.PeerAbortRequest, on_unreachable: Callable[[], None] | None = None
    ) -> peer_pb2.PeerAbortResponse | None:
        """Abort one room at the peer, in its next AbortRooms call."""
        response: peer_pb2.PeerAbortResponse | None = await self.deliver(
            broker_id,
            f"AbortRoom(room {request.room})",
            lambda peer: self._abort_one(peer, request),
            on_unreachable=on_unreachable,
        )
        return response

    async def renew_leases(self, peer: Peer, rooms: Collection[tuple[int, str]]) -> peer_pb2.RenewLeasesResponse:
        """Renew the leases of ``rooms`` ((room, sender group)) at ``peer``: one
        call per peer and renewal (it may move onto a peer stream later)."""
        request = peer_pb2.RenewLeasesRequest(
            protocol_version=PROTOCOL_VERSION,
            receiver_broker_id=self._peers.broker_id,
            rooms=[peer_pb2.LeasedRoom(room=room, sender_group=group) for room, group in rooms],
        )
        return await self.caller(peer).call(RENEW_LEASES, request, timeout=self._timeout)

    async def ping(self, peer: Peer, timeout_seconds: float) -> str:
        """The broker id that answers at ``peer``'s address (raises ``KvBrokerError``):
        the one at the other end of our stream if it answered there within
        ``timeout_seconds`` (a ping only while the stream is idle)."""
        caller = self.caller(peer)
        if caller.stream.heard_within(timeout_seconds) and caller.stream.broker_id:
            return caller.stream.broker_id
        reply = await caller.call(PING, peer_pb2.PingRequest(from_broker_id=self._peers.broker_id), timeout=timeout_seconds)
        return str(reply.broker_id)

    async def deliver(
        self,
        broker_id: str,
        what: str,
        call: Callable[[Peer], Awaitable[T]],
        attempts: int = 4,
        on_unreachable: Callable[[], None] | None = None,
    ) -> T | None:
        """A one-way call (a report, an abort) to peer ``broker_id``, retried
        while it is unreachable. The response, or None (logged) if it could not
        be delivered; a peer that stays unreachable is the liveness monitor's
        business. ``on_unreachable`` runs when the peer is gone or did not
        answer (not when it answered with an error)."""
        delay = 0.05
        introduced = False
        for attempt in range(attempts):
            try:
                peer = self._peers.get(broker_id)
            except KvBrokerError as exc:
                log.warning("peer_call_undeliverable", call=what, peer=broker_id, error=exc.message)
                unreachable = True
                break
            try:
                return await call(peer)
            except KvBrokerError as exc:
                err = exc
            if isinstance(err, Aborted) and not introduced:
                # The peer does not know us (it took us for lost): introduce ourselves again.
                introduced = True
                try:
                    await self.handshake(peer)
                    continue
                except KvBrokerError as exc:
                    err = exc
            unreachable = isinstance(err, (Unavailable, DeadlineExceeded))
            if unreachable and attempt + 1 < attempts:
                await asyncio.sleep(delay)
                delay *= 4
                continue
            log.warning("peer_call_failed", call=what, peer=broker_id, error=err.message)
            break
        if unreachable and on_unreachable is not None:
            on_unreachable()
        return None

    # -- channels ---------------------------------------------------------------
    def caller(self, peer: Peer) -> PeerCaller:
        """The calls to ``peer`` (made once per peer record): the room calls go
        on its stream (``peers._stream``), the others are unary."""
        if peer.caller is None:
            if not peer.address:
                raise Unavailable(f"broker {peer.broker_id} did not say where it listens")
            # The unary calls get RPC spans (registrations go on the stream:
            # each carries its room's trace context).
            untraced = filters.negate(filters.method_name("RegisterRooms"))
            peer.channel = _channel(peer.address, self._credentials, self._options, aio_client_interceptors(filter_=untraced))
            # The stream goes on a channel of its own without interceptors: it
            # lives as long as the pair of brokers and each of its calls
            # carries its own trace context, and any interceptor on a channel
            # proxies every write of a stream through a queue and a task.
            # (Channels to one address with the same options share the
            # connection.)
            peer.stream_channel = _channel(peer.address, self._credentials, self._options, None)
            peer.stream = PeerStream(peer_pb2_grpc.PeerBrokerStub(peer.stream_channel), peer.address, lambda: self._peers.broker_id)
            peer.caller = PeerCaller(peer.channel, peer.stream)
        return peer.caller

    async def close(self) -> None:
        for peer in self._peers.peers():
            if peer.stream is not None:
                peer.stream.close()
                peer.stream = None
            for channel in (peer.channel, peer.stream_channel):
                if channel is not None:
                    await channel.close()
            peer.channel = peer.stream_channel = None
            peer.caller = None


async def reach_back(client: PeerClient, caller: peer_pb2.BrokerIdentity) -> None:
    """Check that a broker handshaking with this one answers where it says it
    listens (its ``--advertise``, else its ``--listen``): this broker's calls
    to it go there, and a room would otherwise wait for them in vain.
    ``FailedPrecondition`` naming the address if nothing answers there within
    half the peer timeout, or another broker does. Once per pair: not for a
    peer already handshaken at that address."""
    if not caller.address or caller.broker_id == client._peers.broker_id:
        return
    known = client._peers.by_id.get(caller.broker_id)
    if known is not None and known.address == caller.address:
        return
    here = client._peers.address
    channel = _channel(caller.address, client._credentials, client._options, None)
    try:
        reply = await call_unary(channel, PING, peer_pb2.PingRequest(from_broker_id=client._peers.broker_id), timeout=client._timeout / 2)
    except KvBrokerError as exc:
        raise FailedPrecondition(
            f"broker {caller.broker_id} says it listens at {caller.address} (its --advertise or --listen), "
            f"but the broker at {here} cannot reach it there: {exc.message}"
        ) from exc
    finally:
        await channel.close()
    if reply.broker_id != caller.broker_id:
        raise FailedPrecondition(
            f"broker {caller.broker_id} says it listens at {caller.address} (its --advertise or --listen), "
            f"but broker {reply.broker_id} answers there for the broker at {here}"
        )


def _channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: list[tuple[str, int]], interceptors: Any
) -> grpc.aio.Channel:
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def _host(staging: list[peer_pb2.RemoteBuffer]) -> peer_pb2.RemoteBuffer | None:
    return next((b for b in staging if b.kind == common_pb2.MEMORY_KIND_DRAM), None)


def _item_error(call: asyncio.Future[Any], index: int, name: str) -> KvBrokerError | None:
    """Item ``index`` of a finished call of ``name`` (RegisterRooms, AbortRooms):
    None if it succeeded, else the call's failure or the item's, typed."""
    if call.cancelled():
        return Unavailable(f"{name} was given up (the broker is stopping)")
    try:
        response = call.result()
    except KvBrokerError as exc:
        return exc
    if index >= len(response.results):
        return Internal(f"the peer answered {len(response.results)} items of {name}, not item {index}")
    result = response.results[index]
    return from_status(result.code, result.message) if result.code else None
