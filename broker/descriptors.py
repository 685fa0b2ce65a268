"""Descriptor math: pure functions from regions and indices to NIXL index lists.

The broker builds, once per engine rank, a table with one descriptor per
addressable item (KV page of one layer, aux row, state item) of every region,
grouped by memory kind: those tables become NIXL prepared descriptor lists
(local ones at registration, remote ones once per peer engine). A chunk's
transfer is then just two int32 index arrays into those lists.

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

from kvbroker.broker.layout import Layout
from kvbroker.errors import InvalidArgument
from kvbroker.indices import IndexArray

__all__ = [
    "BufferPlacement",
    "DescriptorTable",
    "Segment",
    "TransferPart",
    "build_descriptor_table",
    "check_index",
    "check_indices",
    "coalesce_runs",
    "count_runs",
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
    """One descriptor per item of every region of one engine rank.

    ``descs[kind]`` is an N x 3 uint64 array (address, length, device id) for
    memory kind ``kind``; region ``r``'s items are rows
    ``region_base[r] .. region_base[r] + items(r)`` of ``descs[region_kind[r]]``.
    """

    descs: dict[int, npt.NDArray[np.uint64]]
    region_kind: tuple[int, ...]
    region_base: tuple[int, ...]


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


def check_indices(indices: IndexArray, count: int, what: str) -> None:
    """Raise ``InvalidArgument`` unless every index is in ``[0, count)``.

    This runs before any descriptor exists: an index outside a registered
    region must never reach NIXL.
    """
    if indices.size == 0:
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0:
        raise InvalidArgument(f"{what}: index {low} is negative")
    if high >= count:
        raise InvalidArgument(f"{what}: index {high} is out of range (the region holds {count})")


def check_index(index: int, count: int, what: str) -> None:
    """:func:`check_indices` for a single index (an aux row)."""
    check_indices(np.array([index], dtype=np.int64), count, what)


def build_descriptor_table(layout: Layout, buffers: Sequence[BufferPlacement]) -> DescriptorTable:
    """The descriptor table of an engine rank whose buffers sit at ``buffers``."""
    per_kind: dict[int, list[npt.NDArray[np.uint64]]] = {}
    counts: dict[int, int] = {}
    region_kind: list[int] = []
    region_base: list[int] = []
    for region in layout.regions:
        buf = buffers[region.buffer]
        start = buf.address + region.offset_bytes
        block = np.empty((region.items, 3), dtype=np.uint64)
        block[:, 0] = start + np.arange(region.items, dtype=np.uint64) * np.uint64(region.item_bytes)
        block[:, 1] = region.item_bytes
        block[:, 2] = buf.device_id
        region_kind.append(buf.kind)
        region_base.append(counts.get(buf.kind, 0))
        counts[buf.kind] = counts.get(buf.kind, 0) + region.items
        per_kind.setdefault(buf.kind, []).append(block)
    descs = {kind: np.concatenate(blocks) for kind, blocks in per_kind.items()}
    return DescriptorTable(descs=descs, region_kind=tuple(region_kind), region_base=tuple(region_base))


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
