"""Gather and scatter of packed blocks (``kvbroker.broker.device``), on both of its ways.

The host way (numpy, by runs of items) serves DRAM staging; the device way
(one torch index op per block over a flat view of its regions, whatever their
spacing) serves the device path on a GPU, and runs here on CPU tensors: the
same code, what CI can prove of it, with the GPU's gather op (advanced
indexing) run on CPU tensors too (``gather_op``) and launches counted as a
GPU would make them.
"""

from __future__ import annotations

import mmap
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.broker.device import ArrayViews, Extent, checksum, gather, scatter
from kvbroker.broker.device import _block_copies as copies_module
from kvbroker.plan import Block, packed_bytes, packed_offsets
from kvbroker.v1 import common_pb2

ITEMS, PAGE, TOKEN = 12, 4, 16  # pages per region, tokens per page, bytes per token
REGION = ITEMS * PAGE * TOKEN
DRAM, VRAM = common_pb2.MEMORY_KIND_DRAM, common_pb2.MEMORY_KIND_VRAM


def _buffer(regions: int, gap: int, seed: int) -> tuple[np.ndarray, list[int]]:
    buf = np.random.default_rng(seed).integers(0, 256, regions * (REGION + gap) + 64, dtype=np.uint8)
    return buf, [i * (REGION + gap) for i in range(regions)]


def _reference(buf: np.ndarray, offsets: list[int], block: Block) -> np.ndarray:
    out = []
    for o in offsets:
        region = buf[o : o + REGION].reshape(ITEMS, PAGE, TOKEN)
        for item in block.items:
            out.append(region[item, :, block.row_offset : block.row_offset + block.row_bytes].ravel())
    return np.concatenate(out)


@settings(max_examples=60, deadline=None)
@given(
    pages=st.lists(st.integers(0, ITEMS - 1), min_size=1, max_size=ITEMS, unique=True),
    lo=st.integers(0, 15),
    width=st.integers(1, 16),
    gap=st.sampled_from([0, 0, 64, 3]),
    shift=st.sampled_from([0, 0, 8, 1]),
    device=st.booleans(),
)
def test_gather_and_scatter_match_a_page_by_page_reference(
    pages: list[int], lo: int, width: int, gap: int, shift: int, device: bool
) -> None:
    """Packing a head slice of pages (stacked over equally spaced regions, or region by region; any
    word width) gives the reference layout, and scattering it back restores exactly the slices and
    nothing else; the same for numpy (host) and torch (device way, on CPU tensors)."""
    width = min(width, TOKEN - lo)
    block = Block((0, 1, 2), np.array(pages, dtype=np.int64), item_stride=PAGE * TOKEN, row_bytes=width, rows=PAGE, row_stride=TOKEN, row_offset=lo)
    views = ArrayViews(device_as_host=True)
    kind = VRAM if device else DRAM
    buf, offsets = _buffer(3, gap, seed=0)
    offsets = [o + shift * (i == 2) for i, o in enumerate(offsets)]  # shift: the regions are not evenly spaced
    base = buf.ctypes.data
    regions = [Extent(base + o, REGION, kind, 0) for o in offsets]
    out = np.zeros(block.nbytes + 32, dtype=np.uint8)
    slot = Extent(out.ctypes.data + 16, block.nbytes, kind, 0)
    gather(views, [block], [regions], slot)
    assert np.array_equal(out[16 : 16 + block.nbytes], _reference(buf, offsets, block))
    assert not out[:16].any() and not out[16 + block.nbytes :].any()
    target, _ = _buffer(3, gap, seed=1)
    before = target.copy()
    scatter(views, slot, [block], [[Extent(target.ctypes.data + o, REGION, kind, 0) for o in offsets]])
    assert np.array_equal(_reference(target, offsets, block), out[16 : 16 + block.nbytes])
    untouched = np.ones(target.size, dtype=bool)
    for o in offsets:
        view = untouched[o : o + REGION].reshape(ITEMS, PAGE, TOKEN)
        view[block.items, :, lo : lo + width] = False
    assert np.array_equal(target[untouched], before[untouched])


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_blocks_of_a_packed_part_start_aligned_and_come_back_in_order(device: bool) -> None:
    """KV pages, an odd-sized aux row and state items in one slot: each block starts on a 16-byte
    boundary, and scattering the slot back writes each where it came from."""
    kind = VRAM if device else DRAM
    views = ArrayViews(device_as_host=True)
    rng = np.random.default_rng(3)
    kv = rng.integers(0, 256, 2 * ITEMS * 64, dtype=np.uint8)
    aux = rng.integers(0, 256, 5 * 7, dtype=np.uint8)
    state = rng.integers(0, 256, 6 * 24, dtype=np.uint8)
    blocks = [
        Block((0, 1), np.array([5, 2, 3]), item_stride=64, row_bytes=64),
        Block((2,), np.array([4]), item_stride=7, row_bytes=7),
        Block((3,), np.array([0, 5]), item_stride=24, row_bytes=24),
    ]
    spans = [
        [Extent(kv.ctypes.data, ITEMS * 64, kind, 0), Extent(kv.ctypes.data + ITEMS * 64, ITEMS * 64, kind, 0)],
        [Extent(aux.ctypes.data, aux.size, kind, 0)],
        [Extent(state.ctypes.data, state.size, kind, 0)],
    ]
    assert packed_offsets(blocks) == [0, 384, 400] and packed_bytes(blocks) == 448
    out = np.zeros(448, dtype=np.uint8)
    slot = Extent(out.ctypes.data, 448, kind, 0)
    gather(views, blocks, spans, slot)
    assert bytes(out[:64]) == bytes(kv[5 * 64 : 6 * 64]) and bytes(out[192:256]) == bytes(kv[(ITEMS + 5) * 64 : (ITEMS + 6) * 64])
    assert bytes(out[384:391]) == bytes(aux[28:35]) and bytes(out[400:424]) == bytes(state[:24])
    if device:
        assert checksum(views, slot).item() == zlib.crc32(out.tobytes())
    else:
        assert checksum(views, slot) == zlib.crc32(out.tobytes())
    copies = [kv.copy(), aux.copy(), state.copy()]
    kv[:], aux[:], state[:] = 0, 0, 0
    scatter(views, slot, blocks, spans)
    assert bytes(kv[5 * 64 : 6 * 64]) == bytes(copies[0][5 * 64 : 6 * 64]) and bytes(aux[28:35]) == bytes(copies[1][28:35])
    assert bytes(state[5 * 24 : 6 * 24]) == bytes(copies[2][5 * 24 : 6 * 24]) and not state[24 : 5 * 24].any()


# -- the device way over uneven regions: one index op per block -----------------------------------


def _memories(layout: str, regions: int, seed: int) -> list[tuple[np.ndarray, int]]:
    """Where each region lies, as (array, offset): ``spaced``: one buffer, gaps of different sizes
    (odd ones too); ``buffers``: a mapping each (adopted tensors: one allocation per layer; mapped,
    as a device's allocations are, within a terabyte of each other: a small array from the heap
    and one from a mapping can lie 40 TiB apart, past ``_MAX_SPAN``, which made the launch
    counts depend on where malloc put them); ``reversed``: one buffer, regions in descending
    address order."""
    rng = np.random.default_rng(seed)
    if layout == "buffers":
        mapped = [np.frombuffer(mmap.mmap(-1, REGION + 64), dtype=np.uint8) for _ in range(regions)]
        for array in mapped:
            array[:] = rng.integers(0, 256, REGION + 64, dtype=np.uint8)
        return [(array, 8 * int(rng.integers(0, 8))) for array in mapped]
    gaps = rng.integers(0, 3, regions) * 8 + (rng.integers(0, 2, regions) if layout == "spaced" else 0)
    starts = np.concatenate(([0], np.cumsum(REGION + gaps)[:-1]))
    buf = rng.integers(0, 256, int(starts[-1]) + REGION + 64, dtype=np.uint8)
    order = starts[::-1] if layout == "reversed" else starts
    return [(buf, int(o)) for o in order]


def _slices(memories: list[tuple[np.ndarray, int]], block: Block) -> np.ndarray:
    """A block's bytes as a page-by-page reference packs them."""
    out = []
    for array, offset in memories:
        region = array[offset : offset + REGION].reshape(ITEMS, PAGE, TOKEN)
        out += [region[item, :, block.row_offset : block.row_offset + block.row_bytes].ravel() for item in block.items]
    return np.concatenate(out)


def _extents(memories: list[tuple[np.ndarray, int]]) -> list[Extent]:
    return [Extent(a.ctypes.data + o, REGION, VRAM, 0) for a, o in memories]


@pytest.fixture(params=["host-op", "gpu-op"])
def gather_op(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Gather with the host's op (index_select) and with the GPU's (advanced indexing), both on CPU tensors."""
    monkeypatch.setattr(copies_module, "_GPU_GATHER_ON_HOST", request.param == "gpu-op")
    return str(request.param)


@pytest.mark.parametrize("layout", ["spaced", "buffers", "reversed"])
@pytest.mark.parametrize("head", [False, True], ids=["pages", "head-slice"])
def test_uneven_regions_move_in_one_index_op_per_block_both_ways(layout: str, head: bool, gather_op: str) -> None:
    """Regions not equally spaced (gaps of different, odd sizes; separate buffers; descending
    addresses) gather to the page-by-page reference and scatter back exactly, touching no byte
    outside the items (gaps between regions included), in one index upload and one index op per
    block and direction: the launch count does not grow with the regions."""
    pages = np.array([9, 0, 4, 11], dtype=np.int64)
    if head:  # bytes 2..8 of each token: rows of 6 bytes at odd offsets (byte words)
        block = Block(tuple(range(5)), pages, item_stride=PAGE * TOKEN, row_bytes=6, rows=PAGE, row_stride=TOKEN, row_offset=2)
    else:
        block = Block(tuple(range(5)), pages, item_stride=PAGE * TOKEN, row_bytes=PAGE * TOKEN)
    views = ArrayViews(device_as_host=True)
    source = _memories(layout, 5, seed=1)
    out = np.zeros(block.nbytes + 32, dtype=np.uint8)
    slot = Extent(out.ctypes.data + 16, block.nbytes, VRAM, 0)
    gather(views, [block], [_extents(source)], slot)
    assert np.array_equal(out[16:-16], _slices(source, block)) and not out[:16].any() and not out[-16:].any()
    assert views.launches == 2, "one index upload and one index op"
    target = _memories(layout, 5, seed=2)
    before = [a.copy() for a, _ in target]
    scatter(views, slot, [block], [_extents(target)])
    assert views.launches == 4
    assert np.array_equal(_slices(target, block), out[16:-16])
    lo, hi = block.row_offset, block.row_offset + block.row_bytes
    for (array, offset), original in zip(target, before):  # put the block's bytes back as they were
        region = array[offset : offset + REGION].reshape(ITEMS, PAGE, TOKEN)
        region[block.items, :, lo:hi] = original[offset : offset + REGION].reshape(ITEMS, PAGE, TOKEN)[block.items, :, lo:hi]
    assert all(np.array_equal(a, b) for (a, _), b in zip(target, before)), "a byte outside the block's items changed"


@pytest.mark.parametrize("regions", [2, 64])
@pytest.mark.parametrize("pages", [1, ITEMS])
def test_launches_per_block_grow_with_neither_regions_nor_part_size(regions: int, pages: int) -> None:
    """Over regions of one (fake) GPU, a block is one index upload and one op each way, for 2 or
    64 uneven regions and 1 page or all of them (on 8b775e4: one upload and one op per
    region, and per region on the host even where the regions were equally spaced)."""
    views = ArrayViews(device_as_host=True)
    memories = _memories("buffers", regions, seed=regions)
    block = Block(tuple(range(regions)), np.arange(pages, dtype=np.int64)[::-1].copy(), item_stride=PAGE * TOKEN, row_bytes=PAGE * TOKEN)
    out = np.zeros(block.nbytes, dtype=np.uint8)
    slot = Extent(out.ctypes.data, block.nbytes, VRAM, 0)
    gather(views, [block], [_extents(memories)], slot)
    scatter(views, slot, [block], [_extents(memories)])
    assert views.launches == 4
    assert np.array_equal(out, _slices(memories, block))


def test_region_views_are_made_once_not_per_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second part over the same regions makes one tensor (its slot, shaped), not one per region."""
    made: list[Extent] = []
    tensor, shaped = ArrayViews.tensor, ArrayViews.shaped
    monkeypatch.setattr(ArrayViews, "tensor", lambda self, span: made.append(span) or tensor(self, span))
    monkeypatch.setattr(ArrayViews, "shaped", lambda self, span, width, shape: made.append(span) or shaped(self, span, width, shape))
    views = ArrayViews(device_as_host=True)
    memories = _memories("buffers", 8, seed=3)
    block = Block(tuple(range(8)), np.array([3, 1]), item_stride=PAGE * TOKEN, row_bytes=PAGE * TOKEN)
    out = np.zeros(block.nbytes, dtype=np.uint8)
    slot = Extent(out.ctypes.data, block.nbytes, VRAM, 0)
    gather(views, [block], [_extents(memories)], slot)
    made.clear()
    gather(views, [block], [_extents(memories)], slot)
    scatter(views, slot, [Block(block.regions, np.array([5]), item_stride=PAGE * TOKEN, row_bytes=PAGE * TOKEN)], [_extents(memories)])
    assert made == [slot, Extent(slot.address, 8 * PAGE * TOKEN, VRAM, 0)], "one view per part: its slot"


def test_regions_in_different_memories_go_region_by_region_with_one_index_per_memory(gather_op: str) -> None:
    """Regions on two GPUs and the host: no one op can span them, so each region is an op, each
    memory gets the index once (an upload per GPU, none for the host), and a region outside the
    slot's memory costs one copy; the bytes are right both ways."""
    views = ArrayViews(device_as_host=True)
    memories = _memories("buffers", 4, seed=4)
    spans = [Extent(a.ctypes.data + o, REGION, kind, device) for (a, o), (kind, device) in zip(memories, [(VRAM, 0), (VRAM, 1), (DRAM, 0), (VRAM, 0)])]
    block = Block(tuple(range(4)), np.array([2, 7, 5]), item_stride=PAGE * TOKEN, row_bytes=PAGE * TOKEN)
    out = np.zeros(block.nbytes, dtype=np.uint8)
    slot = Extent(out.ctypes.data, block.nbytes, VRAM, 0)
    gather(views, [block], [spans], slot)
    assert np.array_equal(out, _slices(memories, block))
    assert views.launches == 2 + 4 + 2, "uploads to GPUs 0 and 1, an op per region, copies from GPU 1 and the host"
    for a, o in memories:
        a[o : o + REGION] = 0
    scatter(views, slot, [block], [spans])
    assert np.array_equal(_slices(memories, block), out)


@pytest.mark.parametrize("head", [False, True], ids=["pages", "head-slice"])
def test_regions_too_far_apart_for_one_view_go_region_by_region(head: bool, gather_op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regions of one GPU spread wider than a view may sanely span (``_MAX_SPAN``, made small here)
    are copied region by region, with the index uploaded once: right bytes both ways."""
    monkeypatch.setattr(copies_module, "_MAX_SPAN", 2 * REGION)
    views = ArrayViews(device_as_host=True)
    memories = _memories("spaced", 4, seed=8)
    if head:
        block = Block((0, 1, 2, 3), np.array([6, 2]), item_stride=PAGE * TOKEN, row_bytes=8, rows=PAGE, row_stride=TOKEN, row_offset=8)
    else:
        block = Block((0, 1, 2, 3), np.array([6, 2]), item_stride=PAGE * TOKEN, row_bytes=PAGE * TOKEN)
    out = np.zeros(block.nbytes, dtype=np.uint8)
    slot = Extent(out.ctypes.data, block.nbytes, VRAM, 0)
    gather(views, [block], [_extents(memories)], slot)
    assert np.array_equal(out, _slices(memories, block)) and views.launches == 1 + 4
    for a, o in memories:
        a[o : o + REGION] = 0
    scatter(views, slot, [block], [_extents(memories)])
    assert np.array_equal(_slices(memories, block), out) and views.launches == 2 * (1 + 4)


def test_items_past_a_region_fail_and_write_nothing(gather_op: str) -> None:
    """An item past the end of the shortest region is refused before anything moves: over a flat
    span it would otherwise read or write the next region or the gap after it."""
    views = ArrayViews(device_as_host=True)
    memories = _memories("spaced", 3, seed=5)
    buf = memories[0][0]
    before = buf.copy()
    block = Block((0, 1, 2), np.array([1, ITEMS]), item_stride=PAGE * TOKEN, row_bytes=PAGE * TOKEN)
    out = np.full(block.nbytes, 7, dtype=np.uint8)
    slot = Extent(out.ctypes.data, block.nbytes, VRAM, 0)
    with pytest.raises(IndexError):
        scatter(views, slot, [block], [_extents(memories)])
    with pytest.raises(IndexError):
        gather(views, [block], [_extents(memories)], slot)
    assert np.array_equal(buf, before) and (out == 7).all()


@pytest.mark.parametrize("word", [8, 3])
def test_items_in_regions_around_their_slot_move_right(word: int, gather_op: str) -> None:
    """The slot lies inside the flat span of its regions (a transfer buffer allocated between two
    layers' tensors), with items of one word (an aux or state row of 8 bytes, or of 3 at byte
    width, whose views torch sees as dense): only the items are read and written, both ways."""
    views = ArrayViews(device_as_host=True)
    buf = np.random.default_rng(6).integers(0, 256, 4096, dtype=np.uint8)
    region = 16 * word
    spans = [Extent(buf.ctypes.data, region, VRAM, 0), Extent(buf.ctypes.data + 4096 - region, region, VRAM, 0)]
    block = Block((0, 1), np.array([3, 0, 15]), item_stride=word, row_bytes=word)
    slot = Extent(buf.ctypes.data + 1024, block.nbytes, VRAM, 0)
    gather(views, [block], [spans], slot)
    rows = buf[: region].reshape(16, word), buf[4096 - region :].reshape(16, word)
    expected = np.concatenate([r[block.items].ravel() for r in rows])
    assert np.array_equal(buf[1024 : 1024 + block.nbytes], expected)
    for r in rows:
        r[block.items] = 0
    scatter(views, slot, [block], [spans])
    assert np.array_equal(np.concatenate([r[block.items].ravel() for r in rows]), expected)
