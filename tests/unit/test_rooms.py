"""Room records and the room state machine: ``kvbroker.broker.rooms``."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvbroker.broker.memory import CreditRange, StagingReservation
from kvbroker.broker.rooms import (
    Chunk,
    Destination,
    Receiver,
    ReceiverRoom,
    RoomTables,
    SenderLeg,
    SenderRoom,
    Side,
    Source,
    SourceExpectation,
    TransferInfo,
    cause,
    cause_of,
)
from kvbroker.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NixlError,
    NotFound,
    Unavailable,
    Unimplemented,
)
from kvbroker.plan import RankKey, SourcePlan
from kvbroker.v1 import common_pb2, peer_pb2

FAILED = common_pb2.ROOM_STATE_FAILED
LEG = SenderLeg("p-broker", "p-host:1")
BOOTSTRAPPING = common_pb2.ROOM_STATE_BOOTSTRAPPING
WAITING = common_pb2.ROOM_STATE_WAITING_FOR_INPUT
TRANSFERRING = common_pb2.ROOM_STATE_TRANSFERRING
SUCCESS = common_pb2.ROOM_STATE_SUCCESS
ORDER = [FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS]

TTL, TOMBSTONE_TTL, ORPHAN = 10.0, 30.0, 60.0


class Recorder:
    """A listener that records (state, pages_settled) at every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.progress: list[Side] = []

    def __call__(self, progress: Side) -> None:
        self.calls.append((progress.state, progress.pages_settled))
        self.progress.append(progress)


def engine(group: str = "g", tp: int = 0, pp: int = 0) -> Any:
    """A stand-in for an Engine: Side only reads ``key`` (and ``engine_id``)."""
    return SimpleNamespace(
        key=RankKey(group, tp, pp), engine_id=f"e-{group}-{tp}-{pp}", layout=SimpleNamespace(page_size_tokens=16)
    )


def failure(
    message: str = "boom", kind: int = common_pb2.FAILURE_KIND_ABORTED
) -> common_pb2.FailureCause:
    return cause(kind, message, "broker-a")


def source(room: int = 1, listener: Recorder | None = None, **kwargs: Any) -> Source:
    return Source(room=room, engine=engine(**kwargs), listener=listener or Recorder())


def receiver(room: int = 1, listener: Recorder | None = None, **kwargs: Any) -> Receiver:
    return Receiver(room=room, engine=engine(**kwargs), listener=listener or Recorder())


PROGRESS_TYPES = [Source, Receiver]


# -- the state machine ---------------------------------------------------------


def test_state_order_matches_design() -> None:
    """FAILED < BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS."""
    assert ORDER == sorted(ORDER)
    assert ORDER == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_new_progress(cls: type[Side]) -> None:
    """A new record is BOOTSTRAPPING, without cause, unsettled, keyed by its engine."""
    listener = Recorder()
    p = cls(room=7, engine=engine("d", 2, 1), listener=listener)
    assert (p.state, p.cause, p.finished_at, p.pages_settled, p.terminal) == (
        BOOTSTRAPPING,
        None,
        None,
        False,
        False,
    )
    assert p.key == RankKey("d", 2, 1)
    assert listener.calls == []


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_timeline_keeps_the_first_time_of_each_event_in_order(cls: type[Side], monkeypatch: pytest.MonkeyPatch) -> None:
    """mark() notes an event once; the timeline lists events by time, ties in their canonical order."""
    p = cls(room=7, engine=engine(), listener=Recorder())
    t0 = p.opened_ns / 1e9
    clock = iter([t0 + 1, t0 + 2, t0 + 3, t0 + 3])
    monkeypatch.setattr(time, "time", lambda: next(clock))  # the wall clock the sides stamp with
    p.mark("registered")
    p.mark("registered")  # noted once: the clock is not read again
    p.mark("first_byte")
    p.mark("settled")
    p.mark("success")  # the same instant as "settled": listed before it
    events = [name for name, _ in p.timeline]
    assert events == ["opened", "registered", "first_byte", "success", "settled"]
    assert dict(p.timeline)["registered"] == t0 + 1 and p.timeline[0][1] == t0
    with pytest.raises(KeyError):
        p.mark("no such event")


def test_per_room_records_have_no_instance_dict() -> None:
    """Every per-room record is slotted: a broker holds one of each per open room (scale_rooms)."""
    for record in (source(), receiver(), SenderRoom(1), ReceiverRoom(1), _info(1), Destination(info=_info(1), plan=_plan())):
        assert not hasattr(record, "__dict__"), type(record).__name__


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_advance_forward(cls: type[Side]) -> None:
    """Forward moves succeed, call the listener once each, and may skip states."""
    listener = Recorder()
    p = cls(room=1, engine=engine(), listener=listener)
    assert p.advance(WAITING)
    assert p.advance(SUCCESS)  # skips TRANSFERRING
    assert listener.calls == [(WAITING, False), (SUCCESS, True)]
    assert listener.progress == [p, p]


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
@pytest.mark.parametrize(
    "start,target",
    [
        (WAITING, WAITING),
        (TRANSFERRING, WAITING),
        (TRANSFERRING, BOOTSTRAPPING),
        (BOOTSTRAPPING, BOOTSTRAPPING),
    ],
)
def test_advance_backward_or_same_refused(cls: type[Side], start: int, target: int) -> None:
    """Advancing to a lower or equal state returns False and does not call the listener."""
    listener = Recorder()
    p = cls(room=1, engine=engine(), listener=listener)
    if start != BOOTSTRAPPING:
        assert p.advance(start)
    before = list(listener.calls)
    assert not p.advance(target)
    assert p.state == start
    assert listener.calls == before


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_advance_to_failed_refused(cls: type[Side]) -> None:
    """advance(FAILED) is refused: failing needs fail() and a cause."""
    listener = Recorder()
    p = cls(room=1, engine=engine(), listener=listener)
    assert not p.advance(FAILED)
    assert (p.state, p.cause, listener.calls) == (BOOTSTRAPPING, None, [])


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_fail_keeps_first_cause(cls: type[Side]) -> None:
    """FAILED keeps the first cause; a second fail returns False without a listener call."""
    listener = Recorder()
    p = cls(room=1, engine=engine(), listener=listener)
    p.advance(TRANSFERRING)
    first, second = (
        failure("first", common_pb2.FAILURE_KIND_PEER),
        failure("second", common_pb2.FAILURE_KIND_TIMEOUT),
    )
    assert p.fail(first)
    assert (p.state, p.cause, p.terminal) == (FAILED, first, True)
    assert p.finished_at is not None
    calls = list(listener.calls)
    assert not p.fail(second)
    assert p.cause == first
    assert listener.calls == calls
    # A failed record never moves again.
    assert not p.advance(SUCCESS)
    assert p.state == FAILED
    assert listener.calls == calls


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_fail_does_not_settle_pages(cls: type[Side]) -> None:
    """A failure alone does not mark the pages settled (transfers may still write)."""
    p = cls(room=1, engine=engine(), listener=Recorder())
    p.fail(failure())
    assert not p.pages_settled


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_success_is_terminal(cls: type[Side]) -> None:
    """SUCCESS sets pages_settled and finished_at; later advances and fails are refused."""
    listener = Recorder()
    p = cls(room=1, engine=engine(), listener=listener)
    assert p.advance(SUCCESS)
    assert p.terminal and p.pages_settled and p.finished_at is not None
    finished = p.finished_at
    assert not p.fail(failure())
    assert (p.state, p.cause, p.finished_at) == (SUCCESS, None, finished)
    assert not p.advance(SUCCESS)
    assert listener.calls == [(SUCCESS, True)]


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_mark_settled_once(cls: type[Side]) -> None:
    """mark_settled calls the listener only the first time."""
    listener = Recorder()
    p = cls(room=1, engine=engine(), listener=listener)
    p.fail(failure())
    p.mark_settled()
    p.mark_settled()
    assert listener.calls == [(FAILED, False), (FAILED, True)]


@pytest.mark.parametrize("cls", PROGRESS_TYPES)
def test_status(cls: type[Side]) -> None:
    """status() carries room, state, cause, pages_settled, chunks and bytes."""
    p = cls(room=2**63 + 5, engine=engine(), listener=Recorder())
    p.advance(TRANSFERRING)
    p.chunks, p.bytes = 3, 12345
    status = p.status()
    assert (status.room, status.state, status.chunks, status.bytes, status.pages_settled) == (
        2**63 + 5,
        TRANSFERRING,
        3,
        12345,
        False,
    )
    assert not status.HasField("cause")
    why = failure("peer gone", common_pb2.FAILURE_KIND_PEER)
    p.fail(why)
    p.mark_settled()
    status = p.status()
    assert status.state == FAILED
    assert status.HasField("cause")
    assert status.cause == why
    assert status.pages_settled
    # The status holds a copy of the cause.
    status.cause.message = "changed"
    assert p.cause is not None and p.cause.message == "peer gone"


def test_cause_builder() -> None:
    """cause() fills kind, message and origin broker."""
    c = cause(common_pb2.FAILURE_KIND_TIMEOUT, "waited 30 s for chunks", "b1")
    assert (c.kind, c.message, c.origin_broker) == (
        common_pb2.FAILURE_KIND_TIMEOUT,
        "waited 30 s for chunks",
        "b1",
    )


@pytest.mark.parametrize(
    "error,kind",
    [
        (NixlError("post rejected"), common_pb2.FAILURE_KIND_TRANSFER),
        (Unavailable("peer down"), common_pb2.FAILURE_KIND_PEER),
        (DeadlineExceeded("slow"), common_pb2.FAILURE_KIND_PEER),
        (FailedPrecondition("layouts differ"), common_pb2.FAILURE_KIND_MISMATCH),
        (Unimplemented("head slicing"), common_pb2.FAILURE_KIND_MISMATCH),
        (InvalidArgument("bad index"), common_pb2.FAILURE_KIND_MISMATCH),
        (Internal("bug"), common_pb2.FAILURE_KIND_UNSPECIFIED),
        (NotFound("no engine"), common_pb2.FAILURE_KIND_UNSPECIFIED),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else common_pb2.FailureKind.Name(v),
)
def test_cause_of(error: Any, kind: int) -> None:
    """cause_of maps NixlError to TRANSFER, Unavailable to PEER, mismatches to MISMATCH."""
    c = cause_of(error, "origin-1")
    assert (c.kind, c.message, c.origin_broker) == (kind, error.message, "origin-1")


def test_nixl_error_is_transfer_not_peer() -> None:
    """NixlError subclasses Unavailable but still maps to TRANSFER."""
    assert isinstance(NixlError("x"), Unavailable)
    assert cause_of(NixlError("x"), "o").kind == common_pb2.FAILURE_KIND_TRANSFER


# -- tables -----------------------------------------------------------------------


SIZE_KEYS = {
    "sender_rooms",
    "sender_sources",
    "sender_chunks",
    "sender_destinations",
    "transfer_infos",
    "inflight_transfers",
    "receiver_rooms",
    "receiver_ranks",
    "receiver_expected_sources",
    "tombstones",
    "successor_notices",
    "prefetch_requests",
    "staging_reservations",
    "credits_held",
    "landing_gates",
}


def _plan(tp: int = 0) -> SourcePlan:
    return SourcePlan(RankKey("g", tp, 0), peer_pb2.SOURCE_MODE_FULL_PAGES, 1, 0, 4, True, True)


def _info(room: int, receiver_tp: int = 0, created: float = 0.0) -> TransferInfo:
    return TransferInfo(
        room=room,
        receiver_broker_id="rb",
        receiver=RankKey("d", receiver_tp, 0),
        receiver_generation=1,
        sender_group="p",
        pages=np.arange(3, dtype=np.int32),
        aux_row=0,
        state={},
        sources=(_plan(),),
        received_at=created,
    )


def _finish(p: Side, at: float, *, ok: bool = True) -> None:
    if ok:
        p.advance(SUCCESS)
    else:
        p.fail(failure())
    p.finished_at = at
    p.settled_at = at if p.pages_settled else None


def test_sizes_empty() -> None:
    """sizes() names every per-room table, all zero when empty."""
    sizes = RoomTables().sizes()
    assert set(sizes) == SIZE_KEYS
    assert set(sizes.values()) == {0}


def test_sizes_counts_everything() -> None:
    """sizes() counts rooms, sources, chunks, destinations, infos, inflight, ranks, expectations, tombstones."""
    tables = RoomTables()
    src = source(room=1)
    src.chunk_list.extend(
        Chunk(
            index=i,
            pages=np.arange(2, dtype=np.int32),
            page_offset=2 * i,
            is_last=i == 2,
            aux_row=None,
            state={},
        )
        for i in range(3)
    )
    info = _info(1)
    src.destinations[info.receiver] = Destination(info=info, plan=_plan(), prefetch={(0, 0): 4096})
    src.inflight = 2
    tables.sender[1] = SenderRoom(
        room=1, sources={src.key: src}, infos={info.receiver: info, RankKey("d", 1, 0): _info(1, 1)}
    )
    rcv = receiver(room=1, group="d")
    rcv.expected = {
        RankKey("p", 0, 0): SourceExpectation(
            plan=_plan(0), leg=LEG, expects_aux=True, expected_components=frozenset()
        ),
        RankKey("p", 1, 0): SourceExpectation(
            plan=_plan(1), leg=LEG, expects_aux=False, expected_components=frozenset()
        ),
    }
    rcv.staging[(RankKey("p", 0, 0), 0, 0)] = ((common_pb2.MEMORY_KIND_DRAM, 0), StagingReservation(offset=0, nbytes=4096))
    rcv.credits[(RankKey("p", 1, 0), 0, 0)] = ((common_pb2.MEMORY_KIND_VRAM, 0), CreditRange(0, 4096, "pb", 7))
    rcv2 = receiver(room=2, group="d", tp=1)  # expected is None: counts 0
    tables.receiver[1] = ReceiverRoom(room=1, ranks={rcv.key: rcv})
    tables.receiver[2] = ReceiverRoom(room=2, ranks={rcv2.key: rcv2})
    tables.tombstones[("sender", 9)] = 100.0
    tables.successor_notices[("127.0.0.1:1", 3)] = (failure(), 100.0)
    assert tables.sizes() == {
        "sender_rooms": 1,
        "sender_sources": 1,
        "sender_chunks": 3,
        "sender_destinations": 1,
        "transfer_infos": 2,
        "inflight_transfers": 2,
        "receiver_rooms": 2,
        "receiver_ranks": 2,
        "receiver_expected_sources": 2,
        "tombstones": 1,
        "successor_notices": 1,
        "prefetch_requests": 1,
        "staging_reservations": 1,
        "credits_held": 1,
        "landing_gates": 0,
    }
    assert list(tables.all_sources()) == [src]
    assert list(tables.all_receivers()) == [rcv, rcv2]


@pytest.mark.parametrize("ok", [True, False], ids=["success", "failed"])
def test_evict_terminal_after_ttl(ok: bool) -> None:
    """Terminal records go once finished TTL ago; their emptied room goes and is tombstoned."""
    tables = RoomTables()
    rcv = receiver(room=5)
    tables.receiver[5] = ReceiverRoom(room=5, ranks={rcv.key: rcv}, created_at=0.0)
    _finish(rcv, at=100.0, ok=ok)
    assert tables.evict(100.0 + TTL - 0.5, TTL, TOMBSTONE_TTL, ORPHAN) == 0
    assert 5 in tables.receiver
    assert tables.evict(100.0 + TTL, TTL, TOMBSTONE_TTL, ORPHAN) == 2  # the record and its room
    assert tables.receiver == {}
    assert tables.is_tombstoned("receiver", 5)
    assert not tables.is_tombstoned("sender", 5)
    assert tables.tombstones == {("receiver", 5): 100.0 + TTL + TOMBSTONE_TTL}


def test_evict_counts_the_ttl_from_when_pages_settled() -> None:
    """A failed receiver whose pages settle late stays pollable a whole TTL after settling
    (regression: it was evicted at once, so an engine waiting for pages_settled never saw it)."""
    tables = RoomTables()
    rcv = receiver(room=6)
    tables.receiver[6] = ReceiverRoom(room=6, ranks={rcv.key: rcv}, created_at=0.0)
    _finish(rcv, at=100.0, ok=False)
    assert not rcv.pages_settled
    assert tables.evict(100.0 + 5 * TTL, TTL, TOMBSTONE_TTL, ORPHAN, unsettled_ttl_seconds=100 * TTL) == 0
    rcv.mark_settled()
    rcv.settled_at = 100.0 + 5 * TTL
    assert tables.evict(100.0 + 5 * TTL + 0.1, TTL, TOMBSTONE_TTL, ORPHAN, unsettled_ttl_seconds=100 * TTL) == 0
    assert tables.evict(100.0 + 6 * TTL, TTL, TOMBSTONE_TTL, ORPHAN, unsettled_ttl_seconds=100 * TTL) == 2


def test_evict_keeps_non_terminal() -> None:
    """Non-terminal records stay however old they are."""
    tables = RoomTables()
    src = source(room=1)
    src.advance(TRANSFERRING)
    rcv = receiver(room=1)
    tables.sender[1] = SenderRoom(room=1, sources={src.key: src}, created_at=0.0, opened={src.key})
    tables.receiver[1] = ReceiverRoom(room=1, ranks={rcv.key: rcv}, created_at=0.0)
    assert tables.evict(1e9, TTL, TOMBSTONE_TTL, ORPHAN) == 0
    assert tables.sender[1].sources == {src.key: src}
    assert tables.receiver[1].ranks == {rcv.key: rcv}
    assert tables.tombstones == {}


def test_evict_only_expired_members() -> None:
    """In a room, only the expired terminal members go; the room stays while any remain."""
    tables = RoomTables()
    done = receiver(room=3, tp=0)
    busy = receiver(room=3, tp=1)
    _finish(done, at=0.0)
    tables.receiver[3] = ReceiverRoom(room=3, ranks={done.key: done, busy.key: busy}, created_at=0.0)
    assert tables.evict(TTL, TTL, TOMBSTONE_TTL, ORPHAN) == 1
    assert tables.receiver[3].ranks == {busy.key: busy}
    assert not tables.is_tombstoned("receiver", 3)


def test_evict_keeps_source_with_inflight_transfers() -> None:
    """A terminal source with transfers in flight stays until they drain."""
    tables = RoomTables()
    src = source(room=4)
    _finish(src, at=0.0, ok=False)
    src.inflight = 1
    tables.sender[4] = SenderRoom(room=4, sources={src.key: src}, created_at=0.0, opened={src.key})
    assert tables.evict(1000.0, TTL, TOMBSTONE_TTL, ORPHAN) == 0
    assert 4 in tables.sender
    src.inflight = 0
    assert tables.evict(1000.0, TTL, TOMBSTONE_TTL, ORPHAN) == 2
    assert tables.sender == {}
    assert tables.is_tombstoned("sender", 4)


def test_evict_sender_room_takes_its_infos() -> None:
    """A sender room whose sources all went takes its transfer infos with it."""
    tables = RoomTables()
    src = source(room=6)
    _finish(src, at=0.0)
    info = _info(6)
    tables.sender[6] = SenderRoom(
        room=6,
        sources={src.key: src},
        infos={info.receiver: info},
        created_at=0.0,
        opened={src.key},
    )
    tables.evict(TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert tables.sender == {}
    assert tables.sizes()["transfer_infos"] == 0


def test_empty_receiver_room_removed_and_tombstoned() -> None:
    """A receiver room with no ranks is removed and tombstoned once it is as
    old as the shortest wait (eviction looks at no room younger)."""
    tables = RoomTables()
    tables.receiver[8] = ReceiverRoom(room=8, created_at=50.0)
    assert tables.evict(50.0 + TTL - 0.1, TTL, TOMBSTONE_TTL, ORPHAN) == 0
    assert tables.evict(50.0 + TTL, TTL, TOMBSTONE_TTL, ORPHAN) == 1
    assert tables.receiver == {}
    assert tables.is_tombstoned("receiver", 8)


def test_tombstones_expire() -> None:
    """Tombstones are dropped once their TTL has passed, and not before."""
    tables = RoomTables()
    tables.receiver[8] = ReceiverRoom(room=8, created_at=0.0)
    tables.evict(TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert tables.is_tombstoned("receiver", 8)
    assert tables.evict(TTL + TOMBSTONE_TTL - 0.1, TTL, TOMBSTONE_TTL, ORPHAN) == 0
    assert tables.is_tombstoned("receiver", 8)
    tables.evict(TTL + TOMBSTONE_TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert not tables.is_tombstoned("receiver", 8)
    assert tables.sizes()["tombstones"] == 0


@pytest.mark.parametrize("notice_ttl", [None, 500.0])
def test_successor_notices_expire(notice_ttl: float | None) -> None:
    """A notice for the next broker at an address is kept for its TTL (default: the tombstone TTL), then dropped."""
    ttl = TOMBSTONE_TTL if notice_ttl is None else notice_ttl
    tables = RoomTables()
    tables.successor_notices[("127.0.0.1:1", 3)] = (failure(), 100.0)
    tables.evict(100.0 + ttl - 0.1, TTL, TOMBSTONE_TTL, ORPHAN, notice_ttl_seconds=notice_ttl)
    assert tables.sizes()["successor_notices"] == 1
    tables.evict(100.0 + ttl, TTL, TOMBSTONE_TTL, ORPHAN, notice_ttl_seconds=notice_ttl)
    assert tables.sizes()["successor_notices"] == 0


def test_orphan_sender_room_waits_for_begin_send() -> None:
    """A sender room holding only transfer infos stays until the orphan timeout, then goes."""
    tables = RoomTables()
    info = _info(11)
    tables.sender[11] = SenderRoom(room=11, infos={info.receiver: info}, created_at=100.0)
    assert not tables.sender[11].opened
    assert tables.evict(100.0 + ORPHAN - 0.1, TTL, TOMBSTONE_TTL, ORPHAN) == 0
    assert tables.sender[11].infos == {info.receiver: info}
    assert tables.evict(100.0 + ORPHAN, TTL, TOMBSTONE_TTL, ORPHAN) == 1
    assert tables.sender == {}
    assert tables.is_tombstoned("sender", 11)
    assert tables.sizes()["transfer_infos"] == 0


def test_sender_room_that_had_sources_goes_at_once() -> None:
    """A sender room whose sources went does not wait for the orphan timeout."""
    tables = RoomTables()
    src = source(room=12)
    _finish(src, at=100.0)
    tables.sender[12] = SenderRoom(
        room=12, sources={src.key: src}, created_at=100.0, opened={src.key}
    )
    tables.evict(100.0 + TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert tables.sender == {}


def test_sender_room_stays_for_a_source_that_never_opened_it() -> None:
    """A room one source finished stays while a receiver still waits for another source that never
    opened it (until the orphan timeout, or until that receiver was told), then goes with its infos."""
    tables = RoomTables()
    src = source(room=13)
    _finish(src, at=100.0)
    info = _info(13, created=100.0)
    other = _plan(tp=1)
    info = replace(info, sources=(_plan(), other))
    room = tables.sender[13] = SenderRoom(room=13, sources={src.key: src}, infos={info.receiver: info}, created_at=100.0, opened={src.key})
    assert [rank for _, rank in room.unserved()] == [other.rank]
    tables.evict(100.0 + TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert room.sources == {} and tables.sender == {13: room}
    room.abandoned[(info.receiver, other.rank)] = failure()  # the receiver was told
    assert list(room.unserved()) == []
    tables.evict(100.0 + TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert tables.sender == {} and tables.sizes()["transfer_infos"] == 0
    # Without the telling, the orphan timeout bounds the stay.
    tables.sender[14] = SenderRoom(room=14, infos={info.receiver: info}, created_at=100.0, opened={src.key})
    assert tables.evict(100.0 + ORPHAN - 0.1, TTL, TOMBSTONE_TTL, ORPHAN) == 0
    assert tables.evict(100.0 + ORPHAN, TTL, TOMBSTONE_TTL, ORPHAN) == 1


def test_evict_idle_tables_return_to_zero() -> None:
    """After everything finished and TTLs passed, every table is back to zero."""
    tables = RoomTables()
    for room in range(3):
        src, rcv = source(room=room), receiver(room=room)
        _finish(src, at=0.0)
        _finish(rcv, at=0.0, ok=room != 1)
        tables.sender[room] = SenderRoom(
            room=room,
            sources={src.key: src},
            infos={RankKey("d", 0, 0): _info(room)},
            created_at=0.0,
            opened={src.key},
        )
        tables.receiver[room] = ReceiverRoom(room=room, ranks={rcv.key: rcv}, created_at=0.0)
    tables.evict(TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert tables.sizes()["tombstones"] == 6
    tables.evict(TTL + TOMBSTONE_TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert set(tables.sizes().values()) == {0}


def test_evict_looks_at_no_room_younger_than_the_shortest_wait() -> None:
    """Eviction walks the rooms in the order they were made and stops at the
    first one younger than the shortest wait (the TTL here): a room behind it
    is not looked at, even one whose rank would be expired (a room made out
    of that order), until the rooms before it are old enough too."""
    tables = RoomTables()
    old, young, behind = receiver(room=1), receiver(room=2), receiver(room=3)
    for rank in (old, young, behind):
        _finish(rank, at=0.0)
    tables.receiver[1] = ReceiverRoom(room=1, ranks={old.key: old}, created_at=0.0)
    tables.receiver[2] = ReceiverRoom(room=2, ranks={young.key: young}, created_at=5.0)
    tables.receiver[3] = ReceiverRoom(room=3, ranks={behind.key: behind}, created_at=0.0)
    assert tables.evict(TTL, TTL, TOMBSTONE_TTL, ORPHAN) == 2  # room 1 and its rank
    assert list(tables.receiver) == [2, 3]
    assert tables.evict(5.0 + TTL, TTL, TOMBSTONE_TTL, ORPHAN) == 4
    assert tables.receiver == {}


def test_tallies_count_the_sides_held_by_state_as_they_change() -> None:
    """The room gauges' tallies equal a count over every record, and their
    unfinished sides the records not over, through opening, every change of
    state, settling and eviction (no scan needed)."""
    tables = RoomTables()

    def counted() -> dict[tuple[str, int], int]:
        return {(kind, state): n for kind, tally in tables.tallies.items() for state, n in tally.counts.items() if n}

    def scanned() -> dict[tuple[str, int], int]:
        found: dict[tuple[str, int], int] = {}
        for kind, sides in (("sender", tables.all_sources()), ("receiver", tables.all_receivers())):
            for side in sides:
                found[(kind, side.state)] = found.get((kind, side.state), 0) + 1
        # ... and the sides not over are those the tallies list.
        assert set(tables.unfinished_sources()) == {s for s in tables.all_sources() if not s.over}
        assert set(tables.unfinished_receivers()) == {r for r in tables.all_receivers() if not r.over}
        return found

    sources = [source(room=r) for r in range(4)]
    ranks = [receiver(room=r) for r in range(4)]
    sources[3].fail(failure())  # failed before it was held: counted as it is
    for src, rank in zip(sources, ranks, strict=True):
        tables.add_source(tables.sender.setdefault(src.room, SenderRoom(src.room, created_at=0.0, opened=(src.key,))), src)
        tables.add_receiver(tables.receiver.setdefault(rank.room, ReceiverRoom(rank.room, created_at=0.0)), rank)
    assert counted() == scanned() == {("sender", BOOTSTRAPPING): 3, ("sender", FAILED): 1, ("receiver", BOOTSTRAPPING): 4}
    sources[0].advance(TRANSFERRING)
    _finish(sources[1], at=0.0)
    _finish(ranks[0], at=0.0, ok=False)
    _finish(ranks[1], at=0.0)
    ranks[2].advance(WAITING)
    ranks[2].advance(WAITING)  # no change, not counted twice
    assert counted() == scanned()
    assert sources[3] in tables.unfinished_sources() and ranks[0] in tables.unfinished_receivers()  # failed, unsettled
    sources[3].mark_settled()
    assert counted() == scanned() and sources[3] not in tables.unfinished_sources()
    assert counted()[("receiver", WAITING)] == 1
    sources[3].settled_at = sources[3].finished_at = 0.0
    assert ranks[1] not in tables.unfinished_receivers()
    tables.evict(TTL, TTL, TOMBSTONE_TTL, ORPHAN)
    assert counted() == scanned() == {
        ("sender", TRANSFERRING): 1,
        ("sender", BOOTSTRAPPING): 1,
        ("receiver", WAITING): 1,
        ("receiver", BOOTSTRAPPING): 1,
    }


def test_source_ready() -> None:
    """A source is ready once as many destinations registered as it expects."""
    src = source()
    assert not src.ready()
    src.expected_destinations = 2
    info = _info(1)
    src.destinations[info.receiver] = Destination(info=info, plan=_plan())
    assert not src.ready()
    other = _info(1, receiver_tp=1)
    src.destinations[other.receiver] = Destination(info=other, plan=_plan())
    assert src.ready()


def test_transfer_info_plan_for() -> None:
    """plan_for finds a source's plan by its full rank key, or None."""
    info = _info(1)
    assert info.plan_for(RankKey("g", 0, 0)) == _plan()
    assert info.plan_for(RankKey("p", 1, 0)) is None


def test_source_expectation_counts() -> None:
    """chunks_landed counts chunks with every part in; pages_landed sums pages; landed_positions
    lists the positions of the chunks with every part in."""
    exp = SourceExpectation(plan=_plan(), leg=LEG, expects_aux=True, expected_components=frozenset())
    assert exp.part_landed(0, 0, 2) is False and exp.part_landed(1, 0, 1) is True
    assert exp.parts_received == {0: 0b01, 1: 0b01}  # bit i: part i
    exp.chunk_pages = {0: (0, 4), 1: (4, 3)}
    assert exp.chunks_landed() == 1 and exp.landed_positions(0, 16) == {4, 5, 6}
    assert exp.has_part(0, 0) and not exp.has_part(0, 1) and exp.parts_of(0) == 1
    assert exp.part_landed(0, 1, 2) is True
    assert exp.chunks_landed() == 2 and exp.parts_of(0) == 2
    assert exp.pages_landed() == 7 and exp.landed_positions(0, 16) == set(range(7))
    # A later notice that says the chunk has more parts: it is no longer whole, and not counted.
    assert exp.part_landed(1, 1, 3) is False and exp.chunks_landed() == 1
    assert exp.part_landed(1, 0, 3) is False and exp.part_landed(1, 2, 3) is True and exp.chunks_landed() == 2
    exp.total_chunks = 2
    assert exp.all_parts_landed()


def test_a_transfer_infos_indices_are_read_only_once_built() -> None:
    """A receiver's registration (TransferInfo), kept by every destination it feeds, holds its page
    and state indices read-only and its state as a mapping of its own: nothing can change them later."""
    state = {"c": np.array([1], dtype=np.int32)}
    info = TransferInfo(
        room=1,
        receiver_broker_id="rb",
        receiver=RankKey("d", 0, 0),
        receiver_generation=1,
        sender_group="p",
        pages=np.arange(3, dtype=np.int32),
        aux_row=0,
        state=state,
        sources=(_plan(),),
    )
    state["d"] = np.array([2], dtype=np.int32)
    assert list(info.state) == ["c"]
    for indices in (info.pages, info.state["c"]):
        with pytest.raises(ValueError, match="read-only"):
            indices[0] = 9
    with pytest.raises(TypeError):
        info.state["e"] = state["d"]  # type: ignore[index]
