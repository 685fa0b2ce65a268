"""The broker's own copies: blocks gathered into slots and scattered from them.

A :class:`~kvbroker.plan.Block` names items of an engine's
regions; a slot is a reservation in one of this broker's staging or
transfer buffers. :func:`gather` packs blocks into a slot, :func:`scatter`
unpacks a slot into blocks. Two ways, by where the memory is:

- host memory only (DRAM staging of head slices): numpy, one strided copy
  per run of consecutive items, over every region at once when the regions
  lie equally spaced in one buffer (measured here: 9.4 GB/s for a chunk of
  8 pages in 2 runs over 64 regions, 5.7 GB/s beside another copy; fancy
  indexing did 6.3 and 2.3);
- anything in VRAM (the device path): torch index ops, one ``index_select``
  (gather) or ``index_copy_`` (scatter) per block over a stacked view of
  its regions, so a chunk of random pages over 64 layer regions is one
  launch, not one per page or per run; on a GPU they run on the device's
  lane (``lanes``), on CPU tensors in CI — the same code.

Views are made of the widest word (8, 4, 2 or 1 bytes) that every offset,
stride and length of the block divides. Nothing here runs on the control
loop: the executor hands these to the copy thread or a GPU lane.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    """

    def __init__(self, *, device_as_host: bool = False) -> None:
        self.device_as_host = device_as_host
        #: Device operations the copies issued (``Stats.device_launches``): each
        #: index upload, index op and cross-device copy, and each checksum's.
        #: Counted on the copy thread, which issues them all.
        self.launches = 0

    def view(self, span: Extent) -> Array:
        """A uint8 numpy array (DRAM) or torch tensor (VRAM) over ``span`` (no copy)."""
        if span.kind == DRAM:
            return array_at(span.address, span.nbytes)
        return self.tensor(span)

    def tensor(self, span: Extent) -> Any:
        """A uint8 torch tensor over ``span``, on its device (the host for DRAM)."""
        import torch  # only a broker that touches VRAM pays for torch

        if span.kind == DRAM or self.device_as_host:
            return torch.from_numpy(array_at(span.address, span.nbytes))
        return torch.as_tensor(_CudaBytes(span.address, span.nbytes), device=torch.device("cuda", span.device))

    def on_host(self, span: Extent) -> bool:
        """Whether ``span`` is addressable by the CPU (its copies run on the copy thread)."""
        return span.kind == DRAM or self.device_as_host


class _CudaBytes:
    """``__cuda_array_interface__`` over device memory the broker mapped (not owned)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
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
    """The CRC-32 of a slot's bytes: an int (host memory), or a 0-dim device
    tensor not yet read (the caller reads it once the lane finished)."""
    if slot.kind == DRAM:
        return zlib.crc32(array_at(slot.address, slot.nbytes).data)
    from kvbroker.broker.device._devcrc import crc32_tensor

    views.launches += _CRC_LAUNCHES
    return crc32_tensor(views.tensor(slot))


#: Launches counted per device checksum: one entry point, until ``_devcrc``
#: reports its own count per call.
_CRC_LAUNCHES = 1


def _copy(views: ArrayViews, blocks: Sequence[Block], regions: Sequence[Sequence[Extent]], slot: Extent, *, into_slot: bool) -> None:
    host = slot.kind == DRAM and all(s.kind == DRAM for spans in regions for s in spans)
    for block, spans, offset in zip(blocks, regions, packed_offsets(blocks)):
        if not block.nbytes:
            continue
        part = Extent(slot.address + offset, block.nbytes, slot.kind, slot.device)
        if host:
            _numpy_copy(block, spans, part, into_slot)
        else:
            _torch_copy(views, block, spans, part, into_slot)


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


def _width(block: Block, spans: Sequence[Extent], slot: Extent) -> int:
    """The widest word every offset, stride and length of the copy is a multiple of."""
    values = [block.row_bytes, block.row_offset, block.item_stride, slot.address, slot.nbytes]
    if block.rows > 1:
        values.append(block.row_stride)
    for s in spans:
        values += [s.address, s.nbytes]
    for width in (8, 4, 2):
        if all(v % width == 0 for v in values):
            return width
    return 1


def _torch_copy(views: ArrayViews, block: Block, spans: Sequence[Extent], slot: Extent, into_slot: bool) -> None:
    import torch

    width = _width(block, spans, slot)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    rows, row = block.rows, block.row_bytes // width
    packed = views.tensor(slot).view(dtype).view(len(spans), int(block.items.size), rows, row)
    index = torch.from_numpy(block.items)
    shape = (_region_items(block, spans[0]), rows, row)
    strides = (block.item_stride // width, (block.row_stride or block.row_bytes) // width, 1)
    stacked = _stack(spans)
    if stacked is not None:
        first, step, total = stacked
        base = views.tensor(Extent(first, total, spans[0].kind, spans[0].device)).view(dtype)
        region = torch.as_strided(base, (len(spans), *shape), (step // width, *strides), block.row_offset // width)
        if into_slot and region.device.type == "cpu":
            # torch's CPU index_select over a view strided in its first dimension
            # is 10-25x slower than region by region (measured here); on a GPU
            # the one launch over the stacked view is the point.
            for i in range(len(spans)):
                views.launches += _move(region[i], 0, index, packed[i], into_slot)
        else:
            views.launches += _move(region, 1, index, packed, into_slot)
        return
    for i, span in enumerate(spans):
        base = views.tensor(span).view(dtype)
        region = torch.as_strided(base, shape, strides, block.row_offset // width)
        views.launches += _move(region, 0, index, packed[i], into_slot)


def _move(region: Any, dim: int, index: Any, packed: Any, into_slot: bool) -> int:
    """One index op between ``region`` (items along ``dim``) and its packed block; the
    launches it issued (the index upload counts, a no-op on the host, a copy on a GPU)."""
    import torch

    index = index.to(region.device, non_blocking=True)
    if into_slot:
        if region.device == packed.device:
            torch.index_select(region, dim, index, out=packed)
            return 2
        packed.copy_(torch.index_select(region, dim, index), non_blocking=True)
        return 3
    source = packed if packed.device == region.device else packed.to(region.device, non_blocking=True)
    region.index_copy_(dim, index, source)
    return 2 if source is packed else 3

