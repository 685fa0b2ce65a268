"""The device path's packed parts: pure functions from a chunk to blocks of bytes.

Engine VRAM is never registered with NIXL (a NIXL write whose target is a
CUDA VMM allocation falls back to TCP on the host, one descriptor per page
moves a few GB/s even over CUDA IPC, and an IPC-opened pointer cannot be
registered at all; docs/architecture.md, "The device path"). So whatever
of a chunk lies in VRAM on either side moves packed: the sender's broker
gathers it into a slot of its own transfer buffer, one NIXL write moves the
slot into a slot of the receiving broker's transfer buffer, and that broker
scatters it into the engine's pages.

A packed part is a sequence of :class:`Block` s, each starting on a
``BLOCK_ALIGN``-byte boundary of the slot. A block is ``[regions, items,
rows, row_bytes]`` bytes: for each of its regions in order, for each item
(page, aux row, state item or token), ``rows`` rows of ``row_bytes``. The
sender reads its side's blocks, the receiver writes its own; both sides
describe the same bytes in the same order:

- KV (``kv_blocks``): every KV region of the source's layers
  (``slicing.kv_region_pairs`` order) in one block: whole pages; the head
  slice of each token of each page (different tp sizes); or, between
  different page sizes, room tokens as items of ``token_bytes``;
- aux: the row of each aux region, one block each;
- state: for each component (by name), each of its regions on the source's
  layers, one block each, trimmed as ``segments.state_segments`` trims.

The same KV order makes the KV of a whole packed chunk exactly the stream
``checksum.chunk_checksum`` hashes. A chunk larger than a part may be is cut
by KV items (:func:`split`); aux and state go with the last part. The
receiver rebuilds its blocks from its own room and the part's notice
(:func:`landing_blocks`), never from addresses the sender names, so a
packed part can only land in pages the receiving engine listed for the room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbroker.errors import FailedPrecondition
from kvbroker.plan._descriptors import DescriptorTable
from kvbroker.plan._indices import IndexArray
from kvbroker.plan._layout import Layout
from kvbroker.plan._mapping import SourcePlan
from kvbroker.plan._segments import ChunkShape, same_item_bytes, state_regions, state_segments
from kvbroker.plan._slicing import SliceSide, kv_region_pairs, kv_regions, remember, slice_side
from kvbroker.plan._tokens import TokenRange, token_geometry
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = [
    "BLOCK_ALIGN",
    "Block",
    "Packed",
    "PackedChunk",
    "kv_block",
    "landing_blocks",
    "packed_bytes",
    "packed_offsets",
    "plan_packed",
    "pool_text",
    "split",
    "token_items",
    "transfer_pool",
]

#: Item indices: page, row, state item or token numbers.
Items = npt.NDArray[np.integer[Any]] | Sequence[int]
#: Every block of a packed part starts at a multiple of this in the slot, so
#: the copies may move 8- or 16-byte words.
BLOCK_ALIGN = 16
DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM


@dataclass(frozen=True)
class Block:
    """Items of some regions of one side, as a packed part holds them.

    Item ``i`` of region ``r`` is ``rows`` rows of ``row_bytes`` bytes at
    ``start(r) + items[i] * item_stride + row * row_stride + row_offset``;
    the packed block is ``[len(regions), items.size, rows, row_bytes]``.
    """

    regions: tuple[int, ...]
    items: npt.NDArray[np.int64]
    item_stride: int
    row_bytes: int
    rows: int = 1
    row_stride: int = 0
    row_offset: int = 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.regions), int(self.items.size), self.rows, self.row_bytes)

    @property
    def nbytes(self) -> int:
        return len(self.regions) * int(self.items.size) * self.rows * self.row_bytes

    @property
    def item_bytes(self) -> int:
        """Packed bytes of one item over all the block's regions."""
        return len(self.regions) * self.rows * self.row_bytes

    def take(self, begin: int, end: int) -> Block:
        """The same block over items ``[begin, end)`` only (itself, if that is all of them)."""
        if begin == 0 and end >= self.items.size:
            return self
        return replace(self, items=self.items[begin:end])


def packed_offsets(blocks: Sequence[Block]) -> list[int]:
    """Where each block starts in its packed part."""
    out, at = [], 0
    for block in blocks:
        out.append(at)
        at = _aligned(at + block.nbytes)
    return out


def packed_bytes(blocks: Sequence[Block]) -> int:
    """The size of a packed part of ``blocks``."""
    if not blocks:
        return 0
    return packed_offsets(blocks)[-1] + blocks[-1].nbytes


def _aligned(n: int) -> int:
    return -(-n // BLOCK_ALIGN) * BLOCK_ALIGN


# -- the blocks of each kind, on one side ------------------------------------


def kv_block(layout: Layout, regions: Sequence[int], items: Items, head: SliceSide | None, tokens: bool) -> Block:
    """The KV of ``regions``: whole pages ``items``; with ``head``, that slice
    of each token of them; with ``tokens``, token positions ``items``."""
    idx = np.asarray(items, dtype=np.int64)
    page = layout.kv_page_bytes
    if tokens:
        geometry = token_geometry(layout)
        return Block(tuple(regions), idx, item_stride=geometry.token_bytes, row_bytes=geometry.token_bytes)
    if head is not None:
        return Block(
            tuple(regions),
            idx,
            item_stride=page,
            row_bytes=head.slice_bytes,
            rows=head.page_size,
            row_stride=head.token_bytes,
            row_offset=head.offset_bytes,
        )
    return Block(tuple(regions), idx, item_stride=page, row_bytes=page)


def _item_block(layout: Layout, region: int, items: Items) -> Block:
    """Whole items of one region (aux rows, state items)."""
    size = layout.regions[region].item_bytes
    return Block((region,), np.asarray(items, dtype=np.int64), item_stride=size, row_bytes=size)


def token_items(tokens: TokenRange, page_size: int) -> npt.NDArray[np.int64]:
    """Positions of room tokens [begin, end) among a side's tokens (page x page_size + offset)."""
    room = np.arange(tokens.begin, tokens.end, dtype=np.int64)
    pages = np.asarray(tokens.pages, dtype=np.int64)[room // page_size - tokens.first]
    return pages * page_size + room % page_size


# -- planning on the sender -------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """What of one chunk moves packed to one receiver, before it is cut into parts."""

    #: The sender's KV block and the receiver's (None: the KV moves directly, or there is none).
    kv: tuple[Block, Block] | None
    aux: tuple[tuple[Block, Block], ...]
    #: Component -> its (sender, receiver) blocks, by component name.
    state: tuple[tuple[str, tuple[tuple[Block, Block], ...]], ...]

    @property
    def empty(self) -> bool:
        return self.kv is None and not self.aux and not self.state


@dataclass(frozen=True)
class PackedChunk:
    """One packed part of a chunk: the sender's blocks and what the notice says of them."""

    blocks: tuple[Block, ...]
    kv_begin: int
    kv_end: int
    aux: bool
    state: tuple[tuple[str, int], ...]
    nbytes: int


def _in_vram(table: DescriptorTable, regions: Sequence[int]) -> bool:
    return any(table.region_kind[r] == VRAM for r in regions)


def plan_packed(
    src: Layout,
    src_table: DescriptorTable,
    dst: Layout,
    dst_table: DescriptorTable,
    plan: SourcePlan,
    shape: ChunkShape,
) -> Packed:
    """What of chunk ``shape`` must move packed: the KV, aux and each state
    component of which some region, on either side, is in VRAM. Raises
    ``FailedPrecondition`` when the two sides' blocks would not be alike."""
    kv = None
    has_tokens = shape.tokens is not None and shape.tokens.end > shape.tokens.begin
    if plan.writes_data and (shape.src_pages.size or has_tokens):
        packing = _kv_packing(src, src_table, dst, dst_table, plan)
        if packing is not None:
            kv = _kv_pair(src, dst, shape, packing)
    aux: tuple[tuple[Block, Block], ...] = ()
    if shape.aux_rows is not None and (_in_vram(src_table, src.aux_regions) or _in_vram(dst_table, dst.aux_regions)):
        if len(src.aux_regions) != len(dst.aux_regions):
            raise FailedPrecondition(f"the sender has {len(src.aux_regions)} aux regions, the receiver {len(dst.aux_regions)}")
        rows = shape.aux_rows
        for i, (s, d) in enumerate(zip(src.aux_regions, dst.aux_regions)):
            same_item_bytes(src, s, dst, d, f"aux region {i}")
            aux += ((_item_block(src, s, [rows[0]]), _item_block(dst, d, [rows[1]])),)
    state = []
    for name in sorted(shape.state):
        src_idx, dst_idx = shape.state[name]
        segments = state_segments(src, dst, name, src_idx, dst_idx, plan.layer_begin, plan.layer_end)
        if not segments:
            continue
        if _in_vram(src_table, [g.src_region for g in segments]) or _in_vram(dst_table, [g.dst_region for g in segments]):
            state.append((name, tuple((_item_block(src, g.src_region, g.src_items), _item_block(dst, g.dst_region, g.dst_items)) for g in segments)))
    return Packed(kv=kv, aux=aux, state=tuple(state))


@dataclass(frozen=True)
class _KvPacking:
    """What packing a chunk's KV between two ranks needs that no chunk changes:
    each side's regions and head slice (None: whole pages). The pairing's
    checks passed when it was made."""

    src_regions: tuple[int, ...]
    dst_regions: tuple[int, ...]
    src_head: SliceSide | None
    dst_head: SliceSide | None
    #: Why whole pages cannot pair (their items differ in size), or None: a
    #: chunk of token runs (page sizes differ) packs all the same.
    pages_problem: str | None = None


def _kv_packing(src: Layout, src_table: DescriptorTable, dst: Layout, dst_table: DescriptorTable, plan: SourcePlan) -> _KvPacking | None:
    """The KV packing of a source and a receiver under ``plan``, or None if
    neither side's KV is in VRAM (it moves directly); worked out once per pair
    of ranks and plan (kept in the source layout's memo: every chunk asks)."""
    key = ("kv-packing", id(dst), id(src_table), id(dst_table), plan.mode, plan.layer_begin, plan.layer_end, plan.src_head_start, plan.dst_head_start, plan.num_heads)
    found = src.memo.get(key)
    if found is not None and found[0] is dst and found[1] is src_table and found[2] is dst_table:
        packing: _KvPacking | None = found[3]
        return packing
    pairs = kv_region_pairs(src, dst, plan.layer_begin, plan.layer_end)
    s_regions, d_regions = tuple(s for s, _ in pairs), tuple(d for _, d in pairs)
    packing = None
    if pairs and (_in_vram(src_table, s_regions) or _in_vram(dst_table, d_regions)):
        if plan.head_sliced:
            src_head, dst_head = slice_side(src, plan.src_head_start, plan.num_heads, "sender"), slice_side(dst, plan.dst_head_start, plan.num_heads, "receiver")
            packing = _KvPacking(s_regions, d_regions, src_head, dst_head)
        else:
            problem = None
            try:
                for s, d in pairs:
                    same_item_bytes(src, s, dst, d, f"layer {src.regions[s].layer_id}")
            except FailedPrecondition as exc:
                problem = exc.message
            packing = _KvPacking(s_regions, d_regions, None, None, problem)
    remember(src, key, (dst, src_table, dst_table, packing))
    return packing


def _kv_pair(src: Layout, dst: Layout, shape: ChunkShape, packing: _KvPacking) -> tuple[Block, Block]:
    if shape.tokens is not None and shape.tokens.end > shape.tokens.begin:
        if shape.dst_tokens is None:
            raise FailedPrecondition("a token-run chunk without the receiver's tokens")
        pair = (
            kv_block(src, packing.src_regions, token_items(shape.tokens, src.page_size_tokens), None, tokens=True),
            kv_block(dst, packing.dst_regions, token_items(shape.dst_tokens, dst.page_size_tokens), None, tokens=True),
        )
    else:
        if packing.pages_problem is not None:
            raise FailedPrecondition(packing.pages_problem)
        pair = (
            kv_block(src, packing.src_regions, shape.src_pages, packing.src_head, False),
            kv_block(dst, packing.dst_regions, shape.dst_pages, packing.dst_head, False),
        )
    if pair[0].shape != pair[1].shape:
        raise FailedPrecondition(
            f"the packed KV is {pair[0].shape} (regions, items, rows, bytes) on the sender and {pair[1].shape} on the receiver"
        )
    return pair


def split(packed: Packed, limit: int) -> list[PackedChunk]:
    """Cut ``packed`` into parts of at most ``limit`` bytes, by KV items; aux
    and state go with the last (alone when they do not fit beside the KV).
    ``FailedPrecondition`` if one KV item, or the aux and state, exceed it."""
    if packed.kv is not None and not packed.aux and not packed.state:
        kv = packed.kv[0]
        if kv.items.size and kv.nbytes <= limit:  # the common case: the chunk's KV in one part
            return [PackedChunk((kv,), 0, int(kv.items.size), False, (), kv.nbytes)]
    tail = [pair[0] for pair in packed.aux] + [pair[0] for _, pairs in packed.state for pair in pairs]
    counts = tuple((name, int(pairs[0][0].items.size)) for name, pairs in packed.state)
    tail_bytes = packed_bytes(tail)
    if tail_bytes > limit:
        raise FailedPrecondition(
            f"the chunk's packed aux and state are {tail_bytes} bytes; a transfer slot holds {limit} (raise --device-part-mib)"
        )
    if packed.kv is None:
        return [PackedChunk(tuple(tail), 0, 0, bool(packed.aux), counts, tail_bytes)] if tail else []
    kv = packed.kv[0]
    items = int(kv.items.size)
    per_item = kv.item_bytes
    if per_item > limit:
        raise FailedPrecondition(
            f"one KV item of every layer region is {per_item} bytes packed; a transfer slot holds {limit} "
            "(raise --device-part-mib)"
        )
    cuts = [*range(0, items, limit // per_item), items]
    pieces = [kv] if len(cuts) == 2 else [kv.take(a, b) for a, b in zip(cuts, cuts[1:])]
    parts = [PackedChunk((piece,), a, b, False, (), piece.nbytes) for piece, a, b in zip(pieces, cuts, cuts[1:])]
    if tail:
        last = parts[-1]
        blocks = (*last.blocks, *tail)
        if packed_bytes(blocks) <= limit:
            parts[-1] = PackedChunk(blocks, last.kv_begin, last.kv_end, bool(packed.aux), counts, packed_bytes(blocks))
        else:
            parts.append(PackedChunk(tuple(tail), items, items, bool(packed.aux), counts, tail_bytes))
    return parts


def pool_text(pool: tuple[int, int]) -> str:
    """A (memory kind, device) pool as messages name it."""
    return f"GPU {pool[1]}" if pool[0] == VRAM else "host memory"


def transfer_pool(layout: Layout, table: DescriptorTable) -> tuple[int, int]:
    """The (memory kind, device) of the transfer buffer that serves a rank: its
    KV's GPU, or host memory. A receiving broker reserves its packed parts
    there, and the sender sizes them for it."""
    key = ("transfer-pool", id(table))
    found = layout.memo.get(key)
    if found is not None and found[0] is table:
        pool: tuple[int, int] = found[1]
        return pool
    pool = (DRAM, 0)
    for region in list(layout.kv_regions.values()) or range(len(layout.regions)):
        if table.region_kind[region] == VRAM:
            pool = (VRAM, table.region_device[region])
            break
    remember(layout, key, (table, pool))
    return pool


# -- the receiver's side of a packed part -----------------------------------------


def landing_blocks(
    layout: Layout,
    plan: SourcePlan,
    pages: IndexArray,
    prefix_pages: int,
    aux_row: int | None,
    state: dict[str, IndexArray],
    notice: peer_pb2.TransferNotice,
) -> list[Block]:
    """The receiving rank's blocks of packed part ``notice``, from its own room
    (``pages`` after ``prefix_pages`` held ones, ``aux_row``, ``state``).
    ``FailedPrecondition`` if the notice names anything outside them."""
    blocks: list[Block] = []
    if notice.packed_kv_end > notice.packed_kv_begin:
        regions = kv_regions(layout, plan.layer_begin, plan.layer_end, "receiver")
        if notice.token_end > notice.token_begin:
            room = TokenRange(pages, prefix_pages, int(notice.token_begin), int(notice.token_end))
            size = layout.page_size_tokens
            if room.begin < prefix_pages * size or room.end > (prefix_pages + int(pages.size)) * size:
                raise FailedPrecondition(f"a packed part names room tokens [{room.begin}, {room.end}) outside this rank's pages")
            kv = kv_block(layout, regions, token_items(room, size), None, tokens=True)
        else:
            chunk = pages[notice.page_offset : notice.page_offset + notice.pages]
            if chunk.size != notice.pages:
                raise FailedPrecondition(
                    f"a packed part names pages {notice.page_offset}..{notice.page_offset + notice.pages - 1}; "
                    f"this rank has {pages.size}"
                )
            head = slice_side(layout, plan.dst_head_start, plan.num_heads, "receiver") if plan.head_sliced else None
            kv = kv_block(layout, regions, chunk, head, tokens=False)
        if notice.packed_kv_end > kv.items.size:
            raise FailedPrecondition(f"a packed part names KV items up to {notice.packed_kv_end} of the chunk's {kv.items.size}")
        blocks.append(kv.take(notice.packed_kv_begin, notice.packed_kv_end))
    if notice.packed_aux:
        if aux_row is None or not notice.aux:
            raise FailedPrecondition("a packed part carries an aux row this rank did not ask for")
        blocks.extend(_item_block(layout, r, np.array([aux_row])) for r in layout.aux_regions)
    for entry in notice.packed_state:
        indices = state.get(entry.component)
        if indices is None or entry.component not in notice.state_components or entry.items > indices.size:
            raise FailedPrecondition(f"a packed part carries state {entry.component!r} this rank did not list (or more of it)")
        blocks.extend(
            _item_block(layout, r, indices[: entry.items]) for r in state_regions(layout, entry.component, plan.layer_begin, plan.layer_end)
        )
    return blocks
