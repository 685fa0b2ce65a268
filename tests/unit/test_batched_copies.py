"""Copying the parts of one batch (``device.scatter_all``, ``device.gather_all``): the bytes of
per-part copies, two index ops per shape however many parts, and a bad part failing alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.broker.device import ArrayViews, Extent, gather, gather_all, scatter, scatter_all
from kvbroker.broker.device import _block_copies as copies_module
from kvbroker.plan import Block, packed_bytes
from kvbroker.v1 import common_pb2

ITEMS, PAGE, TOKEN = 12, 4, 16  # pages per region, tokens per page, bytes per token
REGION = ITEMS * PAGE * TOKEN
VRAM = common_pb2.MEMORY_KIND_VRAM
SLOT = 4096  # slots of the receive buffer start 4 KiB apart (its free list's alignment)


def _setup(parts: list[list[int]], width: int, lo: int, seed: int) -> tuple[np.ndarray, Extent, list[tuple[Extent, list[Block], list[list[Extent]]]], list[np.ndarray]]:
    """A receive buffer of random bytes holding one slot per part (keep it: the extents point
    into it), and each part's block over
    three regions (the same regions for all): head slices [lo, lo + width) of pages ``parts[i]``."""
    rng = np.random.default_rng(seed)
    buffer = rng.integers(0, 256, SLOT * (len(parts) + 1), dtype=np.uint8)
    whole = Extent(buffer.ctypes.data, buffer.nbytes, VRAM, 0)
    landed = []
    # The three regions in one allocation (64 bytes apart): separately allocated arrays can lie
    # terabytes apart in a long run, past what one op spans, and then go region by region.
    memory = np.zeros(3 * (REGION + 64), dtype=np.uint8)
    targets = [memory[i * (REGION + 64) : i * (REGION + 64) + REGION] for i in range(3)]
    spans = [Extent(t.ctypes.data, REGION, VRAM, 0) for t in targets]
    for i, pages in enumerate(parts):
        block = Block((0, 1, 2), np.array(pages, dtype=np.int64), item_stride=PAGE * TOKEN, row_bytes=width, rows=PAGE, row_stride=TOKEN, row_offset=lo)
        landed.append((Extent(buffer.ctypes.data + i * SLOT, packed_bytes([block]), VRAM, 0), [block], [spans]))
    return buffer, whole, landed, targets


@pytest.fixture(params=["host op", "GPU op"])
def gather_op(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both gather ops on CPU tensors: index_select (the host's), advanced indexing (a GPU's)."""
    monkeypatch.setattr(copies_module, "_GPU_GATHER_ON_HOST", request.param == "GPU op")
    return str(request.param)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.lists(st.integers(0, ITEMS - 1), min_size=1, max_size=4, unique=True), min_size=1, max_size=6),
    lo=st.sampled_from([0, 4, 8]),
    width=st.sampled_from([4, 8, 16]),
)
def test_scatter_all_writes_what_per_part_scatters_write(parts: list[list[int]], lo: int, width: int, gather_op: str) -> None:
    """Parts scattered together leave the regions byte for byte as scattering them one by one,
    in order (pages of different parts disjoint), with the GPU's gather op too (the fixture
    only sets a module flag: nothing to reset between examples)."""
    width = min(width, TOKEN - lo)
    seen: set[int] = set()
    disjoint = []
    for pages in parts:
        mine = [p for p in pages if p not in seen]
        seen.update(mine)
        if mine:
            disjoint.append(mine)
    parts = disjoint
    kept, whole, landed, together = _setup(parts, width, lo, seed=1)
    assert scatter_all(ArrayViews(device_as_host=True), whole, landed) == {}
    kept_again, _, landed_again, alone = _setup(parts, width, lo, seed=1)
    views = ArrayViews(device_as_host=True)
    for slot, blocks, regions in landed_again:
        scatter(views, slot, blocks, regions)
    for a, b in zip(together, alone):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("copy_all", [scatter_all, gather_all], ids=["scatter", "gather"])
def test_launches_per_batch_do_not_grow_with_its_parts(copy_all: Any) -> None:
    """Two index uploads and two ops for a batch of one shape, for 2 parts or 6 (one by one:
    two per part), both ways."""
    for count in (2, 6):
        kept, whole, landed, _ = _setup([[i] for i in range(count)], 16, 0, seed=2)
        views = ArrayViews(device_as_host=True)
        assert copy_all(views, whole, landed) == {}
        assert views.launches == 4


def test_a_part_whose_items_are_outside_its_regions_fails_alone() -> None:
    """One part names a page past the regions' end: it fails with why, the others land."""
    kept, whole, landed, targets = _setup([[1], [2], [3]], 16, 0, seed=3)
    slot, blocks, regions = landed[1]
    landed[1] = (slot, [Block(blocks[0].regions, np.array([ITEMS + 5]), blocks[0].item_stride, blocks[0].row_bytes, blocks[0].rows, blocks[0].row_stride)], regions)
    failed = scatter_all(ArrayViews(device_as_host=True), whole, landed)
    assert list(failed) == [1] and isinstance(failed[1], IndexError)
    for target in targets:
        pages = target.reshape(ITEMS, PAGE * TOKEN)
        assert pages[1].any() and pages[3].any() and not pages[2].any()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.lists(st.integers(0, ITEMS - 1), min_size=1, max_size=4, unique=True), min_size=1, max_size=6),
    lo=st.sampled_from([0, 4, 8]),
    width=st.sampled_from([4, 8, 16]),
)
def test_gather_all_packs_what_per_part_gathers_pack(parts: list[list[int]], lo: int, width: int, gather_op: str) -> None:
    """Parts gathered together fill their slots (and nothing else of the send buffer) byte for
    byte as gathering them one by one, with the GPU's gather op too."""
    width = min(width, TOKEN - lo)
    kept, whole, packed, regions = _setup(parts, width, lo, seed=4)
    for i, region in enumerate(regions):
        region[:] = np.random.default_rng(10 + i).integers(0, 256, REGION, dtype=np.uint8)
    together = kept.copy()
    assert gather_all(ArrayViews(device_as_host=True), whole, packed) == {}
    together, kept[:] = kept.copy(), together  # the batch's result; the buffer as it was
    views = ArrayViews(device_as_host=True)
    for slot, blocks, spans in packed:
        gather(views, blocks, spans, slot)
    assert np.array_equal(together, kept)


def test_a_gather_whose_items_are_outside_its_regions_fails_alone() -> None:
    """One part names a page past the regions' end: it fails with why; the others are packed."""
    kept, whole, packed, regions = _setup([[1], [2], [3]], 16, 0, seed=6)
    for region in regions:
        region[:] = 7
    slot, blocks, spans = packed[1]
    packed[1] = (slot, [Block(blocks[0].regions, np.array([ITEMS + 5]), blocks[0].item_stride, blocks[0].row_bytes, blocks[0].rows, blocks[0].row_stride)], spans)
    before = kept.copy()
    failed = gather_all(ArrayViews(device_as_host=True), whole, packed)
    assert list(failed) == [1] and isinstance(failed[1], IndexError)
    for i in (0, 2):
        at = packed[i][0].address - whole.address
        assert (kept[at : at + packed[i][0].nbytes] == 7).all()
    at = slot.address - whole.address
    assert np.array_equal(kept[at : at + slot.nbytes], before[at : at + slot.nbytes])
