"""End-to-end checksums of a chunk's bytes: what each side hashes, in what order.

When a receiver asks for it (``ExpectRoomRequest.verify_checksum``, or
``--verify-checksums`` on its broker), the sending broker computes, for
every chunk it sends a receiver rank, a CRC-32 of the bytes it reads and
puts it in the chunk's notices; once every part of the chunk has landed, the
receiving broker computes the same over its pages and fails the room with
MISMATCH if they differ, before the room can be SUCCESS.

Both sides hash the same logical stream, each over its own memory:

- KV: for each KV region of the source's layer range (layer order, then
  kind order), each page of the chunk in order: the page, or, for a head
  slice, each token's slice of heads; between different page sizes, the
  chunk's room tokens [begin, end) in token order, wherever each side's
  pages hold them;
- aux: on the last chunk, when the source sends aux, the row of every aux
  region in listed order.

Hybrid-model state is not covered. What of a chunk moves on the device path
is left out (``TransferNotice.kv_packed``, ``aux_packed``): each packed part
carries a checksum of its own. The room state machines only describe a
checksum (:class:`ChunkSum`); the executor computes it on a copy worker
(``region_bytes`` reads the engine's mapped memory there), never on the
control loop.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbroker.plan._indices import IndexArray
from kvbroker.plan._layout import Layout
from kvbroker.plan._mapping import SourcePlan
from kvbroker.plan._slicing import SliceSide, kv_regions
from kvbroker.plan._tokens import TokenRange, token_geometry

__all__ = ["ChunkSum", "chunk_checksum"]


@dataclass(frozen=True, slots=True)
class ChunkSum:
    """What one side hashes of one chunk: ``pages`` of the KV regions of
    ``plan``'s layers (``head``: only that slice of heads of each token;
    ``tokens``: those room tokens instead of whole pages), then ``aux_row``
    of every aux region (None: no aux). ``who`` names the side in errors."""

    plan: SourcePlan
    pages: IndexArray
    head: SliceSide | None
    aux_row: int | None
    who: str
    tokens: TokenRange | None = None


def chunk_checksum(layout: Layout, region_bytes: Callable[[int], np.ndarray], what: ChunkSum) -> int:
    """The CRC-32 of ``what`` over memory laid out as ``layout``;
    ``region_bytes(region)`` is that region as a flat uint8 array."""
    plan, pages, head, tokens = what.plan, what.pages, what.head, what.tokens
    crc = 0
    if plan.writes_data and pages.size:
        for region in kv_regions(layout, plan.layer_begin, plan.layer_end, what.who):
            data = region_bytes(region).reshape(layout.num_pages, -1)[pages]
            if head is not None:
                rows = data.reshape(pages.size, head.page_size, head.token_bytes)
                data = rows[:, :, head.offset_bytes : head.offset_bytes + head.slice_bytes]
            crc = zlib.crc32(np.ascontiguousarray(data).data, crc)
    if plan.writes_data and tokens is not None and tokens.end > tokens.begin:
        geom = token_geometry(layout)
        room = np.arange(tokens.begin, tokens.end, dtype=np.int64)
        page_ids = tokens.pages[room // geom.page_size - tokens.first]
        offsets = room % geom.page_size
        for region in kv_regions(layout, plan.layer_begin, plan.layer_end, what.who):
            region_tokens = region_bytes(region).reshape(layout.num_pages, geom.page_size, geom.token_bytes)
            crc = zlib.crc32(np.ascontiguousarray(region_tokens[page_ids, offsets]).data, crc)
    if what.aux_row is not None:
        for region in layout.aux_regions:
            aux = region_bytes(region).reshape(layout.aux_rows, -1)
            crc = zlib.crc32(aux[what.aux_row].data, crc)
    return crc
