"""What one chunk becomes on the wire: pure planning of its parts.

A chunk that a source sends to one receiver becomes one or more parts, each
one NIXL write carrying its own ``TransferNotice`` (``part`` of ``parts``):

- ``WHOLE``: whole items (KV pages of FULL_PAGES sources, aux rows, state
  items), by index into the prepared descriptor lists, one part per
  (local memory kind, remote memory kind) pair;
- head slices of a HEAD_SLICE source's pages (docs/design.md section 6).
  One side's slice is always its whole token (the rank with fewer heads
  holds a subset of the other's), so one copy is enough:
  ``GATHERED`` (the receiver holds fewer heads): this broker packs the slice
  into its send staging buffer and writes each packed page straight into
  the receiver's page; ``STAGED`` (the sender holds fewer heads): this
  broker writes its whole pages into room the receiver reserved in its
  receive staging buffer, and the receiver unpacks them into the slice of
  its pages. Either way one descriptor per page (contiguous runs merged);
- ``TOKENS``: the same head slices with one descriptor per (layer region,
  page, token), when staging is off or the block cannot fit; always for
  fused pages, where a head slice is one piece per page;
- ``RUNS``: whole tokens between different page sizes, one descriptor per
  (layer region, token run) (``kvbroker.plan``);
- ``NOTICE``: no bytes, only the notification: a completion-only source, or
  a last chunk with no pages, aux or state, so completion stays explicit;
- ``PACKED``: the device path. Whatever of the chunk lies in VRAM on either
  side (its KV, aux rows, state components) never meets NIXL in engine
  memory: this broker gathers it into a slot of its transfer buffer, one
  write moves the slot into a slot the receiver reserved (as for STAGED),
  and the receiver scatters it (``kvbroker.plan``). A chunk larger
  than a part may be is several PACKED parts. The rest of the chunk (DRAM on
  both sides) takes the paths above.

Nothing here does I/O; the sender's state machine counts the parts in
flight and the executor carries them out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from kvbroker.errors import FailedPrecondition
from kvbroker.plan._descriptors import DescriptorTable, Segment, plan_parts
from kvbroker.plan._indices import NO_INDICES, IndexArray
from kvbroker.plan._layout import Layout
from kvbroker.plan._mapping import SourcePlan
from kvbroker.plan._packing import Packed, PackedChunk, plan_packed, pool_text, split, transfer_pool
from kvbroker.plan._segments import ChunkShape, build_segments, same_item_bytes
from kvbroker.plan._slicing import HeadSlice, head_slice, kv_region_pairs, staged_bytes
from kvbroker.plan._tokens import TOKENS, TokenGeometry, check_alike, token_geometry
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["MAX_PARTS", "KvPairs", "PartKind", "PartSpec", "kv_pairs", "page_blocks", "plan_chunk", "span_names"]

VRAM = common_pb2.MEMORY_KIND_VRAM

#: A chunk has one part per (local, remote) pair of memory kinds, plus at most
#: one head-sliced part, plus its packed parts: a handful. A receiver refuses a notice whose part
#: index or count goes beyond this (it tracks parts as bits of an int).
MAX_PARTS = 1024


class PartKind(enum.Enum):
    WHOLE = "prepped"
    GATHERED = "gathered"
    STAGED = "staged"
    TOKENS = "per_token"
    RUNS = "token_runs"
    NOTICE = "notice"
    PACKED = "packed"


@dataclass(frozen=True)
class PartSpec:
    """One part of a chunk to one receiver: what moves, not yet how."""

    kind: PartKind
    nbytes: int
    #: WHOLE: memory kinds and index lists into the prepared lists.
    local_kind: int = 0
    remote_kind: int = 0
    local_indices: IndexArray | None = None
    remote_indices: IndexArray | None = None
    #: Span names of the aux rows and state components this part carries.
    carries: tuple[str, ...] = ()
    #: STAGED / TOKENS: (source region, receiver region) of every KV region
    #: of the layers moved, the pages on both sides and the head slice.
    pairs: tuple[tuple[int, int], ...] = ()
    src_pages: IndexArray | None = None
    dst_pages: IndexArray | None = None
    slice: HeadSlice | None = None
    #: RUNS: the token runs (``tokens.token_runs``) and both sides' geometry.
    runs: npt.NDArray[np.int64] | None = None
    geometry: tuple[TokenGeometry, TokenGeometry] | None = None
    #: PACKED: the sender's blocks and what the notice says of them, and the
    #: (memory kind, device) of the sender's and the receiver's transfer buffers.
    packing: PackedChunk | None = None
    pools: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))


#: Whether a head-sliced block of ``nbytes`` can be staged, and where:
#: ``stage(nbytes, "send", kind, device)`` (this broker's send buffer for
#: that memory) or ``stage(nbytes, "receive", kind, 0)`` (the receiver's).
StagePolicy = Callable[[int, str, int, int], bool]
#: The largest packed part between the sender's transfer buffer and the
#: receiver's, each named (memory kind, device); 0: one side has none.
PackLimit = Callable[[tuple[int, int], tuple[int, int]], int]


@dataclass(frozen=True)
class KvPairs:
    """The KV regions one source writes whole into one receiver, planned once per
    (source, receiver): grouped by (local memory kind, remote memory kind), the
    index of each region's first page in both prepared lists, the bytes of
    one page over the group, and of one page of each region. A chunk's KV then
    costs two broadcasts per group, not one segment per layer."""

    groups: tuple[tuple[int, int, npt.NDArray[np.int64], npt.NDArray[np.int64], int, npt.NDArray[np.int64]], ...]


def kv_pairs(src: Layout, src_table: DescriptorTable, dst: Layout, dst_table: DescriptorTable, plan: SourcePlan) -> KvPairs:
    """Plan a FULL_PAGES source's KV regions for one receiver (``FailedPrecondition``
    if the layouts do not pair)."""
    grouped: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}
    for s, d in kv_region_pairs(src, dst, plan.layer_begin, plan.layer_end):
        item = same_item_bytes(src, s, dst, d, f"layer {src.regions[s].layer_id}")
        sb, db, sizes = grouped.setdefault((src_table.region_kind[s], dst_table.region_kind[d]), ([], [], []))
        sb.append(src_table.region_base[s])
        db.append(dst_table.region_base[d])
        sizes.append(item)
    return KvPairs(
        groups=tuple(
            (lk, rk, np.asarray(sb, dtype=np.int64), np.asarray(db, dtype=np.int64), sum(sizes), np.asarray(sizes, dtype=np.int64))
            for (lk, rk), (sb, db, sizes) in grouped.items()
        )
    )


def _whole_parts(
    lk: int,
    rk: int,
    local: list[IndexArray],
    remote: list[IndexArray],
    sizes: list[int],
    kv_item_bytes: list[npt.NDArray[np.int64]],
    carries: tuple[str, ...],
    limit: int,
) -> list[PartSpec]:
    """One pair of memory kinds' WHOLE items as parts of at most about
    ``limit`` bytes: its first ``len(kv_item_bytes)`` arrays are KV pages
    (their items of those sizes: cut between items), the rest (aux rows, state)
    goes whole with the last part. At most ``MAX_PARTS // 2`` parts."""
    total = sum(sizes)
    if not limit or total <= limit:
        return [_whole(lk, rk, local, remote, total, carries)]
    limit = max(limit, -(-total // (MAX_PARTS // 2)))
    items = np.concatenate(kv_item_bytes) if kv_item_bytes else None
    kv_local = np.concatenate(local[: len(kv_item_bytes)]) if kv_item_bytes else NO_INDICES
    kv_remote = np.concatenate(remote[: len(kv_item_bytes)]) if kv_item_bytes else NO_INDICES
    rest = (local[len(kv_item_bytes) :], remote[len(kv_item_bytes) :], sum(sizes[len(kv_item_bytes) :]))
    bounds = [0]
    if items is not None:
        ends = np.cumsum(items)
        bounds += [int(i) for i in np.searchsorted(ends, np.arange(limit, int(ends[-1]), limit), side="right") if i > 0]
        bounds.append(len(items))
    bounds = sorted(set(bounds))
    parts = []
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        last = k == len(bounds) - 2
        loc, rem = [kv_local[lo:hi]], [kv_remote[lo:hi]]
        nbytes = int(items[lo:hi].sum()) if items is not None else 0
        if last:
            loc, rem, nbytes = loc + rest[0], rem + rest[1], nbytes + rest[2]
        parts.append(_whole(lk, rk, loc, rem, nbytes, carries if last else ()))
    return parts or [_whole(lk, rk, local, remote, total, carries)]


def _whole(lk: int, rk: int, local: list[IndexArray], remote: list[IndexArray], nbytes: int, carries: tuple[str, ...]) -> PartSpec:
    return PartSpec(
        kind=PartKind.WHOLE,
        nbytes=nbytes,
        local_kind=lk,
        remote_kind=rk,
        local_indices=local[0] if len(local) == 1 else np.concatenate(local).astype(np.int32),
        remote_indices=remote[0] if len(remote) == 1 else np.concatenate(remote).astype(np.int32),
        carries=carries,
    )


def plan_chunk(
    src: Layout,
    src_table: DescriptorTable,
    dst: Layout,
    dst_table: DescriptorTable,
    plan: SourcePlan,
    shape: ChunkShape,
    stage: StagePolicy,
    kv: KvPairs | None = None,
    pack_limit: PackLimit | None = None,
    whole_limit: int = 0,
) -> list[PartSpec]:
    """The parts of one chunk (``shape``) that source ``plan`` sends one receiver.

    ``kv``: the source's :class:`KvPairs` for this receiver, if planned already.
    ``pack_limit``: how large a PACKED part may be (needed when either side
    has memory in VRAM). ``whole_limit``: how large a WHOLE part may be (0:
    any): a larger pair of memory kinds is cut between KV pages into parts of
    about that size (so that a room of a higher class can pass it between two
    parts), its aux rows and state in the last. Raises ``FailedPrecondition``
    when the layouts do not pair. Never empty: a chunk that moves nothing is
    one ``NOTICE`` part.
    """
    packed: list[PartSpec] = []
    if VRAM in src_table.region_kind or VRAM in dst_table.region_kind:
        found = plan_packed(src, src_table, dst, dst_table, plan, shape)
        if not found.empty:
            packed = _packed_parts(found, transfer_pool(src, src_table), transfer_pool(dst, dst_table), pack_limit)
            if found.kv is not None and (shape.aux_rows is None or found.aux) and len(found.state) == len(shape.state) and len(packed) <= MAX_PARTS:
                return packed  # all of the chunk moves packed: nothing is left to plan directly
            shape = _left_direct(shape, found)
    # (local kind, remote kind) -> local index arrays, remote index arrays, bytes; in order of appearance.
    whole: dict[tuple[int, int], tuple[list[IndexArray], list[IndexArray], list[int]]] = {}
    #: The bytes of each item of the KV arrays of ``whole`` (the others are not cut), per pair of kinds.
    item_bytes: dict[tuple[int, int], list[npt.NDArray[np.int64]]] = {}
    pages = int(shape.src_pages.size)
    if pages and plan.mode == peer_pb2.SOURCE_MODE_FULL_PAGES:
        kv = kv or kv_pairs(src, src_table, dst, dst_table, plan)
        src_pages, dst_pages = shape.src_pages.astype(np.int64), shape.dst_pages.astype(np.int64)
        for lk, rk, src_bases, dst_bases, page_bytes, region_bytes in kv.groups:
            local, remote, sizes = whole.setdefault((lk, rk), ([], [], []))
            local.append((src_bases[:, None] + src_pages[None, :]).ravel().astype(np.int32))
            remote.append((dst_bases[:, None] + dst_pages[None, :]).ravel().astype(np.int32))
            sizes.append(page_bytes * pages)
            item_bytes.setdefault((lk, rk), []).append(np.repeat(region_bytes, pages))
    segments = build_segments(src, dst, plan, shape, kv=False)
    for p in plan_parts(src_table, dst_table, segments):
        local, remote, sizes = whole.setdefault((p.local_kind, p.remote_kind), ([], [], []))
        local.append(p.local_indices)
        remote.append(p.remote_indices)
        sizes.append(p.bytes)
    carried = _carried(src, src_table, dst_table, segments)
    parts = [
        piece
        for (lk, rk), (local, remote, sizes) in whole.items()
        for piece in _whole_parts(lk, rk, local, remote, sizes, item_bytes.get((lk, rk), []), carried.get((lk, rk), ()), whole_limit)
    ]
    if plan.head_sliced and shape.src_pages.size:
        hs = head_slice(src, dst, plan)
        pairs = tuple(kv_region_pairs(src, dst, plan.layer_begin, plan.layer_end))
        nbytes = staged_bytes(len(pairs), int(shape.src_pages.size), hs.src)
        kinds = {(src_table.region_kind[s], dst_table.region_kind[d]) for s, d in pairs}
        if len(kinds) != 1:
            raise FailedPrecondition("the KV regions of a head-sliced transfer must share one memory kind per side")
        (src_kind, dst_kind) = next(iter(kinds))
        src_device = src_table.region_device[pairs[0][0]] if pairs else 0
        dst_device = dst_table.region_device[pairs[0][1]] if pairs else 0
        if hs.src.page_size == 1:
            # Fused pages: the slice is one contiguous piece per page already.
            kind = PartKind.TOKENS
        elif hs.dst.slice_bytes == hs.dst.token_bytes and stage(nbytes, "send", src_kind, src_device):
            kind = PartKind.GATHERED
        elif hs.src.slice_bytes == hs.src.token_bytes and stage(nbytes, "receive", dst_kind, dst_device):
            kind = PartKind.STAGED
        else:
            kind = PartKind.TOKENS
        parts.append(
            PartSpec(
                kind=kind,
                nbytes=nbytes,
                local_kind=src_kind,
                remote_kind=dst_kind,
                pairs=pairs,
                src_pages=shape.src_pages,
                dst_pages=shape.dst_pages,
                slice=hs,
            )
        )
    if shape.runs is not None and shape.runs.size and plan.mode == peer_pb2.SOURCE_MODE_FULL_PAGES:
        parts.append(_runs_part(src, src_table, dst, dst_table, plan, shape.runs))
    parts.extend(packed)
    if not parts:
        parts.append(PartSpec(kind=PartKind.NOTICE, nbytes=0))
    if len(parts) > MAX_PARTS:
        raise FailedPrecondition(
            f"the chunk would move in {len(parts)} parts, at most {MAX_PARTS}: send smaller chunks or raise --device-part-mib"
        )
    return parts


def _left_direct(shape: ChunkShape, packed: Packed) -> ChunkShape:
    """What of ``shape`` is left for the direct paths once ``packed`` is packed."""
    if packed.kv is not None:
        shape = replace(shape, src_pages=NO_INDICES, dst_pages=NO_INDICES, tokens=None, runs=None, dst_tokens=None)
    if packed.aux:
        shape = replace(shape, aux_rows=None)
    if packed.state:
        gone = {name for name, _ in packed.state}
        shape = replace(shape, state={k: v for k, v in shape.state.items() if k not in gone})
    return shape


def _packed_parts(
    packed: Packed, send_pool: tuple[int, int], receive_pool: tuple[int, int], pack_limit: PackLimit | None
) -> list[PartSpec]:
    """``packed`` cut into PACKED parts that fit both transfer buffers."""
    limit = pack_limit(send_pool, receive_pool) if pack_limit is not None else 0
    if limit <= 0:
        raise FailedPrecondition(
            f"this chunk touches GPU memory and must move through transfer buffers, but the sender has none for "
            f"{pool_text(send_pool)} or the receiver none for {pool_text(receive_pool)} (--no-staging, or no GPU buffer)"
        )
    carries = (("kvbroker.aux",) if packed.aux else ()) + tuple(f"kvbroker.state.{name}" for name, _ in packed.state)
    out = []
    for chunk in split(packed, limit):
        out.append(
            PartSpec(
                kind=PartKind.PACKED,
                nbytes=chunk.nbytes,
                local_kind=send_pool[0],
                remote_kind=receive_pool[0],
                carries=carries if chunk.aux or chunk.state else (),
                packing=chunk,
                pools=(send_pool, receive_pool),
            )
        )
    return out


def _runs_part(
    src: Layout, src_table: DescriptorTable, dst: Layout, dst_table: DescriptorTable, plan: SourcePlan, runs: npt.NDArray[np.int64]
) -> PartSpec:
    """The part that moves a FULL_PAGES source's KV as token runs."""
    pairs = tuple(kv_region_pairs(src, dst, plan.layer_begin, plan.layer_end))
    kinds = {(src_table.region_kind[s], dst_table.region_kind[d]) for s, d in pairs}
    if len(kinds) != 1:
        raise FailedPrecondition("the KV regions of a token-run transfer must share one memory kind per side")
    geometry = (token_geometry(src), token_geometry(dst))
    check_alike(*geometry)
    (src_kind, dst_kind) = kinds.pop()
    nbytes = len(pairs) * geometry[0].token_bytes * int(runs[:, TOKENS].sum())
    return PartSpec(
        kind=PartKind.RUNS, nbytes=nbytes, local_kind=src_kind, remote_kind=dst_kind, pairs=pairs, runs=runs, geometry=geometry
    )


def page_blocks(
    table: DescriptorTable, regions: tuple[int, ...], pages: IndexArray, block_bytes: int, base: int, device: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Descriptors pairing whole pages with a packed block: the pages ``pages`` of
    every region in ``regions`` (in that order, each page ``block_bytes``) and
    consecutive ``block_bytes`` blocks from address ``base`` (device
    ``device``). Runs of pages adjacent in memory merge into one descriptor on
    both sides. Returns (page-side N x 3, block-side N x 3)."""
    addresses = np.concatenate([table.item_addresses(r, pages) for r in regions]).astype(np.int64)
    count = addresses.size
    breaks = np.flatnonzero(np.diff(addresses) != block_bytes) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [count]))) * block_bytes
    devices = np.asarray([table.region_device[r] for r in regions], dtype=np.uint64).repeat(pages.size)[starts]
    page_side = np.stack((addresses[starts].astype(np.uint64), lengths.astype(np.uint64), devices), axis=1)
    block_side = np.empty_like(page_side)
    block_side[:, 0] = np.uint64(base) + starts.astype(np.uint64) * np.uint64(block_bytes)
    block_side[:, 1] = page_side[:, 1]
    block_side[:, 2] = device
    return page_side, block_side


def _carried(
    layout: Layout, src: DescriptorTable, dst: DescriptorTable, segments: list[Segment]
) -> dict[tuple[int, int], tuple[str, ...]]:
    """(local kind, remote kind) -> span names of the aux rows and state components in that part."""
    out: dict[tuple[int, int], list[str]] = {}
    for seg in segments:
        name = span_names(layout, seg.src_region)
        if name is None:
            continue
        names = out.setdefault((src.region_kind[seg.src_region], dst.region_kind[seg.dst_region]), [])
        if name not in names:
            names.append(name)
    return {k: tuple(v) for k, v in out.items()}


def span_names(layout: Layout, region: int) -> str | None:
    """The span name of what region ``region`` carries, for aux and state regions."""
    r = layout.regions[region]
    if r.kind == common_pb2.REGION_KIND_AUX:
        return "kvbroker.aux"
    if r.kind == common_pb2.REGION_KIND_STATE:
        return f"kvbroker.state.{r.component}"
    return None
