"""The receiver's state machine, event by event, without gRPC or an agent: ``kvbroker.broker.receiver``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbroker.broker.memory import (
    CreditLedger,
    CreditRange,
    Grant,
    StagingReservation,
    TransferSlot,
)
from kvbroker.broker.rooms import (
    Abort,
    AbortAtPeer,
    Effect,
    ExpectRoom,
    FindSender,
    HandBackCredits,
    Landing,
    Publish,
    Receiver,
    ReceiverCore,
    RegisterRoom,
    ReleaseStaging,
    RoomEnded,
    RoomTables,
    Scatter,
    SenderLeg,
    TellSuccessor,
    VerifyChunk,
    cause,
)
from kvbroker.broker.telemetry import Counters, QueueStats
from kvbroker.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from kvbroker.plan import MAX_PARTS, RankKey, kv_block, kv_regions, landing_blocks, packed_bytes
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

FAILED = common_pb2.ROOM_STATE_FAILED
BOOTSTRAPPING = common_pb2.ROOM_STATE_BOOTSTRAPPING
WAITING = common_pb2.ROOM_STATE_WAITING_FOR_INPUT
TRANSFERRING = common_pb2.ROOM_STATE_TRANSFERRING
SUCCESS = common_pb2.ROOM_STATE_SUCCESS
P = "prefill-broker"
ADDRESS = "host-a:50051"

Builder = Callable[..., Any]


def i32(values: list[int] | range) -> np.ndarray:
    return np.array(list(values), dtype=np.int32)


class World:
    def __init__(self, engine_stub: Builder) -> None:
        self.engine_stub = engine_stub
        self.rooms = RoomTables()
        self.counters = Counters(queues=QueueStats())
        self.core = ReceiverCore(broker_id="decode-broker", rooms=self.rooms, counters=self.counters, credits=CreditLedger(), on_bytes=lambda _n: None)

    def take(self) -> list[Effect]:
        return self.core.take()

    def registered(self, room: int = 1, *, senders: list[Any] | None = None, decode: Any = None, **expect: Any) -> Receiver:
        """A rank that expected ``room``, found its sender group and registered there."""
        de = decode or self.engine_stub("decode")
        senders = senders or [self.engine_stub("prefill")]
        args: dict[str, Any] = {"pages": i32([0, 1, 2]), "aux_row": 1, "state": {}, **expect}
        rank = self.core.expect(ExpectRoom(engine=de, room=room, sender_address=ADDRESS, sender_group=senders[0].key.group, **args))
        self.core.bootstrap.sender_found(rank, P, [s.layout for s in senders])
        self.core.bootstrap.room_registered(rank, rank.legs[0], P, still_known=True)
        self.take()
        return rank


@pytest.fixture
def world(engine_stub: Builder) -> World:
    return World(engine_stub)


def notice(rank: Receiver, source: RankKey, *, chunk: int = 0, part: int = 0, parts: int = 1, last: bool = True, total: int = 1,
           pages: int = 3, aux: bool = True, components: tuple[str, ...] = (), **extra: Any) -> tuple[str, bytes]:
    message = peer_pb2.TransferNotice(
        protocol_version=PROTOCOL_VERSION,
        room=rank.room,
        sender_broker_id=P,
        source=source.to_proto(),
        receiver=rank.key.to_proto(),
        chunk_index=chunk,
        is_last=last,
        total_chunks=total if last else 0,
        pages=pages,
        parts=parts,
        part=part,
        aux=aux,
        state_components=list(components),
        bytes=100,
        **extra,
    )
    return ("prefill-agent", message.SerializeToString())


SOURCE = RankKey("prefill-group", 0, 0)


# -- a room's whole life ----------------------------------------------------------


def test_a_receiver_bootstraps_registers_and_succeeds_on_its_notices(world: World) -> None:
    """ExpectRoom -> FindSender; the plan made, RegisterRoom; registered: WAITING_FOR_INPUT;
    notices: TRANSFERRING, then SUCCESS when every part of every chunk and the aux row landed."""
    de, pe = world.engine_stub("decode"), world.engine_stub("prefill")
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="prefill-group", pages=i32([4, 5, 6]), aux_row=2))
    (find,) = world.take()
    assert isinstance(find, FindSender) and find.receiver is rank and rank.state == BOOTSTRAPPING
    world.core.bootstrap.sender_found(rank, P, [pe.layout])
    (register,) = world.take()
    assert isinstance(register, RegisterRoom) and register.broker_id == P
    request = register.request
    assert request.protocol_version == PROTOCOL_VERSION and request.sender_broker_id == P and request.aux_row == 2
    assert [s.rank.group for s in request.sources] == ["prefill-group"]
    assert rank.registered_with_sender and rank.registering
    world.core.bootstrap.room_registered(rank, rank.legs[0], P, still_known=True)
    assert rank.state == WAITING and [type(e) for e in world.take()] == [Publish]
    world.core.landing.notices([notice(rank, SOURCE, last=False, pages=2, aux=False)])
    assert rank.state == TRANSFERRING
    world.core.landing.notices([notice(rank, SOURCE, chunk=1, total=2, pages=1)])
    effects = world.take()
    assert rank.state == SUCCESS and rank.pages_settled and rank.chunks == 2
    assert [type(e) for e in effects] == [Publish, Publish, RoomEnded]


def test_lesson2_completion_counts_unique_sources(world: World) -> None:
    """tp2 -> tp1 with pp 1: two sources of pp rank 0, both awaited (keyed by tp rank too)."""
    senders = [world.engine_stub("prefill", tp_size=2, tp_rank=r) for r in (0, 1)]
    rank = world.registered(senders=senders)
    assert rank.expected is not None and len(rank.expected) == 2
    world.core.landing.notices([notice(rank, RankKey("prefill-group", 0, 0))])
    assert rank.state == TRANSFERRING
    world.core.landing.notices([notice(rank, RankKey("prefill-group", 1, 0), aux=False)])
    assert rank.state == SUCCESS


def test_lesson1_an_empty_state_list_is_not_expected(world: World, state_spec: Any) -> None:
    """A component listed with no indices is not awaited: the room completes without it."""
    spec = state_spec("swa", common_pb2.STATE_TYPE_SWA, items=8, item_bytes=32, regions=1)
    de, pe = world.engine_stub("decode", state=(spec,)), world.engine_stub("prefill", state=(spec,))
    rank = world.registered(senders=[pe], decode=de, state={"swa": i32([])})
    assert rank.state_indices == {}
    world.core.landing.notices([notice(rank, SOURCE)])
    assert rank.state == SUCCESS


def test_a_source_that_forgets_a_component_fails_the_room_naming_it(world: World, state_spec: Any) -> None:
    """Completion tracks every component it listed; a last notice without one is a MISMATCH."""
    spec = state_spec("swa", common_pb2.STATE_TYPE_SWA, items=8, item_bytes=32, regions=1)
    de, pe = world.engine_stub("decode", state=(spec,)), world.engine_stub("prefill", state=(spec,))
    rank = world.registered(senders=[pe], decode=de, state={"swa": i32([1])})
    world.core.landing.notices([notice(rank, SOURCE)])
    assert rank.state == FAILED and rank.cause is not None and "['swa']" in rank.cause.message


def test_a_chunk_of_several_parts_lands_when_all_its_parts_did(world: World) -> None:
    """Parts of one chunk (e.g. VRAM KV and DRAM aux) each carry a notice; duplicates count once."""
    rank = world.registered()
    world.core.landing.notices([notice(rank, SOURCE, part=0, parts=2)] * 2)
    assert rank.state == TRANSFERRING
    world.core.landing.notices([notice(rank, SOURCE, part=1, parts=2)])
    assert rank.state == SUCCESS


@pytest.mark.parametrize(("part", "parts"), [(2, 2), (0, MAX_PARTS + 1), (2**32 - 1, 2**32 - 1)])
def test_a_notice_for_a_part_beyond_its_count_fails_the_room(world: World, part: int, parts: int) -> None:
    """Parts are tracked as bits of an int: a part index at or past the notice's count, or a
    count beyond MAX_PARTS, is a MISMATCH (a hostile peer cannot make the broker allocate a
    4-Gbit mask), and nothing of it counts as landed."""
    rank = world.registered()
    world.core.landing.notices([notice(rank, SOURCE, part=part, parts=parts)])
    assert rank.state == FAILED and rank.cause is not None and rank.cause.kind == common_pb2.FAILURE_KIND_MISMATCH
    assert "at most" in rank.cause.message
    assert rank.expected is not None and all(not e.parts_received for e in rank.expected.values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"token_begin": 0, "token_end": 2**40}, "this rank's pages hold"),
        ({"token_begin": 9, "token_end": 3}, "this rank's pages hold"),
        ({"token_begin": 0, "token_end": 4, "page_offset": 2, "pages": 5}, "this rank has 3"),
    ],
    ids=["tokens-past-the-pages", "begin-after-end", "completes-pages-it-lacks"],
)
def test_a_token_run_notice_outside_the_ranks_pages_fails_the_room(world: World, extra: dict[str, int], message: str) -> None:
    """Different page sizes: a notice naming room tokens outside the rank's pages, or completing
    pages it does not have, is a MISMATCH naming both, and nothing of it counts as landed (its
    range would index the pages when the checksum or the landed pages are worked out)."""
    rank = world.registered()
    world.core.landing.notices([notice(rank, SOURCE, **{"pages": 3, **extra})])
    assert rank.state == FAILED and rank.cause is not None and rank.cause.kind == common_pb2.FAILURE_KIND_MISMATCH
    assert message in rank.cause.message, rank.cause.message
    assert rank.expected is not None and all(not e.parts_received for e in rank.expected.values())


# -- notices that must not create anything -----------------------------------------


def test_lesson6_notices_for_unknown_rooms_are_counted_and_dropped(world: World) -> None:
    """A late notice, a bad payload and another protocol version change no room."""
    rank = world.registered()
    stray = peer_pb2.TransferNotice(protocol_version=PROTOCOL_VERSION, room=999, receiver=rank.key.to_proto(), parts=1)
    old = peer_pb2.TransferNotice(protocol_version=PROTOCOL_VERSION - 1, room=rank.room, receiver=rank.key.to_proto(), parts=1)
    world.core.landing.notices([("a", stray.SerializeToString()), ("a", b"\xff\xffnot a notice"), ("a", old.SerializeToString())])
    assert list(world.rooms.receiver) == [1] and rank.state == WAITING
    assert world.counters.late_notices == 1 and world.counters.bad_notices == 2


def test_a_notice_from_an_unexpected_source_fails_the_room(world: World) -> None:
    """Only planned sources may write: anything else is a MISMATCH."""
    rank = world.registered()
    world.core.landing.notices([notice(rank, RankKey("prefill-group", 5, 0))])
    assert rank.state == FAILED and rank.cause is not None and rank.cause.kind == common_pb2.FAILURE_KIND_MISMATCH


# -- staging ----------------------------------------------------------------------


def _staged_rank(world: World) -> tuple[Receiver, peer_pb2.ReserveStagingRequest]:
    rank = world.registered(decode=world.engine_stub("decode", tp_size=2), pages=i32([0, 1]))
    request = peer_pb2.ReserveStagingRequest(
        protocol_version=PROTOCOL_VERSION,
        room=rank.room,
        sender_broker_id=P,
        source=SOURCE.to_proto(),
        receiver=rank.key.to_proto(),
        chunk_index=0,
        part=1,
        bytes=4096,
    )
    return rank, request


def test_a_staged_part_is_scattered_before_it_counts_and_its_reservation_goes(world: World) -> None:
    """The prefetch is recorded (idempotently); the staged notice asks for a scatter; only when the
    scatter is done does the part count, and the reservation is given back."""
    rank, request = _staged_rank(world)
    pool, held = world.core.landing.staging_wanted(request)
    assert held is None and pool == (common_pb2.MEMORY_KIND_DRAM, 0)
    reservation = StagingReservation(offset=8192, nbytes=8192)
    assert world.core.landing.staging_granted(request, pool, reservation) == reservation
    assert world.core.landing.staging_wanted(request) == (pool, reservation)
    expect = rank.expected[SOURCE]  # type: ignore[index]
    nbytes = 2 * 4 * 2 * 4 * 4 * 8 * 2  # layers x K,V x pages x page size x heads x head_dim x fp16
    world.core.landing.notices([
        notice(rank, SOURCE, part=0, parts=2, pages=2),
        notice(rank, SOURCE, part=1, parts=2, pages=2, staged=True, staging_offset=8192, staging_bytes=nbytes),
    ])
    (scatter,) = [e for e in world.take() if isinstance(e, Scatter)]
    assert rank.state == TRANSFERRING and scatter.landing.held == reservation and scatter.landing.nbytes == nbytes
    assert rank.scattering and not expect.complete
    world.core.landing.scattered(rank, scatter.landing, None)
    effects = world.take()
    assert rank.state == SUCCESS and rank.staging == {}
    assert any(isinstance(e, ReleaseStaging) and e.reservations == ((*pool, reservation),) for e in effects)


# -- receive credits ----------------------------------------------------------------


def _credited_rank(world: World) -> tuple[Receiver, tuple[int, int]]:
    """A rank whose sender broker P holds a grant of this broker's receive buffer, 64 KiB at 0."""
    ledger = CreditLedger()
    pool = (common_pb2.MEMORY_KIND_DRAM, 0)
    ledger.add(Grant("g1", P, pool, TransferSlot(0, 65536)))
    world.core = ReceiverCore(broker_id="decode-broker", rooms=world.rooms, counters=world.counters, credits=ledger, on_bytes=lambda _n: None)
    return world.registered(pages=i32([0, 1, 2]), aux_row=None), pool


def _packed(rank: Receiver, offset: int, credit_id: int, part: int = 0, parts: int = 1) -> tuple[str, bytes]:
    """A packed part of all of chunk 0's KV, written at ``offset`` in P's credits."""
    plan, layout = rank.expected[SOURCE].plan, rank.engine.layout  # type: ignore[index]
    items = kv_block(layout, kv_regions(layout, plan.layer_begin, plan.layer_end, "receiver"), rank.pages, None, tokens=False).items.size
    fields: dict[str, Any] = {"packed": True, "staged": True, "packed_kv_begin": 0, "packed_kv_end": items}
    nbytes = packed_bytes(landing_blocks(layout, plan, rank.pages, 0, None, {}, peer_pb2.TransferNotice(page_offset=0, pages=3, **fields)))
    return notice(rank, SOURCE, part=part, parts=parts, aux=False, staging_offset=offset, staging_bytes=nbytes,
                  credit_id=credit_id, **fields)


def test_a_packed_part_holds_its_senders_credit_until_scattered_and_it_goes_back_as_a_credit(world: World) -> None:
    """A packed part lands in a range of its sender's credits: the rank holds it as a credit (not a
    staging reservation) while the part is scattered. Scattered, with the lane having handed it back,
    nothing more is said; a scatter that failed (nothing handed back) returns it to its sender
    (``HandBackCredits``), never to the receive pool (``ReleaseStaging``)."""
    rank, pool = _credited_rank(world)
    world.core.landing.notices([_packed(rank, 8192, credit_id=7)])
    (scatter,) = [e for e in world.take() if isinstance(e, Scatter)]
    held = CreditRange(8192, scatter.landing.nbytes, P, 7)
    assert scatter.landing.held == held and rank.credits == {(SOURCE, 0, 0): (pool, held)} and rank.staging == {}
    world.core.landing.scattered(rank, scatter.landing, None, handed_back=True)
    effects = world.take()
    assert rank.state == SUCCESS and rank.credits == {}
    assert not any(isinstance(e, (HandBackCredits, ReleaseStaging)) for e in effects)

    rank2 = world.registered(room=2, pages=i32([0, 1, 2]), aux_row=None)
    world.core.landing.notices([_packed(rank2, 0, credit_id=8)])
    (scatter,) = [e for e in world.take() if isinstance(e, Scatter)]
    world.core.landing.scattered(rank2, scatter.landing, FailedPrecondition("the copy failed"))
    effects = world.take()
    assert rank2.state == FAILED and rank2.credits == {}
    assert [e.credits for e in effects if isinstance(e, HandBackCredits)] == [((*pool, scatter.landing.held),)]
    assert not any(isinstance(e, ReleaseStaging) for e in effects)


def test_a_packed_part_for_no_room_here_or_outside_the_grants_gives_nothing_to_the_receive_pool(world: World) -> None:
    """A packed notice for a room that is not here hands its range back to the sender at once, as a
    credit. One written outside the sender's grants fails the rank and holds nothing."""
    rank, _ = _credited_rank(world)
    payload = peer_pb2.TransferNotice.FromString(_packed(rank, 4096, credit_id=9)[1])
    payload.room = 99
    world.core.landing.notices([("prefill-agent", payload.SerializeToString())])
    effects = world.take()
    assert [e.credits for e in effects if isinstance(e, HandBackCredits)] == [((0, 0, CreditRange(4096, payload.staging_bytes, P, 9)),)]
    world.core.landing.notices([_packed(rank, 1 << 20, credit_id=10)])
    effects = world.take()
    assert rank.state == FAILED and "outside the credits" in rank.cause.message  # type: ignore[union-attr]
    assert rank.credits == {} and not any(isinstance(e, ReleaseStaging) for e in effects)


def test_a_failed_rank_returns_the_credits_of_its_landed_parts_once_their_scatter_is_done(world: World) -> None:
    """Abort racing a scatter: the rank fails while its packed part is being scattered. The range
    stays held (the scatter still reads it) and the pages unsettled; once the scatter is done, the
    range goes back to its sender as a credit and the pages settle."""
    rank, pool = _credited_rank(world)
    world.core.landing.notices([_packed(rank, 0, credit_id=11, part=0, parts=2)])
    (scatter,) = [e for e in world.take() if isinstance(e, Scatter)]
    world.core.abort(Abort(engine=rank.engine, room=rank.room, reason="the engine gave up"))
    report = peer_pb2.CompletionReport(room=rank.room, sender_broker_id=P, source=SOURCE.to_proto(), receiver=rank.key.to_proto(), settled=True)
    world.core.landing.completion_report(report)
    assert rank.state == FAILED and not rank.pages_settled and rank.credits
    assert not any(isinstance(e, HandBackCredits) for e in world.take())
    world.core.landing.scattered(rank, scatter.landing, None)
    effects = world.take()
    assert rank.pages_settled and rank.credits == {}
    assert [e.credits for e in effects if isinstance(e, HandBackCredits)] == [((*pool, scatter.landing.held),)]


def test_a_ranks_gate_opens_with_its_plan_and_a_part_taken_through_it_counts_once(world: World) -> None:
    """Once its plan is made, a rank is open to packed parts landing without the loop: its gate is in
    the tables (where the data-plane thread finds it) with the sources it expects and their sender.
    A part the thread claimed is counted when its outcome comes (``taken``), once: the same part's
    notice reaching the loop afterwards is neither scattered again nor handed back (its range is the
    claimed part's). Success shuts the gate and takes it out of the tables."""
    rank, pool = _credited_rank(world)
    gate = rank.gate
    assert gate is not None and world.rooms.gates == {(rank.room, rank.key): gate}
    assert gate.pool == pool and set(gate.sources) == {SOURCE} and gate.sources[SOURCE][1] == P
    payload = _packed(rank, 0, credit_id=21)
    notice = peer_pb2.TransferNotice.FromString(payload[1])
    key = (SOURCE, 0, 0)
    assert gate.claim(key) and not gate.claim(key) and gate.busy()
    world.core.landing.notices([payload])  # the same notice, at the loop too
    effects = world.take()
    assert effects == [] and rank.credits == {}  # (no Scatter, no HandBackCredits)
    held = CreditRange(0, notice.staging_bytes, P, 21)
    landing = Landing(key=key, pool=pool, held=held, nbytes=notice.staging_bytes, blocks=(), notice=notice)
    world.core.landing.taken(rank, landing, None, True)
    effects = world.take()
    assert rank.state == SUCCESS and not gate.busy() and world.rooms.gates == {}
    assert not gate.claim((SOURCE, 0, 1)), "shut with the rank's end"
    assert not any(isinstance(e, HandBackCredits) for e in effects)


def test_a_failed_rank_with_a_part_taken_off_the_loop_keeps_its_pages_until_that_part_is_counted(world: World) -> None:
    """Abort racing a scatter the data-plane thread started: the rank fails while a part it took is
    being scattered. The gate shuts at once (nothing more is taken), the pages stay unsettled while
    that part may still write them, and settle when its outcome is counted; a range the thread could
    not hand back goes back then (``HandBackCredits``)."""
    rank, pool = _credited_rank(world)
    gate = rank.gate
    assert gate is not None
    payload = _packed(rank, 4096, credit_id=22, part=0, parts=2)
    notice = peer_pb2.TransferNotice.FromString(payload[1])
    key = (SOURCE, 0, 0)
    assert gate.claim(key)
    world.core.abort(Abort(engine=rank.engine, room=rank.room, reason="the engine gave up"))
    report = peer_pb2.CompletionReport(room=rank.room, sender_broker_id=P, source=SOURCE.to_proto(), receiver=rank.key.to_proto(), settled=True)
    world.core.landing.completion_report(report)
    assert rank.state == FAILED and not rank.pages_settled and world.rooms.gates == {}
    assert not gate.claim((SOURCE, 0, 1))
    world.take()
    held = CreditRange(4096, notice.staging_bytes, P, 22)
    landing = Landing(key=key, pool=pool, held=held, nbytes=notice.staging_bytes, blocks=(), notice=notice)
    world.core.landing.taken(rank, landing, None, False)
    effects = world.take()
    assert rank.pages_settled and not gate.busy()
    assert [e.credits for e in effects if isinstance(e, HandBackCredits)] == [((*pool, held),)]


def test_a_staged_notice_without_a_reservation_fails_the_room(world: World) -> None:
    """A staged part this broker never reserved is refused (it could be anywhere in the buffer)."""
    rank, _ = _staged_rank(world)
    world.core.landing.notices([notice(rank, SOURCE, part=1, parts=2, pages=2, staged=True, staging_offset=0, staging_bytes=64)])
    assert rank.state == FAILED and rank.cause is not None and "did not reserve" in rank.cause.message


def test_staging_requests_for_ended_or_unknown_rooms_are_refused(world: World) -> None:
    """No reservation for a room that ended, or that is not expecting that sender."""
    rank, request = _staged_rank(world)
    world.core.abort(Abort(engine=rank.engine, room=rank.room))
    with pytest.raises(FailedPrecondition):
        world.core.landing.staging_wanted(request)
    request.room = 999
    with pytest.raises(NotFound):
        world.core.landing.staging_wanted(request)


# -- failures and settling -------------------------------------------------------------


def test_an_abort_tells_the_sender_and_settles_only_when_it_says_so(world: World) -> None:
    """Lesson 7: after an abort the pages are not free while a source may still write; the sender's
    report that it settled frees them."""
    rank = world.registered()
    world.core.abort(Abort(engine=rank.engine, room=rank.room, reason="client went away"))
    effects = world.take()
    (abort,) = [e for e in effects if isinstance(e, AbortAtPeer)]
    assert abort.broker_id == P and abort.cause.message == "client went away"
    assert rank.state == FAILED and not rank.pages_settled
    report = peer_pb2.CompletionReport(room=rank.room, sender_broker_id=P, source=SOURCE.to_proto(), receiver=rank.key.to_proto(), settled=True)
    world.core.landing.completion_report(report)
    assert rank.pages_settled


def test_a_sources_failure_report_fails_the_room_without_aborting_back(world: World) -> None:
    """The sender told us: no AbortAtPeer goes back."""
    rank = world.registered()
    why = cause(common_pb2.FAILURE_KIND_TRANSFER, "a NIXL write failed", P)
    report = peer_pb2.CompletionReport(room=1, sender_broker_id=P, source=SOURCE.to_proto(), receiver=rank.key.to_proto(), failure=why, settled=True)
    world.core.landing.completion_report(report)
    assert rank.state == FAILED and rank.pages_settled and rank.cause == why
    assert not any(isinstance(e, AbortAtPeer) for e in world.take())


def test_a_lost_sender_broker_fails_and_settles_and_its_successor_is_told(world: World) -> None:
    """A dead broker writes nothing more: FAILED (PEER), settled; the broker at that address next hears of it."""
    rank = world.registered()
    why = cause(common_pb2.FAILURE_KIND_PEER, "peer broker gone", "decode-broker")
    assert world.core.peer_lost(P, why) == 1
    assert rank.state == FAILED and rank.pages_settled
    assert (ADDRESS, 1) in world.rooms.successor_notices
    world.core.tick(rank.opened_at + 1, data_timeout_seconds=100, retry_seconds=1)
    assert [e for e in world.take() if isinstance(e, TellSuccessor)] == [TellSuccessor(ADDRESS)]
    assert world.core.successors.take(ADDRESS) == [(1, why)] and world.rooms.successor_notices == {}


def test_a_silent_sender_broker_fails_the_rank_unsettled_until_it_says_so_once_back(world: World) -> None:
    """A silent broker may still write: FAILED (PEER) at once, not settled, and not told (it is the
    one lost). Back, it is asked about the room (an abort, not remembered for a successor); its
    answer "nothing in flight" settles the rank."""
    rank = world.registered()
    world.take()
    why = cause(common_pb2.FAILURE_KIND_PEER, "peer broker has not answered", "decode-broker")
    assert world.core.peer_lost(P, why, settled=False) == 1
    assert rank.state == FAILED and not rank.pages_settled
    assert not any(isinstance(e, AbortAtPeer) for e in world.take())
    assert world.core.peer_back(P) == 1
    assert [e for e in world.take() if isinstance(e, AbortAtPeer)] == [AbortAtPeer(P, 1, why, remember=False)]
    assert not rank.pages_settled
    world.core.peer_settled(P, 1)
    assert rank.pages_settled
    assert world.core.peer_back(P) == 0, "a settled rank is not asked again"


def test_a_rank_registering_when_its_peer_is_lost_learns_where_its_room_landed(world: World) -> None:
    """A loss seen while RegisterRoom is out leaves the rank alone; the answer tells: the process that
    took it is gone, so the room fails PEER, settled."""
    de, pe = world.engine_stub("decode"), world.engine_stub("prefill")
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="prefill-group", pages=i32([0])))
    world.core.bootstrap.sender_found(rank, P, [pe.layout])
    assert world.core.peer_lost(P, cause(common_pb2.FAILURE_KIND_PEER, "gone", "decode-broker")) == 0
    world.core.bootstrap.room_registered(rank, rank.legs[0], P, still_known=False)
    assert rank.state == FAILED and rank.pages_settled and "went away while room 1 registered" in rank.cause.message  # type: ignore[union-attr]


@pytest.mark.parametrize("maybe_delivered", [True, False])
def test_a_failed_registration_settles_unless_it_may_have_reached_the_sender(world: World, maybe_delivered: bool) -> None:
    """A timeout may have delivered the room (the sender may write); a refusal did not."""
    de, pe = world.engine_stub("decode"), world.engine_stub("prefill")
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="prefill-group", pages=i32([0])))
    world.core.bootstrap.sender_found(rank, P, [pe.layout])
    world.core.bootstrap.registration_failed(rank, rank.legs[0], Unavailable("deadline"), maybe_delivered=maybe_delivered)
    assert rank.state == FAILED and rank.pages_settled is not maybe_delivered


def test_a_sender_that_cannot_be_reached_fails_the_room_and_is_remembered(world: World) -> None:
    """Bootstrapping gave up: the room fails, and the broker that answers at that address next is told."""
    de = world.engine_stub("decode")
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="prefill-group", pages=i32([0])))
    world.core.bootstrap.bootstrap_failed(rank, Unavailable("nobody home (gave up after 30 s)"))
    assert rank.state == FAILED and rank.pages_settled and rank.cause.kind == common_pb2.FAILURE_KIND_PEER  # type: ignore[union-attr]
    assert (ADDRESS, 1) in world.rooms.successor_notices


def test_a_registered_rank_times_out_waiting_for_data(world: World) -> None:
    """The data timeout runs from registration and names the sources not complete."""
    rank = world.registered()
    assert rank.registered_at is not None
    world.core.tick(rank.registered_at + 11, data_timeout_seconds=10, retry_seconds=1)
    assert rank.state == FAILED and "prefill-group/tp0/pp0" in rank.cause.message  # type: ignore[union-attr]


def test_data_still_landing_after_an_abort_settles_the_pages(world: World) -> None:
    """Once every part of a failed rank's sources landed, nothing of them is in flight: settled."""
    rank = world.registered()
    world.core.abort(Abort(engine=rank.engine, room=rank.room))
    assert not rank.pages_settled
    world.core.landing.notices([notice(rank, SOURCE)])
    assert rank.pages_settled and rank.state == FAILED


def test_the_data_plane_listens_until_a_failed_ranks_pages_settle(world: World) -> None:
    """A failed rank whose source may still write keeps the data plane polling for
    notices: the notice of that write is what settles the pages (it was left for
    the once-a-second drain, so an aborted room's pages settled up to 1 s late)."""
    rank = world.registered()
    assert world.core.ranks_awaiting_data() == 1
    world.core.abort(Abort(engine=rank.engine, room=rank.room))
    assert rank.state == FAILED and world.core.ranks_awaiting_data() == 1
    world.core.landing.notices([notice(rank, SOURCE)])
    assert rank.pages_settled and world.core.ranks_awaiting_data() == 0


def test_a_stale_registration_is_sent_again_to_the_process_found_by_a_fresh_handshake(world: World) -> None:
    """ABORTED (the sender's view of us is stale, or it restarted): until the answer the rank may not be
    written by anyone; after a fresh handshake it registers with whichever process answers now."""
    de, pe = world.engine_stub("decode"), world.engine_stub("prefill")
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="prefill-group", pages=i32([0])))
    world.core.bootstrap.sender_found(rank, P, [pe.layout])
    world.core.bootstrap.registration_stale(rank, rank.legs[0])
    assert not rank.registered_with_sender and not rank.registering
    # A loss found by that handshake does not touch the rank: the old process never had the room.
    assert world.core.peer_lost(P, cause(common_pb2.FAILURE_KIND_PEER, "restarted", "decode-broker")) == 0
    assert world.core.bootstrap.register_again(rank, rank.legs[0], "prefill-broker-2")
    world.core.bootstrap.room_registered(rank, rank.legs[0], "prefill-broker-2", still_known=True)
    assert rank.state == WAITING and rank.peer_broker_id == "prefill-broker-2"


def test_a_rank_that_ended_meanwhile_does_not_register_again(world: World) -> None:
    """Aborted while the registration was being retried: the retry is dropped."""
    de, pe = world.engine_stub("decode"), world.engine_stub("prefill")
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="prefill-group", pages=i32([0])))
    world.core.bootstrap.sender_found(rank, P, [pe.layout])
    world.core.bootstrap.registration_stale(rank, rank.legs[0])
    world.core.abort(Abort(engine=de, room=1, reason="cancelled"))
    assert not world.core.bootstrap.register_again(rank, rank.legs[0], "prefill-broker-2")


def test_the_senders_abort_fails_its_ranks_without_aborting_back(world: World) -> None:
    """PeerAbort from the sender's broker fails the ranks it feeds; nothing is sent back to it."""
    rank = world.registered()
    why = cause(common_pb2.FAILURE_KIND_ABORTED, "prefill OOM", P)
    assert world.core.peer_abort(rank.room, why, P) == 1
    assert rank.state == FAILED and rank.cause == why
    assert not any(isinstance(e, AbortAtPeer) for e in world.take())
    assert world.core.peer_abort(rank.room, why, "another-broker") == 0


# -- bad input ------------------------------------------------------------------------


def test_bad_expectations_are_refused_and_change_nothing(world: World) -> None:
    """Out-of-range indices, a missing group, a reused room id: refused before any record exists."""
    de = world.engine_stub("decode")
    with pytest.raises(InvalidArgument, match="out of range"):
        world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="g", pages=i32([16])))
    with pytest.raises(InvalidArgument, match="group"):
        world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="", pages=i32([0])))
    assert world.rooms.receiver == {} and world.take() == []
    world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="g", pages=i32([0])))
    with pytest.raises(AlreadyExists):
        world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="g", pages=i32([0])))


def test_a_rank_that_failed_before_its_sender_was_reachable_tells_the_broker_found_later(world: World) -> None:
    """Aborted while the sender's broker could not be reached: remembered for whoever answers there; when
    the bootstrap then finds a broker, that broker is told the remembered way (once), not a second way."""
    de, pe = world.engine_stub("decode"), world.engine_stub("prefill")
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address=ADDRESS, sender_group="prefill-group", pages=i32([0])))
    world.core.abort(Abort(engine=de, room=1, reason="cancelled"))
    assert (ADDRESS, 1) in world.rooms.successor_notices
    world.take()
    world.core.bootstrap.sender_found(rank, P, [pe.layout])
    assert world.take() == [TellSuccessor(ADDRESS)]
    world.core.tick(rank.opened_at, data_timeout_seconds=100, retry_seconds=1)
    assert world.take() == []  # already being told


# -- a rank whose sources live on two sender brokers (found through etcd) ------------------------

Q = "prefill-broker-2"


def _two_legs(world: World) -> tuple[Receiver, list[RegisterRoom]]:
    """A decode rank reading a pp2 prefill group whose pp0 is on broker P and pp1 on broker Q."""
    de = world.engine_stub("decode")
    pe = world.engine_stub("prefill", pp_size=2, pp_rank=0)
    rank = world.core.expect(ExpectRoom(engine=de, room=1, sender_address="", sender_group="prefill-group", pages=i32([0, 1, 2]), aux_row=1))
    world.take()
    legs = [SenderLeg(P, ADDRESS, frozenset({(0, 0)})), SenderLeg(Q, "host-b:50051", frozenset({(0, 1)}))]
    world.core.bootstrap.sender_found(rank, legs, [pe.layout])
    registrations = [e for e in world.take() if isinstance(e, RegisterRoom)]
    return rank, registrations


def test_a_rank_registers_with_each_sender_broker_for_its_sources_and_waits_for_both(world: World) -> None:
    """A rank whose sources live on two sender brokers registers with each for its own sources, and waits until both
    took the room."""
    rank, registrations = _two_legs(world)
    assert [(r.broker_id, [(s.rank.tp_rank, s.rank.pp_rank) for s in r.request.sources]) for r in registrations] == [
        (P, [(0, 0)]),
        (Q, [(0, 1)]),
    ]
    world.core.bootstrap.room_registered(rank, rank.legs[0], P, still_known=True)
    assert rank.state == BOOTSTRAPPING, "one sender broker has not taken the room yet"
    world.core.bootstrap.room_registered(rank, rank.legs[1], Q, still_known=True)
    assert rank.state == WAITING and rank.peer_broker_id == f"{P},{Q}"


def test_a_source_is_accepted_only_from_the_broker_that_holds_it(world: World) -> None:
    """A source's notice from a sender broker that does not hold that source fails the rank, naming an unexpected
    source."""
    rank, _ = _two_legs(world)
    for leg, broker in zip(rank.legs, (P, Q), strict=True):
        world.core.bootstrap.room_registered(rank, leg, broker, still_known=True)
    pp1 = RankKey("prefill-group", 0, 1)
    stray = peer_pb2.TransferNotice.FromString(notice(rank, pp1)[1])  # pp1's notice, but from P
    world.core.landing.notices([("prefill-agent", stray.SerializeToString())])
    assert rank.state == FAILED and "unexpected source" in rank.cause.message  # type: ignore[union-attr]


def test_losing_one_sender_broker_fails_the_rank_tells_the_other_and_settles_when_it_has(world: World) -> None:
    """Losing one of a rank's two sender brokers fails it and tells the other (not the lost one); its pages settle
    only once the living one says it settled."""
    rank, _ = _two_legs(world)
    for leg, broker in zip(rank.legs, (P, Q), strict=True):
        world.core.bootstrap.room_registered(rank, leg, broker, still_known=True)
    world.take()
    why = cause(common_pb2.FAILURE_KIND_PEER, "peer broker host-b:50051 went away", "decode-broker")
    assert world.core.peer_lost(Q, why) == 1
    aborts = [e for e in world.take() if isinstance(e, AbortAtPeer)]
    assert rank.state == FAILED and [a.broker_id for a in aborts] == [P], "the living broker is told, the lost one is not"
    assert not rank.pages_settled, "P may still write its source"
    assert world.core.has_business(P) and (("host-b:50051", 1) in world.rooms.successor_notices)
    world.core.peer_settled(P, 1)
    assert rank.pages_settled and not world.core.has_business(P)


def test_an_abort_from_one_sender_broker_is_passed_to_the_other(world: World) -> None:
    """An abort from one of a rank's two sender brokers fails the rank and is passed to the other."""
    rank, _ = _two_legs(world)
    for leg, broker in zip(rank.legs, (P, Q), strict=True):
        world.core.bootstrap.room_registered(rank, leg, broker, still_known=True)
    world.take()
    world.core.peer_abort(1, cause(common_pb2.FAILURE_KIND_ABORTED, "the prefill engine aborted", P), P)
    assert rank.state == FAILED and [a.broker_id for a in world.take() if isinstance(a, AbortAtPeer)] == [Q]


@pytest.mark.parametrize("matches", [True, False])
def test_a_verified_chunk_is_hashed_by_the_executor_and_the_rank_succeeds_only_after(world: World, matches: bool) -> None:
    """A chunk all of whose parts landed leaves a VerifyChunk (the core reads no memory: the engine
    stand-in has none); the rank is not SUCCESS, nor its pages settled, until the executor's answer;
    a different checksum fails it with MISMATCH naming the chunk."""
    rank = world.registered(verify_checksum=True)
    world.core.landing.notices([notice(rank, SOURCE, checksum=0x1234)])
    (verify,) = [e for e in world.take() if isinstance(e, VerifyChunk)]
    assert verify.receiver is rank and verify.expected == 0x1234 and verify.chunk_index == 0
    assert verify.what.who == "receiver" and list(verify.what.pages) == [0, 1, 2] and verify.what.aux_row == 1
    assert rank.state == TRANSFERRING and rank.verifying == 1 and not rank.pages_settled
    world.core.landing.chunk_verified(verify, 0x1234 if matches else 0x4321, None)
    if matches:
        assert rank.state == SUCCESS and rank.pages_settled and rank.verifying == 0
    else:
        assert rank.state == FAILED and rank.cause.kind == common_pb2.FAILURE_KIND_MISMATCH
        assert "chunk 0" in rank.cause.message and "corrupted" in rank.cause.message
        assert world.counters.checksum_mismatches == 1 and rank.pages_settled


def test_an_abort_while_a_chunk_is_verified_settles_once_the_hashing_is_done(world: World) -> None:
    """The executor reads the rank's pages while it verifies: the pages settle only after."""
    rank = world.registered(verify_checksum=True)
    world.core.landing.notices([notice(rank, SOURCE, checksum=7)])
    (verify,) = [e for e in world.take() if isinstance(e, VerifyChunk)]
    world.core.abort(Abort(engine=rank.engine, room=rank.room, reason="the engine gave up"))
    assert rank.state == FAILED and not rank.pages_settled
    world.core.landing.chunk_verified(verify, 7, None)
    assert rank.pages_settled and rank.state == FAILED


def test_a_settled_report_while_a_staged_part_is_scattered_settles_only_after_the_scatter(world: World) -> None:
    """The sender reports its writes settled while this broker still unpacks a staged part into the
    rank's pages: those pages are not free until the scatter is done (seed #27011's kind: a
    ``nothing_in_flight`` that ignored a rank still scattering let them go while it ran)."""
    rank, request = _staged_rank(world)
    pool, _ = world.core.landing.staging_wanted(request)
    reservation = StagingReservation(offset=0, nbytes=8192)
    world.core.landing.staging_granted(request, pool, reservation)
    nbytes = 2 * 4 * 2 * 4 * 4 * 8 * 2
    world.core.landing.notices([notice(rank, SOURCE, part=1, parts=2, pages=2, staged=True, staging_offset=0, staging_bytes=nbytes)])
    (scatter,) = [e for e in world.take() if isinstance(e, Scatter)]
    world.core.abort(Abort(engine=rank.engine, room=rank.room, reason="the engine gave up"))
    report = peer_pb2.CompletionReport(room=rank.room, sender_broker_id=P, source=SOURCE.to_proto(), receiver=rank.key.to_proto(), settled=True)
    world.core.landing.completion_report(report)
    assert rank.state == FAILED and rank.scattering and not rank.pages_settled
    assert not any(isinstance(e, ReleaseStaging) for e in world.take())  # the scatter still reads the slot
    world.core.landing.scattered(rank, scatter.landing, None)
    effects = world.take()
    assert rank.pages_settled and rank.staging == {}
    assert any(isinstance(e, ReleaseStaging) and e.reservations == ((*pool, reservation),) for e in effects)


def test_a_failed_ranks_staging_goes_source_by_source_as_each_writes_no_more(world: World) -> None:
    """Prefill tp 2 -> decode tp 1: both sources stage into this broker. The rank fails; one source
    reports itself settled while the other still waits for a reservation. The settled source's
    slot goes at once (the other may be waiting for it); the rank settles with the second."""
    senders = [world.engine_stub("prefill", tp_size=2, tp_rank=r) for r in range(2)]
    rank = world.registered(senders=senders, pages=i32([0, 1]))
    sources = [s.key for s in senders]
    reservation = StagingReservation(offset=0, nbytes=4096)
    request = peer_pb2.ReserveStagingRequest(
        protocol_version=PROTOCOL_VERSION, room=rank.room, sender_broker_id=P, source=sources[0].to_proto(),
        receiver=rank.key.to_proto(), chunk_index=0, part=0, bytes=4096,
    )
    pool, _ = world.core.landing.staging_wanted(request)
    world.core.landing.staging_granted(request, pool, reservation)
    world.core.abort(Abort(engine=rank.engine, room=rank.room, reason="the engine gave up"))
    assert not any(isinstance(e, ReleaseStaging) for e in world.take())  # source 0 may still write into it

    def settled(source: RankKey) -> peer_pb2.CompletionReport:
        return peer_pb2.CompletionReport(room=rank.room, sender_broker_id=P, source=source.to_proto(), receiver=rank.key.to_proto(), settled=True)

    world.core.landing.completion_report(settled(sources[0]))
    assert not rank.pages_settled
    assert [e.reservations for e in world.take() if isinstance(e, ReleaseStaging)] == [((*pool, reservation),)]
    world.core.landing.completion_report(settled(sources[1]))
    assert rank.pages_settled and rank.staging == {}
    assert not any(isinstance(e, ReleaseStaging) for e in world.take())  # nothing released twice
