"""The broker's own copies: blocks gathered into slots and scattered from them.

A :class:`~kvbroker.plan.Block` names items of an engine's
regions; a slot is a range of one of this broker's host staging or GPU
transfer buffers (a ``StagingReservation`` or a ``TransferSlot``), or a
sender's credits in one. :func:`gather` packs blocks into a slot, :func:`scatter`
unpacks a slot into blocks. Two ways, by where the memory is:

- host memory only (DRAM staging of head slices): numpy, one strided copy
  per run of consecutive items, over every region at once when the regions
  lie equally spaced in one buffer (measured here: 9.4 GB/s for a chunk of
  8 pages in 2 runs over 64 regions, 5.7 GB/s beside another copy; fancy
  indexing did 6.3 and 2.3);
- anything in VRAM (the device path): torch index ops, one gather
  (``index_select``, or advanced indexing on a GPU) or one ``index_copy_``
  per block over a flat view of the words from its lowest region to the
  end of its highest, whatever their spacing (equally spaced layers, or
  adopted tensors and vLLM's layouts: one allocation per layer), with an
  index of where each (region, item) starts in that span. So a block of
  random pages over 64 layer regions is one index upload and one launch,
  not one per region, page or run (measured on CPU tensors here: a 1-page
  part over 64 uneven regions in 0.1 ms, not 0.5-1 ms). Regions in
  different memories (two devices, VRAM and host) go region by region. On
  a GPU these run on the device's lane (``lanes``), on CPU tensors in CI:
  the same code.

Region views and what a block's set of regions needs (the span, where each
region starts in it) are made once (``ArrayViews`` caches them by address),
not per part. Views are made of the widest word (8, 4, 2 or 1 bytes) that
every offset, stride and length of the block divides. Nothing here runs on
the control loop: the executor hands these to the copy thread or a GPU lane.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvbroker.broker.memory import array_at
from kvbroker.plan import Block, packed_offsets
from kvbroker.v1 import common_pb2

__all__ = ["Array", "ArrayViews", "Extent", "checksum", "gather", "scatter"]

DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM

#: An array over mapped memory: a numpy array (host) or a torch tensor.
Array = Any
K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class Extent:
    """Where one region (or slot) lies: address, bytes, memory kind, device."""

    address: int
    nbytes: int
    kind: int
    device: int


class ArrayViews:
    """Makes arrays over memory the broker mapped: numpy for host memory,
    torch CUDA tensors for VRAM (torch is imported on the first VRAM view).

    Tests whose "VRAM" is host memory behind the fake CUDA driver set
    ``device_as_host``: VRAM is then viewed as torch CPU tensors, so the
    device path's code runs unchanged on the host.

    Views of regions (:meth:`words`) and what the copies need of a block's
    regions (:meth:`regions`) are kept, the last ``_CACHED`` of each used, by
    address: a view holds no memory, so one over memory since unmapped is
    only used again if the same address range is mapped again.
    """

    def __init__(self, *, device_as_host: bool = False) -> None:
        self.device_as_host = device_as_host
        #: Device operations the copies issued (``Stats.device_launches``): each
        #: index upload, index op and cross-device copy, and each checksum's.
        #: Counted on the copy thread, which issues them all; counted as a GPU
        #: would launch them where the fake driver's "VRAM" is host memory.
        self.launches = 0
        self._words: OrderedDict[tuple[int, int, int, int, int], Any] = OrderedDict()
        self._regions: OrderedDict[tuple[tuple[int, int, int, int], ...], _Regions] = OrderedDict()
        #: id(list of spans) -> (that list, its _Regions): the list is kept, so its id is not reused meanwhile.
        self._by_list: dict[int, tuple[Sequence[Extent], _Regions]] = {}

    def view(self, span: Extent) -> Array:
        """A uint8 numpy array (DRAM) or torch tensor (VRAM) over ``span`` (no copy)."""
        if span.kind == DRAM:
            return array_at(span.address, span.nbytes)
        return self.tensor(span)

    def tensor(self, span: Extent) -> Any:
        """A uint8 torch tensor over ``span``, on its device (the host for DRAM); made anew
        (slots: a part's slot is made once per part; regions: :meth:`words`)."""
        torch = torch_for_copies()  # only a broker that touches VRAM pays for torch

        if span.kind == DRAM or self.device_as_host:
            return torch.from_numpy(array_at(span.address, span.nbytes))
        return torch.as_tensor(_CudaBytes(span.address, span.nbytes), device=torch.device("cuda", span.device))

    def shaped(self, span: Extent, width: int, shape: tuple[int, ...]) -> Any:
        """A torch tensor of ``width``-byte words in ``shape`` (C order) over ``span``, made in
        one step (a slice and two views of a uint8 tensor were three torch calls per part, each
        giving up the GIL and taking it back)."""
        torch = torch_for_copies()

        if span.kind == DRAM or self.device_as_host:
            return torch.from_numpy(array_at(span.address, span.nbytes).view(_NP_WORDS[width]).reshape(shape))
        return torch.as_tensor(_CudaBytes(span.address, span.nbytes, shape, _TYPESTR[width]), device=torch.device("cuda", span.device))

    def words(self, span: Extent, width: int) -> Any:
        """A torch tensor of ``width``-byte words over region ``span``, made once."""
        key = (span.address, span.nbytes, span.kind, span.device, width)
        return self._cached(self._words, key, lambda: self.tensor(span).view(_dtype(width)))

    def regions(self, spans: Sequence[Extent]) -> _Regions:
        """What the device copies need of a block's regions, worked out once per set of regions
        (found by the list's identity first: callers keep one list per engine and regions)."""
        known = self._by_list.get(id(spans))
        if known is not None and known[0] is spans:
            return known[1]
        key = tuple([(s.address, s.nbytes, s.kind, s.device) for s in spans])
        made = self._cached(self._regions, key, lambda: _Regions(tuple(spans)))
        if len(self._by_list) >= _CACHED:
            self._by_list.clear()
        self._by_list[id(spans)] = (spans, made)
        return made

    def on_host(self, span: Extent) -> bool:
        """Whether ``span`` is addressable by the CPU (its copies run on the copy thread)."""
        return span.kind == DRAM or self.device_as_host

    def _cached(self, cache: OrderedDict[K, V], key: K, make: Callable[[], V]) -> V:
        # The copy thread's only (where it issues every copy), as ``launches``.
        made = cache.get(key)
        if made is None:
            made = cache[key] = make()
            if len(cache) > _CACHED:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return made


def torch_for_copies() -> Any:
    """torch, imported on first use, with one intra-op thread: the broker's copies run on one
    thread of their own (``kvb-copy``), and torch's pool of a thread per core spun on the
    cores the engines and the broker's other threads need (on CPU tensors an index op over
    a batch of parts cost about twice its time in CPU)."""
    global _TORCH
    if _TORCH is None:
        import torch

        torch.set_num_threads(1)
        _TORCH = torch
    return _TORCH


_TORCH: Any = None


class _CudaBytes:
    """``__cuda_array_interface__`` over device memory the broker mapped (not owned): bytes,
    or words of a type string in a shape (C order)."""

    def __init__(self, address: int, nbytes: int, shape: tuple[int, ...] | None = None, typestr: str = "|u1") -> None:
        self.__cuda_array_interface__ = {
            "shape": shape if shape is not None else (nbytes,),
            "typestr": typestr,
            "data": (address, False),
            "strides": None,
            "version": 2,
        }


# -- the one entry point per direction -------------------------------------------------


def gather(views: ArrayViews, blocks: Sequence[Block], regions: Sequence[Sequence[Extent]], slot: Extent) -> None:
    """Pack ``blocks`` (``regions[i]``: where block ``i``'s regions lie) into ``slot``."""
    _copy(views, blocks, regions, slot, into_slot=True)


def scatter(views: ArrayViews, slot: Extent, blocks: Sequence[Block], regions: Sequence[Sequence[Extent]]) -> None:
    """Unpack ``slot`` into ``blocks`` (the inverse of :func:`gather`)."""
    _copy(views, blocks, regions, slot, into_slot=False)


def checksum(views: ArrayViews, slot: Extent) -> Any:
    """The CRC-32 of a slot's bytes: an int (host memory), or a 0-dim host
    tensor that holds it once the lane's work queued so far is done (the
    caller reads it after the lane's event: ``int()`` on it then waits for
    nothing, where reading a device tensor would wait for everything queued
    on the lane's stream after it, such as the next part's gather)."""
    if slot.kind == DRAM:
        return zlib.crc32(array_at(slot.address, slot.nbytes).data)
    import torch

    from kvbroker.broker.device._devcrc import crc32_tensor, launches_for

    data = views.tensor(slot)
    views.launches += launches_for(data.numel(), data.device)
    crc = crc32_tensor(data)
    if crc.device.type == "cpu":
        return crc
    host = torch.empty((), dtype=crc.dtype, pin_memory=True)
    host.copy_(crc, non_blocking=True)
    views.launches += 1
    return host


def _copy(views: ArrayViews, blocks: Sequence[Block], regions: Sequence[Sequence[Extent]], slot: Extent, *, into_slot: bool) -> None:
    host = slot.kind == DRAM and all(s.kind == DRAM for spans in regions for s in spans)
    for block, spans, offset in zip(blocks, regions, packed_offsets(blocks)):
        if not block.nbytes:
            continue
        part = Extent(slot.address + offset, block.nbytes, slot.kind, slot.device)
        if host:
            _numpy_copy(block, spans, part, into_slot)
        else:
            _torch_copy(views, block, views.regions(spans), part, into_slot)


# -- host memory: numpy, by runs ------------------------------------------------------


def _runs(items: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    """Runs of consecutive items: (first item, position in ``items``, length)."""
    if not items.size:
        return []
    breaks = np.flatnonzero(np.diff(items) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [items.size]))
    return [(int(items[a]), int(a), int(e - a)) for a, e in zip(starts, ends)]


def _numpy_copy(block: Block, spans: Sequence[Extent], slot: Extent, into_slot: bool) -> None:
    packed = array_at(slot.address, slot.nbytes).reshape(block.shape)
    stacked = _stack(spans)
    shape = (_region_items(block, spans[0]), block.rows, block.row_bytes)
    strides = (block.item_stride, block.row_stride or block.row_bytes, 1)
    if stacked is not None:
        first, step, total = stacked
        base = array_at(first + block.row_offset, total - block.row_offset)
        targets = [np.lib.stride_tricks.as_strided(base, shape=(len(spans), *shape), strides=(step, *strides))]
        packed_views = [packed]
    else:
        targets = [
            np.lib.stride_tricks.as_strided(array_at(s.address + block.row_offset, s.nbytes - block.row_offset), shape=shape, strides=strides)
            for s in spans
        ]
        packed_views = [packed[i] for i in range(len(spans))]
    axis = 1 if stacked is not None else 0
    for first_item, at, count in _runs(block.items):
        for target, mine in zip(targets, packed_views):
            theirs = target[:, first_item : first_item + count] if axis else target[first_item : first_item + count]
            ours = mine[:, at : at + count] if axis else mine[at : at + count]
            if into_slot:
                np.copyto(ours, theirs)
            else:
                np.copyto(theirs, ours)


def _stack(spans: Sequence[Extent]) -> tuple[int, int, int] | None:
    """(first address, step, bytes from the first region's start to the last's end) when
    the regions lie equally spaced, apart, in one kind of memory on one device; else None."""
    if len(spans) < 2 or len({(s.kind, s.device, s.nbytes) for s in spans}) != 1:
        return None
    steps = {b.address - a.address for a, b in zip(spans, spans[1:])}
    if len(steps) != 1:
        return None
    step = steps.pop()
    if step < spans[0].nbytes:
        return None
    return spans[0].address, step, step * (len(spans) - 1) + spans[0].nbytes


def _region_items(block: Block, span: Extent) -> int:
    return span.nbytes // block.item_stride


# -- anything on a device: torch index ops ---------------------------------------------


class _Regions:
    """What the device copies need of one block's regions (``ArrayViews.regions`` keeps it):
    the flat span from the lowest region to the end of the highest, where each region
    starts in it, and whether one index op over that span can serve them all."""

    __slots__ = ("_bases", "_hows", "_starts", "flat", "lo", "nbytes", "place", "shortest", "spans", "starts", "width")

    def __init__(self, spans: tuple[Extent, ...]) -> None:
        self.spans = spans
        places = {_place(s.kind, s.device) for s in spans}
        #: The one memory the regions all lie in, or None.
        self.place = places.pop() if len(places) == 1 else None
        self.lo = min(s.address for s in spans)
        self.nbytes = max(s.address + s.nbytes for s in spans) - self.lo
        self.starts = np.array([s.address - self.lo for s in spans], dtype=np.int64)
        self.shortest = min(s.nbytes for s in spans)
        bits = 0
        for s in spans:
            bits |= s.address | s.nbytes
        self.width = _widest(bits)
        # One op over a flat span needs the regions in one memory (one tensor on one device)
        # and a span of a size a view may sanely have: regions in different memories, or
        # farther apart than _MAX_SPAN (not one device's allocations), go region by region.
        self.flat = self.place is not None and self.nbytes <= _MAX_SPAN
        self._bases: dict[int, Any] = {}
        self._starts: dict[tuple[int, int], npt.NDArray[np.int64]] = {}
        self._hows: dict[tuple[int, ...], _How] = {}

    def how(self, views: ArrayViews, block: Block, slot_bits: int) -> _How:
        """How blocks shaped like ``block`` copy over these regions into slots whose address
        and size or to ``slot_bits`` (worked out once per shape: every part of a room has one)."""
        key = (block.row_bytes, block.row_offset, block.item_stride, block.rows, block.row_stride, _widest(slot_bits))
        made = self._hows.get(key)
        if made is None:
            made = self._hows[key] = _How(views, self, block, key[-1])
        return made

    def base(self, views: ArrayViews, width: int) -> Any:
        """The flat span as a 1-D tensor of ``width``-byte words (made once per width)."""
        made = self._bases.get(width)
        if made is None:
            assert self.place is not None
            made = self._bases[width] = views.tensor(Extent(self.lo, self.nbytes, *self.place)).view(_dtype(width))
        return made

    def first_words(self, width: int, row_offset: int) -> npt.NDArray[np.int64]:
        """Where each region's first row starts in the span, in words (made once)."""
        made = self._starts.get((width, row_offset))
        if made is None:
            made = self._starts[(width, row_offset)] = self.starts // width + row_offset
        return made


class _How:
    """What copying one shape of block over one set of regions needs, worked out once: the
    widest word every offset, stride and length divides, the block's rows in words, the
    last item every region holds, and (one op over the span) the overlapping windows over
    the span and where each region's first row starts in it."""

    __slots__ = ("dtype", "first", "flat", "item_stride", "last", "row", "row_offset", "row_stride", "rows", "width")

    def __init__(self, views: ArrayViews, regions: _Regions, block: Block, slot_width: int) -> None:
        import torch

        bits = block.row_bytes | block.row_offset | block.item_stride
        width = min(_widest(bits | (block.row_stride if block.rows > 1 else 0)), regions.width, slot_width)
        self.width, self.dtype = width, _dtype(width)
        self.rows, self.row = block.rows, block.row_bytes // width
        self.row_stride = (block.row_stride or block.row_bytes) // width
        self.item_stride, self.row_offset = block.item_stride // width, block.row_offset // width
        reach = (self.rows - 1) * self.row_stride + self.row  # the words of one item, from its first row's start
        #: The last item every region holds.
        self.last = (regions.shortest // width - self.row_offset - reach) // self.item_stride
        self.flat: Any = None
        self.first: npt.NDArray[np.int64] | None = None
        if regions.flat:
            base = regions.base(views, width)
            # Overlapping windows over the span: entry p is the rows of an item starting at word p.
            self.flat = torch.as_strided(base, (base.numel() - reach + 1, self.rows, self.row), (1, self.row_stride, 1))
            self.first = regions.first_words(width, self.row_offset)[:, None]

    def check(self, items: npt.NDArray[np.int64]) -> None:
        """``IndexError`` unless every one of ``items`` lies in every region (a negative
        item is a large unsigned one)."""
        if items.size and int(items.view(np.uint64).max()) > self.last:
            raise IndexError(f"items {int(items.min())}..{int(items.max())} of a block, past item {self.last} of its shortest region")


#: The largest span of regions (bytes) one index op covers (a view of it is only
#: its size: nothing between the regions is read or written).
_MAX_SPAN = 1 << 40
#: How many region views and sets of regions ArrayViews keeps (least recently used go).
_CACHED = 1024
#: Tests set this to run the GPU's gather op (advanced indexing) on CPU tensors.
_GPU_GATHER_ON_HOST = False


#: Word widths as numpy dtypes and as ``__cuda_array_interface__`` type strings.
_NP_WORDS = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}
_TYPESTR = {8: "<i8", 4: "<i4", 2: "<i2", 1: "|u1"}


def _dtype(width: int) -> Any:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]


def _place(kind: int, device: int) -> tuple[int, int]:
    """Where memory lies as a GPU sees it: VRAM of a device, or the host (the fake CUDA
    driver's "VRAM" is host memory, but its launches are counted as on a GPU)."""
    return (VRAM, device) if kind == VRAM else (DRAM, -1)


def _widest(bits: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that values whose bitwise or is ``bits`` are all multiples of."""
    return min(8, bits & -bits) if bits else 8


def _torch_copy(views: ArrayViews, block: Block, regions: _Regions, slot: Extent, into_slot: bool) -> None:
    """Copy one block between its regions and ``slot`` (its bytes of a part's slot), counting in ``views.launches`` what a GPU would launch: one index upload and
    one index op (and one copy if the slot lies in other memory) where the regions share a
    memory, whatever their number and spacing and the block's size."""
    import torch

    how = regions.how(views, block, slot.address | slot.nbytes)
    items = np.ascontiguousarray(block.items, dtype=np.int64)
    how.check(items)
    count = int(items.size)
    packed = views.shaped(slot, how.width, (len(regions.spans) * count, how.rows, how.row))
    slot_place = _place(slot.kind, slot.device)
    if how.flat is not None:
        assert regions.place is not None and how.first is not None
        offsets = how.first + items[None, :] * how.item_stride
        index = _index(views, offsets.reshape(-1), how.flat, regions.place)
        views.launches += _move(how.flat, index, packed, into_slot, cross=regions.place != slot_place)
        return
    # Region by region (the regions lie in different memories, or too far apart), each
    # index made (and uploaded) once per memory, not once per region.
    indexes: dict[tuple[int, int], Any] = {}
    for i, span in enumerate(regions.spans):
        place = _place(span.kind, span.device)
        base = views.words(span, how.width)
        region = torch.as_strided(base, (how.last + 1, how.rows, how.row), (how.item_stride, how.row_stride, 1), how.row_offset)
        index = indexes.get(place)
        if index is None:
            index = indexes[place] = _index(views, items, region, place)
        views.launches += _move(region, index, packed[i * count : (i + 1) * count], into_slot, cross=place != slot_place)


def _index(views: ArrayViews, values: npt.NDArray[np.int64], on: Any, place: tuple[int, int]) -> Any:
    """``values`` as an index tensor on ``on``'s device: on the host the array itself (no
    copy); on a GPU one upload from pinned memory, not waited for (torch's pinned memory
    cache keeps the buffer until the copy is done). The upload counts where ``place`` is VRAM."""
    import torch

    if place[0] == VRAM:
        views.launches += 1
    if on.device.type == "cpu":
        return torch.from_numpy(values)
    pinned = torch.empty(values.shape, dtype=torch.int64, pin_memory=True)
    pinned.numpy()[...] = values
    return pinned.to(on.device, non_blocking=True)


def _move(src: Any, index: Any, packed: Any, into_slot: bool, *, cross: bool) -> int:
    """One index op between ``src`` (items along its first dimension) and its packed block,
    on ``src``'s device; where the slot lies in other memory (``cross``), one copy too. The
    launches: the op, and the copy (counted as on a GPU, also where both are host memory)."""
    if into_slot:
        if packed.device == src.device:
            _gather(src, index, packed)
        else:
            packed.copy_(_gather(src, index, None), non_blocking=True)
    else:
        source = packed if packed.device == src.device else packed.to(src.device, non_blocking=True)
        src.index_copy_(0, index, source)
    return 2 if cross else 1


def _gather(src: Any, index: Any, out: Any) -> Any:
    """``src[index]`` (into ``out`` if given). On the host ``index_select``, the fastest there
    (measured: 1.4-2.6x faster than advanced indexing); on a GPU advanced indexing,
    whose kernel iterates over the output with 32-bit math and adds index * stride in 64
    bits, where ``index_select``'s CUDA kernel (in some torch versions) drops to 64-bit
    offset math for a source view of 2^31 elements or more, as a span's view has."""
    import torch

    if src.device.type == "cpu" and not _GPU_GATHER_ON_HOST:
        return torch.index_select(src, 0, index) if out is None else torch.index_select(src, 0, index, out=out)
    if out is None:
        return src[index]
    return torch.ops.aten.index.Tensor_out(src, [index], out=out)
