"""Descriptor math: ``kvbroker.plan``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.errors import InvalidArgument
from kvbroker.plan import Layout
from kvbroker.plan._descriptors import (
    BufferPlacement,
    DescriptorTable,
    Segment,
    build_descriptor_table,
    coalesce_runs,
    count_runs,
    expand_rows,
    plan_parts,
)
from kvbroker.v1 import common_pb2

DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM

Builder = Callable[..., Any]


def i32(values: list[int] | range) -> np.ndarray:
    return np.array(list(values), dtype=np.int32)


# -- descriptor tables --------------------------------------------------------


@pytest.fixture
def mixed_layout(layout_proto: Builder, state_spec: Any) -> Layout:
    """KV in buffer 0, aux in buffer 1, state in buffer 2."""
    built = layout_proto(
        num_layers=2,
        num_pages=5,
        aux_rows=3,
        aux_row_bytes=(16, 8),
        state=(
            state_spec("mamba", common_pb2.STATE_TYPE_MAMBA, items=2, item_bytes=64, regions=1),
        ),
    )
    layout: Layout = built.build()
    return layout


def _placements(layout: Layout) -> list[BufferPlacement]:
    # KV on GPU 3, aux in host memory, state on GPU 3 as well.
    return [
        BufferPlacement(address=0x7F00_0000_0000, size_bytes=1 << 20, kind=VRAM, device_id=3),
        BufferPlacement(address=0x1000, size_bytes=1 << 12, kind=DRAM, device_id=0),
        BufferPlacement(address=0x7F00_1000_0000, size_bytes=1 << 12, kind=VRAM, device_id=3),
    ]


def test_descriptor_table_addresses(mixed_layout: Layout) -> None:
    """Item j of a region is (buffer address + offset + j*item_bytes, item_bytes, device)."""
    buffers = _placements(mixed_layout)
    table = build_descriptor_table(mixed_layout, buffers)
    assert set(table.rows) == {DRAM, VRAM}
    for region in mixed_layout.regions:
        buf = buffers[region.buffer]
        kind = table.region_kind[region.index]
        assert kind == buf.kind
        base = table.region_base[region.index]
        rows = table.expand(kind)[base : base + region.items]
        addresses = table.item_addresses(region.index, np.arange(region.items, dtype=np.int32))
        assert addresses.tolist() == rows[:, 0].tolist()
        assert rows.dtype == np.uint64
        expected = [
            (
                buf.address + region.offset_bytes + j * region.item_bytes,
                region.item_bytes,
                buf.device_id,
            )
            for j in range(region.items)
        ]
        assert [tuple(int(x) for x in row) for row in rows] == expected


def test_descriptor_table_region_base_per_kind(mixed_layout: Layout) -> None:
    """region_base counts items per memory kind in region order."""
    table = build_descriptor_table(mixed_layout, _placements(mixed_layout))
    # Regions: K0 V0 K1 V1 (VRAM, 5 pages each), aux 16 B, aux 8 B (DRAM, 3 rows), mamba (VRAM, 2).
    assert table.region_kind == (VRAM, VRAM, VRAM, VRAM, DRAM, DRAM, VRAM)
    assert table.region_base == (0, 5, 10, 15, 0, 3, 20)
    assert table.expand(VRAM).shape == (22, 3) and table.items(VRAM) == 22
    assert table.expand(DRAM).shape == (6, 3) and table.items(DRAM) == 6


def test_descriptor_table_is_one_strided_row_per_region(mixed_layout: Layout) -> None:
    """The table holds NIXL's strided form: (address, item bytes, device, stride, count) per region,
    so describing an engine costs one row per region, however many pages it has."""
    buffers = _placements(mixed_layout)
    table = build_descriptor_table(mixed_layout, buffers)
    assert table.rows[VRAM].shape == (5, 5) and table.rows[DRAM].shape == (2, 5)
    first = mixed_layout.regions[0]
    assert table.rows[VRAM][0].tolist() == [buffers[0].address + first.offset_bytes, first.item_bytes, 3, first.item_bytes, 5]


def test_expand_rows_follows_the_strides() -> None:
    """Expanding strided rows gives one (address, length, device) row per item, in order."""
    rows = np.array([[100, 8, 1, 16, 3], [1000, 4, 0, 4, 2]], dtype=np.uint64)
    assert expand_rows(rows).tolist() == [[100, 8, 1], [116, 8, 1], [132, 8, 1], [1000, 4, 0], [1004, 4, 0]]


def test_descriptor_table_all_dram(layout_proto: Builder) -> None:
    """With every buffer in one kind, bases run across all regions."""
    layout = layout_proto(num_layers=1, num_pages=4, aux_rows=2, aux_row_bytes=(16,)).build()
    buffers = [BufferPlacement(0, 1 << 20, DRAM, 0), BufferPlacement(1 << 20, 1 << 10, DRAM, 0)]
    table = build_descriptor_table(layout, buffers)
    assert list(table.rows) == [DRAM]
    assert table.region_base == (0, 4, 8)
    assert table.expand(DRAM).shape == (10, 3)
    assert int(table.expand(DRAM)[8, 0]) == 1 << 20


def _table(kinds: list[int], items: list[int], base_address: int = 0) -> DescriptorTable:
    """A hand-made table: region r has ``items[r]`` items of memory kind ``kinds[r]``."""
    counts: dict[int, int] = {}
    bases = []
    for kind, n in zip(kinds, items):
        bases.append(counts.get(kind, 0))
        counts[kind] = counts.get(kind, 0) + n
    rows = {k: np.array([[0, 1, 0, 1, n]], dtype=np.uint64) for k, n in counts.items()}
    zeros = tuple(0 for _ in kinds)
    return DescriptorTable(
        rows=rows,
        region_kind=tuple(kinds),
        region_base=tuple(bases),
        region_address=zeros,
        region_item_bytes=tuple(1 for _ in kinds),
        region_device=zeros,
    )


# -- transfer parts -----------------------------------------------------------


def test_plan_parts_groups_by_kind_pair() -> None:
    """Segments group into one part per (local kind, remote kind), offset by region_base."""
    src = _table([VRAM, VRAM, DRAM], [10, 10, 4])
    dst = _table([VRAM, DRAM, DRAM], [20, 6, 6])
    segments = [
        Segment(0, 0, i32([1, 2]), i32([5, 6]), 100),  # VRAM -> VRAM
        Segment(2, 1, i32([3]), i32([0]), 16),  # DRAM -> DRAM
        Segment(1, 0, i32([9, 0]), i32([7, 8]), 100),  # VRAM -> VRAM (src base 10)
        Segment(0, 2, i32([4]), i32([5]), 100),  # VRAM -> DRAM (dst base 6)
    ]
    parts = plan_parts(src, dst, segments)
    by_key = {(p.local_kind, p.remote_kind): p for p in parts}
    assert list(by_key) == [(VRAM, VRAM), (DRAM, DRAM), (VRAM, DRAM)]
    vv = by_key[(VRAM, VRAM)]
    assert vv.local_indices.tolist() == [1, 2, 19, 10]
    assert vv.remote_indices.tolist() == [5, 6, 7, 8]
    assert vv.bytes == 4 * 100
    dd = by_key[(DRAM, DRAM)]
    assert (dd.local_indices.tolist(), dd.remote_indices.tolist(), dd.bytes) == ([3], [0], 16)
    vd = by_key[(VRAM, DRAM)]
    assert (vd.local_indices.tolist(), vd.remote_indices.tolist(), vd.bytes) == ([4], [11], 100)
    for part in parts:
        assert part.local_indices.dtype == np.int32
        assert part.remote_indices.dtype == np.int32


def test_plan_parts_bytes_sum_items_times_item_bytes() -> None:
    """A part's bytes are the sum of items * item_bytes of its segments."""
    src = _table([DRAM, DRAM], [8, 8])
    dst = _table([DRAM, DRAM], [8, 8])
    parts = plan_parts(
        src,
        dst,
        [Segment(0, 0, i32(range(3)), i32(range(3)), 64), Segment(1, 1, i32([7]), i32([0]), 24)],
    )
    assert len(parts) == 1
    assert parts[0].bytes == 3 * 64 + 24


def test_plan_parts_skips_empty_segments() -> None:
    """Empty segments make no part and add no bytes."""
    src = _table([DRAM, VRAM], [4, 4])
    dst = _table([DRAM, VRAM], [4, 4])
    parts = plan_parts(
        src, dst, [Segment(0, 0, i32([]), i32([]), 8), Segment(1, 1, i32([2]), i32([3]), 8)]
    )
    assert [(p.local_kind, p.remote_kind) for p in parts] == [(VRAM, VRAM)]
    assert parts[0].local_indices.tolist() == [2]
    assert plan_parts(src, dst, [Segment(0, 0, i32([]), i32([]), 8)]) == []
    assert plan_parts(src, dst, []) == []


def test_plan_parts_mismatched_lengths() -> None:
    """Source and destination item lists of different lengths are InvalidArgument."""
    src = _table([DRAM], [4])
    dst = _table([DRAM], [4])
    with pytest.raises(
        InvalidArgument, match="segment 0->0: 2 source items but 1 destination items"
    ):
        plan_parts(src, dst, [Segment(0, 0, i32([0, 1]), i32([0]), 8)])


def test_plan_parts_keeps_consecutive_items_consecutive(layout_proto: Builder) -> None:
    """Consecutive pages of consecutive layers stay one run per region in the part."""
    layout = layout_proto(num_layers=2, num_pages=8, aux_row_bytes=()).build()
    buffers = [BufferPlacement(0, 1 << 20, VRAM, 0)]
    table = build_descriptor_table(layout, buffers)
    pages = i32([2, 3, 4])
    segments = [Segment(r, r, pages, pages, layout.kv_page_bytes) for r in range(4)]
    (part,) = plan_parts(table, table, segments)
    assert part.local_indices.tolist() == [2, 3, 4, 10, 11, 12, 18, 19, 20, 26, 27, 28]
    assert count_runs(part.local_indices, part.remote_indices) == 4


# -- runs ---------------------------------------------------------------------


def test_coalesce_fully_contiguous() -> None:
    """Indices advancing by one on both sides make a single run."""
    runs = coalesce_runs(i32([4, 5, 6, 7]), i32([10, 11, 12, 13]))
    assert runs.dtype == np.int64
    assert runs.tolist() == [[4, 10, 4]]
    assert count_runs(i32([4, 5, 6, 7]), i32([10, 11, 12, 13])) == 1


def test_coalesce_src_contiguous_dst_not() -> None:
    """A gap on the destination side breaks a run even when the source is contiguous."""
    src, dst = i32([0, 1, 2, 3]), i32([0, 1, 5, 6])
    assert coalesce_runs(src, dst).tolist() == [[0, 0, 2], [2, 5, 2]]
    assert count_runs(src, dst) == 2


def test_coalesce_dst_contiguous_src_not() -> None:
    """A gap on the source side breaks a run even when the destination is contiguous."""
    src, dst = i32([0, 2, 3]), i32([7, 8, 9])
    assert coalesce_runs(src, dst).tolist() == [[0, 7, 1], [2, 8, 2]]
    assert count_runs(src, dst) == 2


@pytest.mark.parametrize(
    "src,dst,runs",
    [
        ([3, 2, 1], [3, 2, 1], [[3, 3, 1], [2, 2, 1], [1, 1, 1]]),  # both go backwards
        ([5, 5], [1, 2], [[5, 1, 1], [5, 2, 1]]),  # repeated source
        ([1, 3], [1, 3], [[1, 1, 1], [3, 3, 1]]),  # both step by two
        ([9], [0], [[9, 0, 1]]),  # one pair
    ],
    ids=["backwards", "repeat", "stride-2", "single"],
)
def test_coalesce_both_sides_must_advance_by_one(
    src: list[int], dst: list[int], runs: list[list[int]]
) -> None:
    """A run continues only while both sides advance by exactly one."""
    assert coalesce_runs(i32(src), i32(dst)).tolist() == runs
    assert count_runs(i32(src), i32(dst)) == len(runs)


def test_coalesce_empty() -> None:
    """Empty input gives no runs."""
    runs = coalesce_runs(i32([]), i32([]))
    assert runs.shape == (0, 3)
    assert count_runs(i32([]), i32([])) == 0


def test_coalesce_mismatched_lengths() -> None:
    """Source and destination lists of different lengths are InvalidArgument."""
    with pytest.raises(InvalidArgument, match="3 source items but 2 destination items"):
        coalesce_runs(i32([0, 1, 2]), i32([0, 1]))


@pytest.mark.parametrize(
    "src,dst", [([0, 1, 2], [5, 6]), ([0, 1, 2, 3], [5, 6, 7])], ids=["broadcasts", "value-error"]
)
def test_count_runs_mismatched_lengths(src: list[int], dst: list[int]) -> None:
    """count_runs rejects lists of different lengths with InvalidArgument, like coalesce_runs."""
    with pytest.raises(InvalidArgument, match="source items but"):
        count_runs(i32(src), i32(dst))


def test_coalesce_int32_extremes_do_not_overflow() -> None:
    """Differences between int32 extremes are computed without wrapping."""
    src = i32([2**31 - 1, -(2**31)])
    dst = i32([0, 1])
    assert count_runs(src, dst) == 2
    assert coalesce_runs(src, dst).tolist() == [[2**31 - 1, 0, 1], [-(2**31), 1, 1]]


_pairs = st.lists(
    st.tuples(st.integers(min_value=0, max_value=40), st.integers(min_value=0, max_value=40)),
    max_size=60,
)


@given(_pairs)
def test_coalesce_runs_expand_to_input(pairs: list[tuple[int, int]]) -> None:
    """Expanding coalesce_runs' rows gives back the input pairs; count_runs is the row count."""
    src = i32([s for s, _ in pairs])
    dst = i32([d for _, d in pairs])
    runs = coalesce_runs(src, dst)
    expanded = [(int(s) + k, int(d) + k) for s, d, n in runs.tolist() for k in range(n)]
    assert expanded == pairs
    assert all(n >= 1 for _, _, n in runs.tolist())
    assert count_runs(src, dst) == runs.shape[0]


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(1, 6)), max_size=20))
def test_coalesce_runs_are_maximal(blocks: list[tuple[int, int, int]]) -> None:
    """Adjacent runs never continue one another: each run is maximal."""
    src = i32([s + k for s, _, n in blocks for k in range(n)])
    dst = i32([d + k for _, d, n in blocks for k in range(n)])
    runs = coalesce_runs(src, dst).tolist()
    for (s1, d1, n1), (s2, d2, _) in itertools.pairwise(runs):
        assert not (s2 == s1 + n1 and d2 == d1 + n1)
    assert len(runs) <= len(blocks)
