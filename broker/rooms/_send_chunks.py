"""One chunk of a source to one receiver rank, planned: pure functions.

Whether a source can fill a receiver at all (:func:`room_mismatch`); where a
chunk's pages land among the receiver's pages (:func:`chunk_window`: the
pages the receiver already holds are skipped; between different page sizes,
the room tokens the chunk writes and the receiver pages it completes) and
what else it carries (the aux row and state components, on the last chunk);
the notice that tells the receiver (:func:`chunk_notice`,
:func:`data_notice`) and each part's copy of it (:func:`part_notices`); and
the staging sizes the parts are planned against (:func:`pack_limit`,
:func:`stage_policy`). Nothing here keeps state or leaves effects:
``PartLedger`` (``_send_parts``) turns the plan into parts in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from kvbroker.broker.rooms._sender_records import Chunk, Destination, Source, TransferInfo
from kvbroker.errors import FailedPrecondition
from kvbroker.plan import (
    FULL_PAGES,
    NO_INDICES,
    ChunkShape,
    IndexArray,
    PackLimit,
    PartSpec,
    StagePolicy,
    TokenRange,
    completed_pages,
    same_token_count,
    state_regions,
    token_runs,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.peers import RemoteEngine

__all__ = [
    "ChunkWindow",
    "StagingBytes",
    "aux_rows",
    "chunk_notice",
    "chunk_window",
    "data_notice",
    "pack_limit",
    "page_sizes_note",
    "part_notices",
    "room_mismatch",
    "stage_policy",
    "state_pairs",
]

log = structlog.get_logger(__name__)

#: Size of a staging buffer for (memory kind, GPU) (0: none).
StagingBytes = Callable[[int, int], int]


def page_sizes_note(ps: int, pd: int) -> str:
    """What to add to a page-count message when the two sides' page sizes differ."""
    return "" if ps == pd else f" (pages of {ps} and {pd} tokens)"


def room_mismatch(source: Source, info: TransferInfo) -> str | None:
    """Why ``source`` cannot fill receiver ``info`` (None if it can, or if
    that is not known yet): it must start at or below the receiver's prefix,
    and end where the room ends (the same tokens, when the page sizes
    differ). Where it starts is known with its first chunk."""
    ps = source.engine.layout.page_size_tokens
    pd = info.page_size or ps
    sizes = page_sizes_note(ps, pd)
    if not source.chunks:
        return (
            f"the sender will send {source.num_pages} pages, receiver {info.receiver} expects {info.pages.size}{sizes}"
            if source.num_pages and not info.prefix_pages and not same_token_count(source.num_pages, ps, int(info.pages.size), pd)
            else None
        )
    if source.first_page * ps > info.prefix_pages * pd:
        return (
            f"the sender starts at room page {source.first_page}, receiver {info.receiver} holds only the first "
            f"{info.prefix_pages}{sizes}"
        )
    if source.num_pages and not same_token_count(
        source.first_page + source.num_pages, ps, info.prefix_pages + int(info.pages.size), pd
    ):
        return (
            f"the sender will send {source.num_pages} pages from room page {source.first_page}, receiver "
            f"{info.receiver} expects {info.pages.size} after the {info.prefix_pages} it holds{sizes}"
        )
    return None


@dataclass(frozen=True, slots=True)
class ChunkWindow:
    """Where one chunk of a source lands among one receiver rank's pages."""

    #: The indices of the chunk on both sides, with its aux row and state.
    shape: ChunkShape
    #: The first of the receiver's ``pages`` the chunk's notice names, and
    #: how many it fills (completes, when the page sizes differ).
    page_offset: int
    pages: int
    #: Different page sizes: the receiver's pages complete once the chunk
    #: landed (the destination's ``completed``); None when the sizes match.
    completed: int | None = None


def chunk_window(source: Source, dest: Destination, chunk: Chunk, remote: RemoteEngine) -> ChunkWindow:
    """Plan where ``chunk`` of ``source`` lands in the receiver of ``dest``
    (a plan that writes data), which ``remote`` describes. Raises
    ``FailedPrecondition`` if it does not fit there."""
    info, plan = dest.info, dest.plan
    # Room pages [start, end) of this chunk (in the sender's pages); the
    # receiver holds the room's first prefix_pages pages (in its own), its
    # `pages` are the rest.
    ps, pd = source.engine.layout.page_size_tokens, remote.layout.page_size_tokens
    start = source.first_page + chunk.page_offset
    end = start + int(chunk.pages.size)
    expected = info.prefix_pages + int(info.pages.size)
    if (end > start and (end - 1) * ps >= expected * pd) or (chunk.is_last and not same_token_count(end, ps, expected, pd)):
        raise FailedPrecondition(
            f"the sender sent room pages up to {end}{' in all' if chunk.is_last else ' so far'}, "
            f"receiver {info.receiver} expects {expected} ({info.prefix_pages} of them held already){page_sizes_note(ps, pd)}"
        )
    tokens: TokenRange | None = None
    runs = None
    completed = None
    if ps != pd and plan.mode != FULL_PAGES:
        raise FailedPrecondition(f"head slices between pages of {ps} and {pd} tokens are not implemented")
    if ps == pd:
        # Its first `skip` pages are the receiver's already; the rest fill the
        # receiver's pages from dst_start.
        skip = min(int(chunk.pages.size), max(0, info.prefix_pages - start))
        dst_start = max(0, start - info.prefix_pages)
        src_pages, dst_pages = chunk.pages[skip:], info.pages[dst_start : max(0, end - info.prefix_pages)]
        completes = int(src_pages.size)
    else:
        # Different page sizes: the tokens of its pages the receiver lacks,
        # [begin, stop) inside the receiver's [lo, hi) (empty for a chunk
        # wholly inside its prefix, or a zero-page last chunk).
        lo, hi = info.prefix_pages * pd, expected * pd
        begin = min(max(start * ps, lo), hi)
        stop = max(begin, min(end * ps, hi))
        runs = token_runs(chunk.pages, start, ps, info.pages, info.prefix_pages, pd, begin, stop)
        dst_start, completes = completed_pages(dest.completed, int(info.pages.size), info.prefix_pages, pd, stop, chunk.is_last)
        completed = dst_start + completes
        tokens = TokenRange(chunk.pages, start, begin, stop)
        src_pages = dst_pages = NO_INDICES
    shape = ChunkShape(
        src_pages=src_pages,
        dst_pages=dst_pages,
        aux_rows=aux_rows(chunk, dest),
        state=state_pairs(chunk, dest, remote),
        tokens=tokens,
        runs=runs,
        dst_tokens=TokenRange(info.pages, info.prefix_pages, tokens.begin, tokens.end) if tokens is not None else None,
    )
    return ChunkWindow(shape=shape, page_offset=dst_start, pages=completes, completed=completed)


def aux_rows(chunk: Chunk, dest: Destination) -> tuple[int, int] | None:
    """(source row, destination row) of the aux row ``chunk`` carries to ``dest``, if any."""
    # Lesson 1: aux goes on every last chunk, whether or not there is state
    # or KV, whenever the receiver asked for a row.
    if not (chunk.is_last and dest.plan.sends_aux and dest.info.aux_row is not None):
        return None
    if chunk.aux_row is None:
        raise FailedPrecondition(
            f"receiver {dest.info.receiver} expects aux row {dest.info.aux_row} but the sender has no aux regions"
        )
    return chunk.aux_row, dest.info.aux_row


def state_pairs(chunk: Chunk, dest: Destination, remote: RemoteEngine) -> dict[str, tuple[IndexArray, IndexArray]]:
    """(source, destination) indices of every component this source owes the receiver."""
    plan = dest.plan
    if not (chunk.is_last and plan.sends_state):
        return {}
    pairs = {}
    for name, dst in dest.info.state.items():
        if not state_regions(remote.layout, name, plan.layer_begin, plan.layer_end):
            continue
        src = chunk.state.get(name)
        if src is None or src.size == 0:
            raise FailedPrecondition(f"receiver {dest.info.receiver} expects state component {name!r} but the sender sent none")
        pairs[name] = (src, dst)
    return pairs


def chunk_notice(
    broker_id: str, source: Source, dest: Destination, chunk: Chunk, *, total_chunks: int, pages: int, page_offset: int = 0
) -> peer_pb2.TransferNotice:
    """The notice of one chunk to one receiver, from the sender's broker
    ``broker_id``: ``pages`` written from the receiver's page ``page_offset``
    (in its ``pages``)."""
    writes = dest.plan.writes_data
    return peer_pb2.TransferNotice(
        protocol_version=PROTOCOL_VERSION,
        room=source.room,
        sender_broker_id=broker_id,
        source=source.key.to_proto(),
        receiver=dest.info.receiver.to_proto(),
        chunk_index=chunk.index if writes else 0,
        is_last=chunk.is_last,
        total_chunks=total_chunks,
        pages=pages,
        page_offset=page_offset if writes else 0,
    )


def data_notice(
    broker_id: str, source: Source, dest: Destination, chunk: Chunk, window: ChunkWindow, specs: list[PartSpec]
) -> peer_pb2.TransferNotice:
    """The notice of a chunk that writes data, planned as ``window`` and
    ``specs``: what it fills and carries, and what of it moves packed."""
    shape = window.shape
    notice = chunk_notice(
        broker_id,
        source,
        dest,
        chunk,
        total_chunks=len(source.chunk_list) if chunk.is_last else 0,
        pages=window.pages,
        page_offset=window.page_offset,
    )
    notice.aux = shape.aux_rows is not None
    notice.state_components.extend(sorted(shape.state))
    if shape.tokens is not None:
        notice.token_begin, notice.token_end = shape.tokens.begin, shape.tokens.end
    notice.kv_packed = any(s.packing is not None and s.packing.kv_end > s.packing.kv_begin for s in specs)
    notice.aux_packed = any(s.packing is not None and s.packing.aux for s in specs)
    return notice


def part_notices(notice: peer_pb2.TransferNotice, specs: list[PartSpec]) -> list[peer_pb2.TransferNotice]:
    """The notice of each part of a chunk: the chunk's ``notice``, numbered,
    with its size and, for a packed part, what it packs."""
    out = []
    for i, spec in enumerate(specs):
        part_notice = peer_pb2.TransferNotice()
        part_notice.CopyFrom(notice)
        part_notice.part, part_notice.parts, part_notice.bytes = i, len(specs), spec.nbytes
        if spec.packing is not None:
            packing = spec.packing
            part_notice.packed = True
            part_notice.packed_kv_begin, part_notice.packed_kv_end = packing.kv_begin, packing.kv_end
            part_notice.packed_aux = packing.aux
            for name, items in packing.state:
                part_notice.packed_state.add(component=name, items=items)
        out.append(part_notice)
    return out


def pack_limit(part_bytes: int, send: StagingBytes, receive: StagingBytes) -> PackLimit:
    """The largest packed part between this broker's send staging (``send``)
    and a receiver's receive staging (``receive``): ``part_bytes``, and at
    most half of either transfer buffer (so consecutive parts overlap)."""

    def limit(sending: tuple[int, int], receiving: tuple[int, int]) -> int:
        ours = send(*sending)
        theirs = receive(*receiving)
        return min(part_bytes, ours // 2, theirs // 2) if ours and theirs else 0

    return limit


def stage_policy(send: StagingBytes, receive: StagingBytes) -> StagePolicy:
    """Whether a block of a part goes through a staging buffer, this broker's
    send staging (``send``) or the receiver's (``receive``): only where
    there is one and the block fits in it."""

    def stage(nbytes: int, where: str, kind: int, device: int) -> bool:
        size = send(kind, device) if where == "send" else receive(kind, device)
        if not size:
            return False
        if nbytes > size:
            log.warning("staging_block_too_large", bytes=nbytes, buffer=size, side=where, fallback="per-token descriptors")
            return False
        return True

    return stage
