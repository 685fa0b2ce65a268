"""The peer stream, both ends in one process over loopback gRPC: calls answered by id (a waiting one
holds up nothing), batched per frame, refused by name across protocol versions, failed as unary calls
fail when the stream breaks or a deadline passes (as the project's errors), and a registration that waits
for a stream; and the one answering chain that both the stream and the unary calls go through."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from kvbroker.broker.api import PeerAnswers, PeerService, ServedStreams, serve_stream
from kvbroker.broker.peers import (
    PEER_METHODS,
    PeerCaller,
    PeerStream,
    answers,
    call_unary,
    handlers_of,
)
from kvbroker.broker.telemetry import Counters, QueueStats
from kvbroker.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    ResourceExhausted,
    Unavailable,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import peer_pb2, peer_pb2_grpc

V = PROTOCOL_VERSION
GRANT_CREDITS, PING, REGISTER_ROOMS, REPORT_COMPLETION, RESERVE_STAGING = (
    PEER_METHODS[name] for name in ("GrantCredits", "Ping", "RegisterRooms", "ReportCompletion", "ReserveStaging")
)


class _Callee(PeerService):
    """A broker's PeerService whose every handler is ``answer``: it records what it was asked
    (both ways: the unary methods are the service's own, made from the table)."""

    def __init__(self, answer: Callable[[str, Any], Any]) -> None:
        self.answer = answer
        self.calls: list[str] = []
        self.streams = 0
        self.served = ServedStreams()
        self.counters = Counters(QueueStats())
        super().__init__(PeerAnswers({name: functools.partial(self._answer, name) for name in PEER_METHODS}, self.counters), "callee", self.counters)

    def _answer(self, name: str, request: Any) -> Any:
        self.calls.append(name)
        return self.answer(name, request)

    async def Stream(self, requests: AsyncIterator[peer_pb2.PeerFrame], context: Any) -> AsyncIterator[peer_pb2.PeerFrame]:
        self.streams += 1
        async for frame in serve_stream(requests, context, "callee", self.answers, self.served):
            yield frame


class _Old(peer_pb2_grpc.PeerBrokerServicer):
    """A protocol-8 broker: it has every unary call and no Stream."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(servicer: peer_pb2_grpc.PeerBrokerServicer, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    peer_pb2_grpc.add_PeerBrokerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 30))


@contextlib.asynccontextmanager
async def _serving(servicer: peer_pb2_grpc.PeerBrokerServicer) -> AsyncIterator[str]:
    """A callee on a free loopback port: its address."""
    server, address = await _serve(servicer)
    try:
        yield address
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def _caller(address: str) -> AsyncIterator[PeerCaller]:
    """A caller for ``address``, its stream closed after."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = PeerCaller(channel, PeerStream(peer_pb2_grpc.PeerBrokerStub(channel), address, lambda: "caller"))
        try:
            yield stub
        finally:
            stub.stream.close()


def _pong(name: str, request: Any) -> Any:
    return peer_pb2.PingResponse(broker_id="callee")


def _grants_never_answered(never: asyncio.Event) -> Callable[[str, Any], Any]:
    """Answers: a GrantCredits waits for ``never``; anything else is a pong."""

    def answer(name: str, request: Any) -> Any:
        return never.wait() if name == "GrantCredits" else _pong(name, request)

    return answer


def test_calls_are_answered_by_id_and_a_waiting_call_holds_up_nothing() -> None:
    """A ReserveStaging that waits for room does not hold up a ping made after it; each gets its own answer."""

    async def body() -> None:
        room = asyncio.Event()

        def answer(name: str, request: Any) -> Any:
            if name == "ReserveStaging":

                async def later() -> peer_pb2.ReserveStagingResponse:
                    await room.wait()
                    return peer_pb2.ReserveStagingResponse(offset=request.bytes)

                return later()
            return _pong(name, request)

        async with _serving(_Callee(answer)) as address, _caller(address) as stub:
            reserve = asyncio.ensure_future(stub.call(RESERVE_STAGING, peer_pb2.ReserveStagingRequest(protocol_version=V, bytes=4096), timeout=10))
            pong = await stub.call(PING, peer_pb2.PingRequest(from_broker_id="caller"), timeout=10)
            assert pong.broker_id == "callee" and not reserve.done()
            room.set()
            assert (await reserve).offset == 4096
            assert stub.stream.broker_id == "callee" and stub.stream.heard_within(5)

    _run(body)


def test_calls_made_together_go_in_fewer_frames_and_errors_keep_their_status() -> None:
    """200 reports at once: every one answered, in fewer frames than calls; a refused call raises its
    own status as a unary call would, and the others are unaffected."""

    async def body() -> None:
        def answer(name: str, request: Any) -> Any:
            if request.room == 13:
                raise ResourceExhausted("no room for room 13")
            return peer_pb2.CompletionAck()

        callee = _Callee(answer)
        async with _serving(callee) as address, _caller(address) as stub:
            stub.stream.open()
            results = await asyncio.gather(
                *(stub.call(REPORT_COMPLETION, peer_pb2.CompletionReport(protocol_version=V, room=r), timeout=10) for r in range(200)), return_exceptions=True
            )
            errors = {r: e for r, e in enumerate(results) if isinstance(e, BaseException)}
            assert list(errors) == [13]
            assert isinstance(errors[13], ResourceExhausted) and errors[13].message == "no room for room 13"
            assert callee.calls == ["ReportCompletion"] * 200 and callee.streams == 1
            assert stub.stream.calls_written == 200 and stub.stream.frames_written < 200

    _run(body)


def test_calls_made_in_one_pass_go_in_one_frame_of_at_most_512_and_one_given_up_unwritten_is_not_sent() -> None:
    """600 reports submitted in one pass of the loop on an open stream (no task each): two frames, 512
    calls and the rest; one given up before the frame went out is not written, nor answered."""

    async def body() -> None:
        rooms: list[int] = []
        callee = _Callee(lambda name, request: rooms.append(request.room) or peer_pb2.CompletionAck())
        async with _serving(callee) as address, _caller(address) as stub:
            await stub.call(REPORT_COMPLETION, peer_pb2.CompletionReport(protocol_version=V, room=0), timeout=10)  # the stream is open
            calls, frames = stub.stream.calls_written, stub.stream.frames_written
            submitted = [stub.stream.submit(REPORT_COMPLETION, peer_pb2.CompletionReport(protocol_version=V, room=r), timeout=10) for r in range(1, 601)]
            submitted[5].cancel()
            answers = await asyncio.gather(*submitted, return_exceptions=True)
            assert isinstance(answers[5], asyncio.CancelledError)
            assert all(isinstance(a, peer_pb2.CompletionAck) for i, a in enumerate(answers) if i != 5)
            assert stub.stream.calls_written - calls == 599 and stub.stream.frames_written - frames == 2
            assert rooms == [r for r in range(601) if r != 6]

    _run(body)


def test_items_made_in_one_pass_join_one_call_and_an_item_after_its_frame_makes_another() -> None:
    """Three registrations in one pass: one RegisterRooms call of three rooms, each with its index
    in the answer; one made once that call's frame is written goes in a call of its own."""

    async def body() -> None:
        def answer(name: str, request: Any) -> Any:
            sizes.append(len(request.rooms))
            return peer_pb2.RegisterRoomsResponse(results=[peer_pb2.RegistrationResult(code=r.room) for r in request.rooms])

        sizes: list[int] = []
        async with _serving(_Callee(answer)) as address, _caller(address) as stub:
            made = [
                stub.submit_item(REGISTER_ROOMS, peer_pb2.RegisterRoomsRequest(protocol_version=V, rooms=[peer_pb2.RegisterRoomRequest(room=r)]),
                                 "rooms", timeout=10)
                for r in (5, 6, 7)
            ]
            assert [index for _, index in made] == [0, 1, 2] and len({id(call) for call, _ in made}) == 1
            response = await made[0][0]
            assert [r.code for r in response.results] == [5, 6, 7] and sizes == [3]
            call, index = stub.submit_item(
                REGISTER_ROOMS, peer_pb2.RegisterRoomsRequest(protocol_version=V, rooms=[peer_pb2.RegisterRoomRequest(room=8)]), "rooms", timeout=10
            )
            assert index == 0 and call is not made[0][0]
            assert [r.code for r in (await call).results] == [8] and sizes == [3, 1]

    _run(body)


def test_a_broker_without_the_stream_is_refused_by_name() -> None:
    """A protocol-8 callee answers Stream UNIMPLEMENTED: the call fails FAILED_PRECONDITION, naming the protocol."""

    async def body() -> None:
        async with _serving(_Old()) as address, _caller(address) as stub:
            with pytest.raises(FailedPrecondition) as caught:
                await stub.call(PING, peer_pb2.PingRequest(), timeout=10)
            assert f"older than {PROTOCOL_VERSION}" in caught.value.message

    _run(body)


def test_a_caller_of_another_protocol_is_refused_by_name() -> None:
    """The callee refuses a StreamOpen of another version, naming both versions and the caller."""

    async def body() -> None:
        async with _serving(_Callee(_pong)) as address, grpc.aio.insecure_channel(address) as channel:
            call = peer_pb2_grpc.PeerBrokerStub(channel).Stream()
            await call.write(peer_pb2.PeerFrame(open=peer_pb2.StreamOpen(protocol_version=PROTOCOL_VERSION - 1, broker_id="old")))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = caught.value.details() or ""
            assert f"broker old speaks kvbroker protocol {PROTOCOL_VERSION - 1}" in details and f"speaks {PROTOCOL_VERSION}" in details

    _run(body)


def test_a_broken_stream_fails_the_calls_written_on_it_and_the_next_call_opens_another() -> None:
    """The callee's process goes away with a call unanswered: that call fails UNAVAILABLE (it may have been
    delivered); once a callee is back at the address, the next call goes on a new stream."""

    async def body() -> None:
        never = asyncio.Event()

        def answer(name: str, request: Any) -> Any:
            if name == "GrantCredits":
                return never.wait()
            return _pong(name, request)

        port = _free_port()
        server, address = await _serve(_Callee(answer), port)
        try:
            async with _caller(address) as stub:
                grant = asyncio.ensure_future(stub.call(GRANT_CREDITS, peer_pb2.GrantCreditsRequest(protocol_version=V), timeout=20))
                await stub.call(PING, peer_pb2.PingRequest(), timeout=10)
                await server.stop(None)
                with pytest.raises(Unavailable) as caught:
                    await grant
                assert "broke" in caught.value.message or "closed" in caught.value.message
                server, _ = await _serve(_Callee(_pong), port)
                for _ in range(100):  # the channel reconnects with backoff
                    try:
                        pong = await stub.call(PING, peer_pb2.PingRequest(), timeout=2)
                        break
                    except Unavailable:
                        await asyncio.sleep(0.1)
                assert pong.broker_id == "callee"
        finally:
            await server.stop(None)

    _run(body)


def test_a_call_not_yet_written_when_its_stream_breaks_goes_on_the_next_stream() -> None:
    """A stream breaks in the loop pass in which a ping was made, before its frame is written (here the
    break is made by hand, in that pass): the written grant fails UNAVAILABLE, as a unary call that
    broke; the ping, which the callee never saw, goes on the next stream and is answered."""

    async def body() -> None:
        callee = _Callee(_grants_never_answered(asyncio.Event()))
        async with _serving(callee) as address, _caller(address) as stub:
            grant = asyncio.ensure_future(stub.call(GRANT_CREDITS, peer_pb2.GrantCreditsRequest(protocol_version=V), timeout=20))
            await stub.call(PING, peer_pb2.PingRequest(), timeout=10)  # the grant is written, and waits at the callee
            ping = stub.stream.submit(PING, peer_pb2.PingRequest(), timeout=10)
            stream = stub.stream
            assert stream._opened is not None
            stream._break(stream._opened, Unavailable("broken by the test"))
            with pytest.raises(Unavailable):
                await grant
            assert (await ping).broker_id == "callee"
            assert callee.streams == 2 and sorted(callee.calls) == ["GrantCredits", "Ping", "Ping"]

    _run(body)


def test_a_registration_waits_for_a_stream_and_other_calls_do_not() -> None:
    """Nothing answers at the address: a ping fails UNAVAILABLE at once; a registration made
    wait_for_ready waits, and is answered by the broker that comes up there within its deadline."""

    async def body() -> None:
        port = _free_port()
        server = None
        try:
            async with _caller(f"127.0.0.1:{port}") as stub:
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(Unavailable):
                    await stub.call(PING, peer_pb2.PingRequest(), timeout=10)
                assert loop.time() - started < 5
                registration = asyncio.ensure_future(
                    stub.call(REGISTER_ROOMS, peer_pb2.RegisterRoomsRequest(protocol_version=V), timeout=20, wait_for_ready=True)
                )
                await asyncio.sleep(0.5)
                assert not registration.done()
                server, _ = await _serve(_Callee(lambda name, request: peer_pb2.RegisterRoomsResponse()), port)
                await registration
        finally:
            if server is not None:
                await server.stop(None)

    _run(body)


def test_a_call_past_its_deadline_fails_and_its_late_answer_is_dropped() -> None:
    """DEADLINE_EXCEEDED after the call's own timeout; the answer that comes later harms no other call."""

    async def body() -> None:
        slow = asyncio.Event()

        def answer(name: str, request: Any) -> Any:
            if name == "GrantCredits":

                async def later() -> peer_pb2.GrantCreditsResponse:
                    await slow.wait()
                    return peer_pb2.GrantCreditsResponse()

                return later()
            return _pong(name, request)

        async with _serving(_Callee(answer)) as address, _caller(address) as stub:
            with pytest.raises(DeadlineExceeded):
                await stub.call(GRANT_CREDITS, peer_pb2.GrantCreditsRequest(protocol_version=V), timeout=0.3)
            slow.set()
            assert (await stub.call(PING, peer_pb2.PingRequest(), timeout=10)).broker_id == "callee"

    _run(body)


def test_a_callee_that_stops_ends_its_streams_and_their_unanswered_calls_fail() -> None:
    """A stopping broker ends the streams it answers before its server stops (the server cancelling
    them left grpc's task pending, logged as an unhandled error at every shutdown): a call still
    unanswered fails UNAVAILABLE at the caller, and the caller's next call opens a new stream."""

    async def body() -> None:
        callee = _Callee(_grants_never_answered(asyncio.Event()))
        async with _serving(callee) as address, _caller(address) as stub:
            grant = asyncio.ensure_future(stub.call(GRANT_CREDITS, peer_pb2.GrantCreditsRequest(protocol_version=V), timeout=20))
            await stub.call(PING, peer_pb2.PingRequest(), timeout=10)
            callee.served.end_all()
            with pytest.raises(Unavailable):
                await grant
            assert (await stub.call(PING, peer_pb2.PingRequest(), timeout=10)).broker_id == "callee"
            assert callee.streams == 2

    _run(body)


class _LostStatusCall:
    """A stream call whose opening write fails inside gRPC: grpc.aio ends it INTERNAL, losing the status the callee sent."""

    async def write(self, frame: Any) -> None:
        raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "Internal error from Core")

    def cancel(self) -> bool:
        return False

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    async def details(self) -> str:
        return "Internal error from Core"


def test_an_opening_whose_status_grpc_lost_is_tried_again() -> None:
    """The StreamOpen write raced an old callee's UNIMPLEMENTED (CI saw the call refused
    UNAVAILABLE, "Internal error from Core"): the opening is tried again, and the next
    try hears UNIMPLEMENTED, so the call fails FAILED_PRECONDITION, naming the protocol."""

    async def body() -> None:
        async with _serving(_Old()) as address, grpc.aio.insecure_channel(address) as channel:
            real = peer_pb2_grpc.PeerBrokerStub(channel)
            opened: list[str] = []

            class Stub:
                def Stream(self) -> Any:
                    opened.append("lost" if not opened else "real")
                    return _LostStatusCall() if len(opened) == 1 else real.Stream()

            stream = PeerStream(Stub(), address, lambda: "caller")  # type: ignore[arg-type]
            with pytest.raises(FailedPrecondition) as caught:
                await stream.submit(PING, peer_pb2.PingRequest(), timeout=10)
            stream.close()
            assert opened == ["lost", "real"]
            assert f"older than {PROTOCOL_VERSION}" in caught.value.message

    _run(body)


def test_the_stream_and_the_unary_calls_answer_through_one_chain() -> None:
    """A handler that breaks (not a project error) fails INTERNAL, naming the call and not the trace; a
    request of another protocol version is refused FAILED_PRECONDITION before its handler runs; both the
    same whether the call came on the stream or unary, and every call is counted under its method."""

    async def body() -> None:
        def answer(name: str, request: Any) -> Any:
            raise ZeroDivisionError("a bug")

        callee = _Callee(answer)
        async with _serving(callee) as address, _caller(address) as stub:
            channel = stub._channel
            for way in ("stream", "unary"):
                report = peer_pb2.CompletionReport(room=1, protocol_version=PROTOCOL_VERSION)
                make = stub.call if way == "stream" else functools.partial(call_unary, channel)
                with pytest.raises(Internal) as broke:
                    await make(REPORT_COMPLETION, report, timeout=10)
                assert broke.value.message == "ReportCompletion failed inside the broker; see its log", way
                report.protocol_version = PROTOCOL_VERSION - 1
                with pytest.raises(FailedPrecondition) as refused:
                    await make(REPORT_COMPLETION, report, timeout=10)
                assert f"protocol version {PROTOCOL_VERSION - 1}" in refused.value.message, way
            assert callee.calls == ["ReportCompletion", "ReportCompletion"]  # the refused ones never reached it
            assert callee.counters.peer_calls_answered["ReportCompletion"] == 4

    _run(body)


def test_the_table_is_the_proto_and_every_call_has_exactly_one_handler() -> None:
    """Every PeerBroker method but Stream is a row, with its stream field where PeerCall carries it;
    handlers are found by their mark, and a missing or doubled one is refused by name at build."""
    assert set(PEER_METHODS) | {"Stream"} == {m.name for m in peer_pb2.DESCRIPTOR.services_by_name["PeerBroker"].methods}
    assert {m.name for m in PEER_METHODS.values() if m.field is None} == {"Handshake", "ReserveProbe", "ReleaseProbe"}
    assert PEER_METHODS["RegisterRooms"].field == "register_rooms" and PEER_METHODS["Ping"].versioned is False

    class Some:
        @answers("Ping")
        def ping(self, request: Any) -> Any:
            return peer_pb2.PingResponse()

    with pytest.raises(TypeError, match="no handler answers PeerBroker.AbortRooms"):
        handlers_of(Some())
    with pytest.raises(TypeError, match="two handlers answer PeerBroker.Ping"):
        handlers_of(Some(), Some())
    with pytest.raises(KeyError, match="no method 'Pong'"):
        answers("Pong")
