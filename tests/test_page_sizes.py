"""Prefill and decode engines whose pages hold different numbers of tokens (vLLM allows it):
the broker moves the room's tokens as runs cut wherever either side's page ends, byte-exact,
for token-major (NHD) and MLA pages, with a prefix the decode holds, with checksums; counts that
cannot be the same tokens are a MISMATCH; head slices, and fused pages (whose inside is the
attention kernel's), between different page sizes are refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from kvbroker.client import ModelSpec, RoomState, SenderRef
from kvbroker.testing import FakeBroker, eventually
from kvbroker.v1 import common_pb2

from .conftest import Engine, token_bytes

# Every test with engines runs on host memory and on the device path (fake VRAM).
MEMORY_KINDS = ("dram", "vram")

NHD = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
FUSED = replace(NHD, kv_layout="hnd_fused")
MLA = ModelSpec(num_layers=2, total_kv_heads=1, head_dim=16, dtype=torch.bfloat16, page_size=4, mla=True)
MODELS = {"nhd": NHD, "mla": MLA}


def room_pages(tokens: int, page_size: int, first: int = 0) -> int:
    return -(-tokens // page_size) - first


def _pages(count: int, base: int, step: int) -> np.ndarray:
    """``count`` scattered page ids: never consecutive, so runs cannot hide behind adjacency."""
    return np.array([base + step * i for i in range(count)], dtype=np.int32)


def assert_tokens_moved(pe: Engine, src: np.ndarray, src_first: int, de: Engine, dst: np.ndarray, dst_first: int, begin: int, end: int) -> None:
    for layer in range(pe.memory.layout.num_layers):
        a = token_bytes(pe.memory, layer, src, src_first, begin, end)
        b = token_bytes(de.memory, layer, dst, dst_first, begin, end)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"layer {layer}: room tokens [{begin}, {end}) differ"


def snapshot(de: Engine) -> list[list[torch.Tensor]]:
    return [[t.view(torch.uint8).clone() for t in de.memory.kv_tensors(layer)] for layer in range(de.memory.layout.num_layers)]


def assert_only_listed_pages_written(de: Engine, before: list[list[torch.Tensor]], listed: np.ndarray) -> None:
    written = set(listed.tolist())
    for layer, tensors in enumerate(before):
        for now, then in zip(de.memory.kv_tensors(layer), tensors):
            for page in range(now.shape[0]):
                if page not in written:
                    assert torch.equal(now[page].view(torch.uint8), then[page]), f"layer {layer}: page {page} was written"


def open_room(p: FakeBroker, pe: Engine, de: Engine, room: int, dst: np.ndarray, pages: int, **expect: Any) -> tuple[Any, Any]:
    """The decode rank expects ``dst`` (aux row 2), the prefill rank opens the room for ``pages`` (aux row 1)."""
    receiver = de.handle.receiver(room, SenderRef(p.address, "prefill-group"))
    receiver.init(dst, aux_row=2, **expect)
    sender = pe.handle.sender(room)
    sender.init(pages, aux_row=1)
    return receiver, sender


def pair(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Engine], model: ModelSpec, ps: int, pd: int
) -> tuple[FakeBroker, Engine, Engine, FakeBroker]:
    p, d = fake_brokers("p"), fake_brokers("d")
    pe = make_engine(p.address, "prefill", model=replace(model, page_size=ps), num_pages=64)
    de = make_engine(d.address, "decode", model=replace(model, page_size=pd), num_pages=64)
    return p, pe, de, d


@pytest.mark.parametrize("layout", ["nhd", "mla"])
@pytest.mark.parametrize(
    "ps,pd,tokens,chunks",
    [
        (4, 8, 29, [8]),  # decode pages twice as large, one chunk
        (8, 4, 29, [1, 2, 1]),  # decode pages half as large, chunks of sender pages
        (6, 4, 23, [1, 1, 2]),  # neither divides the other: pages straddle chunks
        (4, 6, 24, [3, 3]),  # the room ends at a page end on both sides
        (5, 16, 3, [1]),  # less than one page on both sides
    ],
)
def test_tokens_move_between_page_sizes(
    fake_brokers, make_engine, memory_kind: str, layout: str, ps: int, pd: int, tokens: int, chunks: list[int]
) -> None:
    """Every token of the room lands where the decode's pages hold it, in every layout, whatever
    the chunks; no page the decode did not list is touched. In VRAM, each chunk's tokens are one
    packed part (gathered token by token into a slot, one write, scattered)."""
    p, pe, de, _ = pair(fake_brokers, make_engine, MODELS[layout], ps, pd)
    src, dst = _pages(room_pages(tokens, ps), 3, 3), _pages(room_pages(tokens, pd), 60, -2)
    assert sum(chunks) == src.size
    before = snapshot(de)
    receiver, sender = open_room(p, pe, de, 70, dst, int(src.size))
    offset = 0
    for n in chunks:
        sender.send(src[offset : offset + n])
        offset += n
    status = receiver.wait(10)
    assert status.state == RoomState.SUCCESS, status
    assert sender.wait(10).state == RoomState.SUCCESS
    assert_tokens_moved(pe, src, 0, de, dst, 0, 0, tokens)
    for a, b in zip(pe.memory.aux, de.memory.aux):
        assert torch.equal(a[1], b[2]), "the aux row did not come"
    assert_only_listed_pages_written(de, before, dst)
    counters = p.broker.queries.counters
    assert (counters.transfers_token_runs, counters.transfers_packed) == ((len(chunks), 0) if memory_kind == "dram" else (0, len(chunks)))


@pytest.mark.parametrize("ps,pd,prefix", [(4, 8, 1), (8, 4, 3), (6, 4, 2), (4, 6, 3)])
@pytest.mark.parametrize("sender_reads_prefix", [False, True], ids=["whole-room-sent", "sender-reads-prefix"])
def test_a_held_prefix_in_the_decodes_pages_is_not_written(
    fake_brokers, make_engine, ps: int, pd: int, prefix: int, sender_reads_prefix: bool
) -> None:
    """The decode holds its first ``prefix`` pages (its page size): only the tokens after them move,
    whether the prefill sends the whole room or reads the prefix (in its own pages: the whole
    ones inside the decode's prefix) and starts there."""
    tokens = 27
    p, pe, de, _ = pair(fake_brokers, make_engine, NHD, ps, pd)
    src = _pages(room_pages(tokens, ps), 3, 3)
    dst = _pages(room_pages(tokens, pd, prefix), 60, -2)
    before = snapshot(de)
    receiver = de.handle.receiver(71, SenderRef(p.address, "prefill-group"))
    receiver.init(dst, aux_row=2, prefix_pages=prefix)
    sender = pe.handle.sender(71)
    if sender_reads_prefix:
        sender.init(0, aux_row=1)
        held = prefix * pd // ps
        eventually(lambda: sender.status().prefix_pages == held, 10, describe=lambda: f"sender status {sender.status()}")
        sender.send(src[held : held + 1], room_page=held, is_last=False)
        sender.send(src[held + 1 :], is_last=True)
    else:
        sender.init(int(src.size), aux_row=1)
        sender.send(src[:2])
        sender.send(src[2:])
    assert receiver.wait(10).state == RoomState.SUCCESS and sender.wait(10).state == RoomState.SUCCESS
    assert_tokens_moved(pe, src, 0, de, dst, prefix, prefix * pd, tokens)
    assert_only_listed_pages_written(de, before, dst)


@pytest.mark.parametrize("ps,pd,tokens", [(8, 6, 5), (4, 8, 12), (6, 4, 23)])
def test_a_zero_page_last_chunk_completes_the_room(fake_brokers, make_engine, ps: int, pd: int, tokens: int) -> None:
    """Every page sent, then a last chunk with none (it still brings aux): SUCCESS, the tokens
    moved; also where the prefill's last page reaches past the decode's (8 tokens vs 6)."""
    p, pe, de, _ = pair(fake_brokers, make_engine, NHD, ps, pd)
    src, dst = _pages(room_pages(tokens, ps), 3, 3), _pages(room_pages(tokens, pd), 60, -2)
    receiver, sender = open_room(p, pe, de, 77, dst, int(src.size), verify_checksum=True)
    sender.send(src, is_last=False)
    sender.send(src[:0], is_last=True)
    status = receiver.wait(10)
    assert status.state == RoomState.SUCCESS, status
    assert_tokens_moved(pe, src, 0, de, dst, 0, 0, tokens)
    for a, b in zip(pe.memory.aux, de.memory.aux):
        assert torch.equal(a[1], b[2]), "the aux row did not come"


@pytest.mark.parametrize("ps,pd", [(4, 8), (6, 4), (5, 3)])
def test_random_rooms_between_page_sizes(fake_brokers, make_engine, ps: int, pd: int) -> None:
    """Seeded random rooms: token counts, held prefixes, chunk splits (zero-page last chunks
    included), the prefill sending the whole room or only what follows the prefix it read;
    checksums on. Every room succeeds with every token after the prefix in place, and no page the
    decode did not list is touched."""
    rng = np.random.default_rng(ps * 10 + pd)
    p, pe, de, _ = pair(fake_brokers, make_engine, NHD, ps, pd)
    before = snapshot(de)
    listed: list[np.ndarray] = []
    for i in range(12):
        tokens = int(rng.integers(1, 40))
        prefix = int(rng.integers(0, room_pages(tokens, pd)))
        src = rng.permutation(np.arange(20 * (i % 3), 20 * (i % 3) + room_pages(tokens, ps))).astype(np.int32)
        dst = rng.choice(np.arange(24, 64), size=room_pages(tokens, pd, prefix), replace=False).astype(np.int32)
        reads_prefix = bool(rng.integers(0, 2))
        receiver, sender = open_room(
            p, pe, de, 100 + i, dst, 0 if reads_prefix else int(src.size), prefix_pages=prefix, verify_checksum=True
        )
        first = 0
        if reads_prefix:
            first = prefix * pd // ps
            eventually(lambda s=sender, f=first: s.status().prefix_pages == f, 10, describe=lambda s=sender: f"{s.status()}")
        rest = src[first:]
        cuts = sorted({0, rest.size, *rng.integers(0, rest.size + 1, size=2).tolist()})
        pieces = [rest[a:b] for a, b in zip(cuts, cuts[1:])] or [rest]
        if rng.integers(0, 2):
            pieces.append(rest[:0])  # a zero-page last chunk
        for j, piece in enumerate(pieces):
            sender.send(piece, room_page=first if j == 0 and reads_prefix else None, is_last=j == len(pieces) - 1)
        status = receiver.wait(10)
        assert status.state == RoomState.SUCCESS, (i, tokens, prefix, reads_prefix, status)
        assert_tokens_moved(pe, src, 0, de, dst, prefix, prefix * pd, tokens)
        listed.append(dst)
        # Later rooms may reuse these decode pages: check what stayed untouched now.
        assert_only_listed_pages_written(de, before, np.concatenate(listed))


def test_checksums_cover_token_runs(fake_brokers, make_engine) -> None:
    """A verified room between page sizes succeeds (both sides hash the same tokens, each from its own pages)."""
    p, pe, de, _ = pair(fake_brokers, make_engine, NHD, 6, 4)
    src, dst = _pages(4, 3, 3), _pages(6, 60, -2)
    receiver, sender = open_room(p, pe, de, 72, dst, 4, verify_checksum=True)
    sender.send(src[:1])
    sender.send(src[1:])
    assert receiver.wait(10).state == RoomState.SUCCESS
    assert_tokens_moved(pe, src, 0, de, dst, 0, 0, 23)


def test_counts_that_cannot_be_the_same_tokens_are_a_mismatch(fake_brokers, make_engine) -> None:
    """3 pages of 4 tokens (9-12 tokens) cannot fill 3 pages of 8 (17-24): MISMATCH naming both sizes."""
    p, pe, de, _ = pair(fake_brokers, make_engine, NHD, 4, 8)
    receiver, sender = open_room(p, pe, de, 73, _pages(3, 60, -2), 3)
    sender.send(_pages(3, 3, 3))
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_MISMATCH, status
    assert "pages of 4 and 8 tokens" in status.cause.message
    eventually(lambda: receiver.status().pages_settled, 10)


def test_head_slices_between_page_sizes_are_refused(fake_brokers, make_engine) -> None:
    """Prefill tp 2 -> decode tp 1 with different page sizes: the decode's room fails (MISMATCH) naming why."""
    p, d = fake_brokers("p"), fake_brokers("d")
    for r in range(2):
        make_engine(p.address, "prefill", model=NHD, tp_size=2, tp_rank=r)
    de = make_engine(d.address, "decode", model=replace(NHD, page_size=8), num_pages=64)
    receiver = de.handle.receiver(74, SenderRef(p.address, "prefill-group"))
    receiver.init(_pages(2, 60, -2), aux_row=2)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_MISMATCH, status
    assert "head slices between different page sizes" in status.cause.message


def test_fused_pages_of_different_sizes_are_refused(fake_brokers, make_engine) -> None:
    """vLLM's CPU layout with different block sizes: the room fails naming why (the order of tokens
    inside a fused page is the attention kernel's), nothing is written."""
    p, pe, de, d = pair(fake_brokers, make_engine, FUSED, 8, 4)
    before = snapshot(de)
    receiver, sender = open_room(p, pe, de, 76, _pages(4, 60, -2), 2)
    sender.send(_pages(2, 3, 3))
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and "fused pages move whole only" in status.cause.message, status
    assert_only_listed_pages_written(de, before, np.zeros(0, dtype=np.int32))


def test_pages_completed_by_chunks_that_landed_are_reported_after_an_abort(fake_brokers, make_engine) -> None:
    """Pages of 6 -> 4 tokens: two of four chunks land (room tokens [0, 12): decode pages 0-2), then
    the prefill aborts; the settled status lists exactly those pages, holding the prefill's tokens."""
    p, pe, de, d = pair(fake_brokers, make_engine, NHD, 6, 4)
    src, dst = _pages(4, 3, 3), _pages(6, 60, -2)
    receiver, sender = open_room(p, pe, de, 75, dst, 4)
    sender.send(src[:1])
    sender.send(src[1:2])

    def chunks_landed() -> list[int]:
        return [r.chunks for r in d.broker.queries.rooms.receivers_of(75)]

    eventually(lambda: d.loop.call(chunks_landed) == [2], 10)
    sender.abort("prefill preempted")
    eventually(lambda: receiver.status().pages_settled, 10)
    assert receiver.status().state == RoomState.FAILED
    assert receiver.landed_pages().tolist() == dst[:3].tolist()
    assert_tokens_moved(pe, src, 0, de, dst, 0, 0, 12)
