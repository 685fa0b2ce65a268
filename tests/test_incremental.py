"""Incremental transfer: the decode rank already holds a room's leading pages
(its prefix cache), says how many (``prefix_pages``), and lists only the rest.

The sender either sends the whole room and the broker skips what the receiver
holds (vLLM's way: the prefill side does not know the decode's cache), or reads
the prefix from its status and sends only the rest (``first_page``; SGLang's
way). Either way only the pages after the prefix are written, byte-exact, and
aux and state still come with the last chunk, also when every page is held.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvbroker import errors
from kvbroker.client import RoomState, SenderRef
from kvbroker.plan import encode_indices
from kvbroker.testing import FakeBroker, eventually
from kvbroker.v1 import common_pb2, transfer_pb2

from .conftest import SMALL_MODEL, Engine, page_bytes

# Every test with engines runs on host memory and on the device path (fake VRAM).
MEMORY_KINDS = ("dram", "vram")

#: The room's seven pages on the prefill side.
SRC = np.array([3, 4, 5, 9, 10, 20, 21], dtype=np.int32)


def _dst(prefix: int) -> np.ndarray:
    """Decode pages for room pages [prefix, 7): never the same as the prefill's."""
    return np.array([30 - i for i in range(len(SRC) - prefix)], dtype=np.int32)


def _pair(fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Engine], **kw: object) -> tuple[FakeBroker, Engine, Engine]:
    p, d = fake_brokers("p"), fake_brokers("d")
    return p, make_engine(p.address, "prefill", **kw), make_engine(d.address, "decode", **kw)


def _send(pe: Engine, room: int, chunks: list[int], room_page: int | None = None) -> None:
    """Open the room on the prefill rank and send ``chunks`` (page counts) of SRC from ``room_page``."""
    sender = pe.handle.sender(room)
    sender.init(sum(chunks), aux_row=1)
    offset = room_page or 0
    for i, n in enumerate(chunks):
        sender.send(SRC[offset : offset + n], room_page=room_page if i == 0 else None)
        offset += n


def _assert_tail_arrived(pe: Engine, de: Engine, prefix: int, untouched: torch.Tensor) -> None:
    """Room pages [prefix, 7) are in the decode pages; nothing else changed."""
    dst = _dst(prefix)
    for layer in range(SMALL_MODEL.num_layers):
        for a, b in zip(page_bytes(pe.memory, layer, SRC[prefix:]), page_bytes(de.memory, layer, dst)):
            assert torch.equal(a, b), f"layer {layer}: the pages after the prefix differ"
    for src_rows, dst_rows in zip(pe.memory.aux, de.memory.aux):
        assert torch.equal(src_rows[1], dst_rows[2]), "the aux row did not come"
    written = set(dst.tolist())
    for layer in range(SMALL_MODEL.num_layers):
        for now, then in zip(de.memory.kv_tensors(layer), untouched[layer]):
            for page in range(now.shape[0]):
                if page not in written:
                    assert torch.equal(now[page].view(torch.uint8), then[page]), f"layer {layer}: page {page} was written"


def _snapshot(de: Engine) -> list[list[torch.Tensor]]:
    return [[t.view(torch.uint8).clone() for t in de.memory.kv_tensors(layer)] for layer in range(SMALL_MODEL.num_layers)]


@pytest.mark.parametrize("chunks", [[7], [2, 3, 2], [1, 1, 5]], ids=["one-chunk", "2-3-2", "1-1-5"])
@pytest.mark.parametrize("prefix", [0, 1, 3, 7])
def test_the_whole_room_sent_writes_only_the_pages_after_the_prefix(fake_brokers, make_engine, prefix: int, chunks: list[int]) -> None:
    """A sender that does not know the decode's cache sends all 7 pages (chunks wholly inside the
    prefix, across it, after it); the broker writes only room pages [prefix, 7), aux included,
    also when the prefix is the whole room."""
    p, pe, de = _pair(fake_brokers, make_engine)
    untouched = _snapshot(de)
    receiver = de.handle.receiver(40, SenderRef(p.address, "prefill-group"))
    receiver.init(_dst(prefix), aux_row=2, prefix_pages=prefix)
    _send(pe, 40, chunks)
    status = receiver.wait(10)
    assert status.state == RoomState.SUCCESS, status
    assert status.prefix_pages == prefix and pe.handle.sender(40).wait(10).state == RoomState.SUCCESS
    _assert_tail_arrived(pe, de, prefix, untouched)


@pytest.mark.parametrize("prefix", [2, 7])
def test_a_sender_that_reads_the_prefix_sends_only_the_rest(fake_brokers, make_engine, prefix: int) -> None:
    """SGLang's way: the sender opens the room without a page count, reads the receivers' prefix
    from its status once they registered, and sends only the rest, its first chunk starting at
    that room page (for a full hit, a zero-page last chunk that still brings aux)."""
    p, pe, de = _pair(fake_brokers, make_engine)
    untouched = _snapshot(de)
    receiver = de.handle.receiver(41, SenderRef(p.address, "prefill-group"))
    receiver.init(_dst(prefix), aux_row=2, prefix_pages=prefix)
    sender = pe.handle.sender(41)
    sender.init(0, aux_row=1)  # 0: the count is not said yet
    eventually(lambda: sender.status().prefix_pages == prefix, 10, describe=lambda: f"sender status {sender.status()}")
    rest = SRC[prefix:]
    if rest.size > 2:
        sender.send(rest[:2], room_page=prefix, is_last=False)
        sender.send(rest[2:], is_last=True)
    else:
        sender.send(rest, room_page=prefix, is_last=True)
    assert receiver.wait(10).state == RoomState.SUCCESS and sender.wait(10).state == RoomState.SUCCESS
    _assert_tail_arrived(pe, de, prefix, untouched)


def test_pages_nobody_sends_fail_the_room_as_a_mismatch(fake_brokers, make_engine) -> None:
    """A sender starting past the receiver's prefix leaves room pages unwritten: MISMATCH on both
    sides, pages settled; so does a whole-room count that does not match prefix + pages."""
    p, pe, de = _pair(fake_brokers, make_engine)
    receiver = de.handle.receiver(43, SenderRef(p.address, "prefill-group"))
    receiver.init(_dst(2), aux_row=2, prefix_pages=2)
    _send(pe, 43, [4], room_page=3)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_MISMATCH, status
    assert "starts at room page 3" in status.cause.message
    eventually(lambda: receiver.status().pages_settled)
    receiver2 = de.handle.receiver(44, SenderRef(p.address, "prefill-group"))
    receiver2.init(_dst(2), aux_row=2, prefix_pages=2)
    _send(pe, 44, [6])  # the whole room is 7 pages
    status = receiver2.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_MISMATCH, status


def test_only_the_first_chunk_may_say_where_it_starts(fake_brokers, make_engine) -> None:
    """The client refuses room_page after the first chunk at once; so does the broker (a raw command)."""
    p, pe, de = _pair(fake_brokers, make_engine)
    sender = pe.handle.sender(45)
    sender.init(7, aux_row=1)
    sender.send(SRC[:2], room_page=0)
    with pytest.raises(errors.InvalidArgument, match="only the first chunk"):
        sender.send(SRC[2:], room_page=2)
    pe.handle.flush(10)  # the session applied BeginSend and the first chunk
    request = transfer_pb2.SendChunkRequest(
        engine_id=pe.handle.engine_id, room=45, pages=encode_indices(SRC[2:4]), room_page=5
    )
    with pytest.raises(errors.InvalidArgument, match="follows on at 2"):
        pe.client.call(pe.client.stub.SendChunk, request)
    sender.abort()


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (2, 1)], ids=["gathered", "staged"])
def test_a_prefix_with_head_slices_writes_the_tail_of_the_full_transfer(fake_brokers, make_engine, ptp: int, dtp: int) -> None:
    """Different tp sizes (head slices through staging): a room with a prefix writes exactly what
    the full room writes into the pages after the prefix (the full room is the reference)."""
    p, d = fake_brokers("p"), fake_brokers("d")
    model = SMALL_MODEL
    pes = [make_engine(p.address, "prefill", tp_size=ptp, tp_rank=r, seed=r + 1) for r in range(ptp)]
    des = [make_engine(d.address, "decode", tp_size=dtp, tp_rank=r) for r in range(dtp)]
    prefix = 3
    full_dst = np.arange(0, 7, dtype=np.int32)
    tail_dst = np.arange(10, 14, dtype=np.int32)
    for room, dst, held in ((50, full_dst, 0), (51, tail_dst, prefix)):
        receivers = [e.handle.receiver(room, SenderRef(p.address, "prefill-group")) for e in des]
        for r in receivers:
            r.init(dst, aux_row=2, prefix_pages=held)
        for e in pes:
            _send(e, room, [2, 5])
        for r in receivers:
            assert r.wait(10).state == RoomState.SUCCESS, r.status()
    for e in des:
        for layer in range(model.num_layers):
            for full, tail in zip(page_bytes(e.memory, layer, full_dst[prefix:]), page_bytes(e.memory, layer, tail_dst)):
                assert torch.equal(full, tail), f"tp{e.handle.rank.tp_rank} layer {layer}"
