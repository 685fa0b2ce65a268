"""Scattering the parts that landed together in one op per shape, not one per part.

A notification batch lands several packed parts of the same rooms at once
(about ten, with 1-page parts and 8 rooms in flight). Their blocks over the
same regions, of the same shape (the same ``_How``), in one memory, are
unpacked by two index ops for all of them, whatever their number: one
gathers every item's rows out of the parts' slots (a view of the receive
buffer as overlapping windows, one per word, as the regions' span is), one
writes them into the regions. On a GPU that is two launches and two index
uploads for the batch where each part took two; on CPU tensors (CI, the
fake-GPU benchmark) the per-op cost of torch, about 20 us, once per batch.

What cannot go together goes part by part (``scatter``): host memory,
regions in different memories or too far apart, a lone block of its shape.
Where the batched op raises, each of its parts is tried alone, so only a bad
part fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbroker.broker.device._copies import (
    DRAM,
    ArrayViews,
    Extent,
    _gather,
    _How,
    _index,
    _place,
    _Regions,
    _torch_copy,
    scatter,
)
from kvbroker.plan import Block, packed_offsets

__all__ = ["Landed", "scatter_all"]

#: One landed part: its slot, and its blocks with where each block's regions lie.
Landed = tuple[Extent, Sequence[Block], Sequence[Sequence[Extent]]]
#: A block to scatter in a batch: its part's index, the block, its bytes of the slot, its regions, how.
_Entry = tuple[int, Block, Extent, _Regions, _How]


def scatter_all(views: ArrayViews, buffer: Extent, parts: Sequence[Landed]) -> dict[int, Exception]:
    """Unpack every part of ``parts`` (slots of the one receive ``buffer``) into its blocks;
    what each part whose copy raised raised, by its index."""
    failed: dict[int, Exception] = {}
    if len(parts) == 1:
        try:
            scatter(views, *parts[0])
        except Exception as exc:
            failed[0] = exc
        return failed
    groups: dict[tuple[int, int], list[_Entry]] = {}
    for i, (slot, blocks, regions) in enumerate(parts):
        try:
            if slot.kind == DRAM and all(s.kind == DRAM for spans in regions for s in spans):
                scatter(views, slot, blocks, regions)  # host staging: numpy, by runs
                continue
            for block, spans, offset in zip(blocks, regions, packed_offsets(blocks)):
                if not block.nbytes:
                    continue
                part = Extent(slot.address + offset, block.nbytes, slot.kind, slot.device)
                regs = views.regions(spans)
                how = regs.how(views, block, part.address | part.nbytes)
                if how.flat is None or _place(part.kind, part.device) != regs.place:
                    _torch_copy(views, block, regs, part, False)
                    continue
                groups.setdefault((id(regs), id(how)), []).append((i, block, part, regs, how))
        except Exception as exc:  # this part fails, the others go on
            failed[i] = exc
    for entries in groups.values():
        entries = [e for e in entries if e[0] not in failed]
        if len(entries) > 1:
            try:
                _scatter_group(views, buffer, entries)
                continue
            except Exception:  # noqa: BLE001 - one op for all of them raised: each part alone, to fail only the bad
                pass
        for i, block, part, regs, _ in entries:
            try:
                _torch_copy(views, block, regs, part, False)
            except Exception as exc:
                failed.setdefault(i, exc)
    return failed


def _scatter_group(views: ArrayViews, buffer: Extent, entries: list[_Entry]) -> None:
    """Two index ops for blocks of one shape over one set of regions: their items' rows out of
    the slots (windows over ``buffer``), then into the regions."""
    regs, how = entries[0][3], entries[0][4]
    width, item_words = how.width, how.rows * how.row
    assert how.flat is not None and how.first is not None and regs.place is not None
    sources, targets = [], []
    for _, block, part, _, _ in entries:
        items = np.ascontiguousarray(block.items, dtype=np.int64)
        if int(items.view(np.uint64).max()) > how.last:
            raise IndexError(f"items {int(items.min())}..{int(items.max())} of a block, past item {how.last} of its shortest region")
        at = part.address - buffer.address
        if at % width or at < 0 or at + part.nbytes > buffer.nbytes:
            raise ValueError(f"a slot at {part.address:#x} is not a word of the receive buffer")
        sources.append(at // width + np.arange(len(regs.spans) * items.size, dtype=np.int64) * item_words)
        targets.append((how.first + items[None, :] * how.item_stride).reshape(-1))
    words = views.words(buffer, width)
    windows: Any = _windows(words, how.rows, how.row)
    rows = _gather(windows, _index(views, np.concatenate(sources), windows, regs.place), None)
    how.flat.index_copy_(0, _index(views, np.concatenate(targets), how.flat, regs.place), rows)
    views.launches += 2


def _windows(words: Any, rows: int, row: int) -> Any:
    """``words`` as overlapping windows: entry p is ``rows`` rows of ``row`` words from word p on."""
    import torch

    return torch.as_strided(words, (words.numel() - rows * row + 1, rows, row), (1, row, 1))
