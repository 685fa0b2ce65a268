"""Staging copies and pools: ``kvbroker.broker.staging`` and ``parts.page_blocks``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.broker.descriptors import BufferPlacement, build_descriptor_table
from kvbroker.broker.layout import Layout
from kvbroker.broker.parts import page_blocks
from kvbroker.broker.slicing import SliceSide
from kvbroker.broker.staging import (
    RegionSet,
    Reservation,
    StagingBuffer,
    StagingPool,
    gather,
    scatter,
)
from kvbroker.errors import DeadlineExceeded, ResourceExhausted

ITEMS, PAGE, TOKEN = 12, 4, 16  # pages per region, tokens per page, bytes per token


def _buffer(regions: int, gap: int = 0, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    region = ITEMS * PAGE * TOKEN
    buf = np.random.default_rng(seed).integers(0, 256, regions * (region + gap), dtype=np.uint8)
    return buf, [i * (region + gap) for i in range(regions)]


def _reference(buf: np.ndarray, offsets: list[int], pages: np.ndarray, side: SliceSide) -> np.ndarray:
    lo, hi = side.offset_bytes, side.offset_bytes + side.slice_bytes
    out = [buf[o : o + ITEMS * PAGE * TOKEN].reshape(ITEMS, PAGE, TOKEN)[p, :, lo:hi] for o in offsets for p in pages]
    return np.concatenate([x.ravel() for x in out])


@settings(max_examples=60, deadline=None)
@given(
    pages=st.lists(st.integers(0, ITEMS - 1), min_size=1, max_size=ITEMS, unique=True),
    lo=st.integers(0, 3),
    width=st.integers(1, 4),
    gap=st.sampled_from([0, 0, 64]),
    uneven=st.booleans(),
)
def test_gather_and_scatter_match_a_page_by_page_reference(pages: list[int], lo: int, width: int, gap: int, uneven: bool) -> None:
    """Packing by runs of pages (stacked over equally spaced regions, or region by region) gives the
    reference layout, and scattering it back restores exactly the slices and nothing else."""
    width = min(width, 4 - lo)
    side = SliceSide(page_size=PAGE, token_bytes=TOKEN, offset_bytes=lo * 4, slice_bytes=width * 4)
    buf, offsets = _buffer(3, gap)
    if uneven:
        offsets = [offsets[0], offsets[1], offsets[2] + 8]
        buf = np.concatenate([buf, np.zeros(8, dtype=np.uint8)])
    regions = RegionSet.over(buf, offsets, ITEMS, PAGE * TOKEN, PAGE)
    assert (regions.stacked is None) == uneven
    index = np.array(pages, dtype=np.int32)
    out = np.empty(3 * index.size * PAGE * side.slice_bytes, dtype=np.uint8)
    gather(regions, index, side, out)
    assert np.array_equal(out, _reference(buf, offsets, index, side))
    target, _ = _buffer(3, gap, seed=1)
    if uneven:
        target = np.concatenate([target, np.zeros(8, dtype=np.uint8)])
    before = target.copy()
    scatter(out, RegionSet.over(target, offsets, ITEMS, PAGE * TOKEN, PAGE), index, side)
    assert np.array_equal(_reference(target, offsets, index, side), out)
    untouched = np.ones(target.size, dtype=bool)
    for o in offsets:
        view = untouched[o : o + ITEMS * PAGE * TOKEN].reshape(ITEMS, PAGE, TOKEN)
        view[index, :, side.offset_bytes : side.offset_bytes + side.slice_bytes] = False
    assert np.array_equal(target[untouched], before[untouched])


def test_page_blocks_pair_pages_with_packed_blocks_and_merge_runs(layout_proto) -> None:  # type: ignore[no-untyped-def]
    """One descriptor per run of pages adjacent in memory, paired with consecutive packed blocks."""
    layout: Layout = layout_proto(num_layers=1, num_pages=16, aux_row_bytes=()).build()
    table = build_descriptor_table(layout, [BufferPlacement(1 << 20, 1 << 20, 1, 0)])
    page = layout.kv_page_bytes
    regions = tuple(layout.kv_regions.values())  # K and V of layer 0
    pages_side, blocks = page_blocks(table, regions, np.array([3, 4, 9], dtype=np.int32), page, 5000, 7)
    k, v = (table.region_address[r] for r in regions)
    assert pages_side.tolist() == [[k + 3 * page, 2 * page, 0], [k + 9 * page, page, 0], [v + 3 * page, 2 * page, 0], [v + 9 * page, page, 0]]
    assert blocks.tolist() == [[5000, 2 * page, 7], [5000 + 2 * page, page, 7], [5000 + 3 * page, 2 * page, 7], [5000 + 5 * page, page, 7]]


def test_pool_reservations_are_first_fit_aligned_and_merge_back() -> None:
    """Reservations are 4 KiB aligned; released neighbours merge; a full pool waits, then times out."""

    async def run() -> None:
        pool = StagingPool(StagingBuffer(address=0, size_bytes=16384, kind=1, device_id=0))
        a = pool.try_reserve(100)
        b = pool.try_reserve(5000)
        assert a == Reservation(0, 4096) and b == Reservation(4096, 8192)
        assert pool.try_reserve(8192) is None and pool.in_use_bytes == 12288
        pool.release(a)
        pool.release(b)
        assert pool.try_reserve(16384) == Reservation(0, 16384)
        with pytest.raises(DeadlineExceeded):
            await pool.reserve(4096, 0.05)
        with pytest.raises(ResourceExhausted):
            await pool.reserve(1 << 20, 1.0)

    asyncio.run(run())
