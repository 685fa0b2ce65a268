"""The sender's state machine, event by event, without gRPC or an agent: ``kvbroker.broker.sender``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbroker.broker.dataplane import XferState
from kvbroker.broker.peers import RemoteEngine
from kvbroker.broker.rooms import (
    Abort,
    BeginSend,
    Effect,
    Part,
    PostPart,
    Publish,
    ReserveStaging,
    RoomEnded,
    RoomTables,
    SendChunk,
    SenderCore,
    SendReport,
    Source,
    TransferInfo,
    cause,
)
from kvbroker.broker.telemetry import Counters, QueueStats
from kvbroker.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NixlError,
    NotFound,
    PermissionDenied,
)
from kvbroker.plan import GroupShape, PartKind, RankKey, plan_sources
from kvbroker.v1 import common_pb2, peer_pb2

FAILED = common_pb2.ROOM_STATE_FAILED
BOOTSTRAPPING = common_pb2.ROOM_STATE_BOOTSTRAPPING
WAITING = common_pb2.ROOM_STATE_WAITING_FOR_INPUT
TRANSFERRING = common_pb2.ROOM_STATE_TRANSFERRING
SUCCESS = common_pb2.ROOM_STATE_SUCCESS
DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM
D = "decode-broker"

Builder = Callable[..., Any]


def i32(values: list[int] | range) -> np.ndarray:
    return np.array(list(values), dtype=np.int32)


class Peers:
    """The peer table as the sender's state machine sees it (``sender.PeerView``)."""

    def __init__(self) -> None:
        self.remotes: dict[tuple[str, RankKey], RemoteEngine] = {}
        #: (broker, memory kind, GPU) -> size of the receive staging buffer it announced
        self.staging: dict[tuple[str, int, int], int] = {}

    def add(self, broker_id: str, engine: Any) -> RemoteEngine:
        remote = RemoteEngine(key=engine.key, generation=engine.generation, layout=engine.layout, table=engine.table)
        self.remotes[(broker_id, engine.key)] = remote
        return remote

    def remote_engine(self, broker_id: str, rank: RankKey) -> RemoteEngine | None:
        return self.remotes.get((broker_id, rank))

    def receive_staging_bytes(self, broker_id: str, kind: int, device: int) -> int:
        return self.staging.get((broker_id, kind, device), 0)

    def address_of(self, broker_id: str) -> str:
        return f"{broker_id}-host:50051"


class World:
    """One sender state machine, its tables and the effects it left."""

    def __init__(self, engine_stub: Builder, *, send_staging: int = 0) -> None:
        self.engine_stub = engine_stub
        self.rooms = RoomTables()
        self.counters = Counters(queues=QueueStats())
        self.peers = Peers()
        self.core = SenderCore(
            broker_id="prefill-broker",
            rooms=self.rooms,
            counters=self.counters,
            peers=self.peers,
            send_staging_bytes=lambda _kind, _device: send_staging,
        )

    def take(self) -> list[Effect]:
        return self.core.take()

    def info(self, source: Any, receiver: Any, room: int, pages: list[int], *, aux_row: int | None = 0, **extra: Any) -> TransferInfo:
        plans = plan_sources(
            GroupShape.of(source.layout), source.key.group, GroupShape.of(receiver.layout), receiver.key.tp_rank, receiver.key.pp_rank
        )
        return TransferInfo(
            room=room,
            receiver_broker_id=D,
            receiver=receiver.key,
            receiver_generation=receiver.generation,
            sender_group=source.key.group,
            pages=i32(pages),
            aux_row=aux_row,
            state=extra.pop("state", {}),
            sources=tuple(plans),
            **extra,
        )


@pytest.fixture
def world(engine_stub: Builder) -> World:
    return World(engine_stub)


def _posts(effects: list[Effect]) -> list[Part]:
    return [e.part for e in effects if isinstance(e, PostPart)]


def _settle_all(world: World, parts: list[Part], state: XferState = XferState.DONE) -> None:
    for part in parts:
        world.core.part_settled(part, state, 1, None)


def _pair(world: World, room: int = 1, pages: list[int] | None = None, **kw: Any) -> tuple[Any, Any, Source]:
    """A prefill engine, a decode engine the peer table knows, and an open source with its info."""
    pe = world.engine_stub("prefill", **kw)
    de = world.engine_stub("decode", **kw)
    world.peers.add(D, de)
    pages = pages if pages is not None else [4, 5, 6]
    source = world.core.begin(BeginSend(engine=pe, room=room, num_pages=len(pages)))
    world.core.transfer_info(world.info(pe, de, room, pages))
    return pe, de, source


# -- a room's whole life ----------------------------------------------------------


def test_a_source_waits_for_its_receiver_then_posts_every_chunk_and_succeeds(world: World) -> None:
    """BOOTSTRAPPING until the transfer info, WAITING_FOR_INPUT, TRANSFERRING with parts in flight,
    SUCCESS once the last chunk's parts settled DONE; each change is published, the end handed on once."""
    pe = world.engine_stub("prefill")
    de = world.engine_stub("decode")
    world.peers.add(D, de)
    source = world.core.begin(BeginSend(engine=pe, room=7, num_pages=3))
    assert source.state == BOOTSTRAPPING and world.take() == []
    world.core.transfer_info(world.info(pe, de, 7, [10, 11, 12]))
    assert source.state == WAITING and [type(e) for e in world.take()] == [Publish]
    world.core.chunk(SendChunk(engine=pe, room=7, pages=i32([1, 2]), is_last=False))
    effects = world.take()
    (first,) = _posts(effects)
    assert first.kind is PartKind.WHOLE and source.inflight == 1 and source.state == TRANSFERRING
    # K and V of 4 layers, pages 1, 2 -> receiver pages 10, 11; indices into the prepared lists.
    assert first.spec.local_indices is not None and first.spec.local_indices.size == 8 * 2
    assert first.notice.chunk_index == 0 and not first.notice.is_last and first.notice.parts == 1
    world.core.chunk(SendChunk(engine=pe, room=7, pages=i32([3]), is_last=True, aux_row=1))
    (last,) = _posts(world.take())
    assert last.notice.is_last and last.notice.total_chunks == 2 and last.notice.aux and last.notice.page_offset == 2
    _settle_all(world, [first])
    assert source.state == TRANSFERRING
    _settle_all(world, [last])
    effects = world.take()
    assert source.state == SUCCESS and source.pages_settled and source.inflight == 0
    assert [type(e) for e in effects] == [Publish, RoomEnded]
    assert source.bytes == first.nbytes + last.nbytes and world.counters.rooms_succeeded == 1


def test_chunks_before_the_transfer_info_are_posted_in_order_when_it_comes(world: World) -> None:
    """Either order works: chunks wait for the receiver's info, then go in chunk order."""
    pe, de = world.engine_stub("prefill"), world.engine_stub("decode")
    world.peers.add(D, de)
    world.core.begin(BeginSend(engine=pe, room=3, num_pages=3))
    world.core.chunk(SendChunk(engine=pe, room=3, pages=i32([1]), is_last=False))
    world.core.chunk(SendChunk(engine=pe, room=3, pages=i32([2, 3]), is_last=True, aux_row=0))
    assert _posts(world.take()) == []
    world.core.transfer_info(world.info(pe, de, 3, [7, 8, 9]))
    posted = _posts(world.take())
    assert [p.notice.chunk_index for p in posted] == [0, 1]
    assert [p.notice.page_offset for p in posted] == [0, 1]


def test_lesson1_aux_goes_on_a_last_chunk_with_no_pages(world: World) -> None:
    """A last chunk without pages still carries the aux row (it used to be gated on state)."""
    pe, de, source = _pair(world, pages=[])
    world.take()
    world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([]), is_last=True, aux_row=2))
    (part,) = _posts(world.take())
    assert part.notice.aux and part.kind is PartKind.WHOLE and part.notice.pages == 0
    assert part.spec.carries == ("kvbroker.aux",)


def test_a_completion_only_source_sends_a_notice_on_its_last_chunk(world: World) -> None:
    """MLA tp2 -> tp1: the second prefill rank writes nothing but still completes explicitly."""
    pe = world.engine_stub("prefill", mla=True, tp_size=2, tp_rank=1)
    de = world.engine_stub("decode", mla=True)
    world.peers.add(D, de)
    source = world.core.begin(BeginSend(engine=pe, room=5, num_pages=2))
    world.core.transfer_info(world.info(pe, de, 5, [0, 1]))
    world.core.chunk(SendChunk(engine=pe, room=5, pages=i32([3, 4]), is_last=True, aux_row=0))
    (part,) = _posts(world.take())
    assert part.kind is PartKind.NOTICE and part.notice.total_chunks == 1 and part.notice.pages == 0
    world.core.part_settled(part, XferState.DONE, 0, None)
    assert source.state == SUCCESS


# -- failures -----------------------------------------------------------------------


def test_a_failed_part_fails_the_source_and_reports_settled_to_the_receiver(world: World) -> None:
    """An ERR settles the part: the source fails (TRANSFER), is settled, and the receiver hears both."""
    pe, _de, source = _pair(world)
    world.take()
    world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1, 2, 3]), is_last=True, aux_row=0))
    (part,) = _posts(world.take())
    world.core.part_settled(part, XferState.ERR, None, None)
    effects = world.take()
    assert source.state == FAILED and source.cause is not None and source.cause.kind == common_pb2.FAILURE_KIND_TRANSFER
    # The cause names the receiver's broker by address and id, as a lost-peer cause does.
    assert f"at broker {D}-host:50051 ({D}) failed" in source.cause.message, source.cause.message
    assert source.pages_settled
    reports = [e for e in effects if isinstance(e, SendReport)]
    assert len(reports) == 1 and reports[0].report.settled and reports[0].report.HasField("failure")
    assert reports[0].broker_id == D


def test_an_abort_with_parts_in_flight_reports_settled_only_when_they_settle(world: World) -> None:
    """Lesson 7: the receiver is told of the abort at once, and that its pages are safe only later."""
    pe, _de, source = _pair(world)
    world.take()
    world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1, 2, 3]), is_last=True, aux_row=0))
    (part,) = _posts(world.take())
    world.core.abort(Abort(engine=pe, room=1, reason="client went away"))
    effects = world.take()
    (report,) = [e.report for e in effects if isinstance(e, SendReport)]
    assert source.state == FAILED and not source.pages_settled and not report.settled
    assert report.failure.message == "client went away"
    world.core.part_settled(part, XferState.DONE, 1, None)
    effects = world.take()
    (report,) = [e.report for e in effects if isinstance(e, SendReport)]
    assert report.settled and source.pages_settled


def test_a_failed_source_accepts_and_drops_later_chunks(world: World) -> None:
    """Chunks after a failure are counted, not posted (the engine's calls still validate)."""
    pe, _de, source = _pair(world)
    world.core.abort(Abort(engine=pe, room=1))
    world.take()
    index, _ = world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1, 2, 3]), is_last=True, aux_row=0))
    assert index == 0 and source.cursor == 3 and _posts(world.take()) == []


def test_the_receivers_abort_fails_sources_and_later_openers(world: World) -> None:
    """PeerAbort fails every source of the room; one opening it afterwards fails at once."""
    pe, de, source = _pair(world)
    why = cause(common_pb2.FAILURE_KIND_ABORTED, "decode cancelled", D)
    assert world.core.peer_abort(1, why, D) is True
    assert source.state == FAILED and source.cause == why
    other = world.engine_stub("prefill", tp_size=2, tp_rank=1)
    late = world.core.begin(BeginSend(engine=other, room=1, num_pages=3))
    assert late.state == FAILED and late.cause == why


def test_an_abort_from_a_broker_without_a_receiver_in_the_room_is_refused(world: World) -> None:
    """Only the brokers of the room's receivers may abort it."""
    _pe, _de, source = _pair(world)
    with pytest.raises(PermissionDenied):
        world.core.peer_abort(1, cause(common_pb2.FAILURE_KIND_ABORTED, "x", "stranger"), "stranger")
    assert source.state != FAILED


def test_a_lost_receiver_broker_fails_the_sources_serving_it(world: World) -> None:
    """peer_lost fails what that broker's receivers were owed; has_business follows."""
    _pe, _de, source = _pair(world)
    assert world.core.has_business(D)
    why = cause(common_pb2.FAILURE_KIND_PEER, "gone", "prefill-broker")
    assert world.core.peer_lost(D, why) == 1
    assert source.state == FAILED and not world.core.has_business(D)


def test_page_counts_that_disagree_fail_with_mismatch(world: World) -> None:
    """BeginSend's page count and the receiver's disagree: MISMATCH naming both."""
    pe, de = world.engine_stub("prefill"), world.engine_stub("decode")
    world.peers.add(D, de)
    source = world.core.begin(BeginSend(engine=pe, room=2, num_pages=3))
    world.core.transfer_info(world.info(pe, de, 2, [1, 2]))
    assert source.state == FAILED and source.cause is not None
    assert source.cause.kind == common_pb2.FAILURE_KIND_MISMATCH and "expects 2" in source.cause.message


def test_a_post_that_cannot_be_planned_fails_the_source(world: World) -> None:
    """A receiver that re-registered (its generation changed) cannot be written: the source fails."""
    pe, de, source = _pair(world)
    world.peers.remotes[(D, de.key)].generation = 99
    world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1, 2, 3]), is_last=True, aux_row=0))
    assert source.state == FAILED and source.cause is not None and "is gone" in source.cause.message
    assert _posts(world.take()) == []


# -- bad input ---------------------------------------------------------------------


def test_bad_chunks_are_refused_and_change_nothing(world: World) -> None:
    """Out-of-range pages, too many pages, aux on a non-last chunk: INVALID_ARGUMENT before any record."""
    pe, _de, source = _pair(world)
    world.take()
    with pytest.raises(InvalidArgument, match="out of range"):
        world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([16]), is_last=False))
    with pytest.raises(InvalidArgument, match="declared 3"):
        world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1, 2, 3, 4]), is_last=False))
    with pytest.raises(InvalidArgument, match="last chunk"):
        world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1]), is_last=False, aux_row=0))
    with pytest.raises(InvalidArgument, match="must carry aux_row"):
        world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1, 2, 3]), is_last=True))
    assert source.chunk_list == [] and source.cursor == 0 and world.take() == []
    with pytest.raises(NotFound):
        world.core.chunk(SendChunk(engine=pe, room=99, pages=i32([1]), is_last=True, aux_row=0))


def test_a_room_is_opened_once_per_rank(world: World) -> None:
    """A second BeginSend of the same rank is ALREADY_EXISTS; so is a tombstoned room id."""
    pe, _de, _source = _pair(world)
    with pytest.raises(AlreadyExists):
        world.core.begin(BeginSend(engine=pe, room=1, num_pages=3))
    world.rooms.tombstones[("sender", 42)] = 1e12
    with pytest.raises(AlreadyExists, match="unique"):
        world.core.begin(BeginSend(engine=pe, room=42, num_pages=1))


def test_transfer_infos_are_checked_against_what_the_receiver_announced(world: World) -> None:
    """The receiver's broker checked its pages; the sender checks again, and trusts only a known generation."""
    pe, de = world.engine_stub("prefill"), world.engine_stub("decode")
    with pytest.raises(Aborted, match="handshake again"):
        world.core.transfer_info(world.info(pe, de, 1, [0]))
    world.peers.add(D, de)
    with pytest.raises(InvalidArgument, match="receiver decode-group/tp0/pp0 pages: index 16"):
        world.core.transfer_info(world.info(pe, de, 1, [16]))
    world.core.transfer_info(world.info(pe, de, 1, [0]))
    world.core.transfer_info(world.info(pe, de, 1, [0]))  # the same registration again: fine
    again = world.info(pe, de, 1, [0])
    world.peers.add("another-decode-broker", de)
    with pytest.raises(FailedPrecondition, match="registered once"):
        world.core.transfer_info(dataclasses.replace(again, receiver_broker_id="another-decode-broker"))


# -- sources that never come ------------------------------------------------------


def test_a_source_whose_engine_died_first_is_reported_and_cannot_reopen_the_room(world: World) -> None:
    """The receiver is told the source will never open the room; a restarted engine of the same rank
    opening it later fails at once and posts nothing (its bytes would land in pages the receiver
    may have reused since)."""
    pe, de = world.engine_stub("prefill"), world.engine_stub("decode")
    world.peers.add(D, de)
    world.core.transfer_info(world.info(pe, de, 9, [1, 2]))
    why = cause(common_pb2.FAILURE_KIND_ENGINE_LOST, "engine rank prefill-group/tp0/pp0 went away", "prefill-broker")
    world.core.engine_gone(pe, why)
    (report,) = [e.report for e in world.take() if isinstance(e, SendReport)]
    assert report.settled and report.failure == why
    restarted = world.engine_stub("prefill")
    source = world.core.begin(BeginSend(engine=restarted, room=9, num_pages=2))
    assert source.state == FAILED and source.cause is not None
    assert source.cause.kind == common_pb2.FAILURE_KIND_ENGINE_LOST and "cannot be opened again" in source.cause.message
    world.core.chunk(SendChunk(engine=restarted, room=9, pages=i32([3, 4]), is_last=True, aux_row=0))
    assert _posts(world.take()) == []


def test_timeouts_fail_waiting_sources_and_answer_orphan_infos(world: World) -> None:
    """A source without its transfer info times out; an info whose source never opens is answered."""
    pe, de = world.engine_stub("prefill"), world.engine_stub("decode")
    world.peers.add(D, de)
    waiting = world.core.begin(BeginSend(engine=pe, room=1, num_pages=1))
    other = world.engine_stub("prefill", tp_size=2, tp_rank=1)
    world.core.transfer_info(world.info(other, de, 2, [0]))
    now = waiting.opened_at + 1000
    world.core.tick(now, info_timeout_seconds=10, orphan_timeout_seconds=10)
    assert waiting.state == FAILED and waiting.cause is not None and waiting.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT
    reports = [e.report for e in world.take() if isinstance(e, SendReport)]
    assert any(r.room == 2 and "did not open the room" in r.failure.message for r in reports)


def test_a_renewed_lease_runs_from_the_renewal_for_waiting_sources_of_that_group(world: World) -> None:
    """RenewLeases: a source still waiting for its receivers waits from the renewal again; one of
    another group, one that ended, and a room not opened here are left alone; the timeout names
    the renewal."""
    pe, other = world.engine_stub("prefill"), world.engine_stub("prefill", group="other-group")
    waiting = world.core.begin(BeginSend(engine=pe, room=1, num_pages=1))
    elsewhere = world.core.begin(BeginSend(engine=other, room=1, num_pages=1))
    start = max(waiting.opened_at, elsewhere.opened_at)
    assert world.core.renew_lease(1, "prefill-group", start + 8) == [waiting]
    assert world.core.renew_lease(2, "prefill-group", start + 8) == []
    world.core.tick(start + 12, info_timeout_seconds=10, orphan_timeout_seconds=1000)
    assert waiting.state == common_pb2.ROOM_STATE_BOOTSTRAPPING
    assert elsewhere.state == FAILED
    assert world.core.renew_lease(1, "other-group", start + 12) == []  # ended: no lease to renew
    world.core.tick(start + 18.5, info_timeout_seconds=10, orphan_timeout_seconds=1000)
    assert waiting.state == FAILED and waiting.cause is not None and waiting.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT
    assert "since the last lease renewal" in waiting.cause.message, waiting.cause.message


# -- staging ------------------------------------------------------------------------


def test_a_staged_part_reserves_at_the_receiver_before_it_is_posted(engine_stub: Builder) -> None:
    """tp2 -> tp1 (the sender's slice is its whole token): the pages are written into room the
    receiver reserves first (ReserveStaging), the post once the slot is known; the prefetch record
    goes when the part settles."""
    world = World(engine_stub, send_staging=1 << 20)
    pe = engine_stub("prefill", tp_size=2)
    de = engine_stub("decode")
    world.peers.add(D, de)
    world.peers.staging[(D, DRAM, 0)] = 1 << 20
    source = world.core.begin(BeginSend(engine=pe, room=4, num_pages=2))
    world.core.transfer_info(world.info(pe, de, 4, [0, 1]))
    world.take()
    world.core.chunk(SendChunk(engine=pe, room=4, pages=i32([5, 6]), is_last=True, aux_row=0))
    effects = world.take()
    (part,) = [e.part for e in effects if isinstance(e, ReserveStaging)]
    assert part.kind is PartKind.STAGED and part not in _posts(effects) and source.inflight == 2
    world.core.staging_reserved(part, peer_pb2.RemoteBuffer(size_bytes=1 << 20, kind=DRAM), 8192)
    assert _posts(world.take()) == [part]
    assert part.notice.staged and part.notice.staging_offset == 8192 and part.notice.staging_bytes == part.nbytes
    assert source.destinations[de.key].prefetch == {part.key: 8192}
    _settle_all(world, _posts(effects) + [part])
    assert source.state == SUCCESS and source.destinations[de.key].prefetch == {}


def test_vram_moves_packed_through_transfer_buffers_on_the_receivers_own_gpu(engine_stub: Builder) -> None:
    """The receiver's KV is on GPU 1: a receive buffer the peer announced on GPU 0 does not serve
    it, and nothing else may carry VRAM (engine VRAM is never a NIXL target): the room fails naming
    the missing buffer. With one on GPU 1 the head slice moves as one PACKED part, reserved at the
    receiver like a staged part; the aux row (host memory on both sides) goes directly."""
    pe = engine_stub("prefill", tp_size=2)
    de = engine_stub("decode", memory_kind=VRAM, device=1)
    outcomes = []
    for announced in (0, 1):
        world = World(engine_stub, send_staging=1 << 20)
        world.peers.add(D, de)
        world.peers.staging[(D, VRAM, announced)] = 1 << 20
        source = world.core.begin(BeginSend(engine=pe, room=4, num_pages=2))
        world.core.transfer_info(world.info(pe, de, 4, [0, 1]))
        world.core.chunk(SendChunk(engine=pe, room=4, pages=i32([5, 6]), is_last=True, aux_row=0))
        effects = world.take()
        reserved = [e.part for e in effects if isinstance(e, ReserveStaging)]
        outcomes.append((source.state, [p.kind for p in reserved], [p.kind for p in _posts(effects)]))
        if reserved:
            [packed] = reserved
            notice = packed.notice
            assert notice.packed and (notice.packed_kv_begin, notice.packed_kv_end) == (0, 2) and not notice.packed_aux
            assert notice.kv_packed and not notice.aux_packed and packed.spec.pools == ((DRAM, 0), (VRAM, 1))
        else:
            assert "the receiver none for GPU 1" in source.cause.message
    assert outcomes == [(FAILED, [], []), (TRANSFERRING, [PartKind.PACKED], [PartKind.WHOLE])]


def test_a_packed_chunk_is_cut_to_half_the_smaller_transfer_buffer(engine_stub: Builder) -> None:
    """Parts are at most half of either side's buffer (so consecutive parts overlap), cut by pages;
    every part is reserved at the receiver and counted in flight; the aux row (host memory here)
    goes directly, as a part of its own."""
    pe = engine_stub("prefill", memory_kind=VRAM, device=0)
    de = engine_stub("decode", memory_kind=VRAM, device=0)
    page = pe.layout.kv_page_bytes * len(pe.layout.kv_regions)  # one page of every KV region
    world = World(engine_stub, send_staging=8 * page)
    world.peers.add(D, de)
    world.peers.staging[(D, VRAM, 0)] = 6 * page  # parts of at most 3 pages
    source = world.core.begin(BeginSend(engine=pe, room=9, num_pages=7))
    world.core.transfer_info(world.info(pe, de, 9, list(range(7))))
    world.core.chunk(SendChunk(engine=pe, room=9, pages=i32(range(7)), is_last=True, aux_row=0))
    effects = world.take()
    parts = [e.part for e in effects if isinstance(e, ReserveStaging)]
    assert [(p.notice.packed_kv_begin, p.notice.packed_kv_end, p.notice.packed_aux) for p in parts] == [
        (0, 3, False), (3, 6, False), (6, 7, False)
    ]
    [aux] = _posts(effects)
    assert aux.kind is PartKind.WHOLE and aux.spec.carries == ("kvbroker.aux",) and aux.notice.part == 0
    assert [p.notice.part for p in parts] == [1, 2, 3] and {p.notice.parts for p in [aux, *parts]} == {4}
    assert [p.nbytes for p in parts] == [3 * page, 3 * page, page] and source.inflight == 4


def test_a_gathered_part_is_posted_without_the_receivers_staging(engine_stub: Builder) -> None:
    """tp1 -> tp2 (the receiver's slice is its whole token): the sender packs into its own send
    staging and writes into the receiver's pages; no ReserveStaging, no staged notice."""
    world = World(engine_stub, send_staging=1 << 20)
    pe = engine_stub("prefill")
    ranks = [engine_stub("decode", tp_size=2, tp_rank=r) for r in (0, 1)]
    for de in ranks:
        world.peers.add(D, de)
    source = world.core.begin(BeginSend(engine=pe, room=4, num_pages=2))
    for de in ranks:
        world.core.transfer_info(world.info(pe, de, 4, [0, 1]))
    world.take()
    world.core.chunk(SendChunk(engine=pe, room=4, pages=i32([5, 6]), is_last=True, aux_row=0))
    effects = world.take()
    gathered = [p for p in _posts(effects) if p.kind is PartKind.GATHERED]
    assert len(gathered) == 2 and not any(isinstance(e, ReserveStaging) for e in effects)
    assert not any(p.notice.staged for p in gathered)
    _settle_all(world, _posts(effects))
    assert source.state == SUCCESS


def test_a_staged_part_whose_room_failed_meanwhile_is_not_posted(engine_stub: Builder) -> None:
    """The slot arrives after the room failed: the part settles without a write."""
    world = World(engine_stub)
    pe, de = engine_stub("prefill", tp_size=2), engine_stub("decode")
    world.peers.add(D, de)
    world.peers.staging[(D, DRAM, 0)] = 1 << 20
    source = world.core.begin(BeginSend(engine=pe, room=4, num_pages=2))
    world.core.transfer_info(world.info(pe, de, 4, [0, 1]))
    world.core.chunk(SendChunk(engine=pe, room=4, pages=i32([5, 6]), is_last=True, aux_row=0))
    effects = world.take()
    (part,) = [e.part for e in effects if isinstance(e, ReserveStaging)]
    world.core.abort(Abort(engine=pe, room=4))
    for whole in _posts(effects):
        world.core.part_settled(whole, XferState.DONE, 1, None)
    world.core.staging_reserved(part, peer_pb2.RemoteBuffer(size_bytes=1 << 20, kind=DRAM), 0)
    assert _posts(world.take()) == [] and source.inflight == 0 and source.pages_settled


def test_without_staging_head_slices_go_per_token(world: World) -> None:
    """No staging buffers: the head slice is one TOKENS part."""
    pe, de = world.engine_stub("prefill"), world.engine_stub("decode", tp_size=2)
    world.peers.add(D, de)
    world.core.begin(BeginSend(engine=pe, room=4, num_pages=2))
    world.core.transfer_info(world.info(pe, de, 4, [0, 1]))
    world.core.chunk(SendChunk(engine=pe, room=4, pages=i32([5, 6]), is_last=True, aux_row=0))
    kinds = [p.kind for p in _posts(world.take())]
    assert PartKind.TOKENS in kinds and PartKind.STAGED not in kinds


def test_a_part_that_could_not_be_posted_fails_with_its_error(world: World) -> None:
    """An error raised by the post (NIXL rejected it) becomes the cause."""
    pe, _de, source = _pair(world)
    world.core.chunk(SendChunk(engine=pe, room=1, pages=i32([1, 2, 3]), is_last=True, aux_row=0))
    (part,) = _posts(world.take())
    world.core.part_settled(part, XferState.ERR, None, NixlError("NIXL could not post the transfer: boom"))
    assert source.cause is not None and source.cause.kind == common_pb2.FAILURE_KIND_TRANSFER and "boom" in source.cause.message


def test_a_verified_chunk_leaves_its_checksum_to_the_executor_and_reads_no_memory(world: World) -> None:
    """With the receiver verifying, the sender's core only describes what to hash (the engine stand-in
    has no memory to read): every part of the chunk shares one ChunkChecksum, which says what to hash
    and holds no value, and no notice carries one (the executor adds it to the notice's bytes as it
    posts; it never writes the room's record)."""
    pe, de = world.engine_stub("prefill"), world.engine_stub("decode")
    world.peers.add(D, de)
    world.core.begin(BeginSend(engine=pe, room=9, num_pages=3))
    world.core.transfer_info(world.info(pe, de, 9, [4, 5, 6], verify_checksum=True))
    world.take()
    world.core.chunk(SendChunk(engine=pe, room=9, pages=i32([1, 2, 3]), is_last=True, aux_row=1))
    parts = _posts(world.take())
    assert parts
    holders = {id(part.checksum) for part in parts}
    (holder,) = [part.checksum for part in parts[:1]]
    assert len(holders) == 1 and holder is not None and not hasattr(holder, "value")
    assert holder.what.who == "sender" and list(holder.what.pages) == [1, 2, 3] and holder.what.aux_row == 1
    assert not any(part.notice.HasField("checksum") for part in parts)
