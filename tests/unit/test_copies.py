"""Gather and scatter of packed blocks (``kvbroker.broker.device``), on both of its ways.

The host way (numpy, by runs of items) serves DRAM staging; the device way
(torch index ops over stacked views) serves the device path on a GPU, and
runs here on CPU tensors: the same code, what CI can prove of it.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.broker.device._copies import ArrayViews, Extent, checksum, gather, scatter
from kvbroker.plan._packing import Block, packed_bytes, packed_offsets
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
