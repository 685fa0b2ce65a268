"""Copying the parts of one batch in two index ops per shape, not one or more per part.

A notification batch lands several packed parts of the same rooms at once
(about ten, with 1-page parts and 8 rooms in flight), and an engine's
commands hand on many chunks in one pass of the loop (hundreds, in the
fake-GPU benchmark). Their blocks over the same regions, of the same shape
(the same ``_How``), in one memory, are copied by two index ops for all of
them, whatever their number: one reads every item's rows (out of the
regions, or out of the parts' slots: a view of the transfer buffer as
overlapping windows, one per word, as the regions' span is), one writes
them (into the slots, or into the regions). On a GPU that is two launches
and two index uploads a batch where each part took two; on CPU tensors (CI,
the fake-GPU benchmark) the per-op cost of torch, about 20 us, once a batch.

What cannot go together goes part by part (``gather``, ``scatter``): host
memory, regions in different memories or too far apart, a lone block of its
shape. Where the batched op raises, each of its parts is tried alone, so
only a bad part fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbroker.broker.device._block_copies import (
    DRAM,
    ArrayViews,
    Extent,
    _gather,
    _How,
    _index,
    _place,
    _Regions,
    _torch_copy,
    gather,
    scatter,
)
from kvbroker.plan import Block, packed_offsets

__all__ = ["Landed", "gather_all", "scatter_all"]

#: One part: its slot, and its blocks with where each block's regions lie.
Landed = tuple[Extent, Sequence[Block], Sequence[Sequence[Extent]]]
#: A block to copy in a batch: its part's index, the block, its bytes of the slot, its regions, how.
_Entry = tuple[int, Block, Extent, _Regions, _How]


def gather_all(views: ArrayViews, buffer: Extent, parts: Sequence[Landed]) -> dict[int, Exception]:
    """Pack every part of ``parts`` (slots of the one send ``buffer``) from its blocks; what
    each part whose copy raised raised, by its index."""
    return _copy_all(views, buffer, parts, into_slot=True)


def scatter_all(views: ArrayViews, buffer: Extent, parts: Sequence[Landed]) -> dict[int, Exception]:
    """Unpack every part of ``parts`` (slots of the one receive ``buffer``) into its blocks;
    what each part whose copy raised raised, by its index."""
    return _copy_all(views, buffer, parts, into_slot=False)


def _copy_all(views: ArrayViews, buffer: Extent, parts: Sequence[Landed], *, into_slot: bool) -> dict[int, Exception]:
    failed: dict[int, Exception] = {}
    groups: dict[tuple[int, int], list[_Entry]] = {}
    for i, (slot, blocks, regions) in enumerate(parts):
        try:
            if len(parts) == 1 or (slot.kind == DRAM and all(s.kind == DRAM for spans in regions for s in spans)):
                # a lone part, or host staging (numpy, by runs): part by part
                if into_slot:
                    gather(views, blocks, regions, slot)
                else:
                    scatter(views, slot, blocks, regions)
                continue
            for block, spans, offset in zip(blocks, regions, packed_offsets(blocks)):
                if not block.nbytes:
                    continue
                part = Extent(slot.address + offset, block.nbytes, slot.kind, slot.device)
                regs = views.regions(spans)
                how = regs.how(views, block, part.address | part.nbytes)
                if how.flat is None or _place(part.kind, part.device) != regs.place:
                    _torch_copy(views, block, regs, part, into_slot)
                    continue
                groups.setdefault((id(regs), id(how)), []).append((i, block, part, regs, how))
        except Exception as exc:  # this part fails, the others go on
            failed[i] = exc
    for entries in groups.values():
        entries = [e for e in entries if e[0] not in failed]
        if len(entries) > 1:
            try:
                _copy_group(views, buffer, entries, into_slot)
                continue
            except Exception:  # noqa: BLE001 - one op for all of them raised: each part alone, to fail only the bad
                pass
        for i, block, part, regs, _ in entries:
            try:
                _torch_copy(views, block, regs, part, into_slot)
            except Exception as exc:
                failed.setdefault(i, exc)
    return failed


def _copy_group(views: ArrayViews, buffer: Extent, entries: list[_Entry], into_slot: bool) -> None:
    """Two index ops for blocks of one shape over one set of regions: their items' rows read
    out of the regions (or the slots: windows over ``buffer``), then written into the slots
    (or the regions)."""
    regs, how = entries[0][3], entries[0][4]
    width, item_words = how.width, how.rows * how.row
    assert how.flat is not None and how.first is not None and regs.place is not None
    items = [np.ascontiguousarray(block.items, dtype=np.int64) for _, block, _, _, _ in entries]
    ats = np.array([part.address - buffer.address for _, _, part, _, _ in entries], dtype=np.int64)
    ends = ats + np.array([part.nbytes for _, _, part, _, _ in entries], dtype=np.int64)
    if (ats % width).any() or (ats < 0).any() or (ends > buffer.nbytes).any():
        raise ValueError("a slot of the batch is not a word of the transfer buffer")
    counts = {int(i.size) for i in items}
    every = np.concatenate(items) if len(items) > 1 else items[0]
    how.check(every)
    spans = len(regs.spans)
    if len(counts) == 1:  # parts of one size (the common case): every index in a few numpy ops
        count = counts.pop()
        slot_index_values = ((ats // width)[:, None] + np.arange(spans * count, dtype=np.int64)[None, :] * item_words).reshape(-1)
        region_values = (how.first[None, :, :] + every.reshape(len(items), 1, count) * how.item_stride).reshape(-1)
    else:
        slot_index_values = np.concatenate([at // width + np.arange(spans * i.size, dtype=np.int64) * item_words for at, i in zip(ats, items)])
        region_values = np.concatenate([(how.first + i[None, :] * how.item_stride).reshape(-1) for i in items])
    windows: Any = _windows(views.words(buffer, width), how.rows, how.row)
    slot_index = _index(views, slot_index_values, windows, regs.place)
    region_index = _index(views, region_values, how.flat, regs.place)
    if into_slot:
        windows.index_copy_(0, slot_index, _gather(how.flat, region_index, None))
    else:
        how.flat.index_copy_(0, region_index, _gather(windows, slot_index, None))
    views.launches += 2


def _windows(words: Any, rows: int, row: int) -> Any:
    """``words`` as overlapping windows: entry p is ``rows`` rows of ``row`` words from word p on."""
    import torch

    return torch.as_strided(words, (words.numel() - rows * row + 1, rows, row), (1, row, 1))
