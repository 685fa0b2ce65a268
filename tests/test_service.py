"""Service tests: real gRPC servers on port 0, in-process, with the scripted fake NIXL agent.

The fake copies bytes between registered memory for real, so these tests check
byte-exact results as well as states, causes and table sizes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from kvbroker import errors
from kvbroker.broker.dataplane import Notices
from kvbroker.client import RoomState, SenderRef, StateSpec
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.testing import FakeBroker, XferScript, eventually
from kvbroker.v1 import common_pb2, peer_pb2, transfer_pb2

from .conftest import SMALL_MODEL, Engine, page_bytes

SRC = np.array([3, 4, 5, 9, 10, 20], dtype=np.int32)
DST = np.array([0, 1, 2, 7, 8, 30], dtype=np.int32)


def _pair(fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Engine], **kw: object) -> tuple[FakeBroker, FakeBroker, Engine, Engine]:
    p, d = fake_brokers("p"), fake_brokers("d")
    return p, d, make_engine(p.address, "prefill", **kw), make_engine(d.address, "decode", **kw)


def _assert_moved(pe: Engine, de: Engine, src: np.ndarray, dst: np.ndarray, src_row: int | None = 1, dst_row: int | None = 2) -> None:
    for layer in range(SMALL_MODEL.num_layers):
        for a, b in zip(page_bytes(pe.memory, layer, src), page_bytes(de.memory, layer, dst)):
            assert torch.equal(a, b), f"layer {layer} differs"
    if src_row is not None and dst_row is not None:
        for a, b in zip(pe.memory.aux, de.memory.aux):
            assert torch.equal(a[src_row], b[dst_row])


def _wait_tables_empty(*brokers: FakeBroker) -> None:
    for broker in brokers:
        broker.evict_now()
        assert not any(broker.tables().values()), broker.tables()


def _open_room(pe: Engine, de: Engine, sender_address: str, room: int) -> tuple[Any, Any]:
    """Expect and send one room of SRC -> DST (aux row 1 -> 2) in one chunk: (receiver, sender)."""
    receiver = de.handle.receiver(room, SenderRef(sender_address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(room)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC)
    return receiver, sender


def _move_room(pe: Engine, de: Engine, sender_address: str, room: int) -> None:
    """One room of SRC -> DST between the engines; both sides end SUCCESS."""
    receiver, sender = _open_room(pe, de, sender_address, room)
    assert receiver.wait(10).state == RoomState.SUCCESS, receiver.status()
    assert sender.wait(10).state == RoomState.SUCCESS


def test_room_moves_bytes_between_two_brokers(fake_brokers, make_engine) -> None:
    """A chunked room with non-contiguous pages arrives byte-exact and both sides end SUCCESS."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(7, SenderRef(p.address, "prefill-group"))
    assert receiver.init(DST, aux_row=2).state == common_pb2.ROOM_STATE_BOOTSTRAPPING
    sender = pe.handle.sender(7)
    sender.init(num_pages=len(SRC), aux_row=1)
    sender.send(SRC[:2])
    sender.send(SRC[2:5])
    sender.send(SRC[5:])
    rstat = receiver.wait(10)
    sstat = sender.wait(10)
    assert (rstat.state, sstat.state) == (RoomState.SUCCESS, RoomState.SUCCESS)
    assert rstat.pages_settled and sstat.pages_settled
    assert rstat.chunks == 3 and rstat.bytes == sstat.bytes > 0
    _assert_moved(pe, de, SRC, DST)
    _wait_tables_empty(p, d)


def test_a_rooms_priority_is_the_decode_sides_once_its_registration_arrived(fake_brokers, make_engine) -> None:
    """Each side reports the class it queues the room by (RoomStatus.priority): the sender's own until
    the receiver's registration arrives, then the receiver's; a value outside RoomPriority is refused
    by name before it is queued."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    sender = pe.handle.sender(31)
    sender.init(num_pages=len(SRC), aux_row=1, priority="bulk", deadline_seconds=30)

    def side(broker: FakeBroker) -> tuple[int, float | None]:
        sides = broker.loop.call(lambda: broker.broker.queries.rooms.sides_of(31))
        return (sides[0].priority, sides[0].deadline) if sides else (-1, None)

    eventually(lambda: side(p)[0] == common_pb2.ROOM_PRIORITY_BULK and side(p)[1] is not None)
    receiver = de.handle.receiver(31, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2, priority="interactive")
    eventually(lambda: side(d) == (common_pb2.ROOM_PRIORITY_INTERACTIVE, None))
    eventually(lambda: side(p) == (common_pb2.ROOM_PRIORITY_INTERACTIVE, None))
    # (The engine's view follows the broker's by the session stream's next status.)
    eventually(lambda: receiver.status().priority == common_pb2.ROOM_PRIORITY_INTERACTIVE)
    sender.send(SRC)
    assert receiver.wait(10).state == sender.wait(10).state == RoomState.SUCCESS
    _assert_moved(pe, de, SRC, DST)
    with pytest.raises(ValueError, match="bulk, standard, interactive"):
        de.handle.receiver(33, SenderRef(p.address, "prefill-group")).init(DST, priority="urgent")
    _wait_tables_empty(p, d)


def test_a_chunk_larger_than_a_part_is_cut_between_pages_and_lands_byte_exact(fake_brokers, make_engine) -> None:
    """--part-mib: a chunk's KV pages beyond the part size go in several writes (each about the part
    size, the aux row with the last), so a higher class can pass between them; the room is byte-exact."""
    p, d = fake_brokers("p", part_bytes=1024), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    posted = p.broker.queries.counters.transfers_posted
    _move_room(pe, de, p.address, 41)
    _assert_moved(pe, de, SRC, DST)
    # SMALL_MODEL: 4 KV regions of 128-byte pages; 6 pages = 3072 bytes: three parts of 1024.
    assert p.broker.queries.counters.transfers_posted - posted == 3
    _wait_tables_empty(p, d)


def test_chunks_before_the_receiver_registers(fake_brokers, make_engine) -> None:
    """SendChunk may come before ExpectRoom: chunks wait for the transfer info, then go."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    sender = pe.handle.sender(8)
    sender.init(num_pages=len(SRC), aux_row=1)
    sender.send(SRC[:3])
    sender.send(SRC[3:])
    assert sender.poll() == RoomState.BOOTSTRAPPING
    receiver = de.handle.receiver(8, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    assert receiver.wait(10).state == RoomState.SUCCESS
    assert sender.wait(10).state == RoomState.SUCCESS
    _assert_moved(pe, de, SRC, DST)


def test_both_ends_on_one_broker(fake_brokers, make_engine) -> None:
    """A single broker serves both ends of a room (one host, two GPUs): loopback writes."""
    b = fake_brokers("one")
    pe = make_engine(b.address, "prefill")
    de = make_engine(b.address, "decode")
    _move_room(pe, de, "", 9)
    _assert_moved(pe, de, SRC, DST)
    _wait_tables_empty(b)


def test_lesson1_aux_goes_on_a_last_chunk_without_kv_or_state(fake_brokers, make_engine) -> None:
    """Lesson 1: a dense model's room whose last chunk has no pages still sends aux and completes."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(10, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:3], aux_row=3)
    sender = pe.handle.sender(10)
    sender.init(num_pages=3, aux_row=0)
    sender.send(SRC[:3], is_last=False)
    sender.send(np.array([], dtype=np.int32), is_last=True)
    assert receiver.wait(10).state == RoomState.SUCCESS
    assert torch.equal(pe.memory.aux[0][0], de.memory.aux[0][3])
    # An aux-only room (no KV at all) completes too.
    receiver = de.handle.receiver(11, SenderRef(p.address, "prefill-group"))
    receiver.init([], aux_row=1)
    sender = pe.handle.sender(11)
    sender.init(num_pages=0, aux_row=2)
    sender.send([], is_last=True)
    assert receiver.wait(10).state == RoomState.SUCCESS
    assert torch.equal(pe.memory.aux[0][2], de.memory.aux[0][1])


def test_lesson1_empty_state_list_is_not_expected(fake_brokers, make_engine) -> None:
    """Lesson 1: a receiver listing a state component with no indices does not wait for it."""
    spec = (StateSpec(name="swa", type="swa", item_bytes=32, num_items=8),)
    p, d, pe, de = _pair(fake_brokers, make_engine, state=spec)
    receiver = de.handle.receiver(12, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=0, state={"swa": []})
    sender = pe.handle.sender(12)
    sender.init(2, aux_row=0)
    sender.send(SRC[:2])
    assert receiver.wait(10).state == RoomState.SUCCESS


def test_state_component_travels_on_the_last_chunk(fake_brokers, make_engine) -> None:
    """A listed state component is sent on the last chunk and the room waits for it."""
    spec = (StateSpec(name="mamba", type="mamba", item_bytes=48, num_items=6, num_regions=2),)
    p, d, pe, de = _pair(fake_brokers, make_engine, state=spec)
    receiver = de.handle.receiver(13, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=0, state={"mamba": [4]})
    sender = pe.handle.sender(13)
    sender.init(2, aux_row=0)
    sender.send(SRC[:2], state={"mamba": [1]})
    assert receiver.wait(10).state == RoomState.SUCCESS
    for a, b in zip(pe.memory.state["mamba"], de.memory.state["mamba"]):
        assert torch.equal(a[1], b[4])


def test_missing_state_fails_with_a_cause_instead_of_hanging(fake_brokers, make_engine) -> None:
    """A receiver expecting a component the sender does not send fails fast, naming it."""
    spec = (StateSpec(name="mamba", type="mamba", item_bytes=48, num_items=6),)
    p, d, pe, de = _pair(fake_brokers, make_engine, state=spec)
    receiver = de.handle.receiver(14, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=0, state={"mamba": [4]})
    sender = pe.handle.sender(14)
    sender.init(2, aux_row=0)
    sender.send(SRC[:2])
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED
    assert "mamba" in status.cause.message
    assert sender.wait(10).state == RoomState.FAILED


def test_lesson2_completion_counts_unique_sources_with_pp1(fake_brokers, make_engine) -> None:
    """Lesson 2: MLA prefill tp 2 -> decode tp 1 (pp 1): the decode rank waits for both
    tp ranks (one writes, one only completes), keyed by (group, tp, pp), and finishes."""
    from kvbroker.client import ModelSpec

    mla = ModelSpec(num_layers=2, total_kv_heads=1, head_dim=16, dtype=torch.float16, page_size=4, mla=True)
    p, d = fake_brokers("p"), fake_brokers("d")
    prefill = [make_engine(p.address, "prefill", model=mla, tp_size=2, tp_rank=r, seed=r) for r in range(2)]
    de = make_engine(d.address, "decode", model=mla)
    receiver = de.handle.receiver(15, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    senders = []
    for pe in prefill:
        s = pe.handle.sender(15)
        s.init(len(SRC), aux_row=1)
        s.send(SRC)
        senders.append(s)
    assert receiver.wait(10).state == RoomState.SUCCESS
    assert [s.wait(10).state for s in senders] == [RoomState.SUCCESS, RoomState.SUCCESS]
    for layer in range(2):
        assert torch.equal(page_bytes(prefill[0].memory, layer, SRC)[0], page_bytes(de.memory, layer, DST)[0])


def test_equal_tp2_each_rank_gets_its_own_rank(fake_brokers, make_engine) -> None:
    """Equal TP 2 -> 2: decode rank r receives prefill rank r's pages, nothing else."""
    model = SMALL_MODEL
    p, d = fake_brokers("p"), fake_brokers("d")
    prefill = [make_engine(p.address, "prefill", tp_size=2, tp_rank=r, seed=10 + r) for r in range(2)]
    decode = [make_engine(d.address, "decode", tp_size=2, tp_rank=r) for r in range(2)]
    receivers = []
    for de in decode:
        r = de.handle.receiver(16, SenderRef(p.address, "prefill-group"))
        r.init(DST, aux_row=2)
        receivers.append(r)
    for pe in prefill:
        s = pe.handle.sender(16)
        s.init(len(SRC), aux_row=1)
        s.send(SRC)
    for r in receivers:
        assert r.wait(10).state == RoomState.SUCCESS
    for pe, de in zip(prefill, decode):
        for layer in range(model.num_layers):
            for a, b in zip(page_bytes(pe.memory, layer, SRC), page_bytes(de.memory, layer, DST)):
                assert torch.equal(a, b)


def test_lesson9_underscored_agent_names_and_protobuf_notices(fake_brokers, make_engine) -> None:
    """Lesson 9: agent names with '_' (the fakes are named fake_<x>_agent) and false booleans
    survive the notice encoding, which is protobuf, not '_'-joined strings."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    assert "_" in p.agent.name and "_" in d.agent.name
    notice = peer_pb2.TransferNotice(room=5, sender_broker_id="a_b_c", is_last=False, aux=False, parts=1)
    decoded = peer_pb2.TransferNotice.FromString(notice.SerializeToString())
    assert decoded.is_last is False and decoded.aux is False and decoded.sender_broker_id == "a_b_c"
    receiver = de.handle.receiver(17, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(17)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC[:3], is_last=False)
    sender.send(SRC[3:], is_last=True)
    assert receiver.wait(10).state == RoomState.SUCCESS


@pytest.mark.parametrize(
    ("pages", "aux_row", "fragment"),
    [
        ([0, -1], 2, "negative"),
        ([0, 32], 2, "out of range"),
        ([0, 1], 4, "aux_row"),
        ([0, 1], -1, "negative"),
    ],
)
def test_bad_indices_are_refused_and_change_nothing(fake_brokers, make_engine, pages, aux_row, fragment) -> None:
    """Out-of-range or negative indices are INVALID_ARGUMENT before any record or descriptor exists."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    before = d.tables()
    with pytest.raises(errors.InvalidArgument, match=fragment):
        de.handle.receiver(18, SenderRef(p.address, "prefill-group")).init(pages, aux_row=aux_row)
    assert d.tables() == before
    sender = pe.handle.sender(18)
    sender.init(2, aux_row=0)
    pe.handle.flush()  # the unary SendChunk below needs the queued BeginSend applied
    with pytest.raises(errors.InvalidArgument, match=fragment):
        sender.send(pages, is_last=False) if aux_row == 2 else pe.handle.client.call(
            pe.handle.client.stub.SendChunk,
            transfer_pb2.SendChunkRequest(
                engine_id=pe.handle.engine_id,
                room=18,
                pages=transfer_pb2.SendChunkRequest().pages.__class__(values=pages),
                is_last=True,
                aux_row=aux_row,
            ),
        )
    assert d.agent.posted == 0 and p.agent.posted == 0


def test_more_pages_than_declared_are_refused(fake_brokers, make_engine) -> None:
    """A chunk that takes the room past its declared page count is refused."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    sender = pe.handle.sender(19)
    sender.init(2, aux_row=0)
    with pytest.raises(errors.InvalidArgument, match="declared"):
        sender.send(SRC[:3], is_last=False)


def test_sender_and_receiver_disagree_on_pages(fake_brokers, make_engine) -> None:
    """More pages sent than the receiver expects: both sides FAILED with a MISMATCH cause."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(20, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=2)
    sender = pe.handle.sender(20)
    sender.init(0, aux_row=1)
    sender.send(SRC[:4], is_last=True)
    rstat, sstat = receiver.wait(10), sender.wait(10)
    assert rstat.state == sstat.state == RoomState.FAILED
    assert sstat.cause.kind == common_pb2.FAILURE_KIND_MISMATCH
    assert "expects 2" in sstat.cause.message


def test_duplicate_room_unknown_engine_and_wrong_role(fake_brokers, make_engine) -> None:
    """Duplicate rooms are ALREADY_EXISTS, unknown engines NOT_FOUND, wrong roles FAILED_PRECONDITION."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    ref = SenderRef(p.address, "prefill-group")
    de.handle.receiver(21, ref).init(DST)
    with pytest.raises(errors.AlreadyExists):
        de.handle.receiver(21, ref).init(DST)
    pe.handle.sender(21).init(2)
    with pytest.raises(errors.AlreadyExists):
        pe.handle.sender(21).init(2)
    with pytest.raises(errors.FailedPrecondition, match="ROLE_DECODE"):
        pe.handle.receiver(22, ref).init(DST)
    with pytest.raises(errors.FailedPrecondition, match="ROLE_PREFILL"):
        de.handle.sender(22).init(2)
    stub = pe.handle.client.stub
    with pytest.raises(errors.NotFound):
        pe.handle.client.call(stub.Poll, transfer_pb2.PollRequest(engine_id="eng-nope", rooms=[1]))
    with pytest.raises(errors.NotFound, match="BeginSend"):
        pe.handle.sender(23).send([1], is_last=False)


def test_engines_of_role_both_send_some_rooms_and_receive_others(fake_brokers, make_engine) -> None:
    """ROLE_BOTH (vLLM's kv_both): each engine opens senders and receivers, room by room, and the
    bytes arrive both ways; a one-way engine still refuses the other way."""
    p, d = fake_brokers("p"), fake_brokers("d")
    a = make_engine(p.address, "both", "group-a", seed=1)
    b = make_engine(d.address, "both", "group-b", seed=2)
    src, dst = np.array([1, 2, 3], dtype=np.int32), np.array([7, 8, 9], dtype=np.int32)
    for room, (sender, receiver, where) in enumerate([(a, b, p), (b, a, d)], start=40):
        expected = [page_bytes(sender.memory, layer, src) for layer in range(SMALL_MODEL.num_layers)]
        incoming = receiver.handle.receiver(room, SenderRef(where.address, sender.handle.rank.group))
        incoming.init(dst, aux_row=0)
        outgoing = sender.handle.sender(room)
        outgoing.init(len(src), aux_row=1)
        outgoing.send(src)
        assert incoming.wait(10).state == RoomState.SUCCESS
        for layer in range(SMALL_MODEL.num_layers):
            for x, y in zip(expected[layer], page_bytes(receiver.memory, layer, dst)):
                assert torch.equal(x, y)
    decode = make_engine(d.address, "decode")
    with pytest.raises(errors.FailedPrecondition, match="ROLE_PREFILL"):
        decode.handle.sender(50).init(2)


def test_a_sender_that_declares_another_compatibility_is_refused_naming_both(fake_brokers, make_engine) -> None:
    """Same shapes, different declared compatibility (another model, dtype or backend): the receiver
    refuses the room naming both; equal, or undeclared on either side, moves as before."""
    from dataclasses import replace

    p, d = fake_brokers("p"), fake_brokers("d")
    pe = make_engine(p.address, "prefill", "pre-a", model=replace(SMALL_MODEL, compatibility="llama-8b/bf16/flash"))
    same = make_engine(d.address, "decode", "dec-same", model=replace(SMALL_MODEL, compatibility="llama-8b/bf16/flash"))
    other = make_engine(d.address, "decode", "dec-other", model=replace(SMALL_MODEL, compatibility="qwen-8b/bf16/flash"))
    silent = make_engine(d.address, "decode", "dec-silent")
    outcomes = {}
    for room, engine in enumerate((same, other, silent), start=60):
        receiver = engine.handle.receiver(room, SenderRef(p.address, "pre-a"))
        receiver.init(DST[:2], aux_row=0)
        sender = pe.handle.sender(room)
        sender.init(2, aux_row=1)
        sender.send(SRC[:2])
        outcomes[engine.handle.rank.group] = receiver.wait(10)
        if outcomes[engine.handle.rank.group].state == RoomState.FAILED:
            sender.abort("the receiver refused the room")
    assert outcomes["dec-same"].state == RoomState.SUCCESS and outcomes["dec-silent"].state == RoomState.SUCCESS
    refused = outcomes["dec-other"]
    assert refused.state == RoomState.FAILED, refused
    assert "llama-8b/bf16/flash" in refused.cause.message and "qwen-8b/bf16/flash" in refused.cause.message


def test_poll_of_an_unknown_room_reports_failed_not_an_error(fake_brokers, make_engine) -> None:
    """Polling a room the engine never opened reports FAILED / UNKNOWN_ROOM for that room only."""
    p = fake_brokers("p")
    pe = make_engine(p.address, "prefill")
    statuses = pe.handle.poll([99])
    assert statuses[99].state == RoomState.FAILED
    assert statuses[99].cause.kind == common_pb2.FAILURE_KIND_UNKNOWN_ROOM


def test_receiver_abort_reaches_the_sender_and_settles(fake_brokers, make_engine) -> None:
    """A decode-side abort fails both sides with ABORTED; the receiver's pages settle."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    p.agent.script(XferScript(proc_polls=50))
    receiver = de.handle.receiver(24, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(24)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC[:2], is_last=False)
    time.sleep(0.05)
    receiver.abort("client went away")
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_ABORTED
    sstat = sender.wait(10)
    assert sstat.state == RoomState.FAILED and "client went away" in sstat.cause.message
    eventually(lambda: receiver.status().pages_settled)
    assert receiver.status().cause.message == "client went away"


def test_sender_abort_reaches_the_receiver(fake_brokers, make_engine) -> None:
    """A prefill-side abort fails the decode side with the sender's cause."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(25, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(25)
    sender.init(len(SRC), aux_row=1)
    eventually(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT)
    sender.abort("prefill OOM")
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.message == "prefill OOM"
    assert status.cause.origin_broker == p.broker.broker_id
    eventually(lambda: receiver.status().pages_settled)


def test_nixl_error_fails_both_sides_promptly(fake_brokers, make_engine) -> None:
    """A transfer ending in ERR fails the sender with TRANSFER and the receiver hears of it."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    p.agent.script(XferScript(proc_polls=2, outcome="ERR", partial_fraction=0.5))
    receiver, sender = _open_room(pe, de, p.address, 26)
    sstat, rstat = sender.wait(10), receiver.wait(10)
    assert sstat.state == rstat.state == RoomState.FAILED
    assert sstat.cause.kind == rstat.cause.kind == common_pb2.FAILURE_KIND_TRANSFER
    eventually(lambda: receiver.status().pages_settled)
    _wait_tables_empty(p, d)


def test_failed_post_fails_both_sides(fake_brokers, make_engine) -> None:
    """NIXL refusing the post fails the room on both sides with the transfer cause."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    p.agent.script(XferScript(fail_post=True))
    receiver, sender = _open_room(pe, de, p.address, 27)
    assert sender.wait(10).cause.kind == common_pb2.FAILURE_KIND_TRANSFER
    rstat = receiver.wait(10)
    assert rstat.state == RoomState.FAILED and rstat.cause.kind == common_pb2.FAILURE_KIND_TRANSFER
    assert receiver.status().pages_settled


def test_unreachable_sender_broker_fails_after_the_bootstrap_timeout(fake_brokers, make_engine) -> None:
    """A receiver whose sender broker never answers fails with a PEER cause naming it, once the whole
    bootstrap timeout has passed (it used to give up up to one retry interval early while saying it
    waited the whole timeout)."""
    d = fake_brokers("d", bootstrap_timeout_seconds=0.8, peer_rpc_timeout_seconds=0.2)
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(28, SenderRef("127.0.0.1:1", "prefill-group"))
    started = time.monotonic()
    receiver.init(DST, aux_row=2)
    status = receiver.wait(10)
    assert time.monotonic() - started >= 0.8
    assert status.state == RoomState.FAILED
    assert status.cause.kind == common_pb2.FAILURE_KIND_PEER and "127.0.0.1:1" in status.cause.message
    waited = float(status.cause.message.split("gave up after ")[1].split(" s")[0])
    assert 0.8 <= waited < 0.8 + 0.5, status.cause.message
    assert status.pages_settled


def test_stats_tables_return_to_zero_after_eviction(fake_brokers, make_engine) -> None:
    """GetStats per_room_state lists every table and returns to zero once rooms are evicted."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    for room in range(30, 34):
        de.handle.receiver(room, SenderRef(p.address, "prefill-group")).init(DST, aux_row=2)
        s = pe.handle.sender(room)
        s.init(len(SRC), aux_row=1)
        s.send(SRC)
    de.handle.wait(list(range(30, 34)), timeout_seconds=10)
    pe.handle.wait(list(range(30, 34)), timeout_seconds=10)
    tables = d.tables()
    assert tables["receiver_rooms"] == 4 and p.tables()["sender_sources"] == 4
    _wait_tables_empty(p, d)
    assert set(tables) >= {"sender_rooms", "transfer_infos", "inflight_transfers", "receiver_rooms", "tombstones"}


def test_finished_rooms_are_evicted_by_ttl_and_late_ids_refused(fake_brokers, make_engine) -> None:
    """The housekeeping pass evicts finished rooms after their TTL; a reused id is refused."""
    p = fake_brokers("p", finished_room_ttl_seconds=0.1, housekeeping_interval_seconds=0.05)
    d = fake_brokers("d", finished_room_ttl_seconds=0.1, housekeeping_interval_seconds=0.05)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    de.handle.receiver(40, SenderRef(p.address, "prefill-group")).init(DST, aux_row=2)
    s = pe.handle.sender(40)
    s.init(len(SRC), aux_row=1)
    s.send(SRC)
    de.handle.wait([40], timeout_seconds=10)
    eventually(lambda: d.tables()["receiver_rooms"] == 0 and p.tables()["sender_rooms"] == 0)
    # The engine's session still remembers the room; the broker does not.
    assert de.handle.poll([40])[40].state == RoomState.SUCCESS
    stub = de.handle.client.stub
    polled = de.handle.client.call(stub.Poll, transfer_pb2.PollRequest(engine_id=de.handle.engine_id, rooms=[40]))
    assert polled.statuses[0].cause.kind == common_pb2.FAILURE_KIND_UNKNOWN_ROOM
    with pytest.raises(errors.AlreadyExists, match="unique"):
        de.handle.receiver(40, SenderRef(p.address, "prefill-group")).init(DST)


def test_late_notice_never_recreates_a_room(fake_brokers, make_engine) -> None:
    """Lesson 6: a notice for a room that is gone is counted and dropped."""
    d = fake_brokers("d")
    notice = peer_pb2.TransferNotice(
        protocol_version=PROTOCOL_VERSION, room=4242, receiver=common_pb2.EngineRankId(group="decode-group"), parts=1
    )
    d.loop.call(d.broker.internals.services.executor.on_events, [Notices([("someone", notice.SerializeToString())])])
    d.loop.call(d.broker.internals.services.executor.on_events, [Notices([("someone", b"\xff\xffnot a notice")])])
    assert d.tables()["receiver_rooms"] == 0
    assert d.broker.queries.counters.late_notices == 1 and d.broker.queries.counters.bad_notices == 1


def test_engine_death_fails_its_rooms_and_releases_memory(fake_brokers, make_engine) -> None:
    """An engine whose session closes without unregistering loses its rooms and registrations."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(50, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(50)
    sender.init(len(SRC), aux_row=1)
    eventually(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT)
    assert p.agent.registrations == 3  # the engine's buffer and the two staging buffers
    pe.die()  # what the kernel does when the process dies
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_ENGINE_LOST
    eventually(lambda: p.agent.registrations == 2 and not p.broker.queries.engines())
    assert not p.agent.live_dlists


def test_unregister_releases_everything(fake_brokers, make_engine) -> None:
    """UnregisterEngine deregisters memory and releases descriptor lists; the id is then unknown."""
    p = fake_brokers("p")
    baseline = p.agent.registrations
    pe = make_engine(p.address, "prefill")
    assert p.agent.registrations == baseline + 1 and p.agent.live_dlists
    pe.handle.close()
    assert p.agent.registrations == baseline and not p.agent.live_dlists
    with pytest.raises(errors.NotFound):
        pe.client.call(pe.client.stub.Poll, transfer_pb2.PollRequest(engine_id=pe.handle.engine_id, rooms=[1]))


def test_contiguous_runs_become_one_descriptor(fake_brokers, make_engine) -> None:
    """Contiguous page runs on both sides cost one descriptor per run and region."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    de.handle.receiver(60, SenderRef(p.address, "prefill-group")).init([10, 11, 12, 13, 20, 21], aux_row=2)
    s = pe.handle.sender(60)
    s.init(6, aux_row=1)
    s.send([0, 1, 2, 3, 8, 9])
    de.handle.wait([60], timeout_seconds=10)
    # 2 runs x 4 KV regions (K, V of 2 layers) + 1 aux row.
    assert p.broker.queries.counters.descriptors_transferred == 9


def test_watch_streams_state_changes(fake_brokers, make_engine) -> None:
    """WatchRooms yields the current state, then each change up to SUCCESS."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(70, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    stream = de.handle.watch([70])
    first = next(stream)
    assert first.room == 70
    s = pe.handle.sender(70)
    s.init(len(SRC), aux_row=1)
    s.send(SRC)
    states = [first.state]
    for status in stream:
        states.append(status.state)
        if status.state == RoomState.SUCCESS:
            break
    stream.close()
    assert states == sorted(states) and states[-1] == RoomState.SUCCESS


def test_health_and_reflection_are_served(fake_brokers) -> None:
    """The standard health service answers SERVING for the broker and each kvbroker service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    b = fake_brokers("h")
    with grpc.insecure_channel(b.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvbroker.v1.TransferBroker", "kvbroker.v1.PeerBroker", "kvbroker.v1.Admin"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING


def test_handshake_refuses_another_protocol_version(fake_brokers) -> None:
    """A peer speaking another protocol version gets FAILED_PRECONDITION."""
    from kvbroker.v1 import peer_pb2_grpc

    b = fake_brokers("v")
    with grpc.insecure_channel(b.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            peer_pb2_grpc.PeerBrokerStub(ch).Handshake(peer_pb2.HandshakeRequest(protocol_version=99))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version 99" in info.value.details()


def test_state_between_different_tp_sizes_is_refused_on_both_sides(fake_brokers, make_engine) -> None:
    """Non-MLA state cannot be sliced: the receiver fails with a clear cause and the sender hears of it."""
    spec = (StateSpec(name="mamba", type="mamba", item_bytes=48, num_items=6),)
    p, d = fake_brokers("p"), fake_brokers("d")
    prefill = [make_engine(p.address, "prefill", tp_size=2, tp_rank=r, state=spec) for r in range(2)]
    de = make_engine(d.address, "decode", state=spec)
    receiver = de.handle.receiver(80, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=0, state={"mamba": [1]})
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and "cannot be moved between tp 2 and tp 1" in status.cause.message
    for pe in prefill:
        sender = pe.handle.sender(80)
        sender.init(2, aux_row=0)
        sender.send(SRC[:2], state={"mamba": [0]})
        sstat = sender.wait(10)
        assert sstat.state == RoomState.FAILED and "cannot be moved" in sstat.cause.message


def test_lesson4_paged_state_is_trimmed_and_mamba_mismatch_fails(fake_brokers, make_engine) -> None:
    """Lesson 4: SWA indices of different lengths are trimmed to the shorter list; Mamba's fail clearly."""
    spec = (
        StateSpec(name="swa", type="swa", item_bytes=32, num_items=8),
        StateSpec(name="mamba", type="mamba", item_bytes=16, num_items=8),
    )
    p, d, pe, de = _pair(fake_brokers, make_engine, state=spec)
    receiver = de.handle.receiver(81, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=0, state={"swa": [5, 6]})
    sender = pe.handle.sender(81)
    sender.init(2, aux_row=0)
    src_swa = np.array([1, 2, 3], dtype=np.int32)
    sender.send(SRC[:2], state={"swa": src_swa})
    assert receiver.wait(10).state == RoomState.SUCCESS
    assert torch.equal(pe.memory.state["swa"][0][[1, 2]], de.memory.state["swa"][0][[5, 6]])
    assert src_swa.tolist() == [1, 2, 3]
    receiver = de.handle.receiver(82, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=0, state={"mamba": [5]})
    sender = pe.handle.sender(82)
    sender.init(2, aux_row=0)
    sender.send(SRC[:2], state={"mamba": [1, 2]})
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and "position-indexed" in status.cause.message


def test_completion_waits_for_every_state_component(fake_brokers, make_engine) -> None:
    """A source's last notice naming only one of two listed components does not finish the room:
    it fails, naming the missing one (the room must not be done after the first component)."""
    spec = (
        StateSpec(name="swa", type="swa", item_bytes=32, num_items=8),
        StateSpec(name="nsa", type="nsa", item_bytes=24, num_items=8),
    )
    p, d, pe, de = _pair(fake_brokers, make_engine, state=spec)
    receiver = de.handle.receiver(83, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:2], aux_row=0, state={"swa": [1], "nsa": [2]})
    eventually(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT)
    notice = peer_pb2.TransferNotice(
        protocol_version=PROTOCOL_VERSION,
        room=83,
        sender_broker_id=p.broker.broker_id,
        source=common_pb2.EngineRankId(group="prefill-group"),
        receiver=common_pb2.EngineRankId(group="decode-group"),
        chunk_index=0,
        is_last=True,
        total_chunks=1,
        pages=2,
        aux=True,
        state_components=["swa"],
        parts=1,
    )
    d.loop.call(d.broker.internals.services.executor.on_events, [Notices([(p.agent.name, notice.SerializeToString())])])
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and "['nsa']" in status.cause.message


def test_hung_transfer_is_cancelled_and_fails_both_sides(fake_brokers, make_engine) -> None:
    """A transfer that never finishes is cancelled after the transfer timeout; both sides fail, pages settle."""
    p = fake_brokers("p", transfer_timeout_seconds=0.3, housekeeping_interval_seconds=0.05)
    d = fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    p.agent.script(XferScript(outcome="HANG"))
    receiver, sender = _open_room(pe, de, p.address, 90)
    sstat = sender.wait(10)
    assert sstat.state == RoomState.FAILED and "did not finish in 0.3 s" in sstat.cause.message
    assert sstat.pages_settled
    rstat = receiver.wait(10)
    assert rstat.state == RoomState.FAILED
    eventually(lambda: receiver.status().pages_settled)
    assert not p.agent.live_xfers
    _wait_tables_empty(p, d)


def test_receiver_times_out_waiting_for_data_and_tells_the_sender(fake_brokers, make_engine) -> None:
    """A registered receiver that gets no data fails after the data timeout, naming the sources; the sender fails too."""
    p = fake_brokers("p")
    d = fake_brokers("d", receiver_data_timeout_seconds=0.3, housekeeping_interval_seconds=0.05)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver = de.handle.receiver(91, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(91)
    sender.init(len(SRC), aux_row=1)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT
    assert "prefill-group/tp0/pp0" in status.cause.message
    assert sender.wait(10).cause.kind == common_pb2.FAILURE_KIND_TIMEOUT
    eventually(lambda: receiver.status().pages_settled)
    _wait_tables_empty(p, d)


def test_sender_times_out_waiting_for_transfer_info(fake_brokers, make_engine) -> None:
    """A sender whose receivers never register fails after the info timeout, saying what it waited for."""
    p = fake_brokers("p", sender_info_timeout_seconds=0.3, housekeeping_interval_seconds=0.05)
    pe = make_engine(p.address, "prefill")
    sender = pe.handle.sender(92)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC)
    status = sender.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT
    assert "transfer info" in status.cause.message
    _wait_tables_empty(p)


def test_slow_transfers_still_complete(fake_brokers, make_engine) -> None:
    """Transfers that stay in flight for many polls (a slow link) complete byte-exact."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    p.agent.script(*[XferScript(proc_polls=300)] * 3)
    receiver = de.handle.receiver(93, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(93)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC[:2], is_last=False)
    sender.send(SRC[2:4], is_last=False)
    sender.send(SRC[4:], is_last=True)
    assert receiver.wait(10).state == RoomState.SUCCESS
    _assert_moved(pe, de, SRC, DST)


def test_lost_peer_fails_its_rooms_and_is_dropped(fake_brokers, make_engine) -> None:
    """When the decode broker stops answering, the prefill broker fails its rooms naming it and drops it."""
    p = fake_brokers("p", peer_heartbeat_seconds=0.1, peer_dead_after_seconds=0.4)
    # Its own shutdown cannot hear the prefill side settle any more: do not wait long.
    d = fake_brokers("d", unregister_settle_timeout_seconds=0.5)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver = de.handle.receiver(94, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(94)
    sender.init(len(SRC), aux_row=1)
    eventually(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT)
    d.loop.run(d.server._server.stop(0))  # the decode broker's gRPC goes silent
    de.lost_broker()
    status = sender.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER
    assert d.address in status.cause.message
    eventually(lambda: not p.broker.queries.handshaken_peers())


def test_sender_engine_dying_before_it_opens_the_room_fails_the_receiver_at_once(fake_brokers, make_engine) -> None:
    """A receiver whose source engine died before BeginSend learns it (ENGINE_LOST) without waiting for its data timeout."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(95, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    eventually(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT)
    pe.die()  # the prefill engine dies; it never opened room 95
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_ENGINE_LOST
    eventually(lambda: receiver.status().pages_settled)


def test_a_source_that_never_opens_the_room_is_reported_after_the_orphan_timeout(fake_brokers, make_engine) -> None:
    """Transfer infos whose source never calls BeginSend are answered with a TIMEOUT after the orphan timeout."""
    p = fake_brokers("p", orphan_room_timeout_seconds=0.3, housekeeping_interval_seconds=0.05)
    d = fake_brokers("d")
    make_engine(p.address, "prefill")
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(96, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT
    assert "did not open the room" in status.cause.message
    eventually(lambda: receiver.status().pages_settled)
    _wait_tables_empty(p, d)


def _two_sources_one_receiver(fake_brokers, make_engine, room: int, **prefill_config: object):
    """Prefill tp 2 -> decode tp 1: the decode rank waits for both prefill ranks; rank 0 sends
    everything and its finished record is evicted from the prefill broker (rank 1 has not opened)."""
    p = fake_brokers("p", finished_room_ttl_seconds=0.05, housekeeping_interval_seconds=0.05, **prefill_config)
    d = fake_brokers("d")
    prefill = [make_engine(p.address, "prefill", tp_size=2, tp_rank=r, seed=20 + r) for r in range(2)]
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(room, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    first = prefill[0].handle.sender(room)
    first.init(len(SRC), aux_row=1)
    first.send(SRC)
    assert first.wait(10).state == RoomState.SUCCESS
    eventually(lambda: p.tables()["sender_sources"] == 0)
    assert receiver.poll() == RoomState.TRANSFERRING
    return p, d, prefill, de, receiver


def test_a_finished_source_whose_record_went_is_not_reported_as_never_opening(fake_brokers, make_engine) -> None:
    """A source rank that finished its part, whose record was evicted, and whose engine then went away
    is not reported to the receiver as one that never opened the room: the other source still completes it.
    (The broker used to tell the receiver ENGINE_LOST for it and fail the room.)"""
    p, d, prefill, de, receiver = _two_sources_one_receiver(fake_brokers, make_engine, 99)
    prefill[0].die()  # rank 0 goes away after its part was done
    eventually(lambda: p.tables().get("sender_rooms") == 1 and p.broker.queries.engine_keys() == 1)
    second = prefill[1].handle.sender(99)
    second.init(len(SRC), aux_row=1)
    second.send(SRC)
    assert receiver.wait(10).state == RoomState.SUCCESS
    assert second.wait(10).state == RoomState.SUCCESS
    _wait_tables_empty(p, d)


def test_a_source_that_never_opens_a_room_another_source_finished_is_reported(fake_brokers, make_engine) -> None:
    """When one source of a room finished and its record went, the room stays on the sender's broker
    for the source that never opened it, and the orphan timeout tells the receiver. (The room used to
    go with the finished record, leaving the receiver to its data timeout.)"""
    # 2 s: the timeout runs from the room's opening, and the first source's whole
    # room (handshake included) must be done and evicted well inside it (0.44 s once, under load).
    p, d, prefill, de, receiver = _two_sources_one_receiver(fake_brokers, make_engine, 100, orphan_room_timeout_seconds=2.0)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT
    assert "prefill-group/tp1/pp0 did not open the room" in status.cause.message
    late = prefill[0].handle.sender(100)
    with pytest.raises(errors.AlreadyExists, match="already"):
        late.init(len(SRC), aux_row=1)  # a rank opens a room once
    eventually(lambda: receiver.status().pages_settled)
    _wait_tables_empty(p, d)


def test_room_spans_and_the_canonical_log_line(fake_brokers, make_engine, finished_spans) -> None:
    """Both sides of a room are one trace (in-process), and each side writes one room_ended line with its trace id."""
    from structlog.testing import capture_logs

    p, d, pe, de = _pair(fake_brokers, make_engine)
    with capture_logs() as logs:
        _move_room(pe, de, p.address, 97)
    rooms = [s for s in finished_spans.get_finished_spans() if s.name == "kvbroker.room" and s.attributes["kvbroker.room"] == 97]
    assert {s.attributes["kvbroker.side"] for s in rooms} == {"sender", "receiver"}
    assert len({s.context.trace_id for s in rooms}) == 1
    ended = [e for e in logs if e["event"] == "room_ended" and e["room"] == 97]
    assert {e["side"] for e in ended} == {"sender", "receiver"}
    for entry in ended:
        assert entry["state"] == "ROOM_STATE_SUCCESS" and entry["bytes"] > 0 and entry["cause"] is None
        assert entry["trace_id"] == format(rooms[0].context.trace_id, "032x")
        assert entry["total_s"] >= 0 and entry["engine"].endswith("#1")


def test_registration_out_when_a_restart_is_detected_lands_in_the_new_process(fake_brokers, make_engine, monkeypatch) -> None:
    """A room whose registration (RegisterRooms) is out when the decode broker learns that the prefill broker restarted:
    the new process refuses a registration addressed to the old one, the decode broker registers again
    with the new one, and the room completes. (It used to fail PEER on the decode side while the new
    process, which had accepted the room, wrote into its pages.)"""
    p1 = fake_brokers("p1")
    d = fake_brokers("d", peer_heartbeat_seconds=60)  # only the race below may notice the restart
    pe1, de = make_engine(p1.address, "prefill"), make_engine(d.address, "decode")
    receiver = de.handle.receiver(98, SenderRef(p1.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    eventually(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT)  # d has handshaken with p1
    receiver.abort()
    # The abort reached p1 (its answer settles the pages): an abort still out when p1 goes would be
    # told to the next process at the address, and that handshake would find p2 before the race.
    eventually(lambda: receiver.status().pages_settled)
    p1.loop.run(p1.server._server.stop(0))  # p1 is gone; p2 takes its address
    pe1.lost_broker()
    p2 = fake_brokers("p2", listen_address=p1.address)
    pe2 = make_engine(p2.address, "prefill")
    peers, client = d.broker.internals.transport.peers, d.broker.internals.transport.client
    real_stub = client.caller
    raced: list[str] = []

    class RacingStub:
        def __init__(self, stub: object) -> None:
            self._stub = stub

        def __getattr__(self, name: str) -> object:
            return getattr(self._stub, name)

        def submit_item(self, method, request, items, **kwargs):  # type: ignore[no-untyped-def]
            if method.name != "RegisterRooms" or raced:
                return self._stub.submit_item(method, request, items, **kwargs)
            raced.append(request.rooms[0].sender_broker_id)

            async def racing():  # type: ignore[no-untyped-def]
                # While this call is out, a handshake finds the new process
                # (as the liveness monitor would; it retries while the channel
                # to the address is still backing off from the old process).
                for _ in range(100):
                    try:
                        await client.handshake(peers.by_address[p1.address])
                        break
                    except errors.Unavailable:
                        await asyncio.sleep(0.05)
                call, index = self._stub.submit_item(method, request, items, **kwargs)
                assert index == 0
                return await call

            return asyncio.ensure_future(racing()), 0

    monkeypatch.setattr(client, "caller", lambda peer: RacingStub(real_stub(peer)))
    _move_room(pe2, de, p1.address, 99)
    assert raced == [p1.broker.broker_id] and peers.by_address[p1.address].broker_id == p2.broker.broker_id
    _assert_moved(pe2, de, SRC, DST)
    del pe1
    _wait_tables_empty(p2, d)


def test_a_room_opened_while_its_prefill_broker_restarts_registers_with_the_new_process(fake_brokers, make_engine) -> None:
    """The decode broker knows the prefill broker, which is down for a moment (restarting on the
    same address): a room opened then waits for the address to answer (up to the peer timeout),
    registers with the new process and completes. (It used to fail PEER at once with "failed to
    connect", also for a while after the new process was up, while the channel backed off; the
    ten-minute soak showed such rooms.)"""
    p1 = fake_brokers("p1")
    d = fake_brokers("d", peer_heartbeat_seconds=60)  # no heartbeat: only the registration meets p2
    pe1, de = make_engine(p1.address, "prefill"), make_engine(d.address, "decode")
    _move_room(pe1, de, p1.address, 106)
    p1.loop.run(p1.server._server.stop(0))
    pe1.lost_broker()
    # The room opens once the decode broker has seen its stream to p1 break. One
    # opened before that is written on the dying stream and fails PEER (it may have
    # reached p1, like any request in flight when its peer dies): on a loaded
    # machine that happened here (1 run in a full suite).
    stream = d.broker.internals.transport.peers.by_address[p1.address].stream
    eventually(lambda: stream.broker_id is None)
    receiver = de.handle.receiver(107, SenderRef(p1.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    time.sleep(0.5)  # RegisterRoom finds nothing listening
    assert receiver.poll() == RoomState.BOOTSTRAPPING, receiver.status()
    p2 = fake_brokers("p2", listen_address=p1.address)
    pe2 = make_engine(p2.address, "prefill")
    sender = pe2.handle.sender(107)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC)
    assert receiver.wait(15).state == RoomState.SUCCESS, receiver.status()
    assert sender.wait(10).state == RoomState.SUCCESS
    _assert_moved(pe2, de, SRC, DST)
    _wait_tables_empty(p2, d)


def test_registration_accepted_by_a_process_lost_meanwhile_fails_the_room_settled(fake_brokers, make_engine, monkeypatch) -> None:
    """A room registration (RegisterRooms) is accepted, but the sender's broker is found lost before the answer is handled:
    the room fails PEER with its pages settled (nothing of that process can write any more), instead
    of waiting for data that will never come."""
    p, d, _pe, de = _pair(fake_brokers, make_engine)
    client = d.broker.internals.transport.client
    real_stub = client.caller

    class LosingStub:
        def __init__(self, stub: object, peer: object) -> None:
            self._stub, self._peer = stub, peer

        def __getattr__(self, name: str) -> object:
            return getattr(self._stub, name)

        def submit_item(self, method, request, items, **kwargs):  # type: ignore[no-untyped-def]
            answer, index = self._stub.submit_item(method, request, items, **kwargs)
            if method.name == "RegisterRooms":
                # Lost once the answer is in, before the broker handles it.
                answer.add_done_callback(lambda _a: d.broker.internals.routes.peer_loss.peer_lost(self._peer, "stopped answering (test)"))
            return answer, index

    monkeypatch.setattr(client, "caller", lambda peer: LosingStub(real_stub(peer), peer))
    receiver = de.handle.receiver(100, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER
    assert "went away while room 100 registered" in status.cause.message
    eventually(lambda: receiver.status().pages_settled)
    _wait_tables_empty(d)


def test_a_silent_peer_that_answers_again_is_asked_about_the_rooms_whose_pages_wait_for_it(fake_brokers, make_engine) -> None:
    """The decode broker takes the prefill broker for silent (it may still be writing): the room fails
    PEER with its pages not settled. The peer answers again: the decode broker asks it about that
    room (an abort, answered with whether anything is still in flight), and the pages are settled
    within moments. (Heartbeats of a minute: no liveness pass or successor notice does it instead.)"""
    p = fake_brokers("p")
    d = fake_brokers("d", peer_heartbeat_seconds=60)
    make_engine(p.address, "prefill")
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(121, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    eventually(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT)
    peer = d.broker.internals.transport.peers.by_address[p.address]
    loss = d.broker.internals.routes.peer_loss
    d.loop.call(lambda: loss.peer_lost(peer, "stopped answering (test)", True))
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER
    time.sleep(0.5)
    assert not receiver.status().pages_settled, "settled while the peer might still write"
    d.loop.call(lambda: loss.peer_back(peer))
    eventually(lambda: receiver.status().pages_settled, 5)


def test_a_restarted_prefill_broker_learns_the_rooms_its_predecessor_lost(fake_brokers, make_engine) -> None:
    """A decode room registered with a prefill broker process that then died fails PEER, and the decode
    broker tells the broker that next answers at that address: a source the re-registered prefill engine
    opens there fails at once (PEER, naming the receiving broker) instead of waiting its whole
    transfer-info timeout (it used to), and new rooms between them work."""
    p1 = fake_brokers("p1")
    d = fake_brokers("d", peer_heartbeat_seconds=0.1, peer_dead_after_seconds=0.4)
    pe1 = make_engine(p1.address, "prefill")
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(101, SenderRef(p1.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    eventually(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT)
    p1.loop.run(p1.server._server.stop(0))  # the prefill broker dies; p2 takes its address
    pe1.lost_broker()
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER
    assert d.tables()["successor_notices"] == 1
    p2 = fake_brokers("p2", listen_address=p1.address)
    pe2 = make_engine(p2.address, "prefill")
    sender = pe2.handle.sender(101)
    sender.init(len(SRC), aux_row=1)
    sstat = sender.wait(10)
    assert sstat.state == RoomState.FAILED and sstat.cause.kind == common_pb2.FAILURE_KIND_PEER, sstat
    assert f"the receiving broker {d.broker.broker_id} failed the room" in sstat.cause.message
    assert p1.broker.broker_id in sstat.cause.message
    eventually(lambda: d.tables()["successor_notices"] == 0)
    _move_room(pe2, de, p2.address, 102)
    _assert_moved(pe2, de, SRC, DST)
    _wait_tables_empty(p2, d)


def test_a_peer_whose_loaded_memory_got_new_nixl_keys_is_loaded_afresh(fake_brokers, make_engine) -> None:
    """NIXL (1.5) refuses a peer's metadata when memory it loaded comes back at the same place with
    other keys (NIXL_ERR_NOT_ALLOWED; an H200 showed it for a cudaMalloc made again, RDMA does it for
    host memory): the broker that loads it treats the peer as restarted (its rooms there fail PEER,
    naming why) and loads its metadata afresh, so new rooms between them move."""
    p = fake_brokers("p")
    d = fake_brokers("d")
    pe = make_engine(p.address, "prefill")
    de = make_engine(d.address, "decode")
    _move_room(pe, de, p.address, 201)
    _assert_moved(pe, de, SRC, DST)
    waiting = de.handle.receiver(202, SenderRef(p.address, "prefill-group"))
    waiting.init(DST, aux_row=2)
    eventually(lambda: waiting.poll() == RoomState.WAITING_FOR_INPUT)
    p.agent.rekey()
    make_engine(d.address, "decode", group="other-group")  # d handshakes again at its next call, and loads p's
    _move_room(pe, de, p.address, 203)  # that call: d loads p afresh, and the room moves
    status = waiting.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER, status
    assert "changed the NIXL keys of memory this broker had loaded" in status.cause.message
    _assert_moved(pe, de, SRC, DST)
    _wait_tables_empty(p, d)


def test_a_room_registered_again_by_a_restarted_decode_broker_is_refused(fake_brokers, make_engine) -> None:
    """A decode broker that restarted and registers a room its predecessor had registered is refused
    with a clear cause, so its rank fails at once (it used to be accepted silently and wait for data that
    the failed source would never send, until its data timeout)."""
    p = fake_brokers("p", peer_heartbeat_seconds=0.1, peer_dead_after_seconds=0.4)
    d1 = fake_brokers("d1", unregister_settle_timeout_seconds=0.5)
    pe, de1 = make_engine(p.address, "prefill"), make_engine(d1.address, "decode")
    de1.handle.receiver(103, SenderRef(p.address, "prefill-group")).init(DST, aux_row=2)
    sender = pe.handle.sender(103)
    sender.init(len(SRC), aux_row=1)
    eventually(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT)
    d1.loop.run(d1.server._server.stop(0))  # the decode broker dies; d2 takes its address
    de1.lost_broker()
    sstat = sender.wait(10)
    assert sstat.state == RoomState.FAILED and sstat.cause.kind == common_pb2.FAILURE_KIND_PEER
    d2 = fake_brokers("d2", listen_address=d1.address)
    de2 = make_engine(d2.address, "decode")
    again = de2.handle.receiver(103, SenderRef(p.address, "prefill-group"))
    again.init(DST, aux_row=2)
    status = again.wait(10)
    assert status.state == RoomState.FAILED, status
    assert "a room is registered once" in status.cause.message and d1.broker.broker_id in status.cause.message
    eventually(lambda: again.status().pages_settled)


def test_a_room_aborted_while_its_prefill_broker_was_down_fails_at_once_when_it_is_back(fake_brokers, make_engine) -> None:
    """A decode room aborted while its prefill broker could not be reached (it never heard of the room):
    the decode broker tells the broker that answers at that address once it is up, so the prefill engine's
    source there fails at once instead of waiting its transfer-info timeout (it used to)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    d = fake_brokers("d", peer_heartbeat_seconds=0.1)
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(104, SenderRef(address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    time.sleep(0.3)  # bootstrapping: nothing answers there yet
    receiver.abort("the request was cancelled")
    assert receiver.wait(10).state == RoomState.FAILED
    assert d.tables()["successor_notices"] == 1
    p = fake_brokers("p", listen_address=address)
    pe = make_engine(p.address, "prefill")
    sender = pe.handle.sender(104)
    sender.init(len(SRC), aux_row=1)
    sstat = sender.wait(10)
    assert sstat.state == RoomState.FAILED, sstat
    assert f"the receiving broker {d.broker.broker_id} failed the room: the request was cancelled" in sstat.cause.message
    eventually(lambda: d.tables()["successor_notices"] == 0)
    _wait_tables_empty(p, d)


def test_an_abort_the_dead_prefill_broker_missed_reaches_its_successor(fake_brokers, make_engine) -> None:
    """A decode room aborted after its prefill broker died but before any heartbeat noticed: the abort
    cannot be delivered, so the broker that answers at that address next is told, and the prefill engine's
    source there fails at once."""
    p1 = fake_brokers("p1")
    d = fake_brokers("d", peer_heartbeat_seconds=0.1, peer_dead_after_seconds=60)  # no heartbeat notices the death
    pe1 = make_engine(p1.address, "prefill")
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(105, SenderRef(p1.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    eventually(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT)
    p1.loop.run(p1.server._server.stop(0))
    pe1.lost_broker()
    receiver.abort("the request was cancelled")
    eventually(lambda: d.tables()["successor_notices"] == 1)
    p2 = fake_brokers("p2", listen_address=p1.address)
    pe2 = make_engine(p2.address, "prefill")
    sender = pe2.handle.sender(105)
    sender.init(len(SRC), aux_row=1)
    sstat = sender.wait(10)
    assert sstat.state == RoomState.FAILED, sstat
    assert "failed the room: the request was cancelled" in sstat.cause.message
    eventually(lambda: d.tables()["successor_notices"] == 0)
    _wait_tables_empty(p2, d)


def test_a_room_reopened_after_its_receiver_gave_up_on_the_source_writes_nothing(fake_brokers, make_engine) -> None:
    """Foreign write: the decode rank expects R; the prefill engine dies before opening R, so R fails
    (ENGINE_LOST) with its pages settled; the decode engine reuses those pages for R2, which succeeds;
    then the same prefill rank, restarted, opens R. It used to be accepted with R's old transfer info
    and write into R2's pages while reporting SUCCESS. Now R fails at once with the cause, and R2's
    bytes stay as they are."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    stale = de.handle.receiver(110, SenderRef(p.address, "prefill-group"))
    stale.init(DST, aux_row=2)
    eventually(lambda: stale.poll() == RoomState.WAITING_FOR_INPUT)
    pe.die()  # the prefill engine dies before it opens room 110
    assert stale.wait(10).cause.kind == common_pb2.FAILURE_KIND_ENGINE_LOST
    eventually(lambda: stale.status().pages_settled)
    eventually(lambda: not p.loop.call(p.broker.queries.engine_keys))
    pe2 = make_engine(p.address, "prefill", seed=1)  # the same rank, restarted
    _move_room(pe2, de, p.address, 111)  # the decode engine reuses DST for room 111
    _assert_moved(pe2, de, SRC, DST)
    before = [t.clone() for layer in range(SMALL_MODEL.num_layers) for t in page_bytes(de.memory, layer, DST)]
    reopened = pe2.handle.sender(110)
    reopened.init(len(SRC), aux_row=1)
    other = np.array([12, 13, 14, 15, 16, 17], dtype=np.int32)
    reopened.send(other)
    status = reopened.wait(10)
    assert status.state == RoomState.FAILED, status
    assert status.cause.kind == common_pb2.FAILURE_KIND_ENGINE_LOST and "cannot be opened again" in status.cause.message
    after = [t for layer in range(SMALL_MODEL.num_layers) for t in page_bytes(de.memory, layer, DST)]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "room 110's bytes landed in room 111's pages"
    _wait_tables_empty(p, d)


def test_indices_wider_than_int32_are_refused_not_wrapped(fake_brokers, make_engine) -> None:
    """Foreign write: a 64-bit page index (2**32 + 3) given to the client used to be cut to int32 and move
    page 3. The client refuses it before converting, for pages, state indices and aux rows; the broker
    refuses one that reaches it through the grpcurl-friendly ``values`` form."""
    p, d, pe, de = _pair(fake_brokers, make_engine)
    before = (p.tables(), d.tables())
    wide = np.array([2**32 + 3], dtype=np.int64)
    receiver = de.handle.receiver(112, SenderRef(p.address, "prefill-group"))
    for call in (
        lambda: receiver.init(wide, aux_row=2),
        lambda: receiver.init(DST, aux_row=2, state={"mamba": wide}),
        lambda: receiver.init(DST, aux_row=2**32 + 2),
    ):
        with pytest.raises(errors.InvalidArgument, match="int32"):
            call()
    sender = pe.handle.sender(112)
    with pytest.raises(errors.InvalidArgument, match="int32"):
        sender.init(1, aux_row=2**40)
    sender.init(1, aux_row=1)
    with pytest.raises(errors.InvalidArgument, match="int32"):
        sender.send(wide)
    with pytest.raises(errors.InvalidArgument, match="4294967299 does not fit in int32"):
        pe.handle.client.call(
            pe.handle.client.stub.SendChunk,
            transfer_pb2.SendChunkRequest(
                engine_id=pe.handle.engine_id, room=112, pages=common_pb2.PageIndices(values=[2**32 + 3]), is_last=True, aux_row=1
            ),
        )
    assert p.agent.posted == 0 and d.agent.posted == 0
    sender.abort()
    assert d.tables() == before[1]


def test_the_client_refuses_a_broker_of_another_protocol_version() -> None:
    """A client checks the broker's protocol_version (GetBrokerInfo) before anything else: a server
    that answers GetBrokerInfo with the next version, and nothing more, is refused."""
    from concurrent import futures

    from kvbroker.client import BrokerClient
    from kvbroker.v1 import transfer_pb2_grpc

    class NextVersion(transfer_pb2_grpc.TransferBrokerServicer):
        def GetBrokerInfo(self, request: transfer_pb2.GetBrokerInfoRequest, context: Any) -> transfer_pb2.BrokerInfo:
            return transfer_pb2.BrokerInfo(broker_id="next", protocol_version=PROTOCOL_VERSION + 1)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    transfer_pb2_grpc.add_TransferBrokerServicer_to_server(NextVersion(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(errors.FailedPrecondition, match=f"speaks protocol version {PROTOCOL_VERSION + 1}"):
            BrokerClient(f"127.0.0.1:{port}")
    finally:
        server.stop(None)


def test_a_broker_is_built_whole_and_nothing_is_set_on_it_afterwards(fake_brokers) -> None:
    """build_broker makes every part from what the server knows once it listens (the fd socket at its
    path, the peer table at its address, no fleet without --etcd) and sets every late callback; the
    broker's state is private and final, and its parts (``internals``) are frozen bundles."""
    import dataclasses

    b = fake_brokers("w")
    broker = b.broker
    parts = broker.internals
    info = broker.broker_info()
    assert info.fd_socket_path == parts.services.fd_server.path == broker.endpoints.fd_socket_path
    assert info.engine_socket_path == broker.endpoints.engine_socket_path and info.listen_address == b.address
    assert parts.transport.peers.address == b.address
    assert parts.services.fleet_record is None and parts.services.fleet_view is None and broker.queries.fleet is None
    assert parts.services.late.unset() == []  # every late callback bound to its part
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.services.fd_server = parts.services.fd_server  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.services = parts.services  # type: ignore[misc]
    with pytest.raises(AttributeError):
        broker.internals = parts  # type: ignore[misc]
    with pytest.raises(AttributeError):
        broker.fd_server = parts.services.fd_server  # type: ignore[attr-defined]


def test_a_broker_with_a_late_callback_not_set_refuses_to_start(fake_brokers) -> None:
    """Broker.start checks every late callback is bound before it starts anything: a broker wired
    with one left unset is refused with the callback's name, not left to fail when it is first called."""
    import dataclasses

    from kvbroker.broker.runtime import Broker, Late

    b = fake_brokers("w")
    parts = b.broker.internals
    late = dataclasses.replace(parts.services.late, fd_closed=Late("EngineCalls.fd_connection_closed"))
    miswired = Broker(
        config=b.broker.config,
        endpoints=b.broker.endpoints,
        machines=parts.machines,
        transport=parts.transport,
        copying=parts.copying,
        telemetry=parts.telemetry,
        routes=parts.routes,
        services=dataclasses.replace(parts.services, late=late),
    )
    with pytest.raises(errors.Internal, match="late callbacks not set: EngineCalls.fd_connection_closed"):
        b.loop.run(miswired.start())


def test_peers_register_and_abort_rooms_only_in_batches() -> None:
    """The PeerBroker service has no unary RegisterRoom or AbortRoom: brokers call RegisterRooms and AbortRooms."""
    methods = set(peer_pb2.DESCRIPTOR.services_by_name["PeerBroker"].methods_by_name)
    assert methods == {
        "Handshake", "RegisterRooms", "ReserveStaging", "ReportCompletion", "AbortRooms", "Ping",
        "ReserveProbe", "ReleaseProbe", "GrantCredits", "ReturnCredits", "RenewLeases", "Stream",
    }
