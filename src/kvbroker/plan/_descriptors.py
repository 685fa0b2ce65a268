"""Descriptor math: pure functions from regions and indices to NIXL index lists.

The broker describes, once per engine rank, every addressable item (KV page
of one layer, aux row, state item) of every region, grouped by memory kind:
those tables become NIXL prepared descriptor lists (local ones at
registration, remote ones once per peer engine). A table is compact: one
strided row per region (NIXL's K x 5 form), never one row per item, so an
engine of millions of pages costs nothing to describe. A chunk's transfer is
then just two int32 index arrays into those lists.

Items of one region are consecutive in its table, so a run of consecutive
pages on both sides becomes a run of consecutive indices whose descriptors are
adjacent in memory on both sides; NIXL merges such a run into one descriptor
when it makes the transfer (checked by ``tests/test_nixl_real.py`` through
NIXL's telemetry). :func:`coalesce_runs` computes the same runs for the
transient-descriptor path and for descriptor counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbroker.errors import InvalidArgument
from kvbroker.plan._indices import IndexArray
from kvbroker.plan._layout import Layout

__all__ = [
    "BufferPlacement",
    "DescriptorTable",
    "Segment",
    "TransferPart",
    "build_descriptor_table",
    "coalesce_runs",
    "count_runs",
    "expand_rows",
    "plan_parts",
]


@dataclass(frozen=True)
class BufferPlacement:
    """Where a buffer is mapped in the broker that owns it."""

    address: int
    size_bytes: int
    kind: int
    device_id: int


@dataclass(frozen=True)
class DescriptorTable:
    """Every item of every region of one engine rank, indexed per memory kind.

    ``rows[kind]`` is a K x 5 uint64 array of NIXL strided rows (address,
    item bytes, device id, stride, count), one per region of that kind in
    region order; item ``i`` of kind ``kind`` is the ``i``-th item when the
    rows are expanded in order. Region ``r``'s items are indices
    ``region_base[r] .. region_base[r] + items(r)`` of ``region_kind[r]``'s
    list; its first item is at ``region_address[r]``.
    """

    rows: dict[int, npt.NDArray[np.uint64]]
    region_kind: tuple[int, ...]
    region_base: tuple[int, ...]
    region_address: tuple[int, ...]
    region_item_bytes: tuple[int, ...]
    region_device: tuple[int, ...]

    def items(self, kind: int) -> int:
        """How many items the list of memory ``kind`` holds."""
        rows = self.rows.get(kind)
        return 0 if rows is None else int(rows[:, 4].sum())

    def expand(self, kind: int) -> npt.NDArray[np.uint64]:
        """The list of memory ``kind`` as N x 3 rows (address, length, device): one per item."""
        return expand_rows(self.rows[kind])

    def item_addresses(self, region: int, items: IndexArray) -> npt.NDArray[np.uint64]:
        """Addresses of ``items`` of region ``region``."""
        return np.uint64(self.region_address[region]) + items.astype(np.uint64) * np.uint64(self.region_item_bytes[region])


def expand_rows(rows: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Strided K x 5 rows as the N x 3 list they stand for (tests, the fake agent)."""
    counts = rows[:, 4].astype(np.int64)
    out = np.empty((int(counts.sum()), 3), dtype=np.uint64)
    first = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else np.zeros(0, dtype=np.int64)
    for (address, length, device, stride, count), start in zip(rows.tolist(), first.tolist()):
        block = out[start : start + count]
        block[:, 0] = address + np.arange(count, dtype=np.uint64) * np.uint64(stride)
        block[:, 1] = length
        block[:, 2] = device
    return out


@dataclass(frozen=True)
class Segment:
    """Items ``src_items`` of source region ``src_region`` go to ``dst_items`` of ``dst_region``."""

    src_region: int
    dst_region: int
    src_items: IndexArray
    dst_items: IndexArray
    item_bytes: int


@dataclass(frozen=True)
class TransferPart:
    """One NIXL transfer: index lists into one local and one remote prepared list."""

    local_kind: int
    remote_kind: int
    local_indices: IndexArray
    remote_indices: IndexArray
    bytes: int


def build_descriptor_table(layout: Layout, buffers: Sequence[BufferPlacement]) -> DescriptorTable:
    """The descriptor table of an engine rank whose buffers sit at ``buffers`` (one row per region)."""
    per_kind: dict[int, list[tuple[int, int, int, int, int]]] = {}
    counts: dict[int, int] = {}
    region_kind: list[int] = []
    region_base: list[int] = []
    region_address: list[int] = []
    for region in layout.regions:
        buf = buffers[region.buffer]
        start = buf.address + region.offset_bytes
        per_kind.setdefault(buf.kind, []).append((start, region.item_bytes, buf.device_id, region.item_bytes, region.items))
        region_kind.append(buf.kind)
        region_base.append(counts.get(buf.kind, 0))
        region_address.append(start)
        counts[buf.kind] = counts.get(buf.kind, 0) + region.items
    rows = {kind: np.array(r, dtype=np.uint64).reshape(-1, 5) for kind, r in per_kind.items()}
    return DescriptorTable(
        rows=rows,
        region_kind=tuple(region_kind),
        region_base=tuple(region_base),
        region_address=tuple(region_address),
        region_item_bytes=tuple(r.item_bytes for r in layout.regions),
        region_device=tuple(buffers[r.buffer].device_id for r in layout.regions),
    )


def plan_parts(src: DescriptorTable, dst: DescriptorTable, segments: Sequence[Segment]) -> list[TransferPart]:
    """Group segments into one transfer per (local kind, remote kind) pair.

    Within a part, segments keep their order and each segment's items keep
    theirs, so consecutive items stay consecutive indices (and merge).
    """
    grouped: dict[tuple[int, int], tuple[list[IndexArray], list[IndexArray], list[int]]] = {}
    for seg in segments:
        if seg.src_items.shape != seg.dst_items.shape:
            raise InvalidArgument(
                f"segment {seg.src_region}->{seg.dst_region}: {seg.src_items.size} source items "
                f"but {seg.dst_items.size} destination items"
            )
        if seg.src_items.size == 0:
            continue
        key = (src.region_kind[seg.src_region], dst.region_kind[seg.dst_region])
        local, remote, sizes = grouped.setdefault(key, ([], [], []))
        local.append(seg.src_items + np.int32(src.region_base[seg.src_region]))
        remote.append(seg.dst_items + np.int32(dst.region_base[seg.dst_region]))
        sizes.append(int(seg.src_items.size) * seg.item_bytes)
    return [
        TransferPart(
            local_kind=lk,
            remote_kind=rk,
            local_indices=np.concatenate(local).astype(np.int32, copy=False),
            remote_indices=np.concatenate(remote).astype(np.int32, copy=False),
            bytes=sum(sizes),
        )
        for (lk, rk), (local, remote, sizes) in grouped.items()
    ]


def coalesce_runs(src: IndexArray, dst: IndexArray) -> npt.NDArray[np.int64]:
    """Maximal runs where both ``src`` and ``dst`` advance by one.

    Returns a K x 3 int64 array of (src start, dst start, length): each row
    becomes one descriptor of ``length`` items.
    """
    if src.shape != dst.shape:
        raise InvalidArgument(f"{src.size} source items but {dst.size} destination items")
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    s = src.astype(np.int64)
    d = dst.astype(np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return np.stack((s[starts], d[starts], lengths), axis=1)


def count_runs(src: IndexArray, dst: IndexArray) -> int:
    """How many descriptors :func:`coalesce_runs` would make."""
    if src.shape != dst.shape:
        raise InvalidArgument(f"{src.size} source items but {dst.size} destination items")
    if src.size == 0:
        return 0
    return 1 + int(np.count_nonzero((np.diff(src.astype(np.int64)) != 1) | (np.diff(dst.astype(np.int64)) != 1)))
