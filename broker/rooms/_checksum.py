"""End-to-end checksums of a room's bytes (optional, for catching silent corruption).

When a receiver asks for it (``ExpectRoomRequest.verify_checksum``, or
``--verify-checksums`` on its broker), the sending broker computes, for
every chunk it sends a receiver rank, a CRC-32 of the bytes it reads, and
puts it in the chunk's notices. Once every part of the chunk has landed, the
receiving broker computes the same over the bytes in its pages and fails the
room with MISMATCH if they differ, before the room can be SUCCESS.

Both sides hash the same logical stream, each over its own memory:

- KV: for each KV region of the source's layer range (layer order, then
  kind order: the order ``slicing.kv_region_pairs`` pairs them in), each
  page of the chunk in order: the page, or, for a head slice, each token's
  slice of heads; between different page sizes, the chunk's room tokens
  [begin, end) in token order, wherever each side's pages hold them;
- aux: on the last chunk, when the source sends aux, the row of every aux
  region in listed order.

Hybrid-model state is not covered yet. Only host memory is read here:
what of a chunk moves on the device path (its KV or aux rows touch VRAM on
either side) is left out of the chunk's checksum (``TransferNotice
.kv_packed``, ``aux_packed``) and covered part by part instead: the sender
computes the CRC-32 of each packed part's slot where it gathered it (on the
GPU, ``devcrc``) and the receiver checks its slot before it scatters.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np

from kvbroker.broker.memory import Engine
from kvbroker.errors import Unimplemented
from kvbroker.plan import IndexArray, SliceSide, SourcePlan, TokenRange, kv_regions, token_geometry
from kvbroker.v1 import common_pb2

__all__ = ["chunk_checksum"]


def chunk_checksum(
    engine: Engine,
    plan: SourcePlan,
    pages: IndexArray,
    head: SliceSide | None,
    aux_row: int | None,
    who: str,
    tokens: TokenRange | None = None,
) -> int:
    """The CRC-32 of one chunk as ``engine`` holds it: ``pages`` of the KV
    regions of ``plan``'s layers (``head``: only that slice of heads of each
    token; ``tokens``: those room tokens instead of whole pages), then
    ``aux_row`` of every aux region (None: no aux)."""
    layout = engine.layout
    crc = 0
    if plan.writes_data and pages.size:
        for region in kv_regions(layout, plan.layer_begin, plan.layer_end, who):
            data = _region_bytes(engine, region).reshape(layout.num_pages, -1)[pages]
            if head is not None:
                rows = data.reshape(pages.size, head.page_size, head.token_bytes)
                data = rows[:, :, head.offset_bytes : head.offset_bytes + head.slice_bytes]
            crc = zlib.crc32(np.ascontiguousarray(data).data, crc)
    if plan.writes_data and tokens is not None and tokens.end > tokens.begin:
        geom = token_geometry(layout)
        room = np.arange(tokens.begin, tokens.end, dtype=np.int64)
        page_ids = tokens.pages[room // geom.page_size - tokens.first]
        offsets = room % geom.page_size
        for region in kv_regions(layout, plan.layer_begin, plan.layer_end, who):
            region_tokens = _region_bytes(engine, region).reshape(layout.num_pages, geom.page_size, geom.token_bytes)
            crc = zlib.crc32(np.ascontiguousarray(region_tokens[page_ids, offsets]).data, crc)
    if aux_row is not None:
        for region in layout.aux_regions:
            aux = _region_bytes(engine, region).reshape(layout.aux_rows, -1)
            crc = zlib.crc32(aux[aux_row].data, crc)
    return crc


def _region_bytes(engine: Engine, region: int) -> np.ndarray:
    """Region ``region`` of ``engine`` as a uint8 array over the broker's mapping."""
    address, length, kind, _ = engine.region_address(region)
    if kind != common_pb2.MEMORY_KIND_DRAM:
        raise Unimplemented(
            f"checksums read host memory only; region {region} of {engine.label} is in VRAM: turn verify_checksum off"
        )
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))

