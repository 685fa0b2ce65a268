"""The engine session stream: ordering, refusals, backpressure, resuming, a restarted broker.

In-process brokers with the fake NIXL agent (``fake_brokers``), except the
restart test, which runs ``kvbroker serve`` processes over real NIXL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvbroker import errors
from kvbroker.client import BrokerClient, EngineMemory, ExpectSpec, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, Cleanup, TcpGate, eventually, scratch_dir
from kvbroker.v1 import common_pb2, transfer_pb2

from .conftest import SMALL_MODEL, fill_regions, page_bytes
from .test_service import DST, SRC, _assert_moved, _pair, _wait_tables_empty


def test_each_rooms_commands_arrive_in_order_from_many_threads(fake_brokers, make_engine) -> None:
    """Eight threads each drive their own rooms (open, three chunks, the last with aux) at
    once through one session per engine: every room succeeds, byte-exact, and the
    broker applied every command exactly once."""
    p, d, pe, de = _pair(fake_brokers, make_engine, num_pages=64)
    ref = SenderRef(p.address, "prefill-group")
    threads, rooms_per_thread = 8, 12
    errors_seen: list[BaseException] = []

    def drive(t: int) -> None:
        try:
            for i in range(rooms_per_thread):
                room = 1000 + t * rooms_per_thread + i
                de.handle.receiver(room, ref).init(DST, aux_row=2)
                sender = pe.handle.sender(room)
                sender.init(len(SRC), aux_row=1)
                sender.send(SRC[:2], is_last=False)
                sender.send(SRC[2:4], is_last=False)
                sender.send(SRC[4:])
        except BaseException as exc:  # pragma: no cover - reported below
            errors_seen.append(exc)

    workers = [threading.Thread(target=drive, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors_seen
    rooms = [1000 + i for i in range(threads * rooms_per_thread)]
    finished = de.handle.wait(rooms, timeout_seconds=30)
    assert all(s.state == RoomState.SUCCESS for s in finished.values()), [s for s in finished.values() if s.state != RoomState.SUCCESS][:2]
    assert all(s.state == RoomState.SUCCESS for s in pe.handle.wait(rooms, timeout_seconds=30).values())
    _assert_moved(pe, de, SRC, DST)
    pe.handle.flush()
    # 1 BeginSend + 3 SendChunk per room, each applied once.
    assert p.loop.call(lambda: p.broker.queries.engine(pe.handle.engine_id).applied) == 4 * len(rooms)


def test_a_refused_chunk_fails_its_room_once_with_the_brokers_message(fake_brokers, make_engine) -> None:
    """A command only the broker can refuse (here a chunk built by hand past the local
    checks) fails the room on both sides with FAILURE_KIND_REFUSED and the broker's
    message; the first cause stays, and ``failure_exception`` raises it."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(30, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(30)
    sender.init(len(SRC), aux_row=1)
    bad = transfer_pb2.SendChunkRequest(room=30, pages=common_pb2.PageIndices(values=[1, 99]), is_last=False)
    pe.handle.session.submit_many([(30, lambda seq: transfer_pb2.SessionCommand(seq=seq, send_chunk=bad))])
    status = sender.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_REFUSED
    assert "INVALID_ARGUMENT" in status.cause.message and "out of range" in status.cause.message
    with pytest.raises(errors.RoomFailed, match="out of range"):
        sender.failure_exception()
    # The decode side hears of it as the sender's failure; nothing was written.
    rstat = receiver.wait(10)
    assert rstat.state == RoomState.FAILED and "out of range" in rstat.cause.message
    eventually(lambda: receiver.status().pages_settled)
    # Later commands of the failed room are dropped here, and the cause does not change.
    sender.send(SRC[:2], is_last=False)
    pe.handle.flush()
    assert sender.status().cause == status.cause
    assert p.agent.posted == 0


def test_a_refused_opening_fails_only_that_room(fake_brokers, make_engine) -> None:
    """ExpectRoom refused by the broker (its peer address is malformed... here: a draining
    broker) fails that room with the refusal; the engine's other rooms carry on."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    ref = SenderRef(p.address, "prefill-group")
    d.loop.run(d.broker.routes.operators.set_draining(True))
    refused = de.handle.receiver(40, ref)
    refused.init(DST, aux_row=2)
    status = refused.wait(10)
    assert status.cause.kind == common_pb2.FAILURE_KIND_REFUSED and "draining" in status.cause.message
    assert status.pages_settled
    d.loop.run(d.broker.routes.operators.set_draining(False))
    de.handle.receiver(41, ref).init(DST, aux_row=2)
    sender = pe.handle.sender(41)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC)
    assert de.handle.wait([41], timeout_seconds=10)[41].state == RoomState.SUCCESS


def test_local_checks_raise_at_once_and_queue_nothing(fake_brokers, make_engine) -> None:
    """What the client can check against the engine's own layout raises in the calling
    thread, before anything is queued."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    ref = SenderRef(p.address, "prefill-group")
    before = de.handle.session._next_seq
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        de.handle.receiver(50, ref).init([0, 32], aux_row=2)
    with pytest.raises(errors.InvalidArgument, match="aux_row"):
        de.handle.receiver(50, ref).init([0, 1], aux_row=4)
    with pytest.raises(errors.FailedPrecondition, match="ROLE_DECODE"):
        pe.handle.receiver(50, ref).init([0, 1])
    assert de.handle.session._next_seq == before
    de.handle.receiver(50, ref).init([0, 1], aux_row=2)
    with pytest.raises(errors.AlreadyExists):
        de.handle.receiver(50, ref).init([0, 1], aux_row=2)
    sender = pe.handle.sender(50)
    with pytest.raises(errors.NotFound, match="BeginSend"):
        sender.send([0])
    sender.init(2, aux_row=1)
    with pytest.raises(errors.InvalidArgument, match="declared 2"):
        sender.send([0, 1, 2])
    with pytest.raises(errors.InvalidArgument, match="aux_row"):
        pe.handle.sender(51).init(1, aux_row=9)
    opened = pe.handle.session._next_seq
    with pytest.raises(errors.InvalidArgument, match="num_pages 33 exceeds the engine's 32 pages"):
        pe.handle.sender(52).init(33, aux_row=1)  # the pool's size is known here: checked at once, not REFUSED later
    assert pe.handle.session._next_seq == opened and not pe.handle.session.is_tracked(52)
    sender.send([0, 1])
    with pytest.raises(errors.FailedPrecondition, match="last chunk"):
        sender.send([0])
    assert de.handle.wait([50], timeout_seconds=10)[50].state == RoomState.SUCCESS


def test_an_aux_row_set_after_opening_goes_with_the_last_chunk(fake_brokers, make_engine) -> None:
    """SGLang's order: open the room with no page count, learn the aux row later
    (set_aux_row, checked like init's), end it with an explicit last chunk."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    de.handle.receiver(55, SenderRef(p.address, "prefill-group")).init([0, 1], aux_row=2)
    sender = pe.handle.sender(55)
    sender.init(0)
    with pytest.raises(errors.InvalidArgument, match="aux_row"):
        sender.set_aux_row(9)
    sender.set_aux_row(1)
    sender.send([0], is_last=False)
    sender.send([1], is_last=True)
    with pytest.raises(errors.FailedPrecondition, match="last chunk"):
        sender.set_aux_row(0)
    status = de.handle.wait([55], timeout_seconds=10)[55]
    assert status.state == RoomState.SUCCESS
    assert bytes(de.memory.aux[0][2]) == bytes(pe.memory.aux[0][1])


def test_send_returns_without_waiting_for_the_broker(fake_brokers, make_engine) -> None:
    """While the broker's loop is stalled, init and send still return at once: the
    calls queue, and the room completes once the broker catches up."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    de.handle.receiver(60, SenderRef(p.address, "prefill-group")).init(DST, aux_row=2)
    de.handle.flush()
    stall, resumed = threading.Event(), threading.Event()

    def stalled_loop() -> None:  # blocks both brokers' loop until the calls are made
        stall.wait(30.0)
        resumed.set()

    p.loop.loop.call_soon_threadsafe(stalled_loop)
    try:
        sender = pe.handle.sender(60)
        sender.init(len(SRC), aux_row=1)
        sender.send(SRC)
        # They returned while the broker could apply nothing: they did not wait for it.
        assert not resumed.is_set()
        assert sender.poll() == RoomState.BOOTSTRAPPING
    finally:
        stall.set()
    assert de.handle.wait([60], timeout_seconds=10)[60].state == RoomState.SUCCESS


def test_a_flooding_engine_blocks_at_its_bound_then_gets_resource_exhausted(fake_brokers, make_engine) -> None:
    """At most ``max_pending`` commands wait for the broker; the next call blocks for
    the client's timeout and then raises RESOURCE_EXHAUSTED. Nothing queued is lost."""
    p = fake_brokers("p")
    pe = make_engine(p.address, "prefill")
    pe.handle.session._max_pending = 8
    pe.handle.client.timeout_seconds = 0.3
    stall = threading.Event()
    p.loop.loop.call_soon_threadsafe(stall.wait, 10.0)
    try:
        for room in range(70, 78):
            pe.handle.sender(room).init(2, aux_row=1)
        t = time.monotonic()
        with pytest.raises(errors.ResourceExhausted, match="8 commands"):
            pe.handle.sender(78).init(2, aux_row=1)
        assert time.monotonic() - t >= 0.25
    finally:
        stall.set()
    pe.handle.client.timeout_seconds = 30.0
    pe.handle.flush()
    statuses = pe.handle.poll(list(range(70, 78)))
    assert all(s.state == RoomState.BOOTSTRAPPING for s in statuses.values())
    assert p.tables()["sender_sources"] == 8
    for room in range(70, 78):
        pe.handle.sender(room).abort("test over")


def test_a_broken_stream_to_the_same_broker_resumes_without_losing_rooms(fake_brokers, make_engine) -> None:
    """The stream breaks (here cancelled under the session) while rooms are open: the
    session reconnects to the same broker process, sends again what was not applied
    (the broker skips what was), and the rooms complete."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    ref = SenderRef(p.address, "prefill-group")
    for room in (80, 81):
        de.handle.receiver(room, ref).init(DST if room == 80 else DST[:2], aux_row=2)
    senders = {room: pe.handle.sender(room) for room in (80, 81)}
    senders[80].init(len(SRC), aux_row=1)
    senders[80].send(SRC[:3], is_last=False)
    pe.handle.flush()
    call = pe.handle.session._call
    assert call is not None
    call.cancel()
    senders[80].send(SRC[3:])
    senders[81].init(2, aux_row=1)
    senders[81].send(SRC[:2])
    final = de.handle.wait([80, 81], timeout_seconds=15)
    assert all(s.state == RoomState.SUCCESS for s in final.values()), final
    sent = pe.handle.wait([80, 81], timeout_seconds=15)
    assert all(s.state == RoomState.SUCCESS for s in sent.values()), sent
    _assert_moved(pe, de, SRC, DST)
    assert pe.handle.session._call is not call
    assert p.loop.call(lambda: p.broker.queries.engine(pe.handle.engine_id).applied) == 5


def test_batch_calls_open_and_send_many_rooms(fake_brokers, make_engine, monkeypatch) -> None:
    """``EngineHandle.expect`` and ``EngineHandle.send`` take a batch: checked as a
    whole (one bad room queues none), then each room behaves as if opened alone.
    The decode broker registers rooms opened together in fewer RegisterRooms calls and frames
    of its peer stream than rooms (items of one call)."""
    p, d, pe, de = _pair(fake_brokers, make_engine, num_pages=64)
    ref = SenderRef(p.address, "prefill-group")
    calls: set[int] = set()
    rooms_sent: list[int] = []
    written: dict[str, Any] = {}
    real_stub = d.broker.internals.transport.client.caller

    class CountingStub:
        def __init__(self, stub: object) -> None:
            self._stub = stub

        def __getattr__(self, name: str) -> object:
            return getattr(self._stub, name)

        def submit_item(self, method, request, items, **kwargs):  # type: ignore[no-untyped-def]
            call, index = self._stub.submit_item(method, request, items, **kwargs)
            if method.name == "RegisterRooms":
                stream = self._stub.stream
                written.setdefault("before", (stream.calls_written, stream.frames_written))
                written["stream"] = stream
                calls.add(id(call))
                rooms_sent.append(index)
            return call, index

    monkeypatch.setattr(d.broker.internals.transport.client, "caller", lambda peer: CountingStub(real_stub(peer)))
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        de.handle.expect([ExpectSpec(90, ref, DST, aux_row=2), ExpectSpec(91, ref, [0, 99], aux_row=2)])
    assert not de.handle.session.is_tracked(90)
    rooms = list(range(90, 100))
    receivers = de.handle.expect([ExpectSpec(r, ref, DST, aux_row=2) for r in rooms])
    assert [r.room for r in receivers] == rooms
    senders = [pe.handle.sender(r) for r in rooms]
    for s in senders:
        s.init(len(SRC), aux_row=1)
    assert pe.handle.send([(s, SRC[:3]) for s in senders]) == [0] * len(rooms)
    # Defaults as for KVSender.send: the chunk that reaches num_pages is the last.
    assert pe.handle.send([(s, SRC[3:]) for s in senders]) == [1] * len(rooms)
    assert all(s.state == RoomState.SUCCESS for s in de.handle.wait(rooms, timeout_seconds=15).values())
    _assert_moved(pe, de, SRC, DST)
    assert len(rooms_sent) == len(rooms) and len(calls) < len(rooms), (rooms_sent, len(calls))
    calls_before, frames_before = written["before"]
    stream = written["stream"]
    frames = stream.frames_written - frames_before
    assert stream.calls_written - calls_before >= len(calls) and frames < len(rooms), (stream.calls_written, frames)


def test_finished_rooms_are_forgotten_beyond_the_window(fake_brokers, make_engine) -> None:
    """The session keeps the statuses of the newest finished rooms only; an older one is
    asked of the broker, so an engine that runs forever holds bounded memory."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    de.handle.session._finished_kept = 2
    ref = SenderRef(p.address, "prefill-group")
    for room in (110, 111, 112):
        de.handle.receiver(room, ref).init(DST, aux_row=2)
        sender = pe.handle.sender(room)
        sender.init(len(SRC), aux_row=1)
        sender.send(SRC)
        assert de.handle.wait([room], timeout_seconds=10)[room].state == RoomState.SUCCESS
    assert not de.handle.session.is_tracked(110)
    assert de.handle.session.is_tracked(111) and de.handle.session.is_tracked(112)
    assert de.handle.poll([110])[110].state == RoomState.SUCCESS  # from the broker (Poll)
    _wait_tables_empty(p, d)


# -- a restarted broker: real processes -------------------------------------------------


@pytest.fixture
def workdir() -> Iterator[Path]:
    with scratch_dir("kvb-session-") as path:
        yield path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(address: str, role: str, group: str) -> tuple[BrokerClient, object, EngineMemory]:
    rank = RankSpec(group=group, role=role)  # type: ignore[arg-type]
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=32, aux_rows=4, aux_row_bytes=[16])
    if role == "prefill":
        fill_regions(memory, 3)
    # A restart within the bound (a loaded machine may take seconds to start the next process).
    client = BrokerClient(address, broker_lost_after_seconds=60)
    return client, client.register_engine(rank, memory), memory


@pytest.mark.nixl
def test_a_restarted_broker_fails_the_open_rooms_and_the_engine_registers_again(workdir: Path) -> None:
    """The prefill broker is killed and started again on the same addresses, within the client's
    bound, while the prefill engine has a room open: that room fails BROKER_LOST (its pages
    settled: the old process is gone), the session registers the engine with the new process by
    itself, and the next room moves byte-exact."""
    port = _free_port()
    extra = ["--log-level", "warning", "--peer-heartbeat", "0.2", "--peer-dead-after", "1"]
    d = BrokerProcess.start_many(["d"], workdir, extra)[0]
    p = BrokerProcess.start_many(["p"], workdir, [*extra, "--listen", f"127.0.0.1:{port}"])[0]
    pc, prefill, pmem = _engine(p.address, "prefill", "pg")
    dc, decode, dmem = _engine(d.address, "decode", "dg")
    try:
        ref = SenderRef(p.address, "pg")
        decode.receiver(1, ref).init([0, 1], aux_row=0)  # type: ignore[attr-defined]
        sender = prefill.sender(1)  # type: ignore[attr-defined]
        sender.init(2, aux_row=1)
        sender.send([5], is_last=False)
        prefill.flush()  # type: ignore[attr-defined]
        eventually(lambda: decode.poll([1])[1].state >= RoomState.WAITING_FOR_INPUT, 20)  # type: ignore[attr-defined]
        old_id = prefill.broker_id  # type: ignore[attr-defined]
        p.kill()
        p = BrokerProcess.start_many(["p"], workdir, [*extra, "--listen", f"127.0.0.1:{port}"])[0]
        status = sender.wait(20)
        assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_BROKER_LOST
        assert status.pages_settled and "restarted" in status.cause.message
        assert decode.wait([1], timeout_seconds=20)[1].cause.kind == common_pb2.FAILURE_KIND_PEER  # type: ignore[attr-defined]
        eventually(lambda: prefill.broker_id == p.broker_id != old_id, 20)  # type: ignore[attr-defined]
        decode.receiver(2, ref).init([2, 3], aux_row=0)  # type: ignore[attr-defined]
        again = prefill.sender(2)  # type: ignore[attr-defined]
        again.init(2, aux_row=1)
        again.send([6, 7])
        assert decode.wait([2], timeout_seconds=20)[2].state == RoomState.SUCCESS  # type: ignore[attr-defined]
        for layer in range(SMALL_MODEL.num_layers):
            for a, b in zip(page_bytes(pmem, layer, np.array([6, 7])), page_bytes(dmem, layer, np.array([2, 3]))):
                assert torch.equal(a, b)
        # A stop (SIGTERM: a rolling restart) ends the session with an error, not
        # a clean end: the engine registers with the next process the same way.
        second_id = p.broker_id
        assert p.stop() == 0
        p = BrokerProcess.start_many(["p"], workdir, [*extra, "--listen", f"127.0.0.1:{port}"])[0]
        eventually(lambda: prefill.broker_id == p.broker_id != second_id, 20)  # type: ignore[attr-defined]
        decode.receiver(3, ref).init([4], aux_row=0)  # type: ignore[attr-defined]
        third = prefill.sender(3)  # type: ignore[attr-defined]
        third.init(1, aux_row=1)
        third.send([8])
        assert decode.wait([3], timeout_seconds=20)[3].state == RoomState.SUCCESS  # type: ignore[attr-defined]
    finally:
        with Cleanup() as cleanup:
            for engine, client in ((prefill, pc), (decode, dc)):
                cleanup.run(engine.close)  # type: ignore[attr-defined]
                cleanup.run(client.close)
            cleanup.run(p.stop)
            cleanup.run(d.stop)


def _raw_session(handle: object, *requests: transfer_pb2.SessionRequest) -> tuple[object, list[transfer_pb2.SessionEvent]]:
    """Send ``requests`` on a new Session stream of ``handle``'s connection; (status code, events)."""
    import grpc

    call = handle.client.stub.Session(iter(requests), timeout=10)  # type: ignore[attr-defined]
    events: list[transfer_pb2.SessionEvent] = []
    try:
        for event in call:
            events.append(event)
    except grpc.RpcError as exc:
        return exc.code(), events
    return grpc.StatusCode.OK, events


def test_malformed_session_streams_are_refused_and_change_nothing(fake_brokers, make_engine) -> None:
    """What a broken or hostile client may send on a Session stream: each gets its
    status, the broker stays consistent, and the engine's real session carries on.
    (A separate engine rank takes the raw streams: a second stream of an engine
    replaces its first, which is the library's own business.)"""
    import grpc

    from kvbroker.protocol import PROTOCOL_VERSION

    p, d, pe, de = _pair(fake_brokers, make_engine)
    raw = make_engine(d.address, "decode", "raw-decode")
    ref = transfer_pb2.SenderRef(broker_address=p.address, group="prefill-group")
    engine_id = raw.handle.engine_id
    raw.handle.session.close(5)  # the raw streams below are this rank's only ones

    def opening(**kw: object) -> transfer_pb2.SessionRequest:
        fields = {"engine_id": engine_id, "protocol_version": PROTOCOL_VERSION, **kw}
        return transfer_pb2.SessionRequest(open=transfer_pb2.SessionOpen(**fields))  # type: ignore[arg-type]

    def expect(seq: int, room: int, pages: list[int]) -> transfer_pb2.SessionCommand:
        return transfer_pb2.SessionCommand(
            seq=seq, expect_room=transfer_pb2.ExpectRoomRequest(room=room, sender=ref, pages=common_pb2.PageIndices(values=pages), aux_row=0)
        )

    before = d.tables()
    commands = transfer_pb2.SessionRequest(commands=[expect(1, 500, [0])])
    assert _raw_session(raw.handle, commands)[0] == grpc.StatusCode.INVALID_ARGUMENT  # no SessionOpen first
    assert _raw_session(raw.handle, opening(protocol_version=1))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert _raw_session(raw.handle, opening(engine_id="eng-" + "0" * 32))[0] == grpc.StatusCode.NOT_FOUND
    assert _raw_session(raw.handle, opening(), transfer_pb2.SessionRequest(commands=[expect(2, 501, [0])]))[0] == (
        grpc.StatusCode.INVALID_ARGUMENT  # seq 2 after 0: a gap
    )
    assert d.tables() == before
    # Commands in the opening message are applied; an empty command and a bad
    # index are refused one by one; a command sent twice is applied once.
    first = transfer_pb2.SessionRequest(
        open=transfer_pb2.SessionOpen(engine_id=engine_id, protocol_version=PROTOCOL_VERSION),
        commands=[expect(1, 502, [0]), transfer_pb2.SessionCommand(seq=2), expect(3, 503, [99])],
    )
    code, events = _raw_session(raw.handle, first, transfer_pb2.SessionRequest(commands=[expect(1, 502, [0]), expect(4, 504, [1])]))
    assert code == grpc.StatusCode.OK
    refused = {r.seq: r for e in events for r in e.refused}
    assert set(refused) == {2, 3} and "out of range" in refused[3].message and refused[3].pages_settled
    assert max(e.applied for e in events) == 4
    assert d.tables()["receiver_ranks"] == before["receiver_ranks"] + 2  # rooms 502 and 504
    # The real engines' session is untouched: a room still moves.
    de.handle.receiver(505, SenderRef(p.address, "prefill-group")).init(DST, aux_row=2)
    sender = pe.handle.sender(505)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC)
    assert de.handle.wait([505], timeout_seconds=10)[505].state == RoomState.SUCCESS
    for room in (502, 504):
        d.loop.call(d.broker.routes.operators.admin_abort, room, "test over")


def test_closing_the_client_stops_its_engines_sessions_first(fake_brokers) -> None:
    """BrokerClient.close with an engine still registered through it: the session stream stops
    before the channel closes (its thread used to reconnect through the closed channel, and
    grpc crashed the process once the broker went away)."""
    from kvbroker.client import BrokerClient, EngineMemory, RankSpec

    from .conftest import SMALL_MODEL

    d = fake_brokers("d")
    rank = RankSpec("closing-decode", "decode")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=4)
    client = BrokerClient(d.address)
    handle = client.register_engine(rank, memory)
    try:
        client.close()
        assert not handle.session._reader.is_alive()
        d.stop()  # the engine's fd socket is still open: the broker drops it as it stops
    finally:
        handle._fd_session.close()  # type: ignore[union-attr]
        memory.close()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_room_that_ended_while_its_broker_was_unreachable_settles_once_it_answers(fake_brokers, make_engine, side: str) -> None:
    """The engine loses its broker for longer than its bound (the gate cuts the gRPC connection:
    a starved or partitioned broker), while the broker itself goes on and ends the room. The room
    fails here BROKER_LOST, its pages not settled; once the broker answers again the session
    resumes and learns the room's pages are settled. (It used to ask only for the rooms still open
    here: the room's end was never heard again, and a vLLM engine waited for those pages forever.)"""
    p, d = fake_brokers("p"), fake_brokers("d")
    gated_broker, other_broker = (d, p) if side == "decode" else (p, d)
    other = make_engine(other_broker.address, "prefill" if side == "decode" else "decode")
    rank = RankSpec(group=f"{side}-group", role=side)  # type: ignore[arg-type]
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=32, aux_rows=4, aux_row_bytes=[16])
    if side == "prefill":
        fill_regions(memory, 9)
    with TcpGate(gated_broker.address) as gate:
        client = BrokerClient(gate.address, prefer_unix_socket=False, broker_lost_after_seconds=1.0)
        handle = client.register_engine(rank, memory)
        try:
            ref = SenderRef(p.address, "prefill-group")
            if side == "decode":
                room = handle.receiver(90, ref)
                room.init(DST, aux_row=2)
                sender = other.handle.sender(90)
                sender.init(len(SRC), aux_row=1)
            else:
                receiver = other.handle.receiver(90, ref)
                receiver.init(DST, aux_row=2)
                room = handle.sender(90)
                room.init(len(SRC), aux_row=1)
                room.send(SRC[:2], is_last=False)
            handle.flush()
            gate.shut()
            status = room.wait(15)
            assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_BROKER_LOST, status
            assert not status.pages_settled
            if side == "decode":
                sender.send(SRC)  # the broker goes on: the room ends there
                assert sender.wait(10).state == RoomState.SUCCESS
            else:
                # The engine's abort cannot reach its broker; the receiver gives up on the room.
                receiver.abort("the decode gave up")
            eventually(lambda: gated_broker.loop.call(lambda: all(s.terminal for s in _sides_of(gated_broker, 90))), 10)
            gate.open()
            eventually(lambda: room.status().pages_settled, 15)
            assert room.status().cause.kind == common_pb2.FAILURE_KIND_BROKER_LOST, "the first cause stays"
            # The session is back: a new room moves.
            if side == "decode":
                handle.receiver(91, ref).init(DST, aux_row=2)
                sender = other.handle.sender(91)
                sender.init(len(SRC), aux_row=1)
                sender.send(SRC)
            else:
                other.handle.receiver(91, ref).init(DST, aux_row=2)
                room = handle.sender(91)
                room.init(len(SRC), aux_row=1)
                room.send(SRC)
            assert handle.wait([91], timeout_seconds=10)[91].state == RoomState.SUCCESS
        finally:
            handle.close()
            client.close()
            memory.close()


def _sides_of(broker, room: int) -> list:  # type: ignore[no-untyped-def]
    """(loop thread) Every side of ``room`` in ``broker``'s tables."""
    return list(broker.broker.queries.rooms.sides_of(room))
