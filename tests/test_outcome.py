"""The transfer outcome per page: after a failure, once its pages are settled, a receiver learns
which of its pages arrived whole, so an engine recomputes only the others."""

from __future__ import annotations

import numpy as np
import torch

from kvbroker.broker.api import Admin
from kvbroker.client import RoomState, SenderRef
from kvbroker.testing import eventually

from .conftest import SMALL_MODEL, page_bytes

# Every test with engines runs on host memory and on the device path (fake VRAM).
MEMORY_KINDS = ("dram", "vram")

SRC = np.array([3, 4, 5, 9, 10, 20], dtype=np.int32)
DST = np.array([0, 1, 2, 7, 8, 30], dtype=np.int32)


def test_pages_of_the_chunks_that_landed_are_reported_after_an_abort(fake_brokers, make_engine) -> None:
    """Two of three chunks land, then the prefill engine aborts: the receiver's settled status lists
    exactly the pages of those two chunks, and they hold the sender's bytes."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver = de.handle.receiver(60, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(60)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC[:2])
    sender.send(SRC[2:4])
    # (The session hears of state changes; chunks landing within TRANSFERRING show in the broker's record.)
    def chunks_landed() -> list[int]:
        return [r.chunks for r in d.broker.queries.rooms.receivers_of(60)]

    eventually(lambda: d.loop.call(chunks_landed) == [2], 10)
    assert receiver.landed_pages().size == 0  # not failed: nothing to report
    sender.abort("prefill preempted")
    eventually(lambda: receiver.status().pages_settled, 10)
    status = receiver.status()
    assert status.state == RoomState.FAILED
    assert receiver.landed_pages().tolist() == DST[:4].tolist()
    for layer in range(SMALL_MODEL.num_layers):
        for a, b in zip(page_bytes(pe.memory, layer, SRC[:4]), page_bytes(de.memory, layer, DST[:4])):
            assert torch.equal(a, b)


def test_a_page_is_whole_only_when_every_source_that_writes_it_delivered_it(fake_brokers, make_engine) -> None:
    """Prefill tp 2 -> decode tp 1: each prefill rank writes half the heads of every page. One rank
    sends both chunks, the other only the first, then aborts: only the first chunk's pages are whole."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pes = [make_engine(p.address, "prefill", tp_size=2, tp_rank=r, seed=r + 1) for r in range(2)]
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(61, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    senders = [e.handle.sender(61) for e in pes]
    for sender in senders:
        sender.init(len(SRC), aux_row=1)
        sender.send(SRC[:3])
    senders[0].send(SRC[3:])
    assert senders[0].wait(10).state == RoomState.SUCCESS

    def rank1_first_chunk_delivered() -> bool:
        # Rank 1's first chunk must have landed before it aborts (a loaded host may take a while).
        sides = p.loop.call(lambda: Admin(p.broker.queries, p.broker.routes.operators, p.broker.routes.probes, p.broker.routes.peer_loss).get_room(61)).sides
        (side,) = [s for s in sides if s.info.engine.tp_rank == 1]
        return all(dest.chunks_posted == 1 and dest.inflight == 0 for dest in side.destinations)

    eventually(rank1_first_chunk_delivered, 10)
    senders[1].abort("prefill rank 1 preempted")
    eventually(lambda: receiver.status().pages_settled, 10)
    assert receiver.status().state == RoomState.FAILED
    assert receiver.landed_pages().tolist() == DST[:3].tolist()


def test_a_room_that_never_registered_reports_no_page(fake_brokers, make_engine) -> None:
    """Aborted before the sender's broker had it: nothing can have landed."""
    p, d = fake_brokers("p"), fake_brokers("d")
    de = make_engine(d.address, "decode")
    make_engine(p.address, "prefill")
    receiver = de.handle.receiver(62, SenderRef(p.address, "no-such-group"))
    receiver.init(DST, aux_row=2)
    receiver.abort("client went away")
    assert receiver.wait(10).state == RoomState.FAILED
    eventually(lambda: receiver.status().pages_settled, 10)
    assert receiver.landed_pages().size == 0


def test_pages_that_settle_after_the_failure_still_come_with_the_ones_that_landed(fake_brokers, make_engine) -> None:
    """Regression: the decode engine aborts while a write of the second chunk hangs; its pages settle
    only when the transfer timeout cancels that write, a second later. The engine's session kept the
    first (unsettled) FAILED status and took only pages_settled from the later one, dropping the
    list of pages that arrived: they must come with it."""
    from kvbroker.testing.fake_nixl import XferScript

    p, d = fake_brokers("p", transfer_timeout_seconds=1.0), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver = de.handle.receiver(63, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:4], aux_row=2)
    sender = pe.handle.sender(63)
    sender.init(4, aux_row=1)
    sender.send(SRC[:2])

    def chunks_landed() -> list[int]:
        return [r.chunks for r in d.broker.queries.rooms.receivers_of(63)]

    eventually(lambda: d.loop.call(chunks_landed) == [1], 10)
    p.agent.script(XferScript(outcome="HANG"), XferScript(outcome="HANG"))
    sender.send(SRC[2:4])
    eventually(lambda: p.loop.call(lambda: p.broker.queries.traffic.inflight()) >= 1, 10)
    receiver.abort("decode preempted")
    assert receiver.wait(10).state == RoomState.FAILED
    assert not receiver.status().pages_settled, "a write into them is in flight"
    eventually(lambda: receiver.status().pages_settled, 10)
    assert receiver.landed_pages().tolist() == DST[:2].tolist()
    for layer in range(SMALL_MODEL.num_layers):
        for a, b in zip(page_bytes(pe.memory, layer, SRC[:2]), page_bytes(de.memory, layer, DST[:2])):
            assert torch.equal(a, b)


def test_a_part_that_lands_in_staging_after_the_failure_is_not_reported_as_arrived(fake_brokers, make_engine) -> None:
    """Prefill tp 2 -> decode tp 1 (each prefill rank's heads land in staging, or packed on the
    device path, and are scattered into the pages). The decode engine aborts while the last chunk's
    writes are in flight; they complete afterwards, but a failed rank scatters nothing more, so that
    chunk's pages did not arrive and must not be listed as landed."""
    from kvbroker.testing.fake_nixl import XferScript

    p, d = fake_brokers("p"), fake_brokers("d")
    pes = [make_engine(p.address, "prefill", tp_size=2, tp_rank=r, seed=r + 1) for r in range(2)]
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(64, SenderRef(p.address, "prefill-group"))
    receiver.init(DST[:4], aux_row=2)
    senders = [e.handle.sender(64) for e in pes]
    for sender in senders:
        sender.init(4, aux_row=1)
        sender.send(SRC[:2])

    def chunks_landed() -> list[int]:
        return [r.chunks for r in d.broker.queries.rooms.receivers_of(64)]

    eventually(lambda: d.loop.call(chunks_landed) == [2], 10)  # chunk 0 of both sources
    p.agent.script(*[XferScript(proc_polls=60)] * 8)
    for sender in senders:
        sender.send(SRC[2:4])
    eventually(lambda: p.loop.call(lambda: p.broker.queries.traffic.inflight()) >= 2, 10)
    receiver.abort("decode preempted")
    eventually(lambda: receiver.status().pages_settled, 10)
    assert d.broker.queries.counters.late_notices == 0 and p.loop.call(lambda: p.broker.queries.traffic.inflight()) == 0

    def unapplied() -> list[frozenset[int]]:
        return [e.unapplied for r in d.broker.queries.rooms.receivers_of(64) for e in (r.expected or {}).values()]

    assert d.loop.call(unapplied) == [frozenset({1}), frozenset({1})], "the last chunk's parts came after the abort"
    assert receiver.landed_pages().tolist() == DST[:2].tolist()
