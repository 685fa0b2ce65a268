"""zlib-compatible CRC-32 of a uint8 tensor, computed on the tensor's own device.

The broker checksums transfer slots of up to a few hundred MiB that live in GPU
memory; copying them to the host only to run ``zlib.crc32`` would cost a full
device-to-host transfer. This module computes the same value (``zlib.crc32(bytes(data),
value)``) with torch operations on whatever device ``data`` is on (CUDA on a GPU host,
CPU in CI). Only the final 32-bit result is read back; the only host-to-device traffic
is a few small lookup tables, uploaded once per device.

How: the raw CRC register (no pre/post conditioning) is linear over GF(2), so for
messages A and B, ``raw(A || B) = shift_|B|(raw(A)) ^ raw(B)``, where ``shift_k`` is
the 32x32 GF(2) matrix that advances the register over k zero bytes, and
``zlib.crc32(M, prev) = raw(M) ^ shift_|M|(~prev) ^ 0xFFFFFFFF``. The body of the
message is cut into lanes of ``LANE_BYTES`` bytes whose raw CRCs are computed in
parallel, 4 bytes per step (slicing-by-4); the first ``n % LANE_BYTES`` bytes (the
head) are one more lane, computed at once with position-dependent tables; the lanes
are then combined pairwise in a tree of depth at most ``ceil(log2(lanes + 1))``. Each step and
each tree level is 4 tensor operations (5 at a level with an odd number of lanes), so a
call launches about ``LANE_BYTES + 4 * log2(n / LANE_BYTES)`` operations: O(log n).

Representation: a register value travels as its 4 bytes, each in a 16-bit field
``byte | (j << 8)`` (j: the byte's position), so a register's 4 fields are directly
the rows of a 1024-row table (byte j of the register selects a row of block j) that
hold the matrix applied to that byte; XOR-ing the 4 rows applies the matrix. Packed
4 to an int64, 16 bits a field, table rows are XOR-ed as int64 and viewed back as
int16 fields, so a lane step reads the data bytes as bytes: alignment of the data
does not matter, and no shift or mask operation is needed between steps. The lane
phase needs 56 bytes of device scratch memory per lane (about n / 4.5 at its peak, the
tree less); a caller short of memory can hash a slot in pieces and chain them
(``crc32(b, crc32(a)) == zlib.crc32(a + b)``).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["LANE_BYTES", "crc32", "crc32_tensor"]

LANE_BYTES = 256
"""Bytes per lane of the parallel phase (a power of two, a multiple of 4)."""

_POLY = 0xEDB88320  # the reflected CRC-32 polynomial of zlib
_MASK = 0xFFFFFFFF
_LEVELS = 40  # tree levels tabulated: inputs up to LANE_BYTES << _LEVELS bytes
_U32 = npt.NDArray[np.uint32]

# A GF(2) 32x32 matrix is a tuple of its 32 columns: column i is the image of bit i.
_Matrix = tuple[int, ...]


def _apply(matrix: _Matrix, vector: int) -> int:
    out = 0
    i = 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(outer: _Matrix, inner: _Matrix) -> _Matrix:
    return tuple(_apply(outer, column) for column in inner)


@functools.cache
def _zeros_matrix(log2_bytes: int) -> _Matrix:
    """shift_k for k = 2**log2_bytes: the register advanced over k zero bytes."""
    if log2_bytes == 0:
        columns = []
        for bit in range(32):
            reg = 1 << bit
            for _ in range(8):
                reg = (reg >> 1) ^ _POLY if reg & 1 else reg >> 1
            columns.append(reg)
        return tuple(columns)
    half = _zeros_matrix(log2_bytes - 1)
    return _compose(half, half)


def _shift(vector: int, nbytes: int) -> int:
    """shift_nbytes(vector), with O(log nbytes) matrix-vector products on the host."""
    k = 0
    while nbytes:
        if nbytes & 1:
            vector = _apply(_zeros_matrix(k), vector)
        nbytes >>= 1
        k += 1
    return vector


def _byte_tables(matrix: _Matrix) -> _U32:
    """(4, 256) uint32: row j, entry v is ``matrix(v << 8j)``."""
    columns = np.array(matrix, dtype=np.uint32).reshape(4, 8)
    bits = (np.arange(256, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)) & 1
    terms = np.where(bits[None, :, :] == 1, columns[:, None, :], np.uint32(0))
    tables: _U32 = np.bitwise_xor.reduce(terms, axis=2).astype(np.uint32)
    return tables


def _pack(values: _U32, *, with_offsets: bool = False) -> npt.NDArray[np.int64]:
    """Register values as int64 words of four 16-bit fields, field j = byte j of the value
    (plus ``j << 8``, the offset of table block j, when ``with_offsets``)."""
    fields = np.empty((values.size, 4), dtype=np.int16)
    for j in range(4):
        fields[:, j] = (values.reshape(-1) >> np.uint32(8 * j)) & np.uint32(0xFF)
        if with_offsets:
            fields[:, j] |= np.int16(j << 8)
    return fields.view(np.int64).reshape(-1)


@functools.cache
def _host_tables() -> dict[str, npt.NDArray[np.generic]]:
    log2_lane = LANE_BYTES.bit_length() - 1
    # One lane step: the register XOR the next 4 data bytes, advanced over 4 bytes. Block 0's
    # rows carry the field offsets, so the XOR of one row of each block carries them once.
    lane = _byte_tables(_zeros_matrix(2))
    lane_packed = np.concatenate(
        [_pack(lane[0], with_offsets=True)] + [_pack(lane[j]) for j in range(1, 4)]
    )
    # Tree level k: the left lane advanced over the right one's LANE_BYTES << k bytes.
    levels = np.stack(
        [_pack(_byte_tables(_zeros_matrix(log2_lane + k)).reshape(-1)) for k in range(_LEVELS)]
    )
    # Head: row e * 256 + v is the raw CRC of byte v followed by e zero bytes.
    head = np.empty((LANE_BYTES, 256), dtype=np.uint32)
    one_byte = _byte_tables(_zeros_matrix(0))[0]  # the classic CRC table
    head[0] = one_byte
    for e in range(1, LANE_BYTES):
        prev = head[e - 1]
        head[e] = one_byte[prev & 0xFF] ^ (prev >> np.uint32(8))
    # The result's 4 fields back to the 32-bit value: row j * 256 + v is v << 8j.
    final = np.arange(256, dtype=np.int64)[None, :] << (8 * np.arange(4, dtype=np.int64))[:, None]
    return {
        "lane": lane_packed,
        "levels": levels,
        "head": _pack(head.reshape(-1)),
        "head_rows": ((LANE_BYTES - 1 - np.arange(LANE_BYTES)) << 8).astype(np.int32),
        "offsets": (np.arange(4) << 8).astype(np.int16),
        "final": final.reshape(-1),
    }


@dataclass(frozen=True)
class _Tables:
    lane: torch.Tensor  # (1024,) int64, packed
    levels: torch.Tensor  # (_LEVELS, 1024) int64, packed
    head: torch.Tensor  # (LANE_BYTES * 256,) int64, packed
    head_rows: torch.Tensor  # (LANE_BYTES,) int32: row offsets for the head's bytes
    offsets: torch.Tensor  # (4,) int16: the field offsets j << 8
    final: torch.Tensor  # (1024,) int64


_device_tables: dict[torch.device, _Tables] = {}
_device_lock = threading.Lock()


def _tables(device: torch.device) -> _Tables:
    tables = _device_tables.get(device)
    if tables is None:
        with _device_lock:
            tables = _device_tables.get(device)
            if tables is None:
                host = _host_tables()
                tables = _Tables(
                    **{name: torch.from_numpy(array).to(device) for name, array in host.items()}
                )
                _device_tables[device] = tables
    return tables


def _check(data: torch.Tensor) -> None:
    if data.dtype != torch.uint8:
        raise TypeError(f"crc32 needs a uint8 tensor, not {data.dtype}")
    if data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"crc32 needs a 1-D contiguous tensor (shape {tuple(data.shape)})")


def crc32_tensor(data: torch.Tensor, value: int = 0) -> torch.Tensor:
    """``zlib.crc32(bytes(data), value)`` as a 0-dim int64 tensor on ``data``'s device.

    ``data`` is a 1-D contiguous uint8 tensor. Does not block: the work is queued on the
    current stream of ``data``'s device (which must see ``data`` complete) and the result
    is ready when that stream reaches it. The first call on a device uploads the lookup
    tables (about 850 KiB), synchronously.
    """
    _check(data)
    value &= _MASK
    device = data.device
    n = data.numel()
    if n == 0:
        return torch.full((), value, dtype=torch.int64, device=device)
    lanes, head_len = divmod(n, LANE_BYTES)
    slots = lanes + (1 if head_len else 0)
    if (slots - 1).bit_length() > _LEVELS:
        raise ValueError(f"crc32 input of {n} bytes is too long")
    tab = _tables(device)
    lane_fields = _lanes(data[head_len:].view(lanes, LANE_BYTES), tab) if lanes else None
    state = torch.empty((slots, 4), dtype=torch.int32, device=device)
    if head_len:
        _head(data[:head_len], tab, out=state[0])
    if lane_fields is not None:
        state[slots - lanes :].copy_(lane_fields)
    state = _tree(state, tab)
    # state's 4 fields -> the raw CRC, then zlib's conditioning: raw ^ shift_n(~value) ^ ~0.
    raw = torch.index_select(tab.final, 0, state.view(4)).sum()
    return raw ^ (_shift(value ^ _MASK, n) ^ _MASK)


def crc32(data: torch.Tensor, value: int = 0) -> int:
    """``zlib.crc32(bytes(data), value)`` for a 1-D contiguous uint8 tensor, computed on
    ``data``'s device. Blocks until the result is there (reads back one integer)."""
    return int(crc32_tensor(data, value).item())


def _head(head: torch.Tensor, tab: _Tables, out: torch.Tensor) -> None:
    """The raw CRC of ``head`` (fewer than LANE_BYTES bytes), as 4 int32 fields into ``out``.

    Byte i of h contributes the raw CRC of itself followed by h - 1 - i zero bytes (one
    table row); the rows are XOR-ed in a halving tree, zero rows padding h to a power of 2.
    """
    size = head.numel()
    width = 1 << (size - 1).bit_length()
    index = torch.zeros(width, dtype=torch.int32, device=head.device)  # row 0 is 0
    torch.bitwise_or(head, tab.head_rows[LANE_BYTES - size :], out=index[width - size :])
    rows = torch.index_select(tab.head, 0, index)
    while rows.numel() > 1:
        half = rows.numel() // 2
        rows = rows[:half] ^ rows[half:]
    torch.bitwise_xor(rows.view(torch.int16), tab.offsets, out=out)


def _lanes(body: torch.Tensor, tab: _Tables) -> torch.Tensor:
    """The raw CRC of every row of ``body`` (lanes x LANE_BYTES), as (lanes, 4) int16
    fields: LANE_BYTES / 4 steps of 4 operations, each over all lanes at once."""
    lanes = body.shape[0]
    device = body.device
    index = torch.empty((lanes, 4), dtype=torch.int32, device=device)
    rows = torch.empty((lanes, 4), dtype=torch.int64, device=device)
    packed = torch.empty(lanes, dtype=torch.int64, device=device)
    fields = tab.offsets  # the register starts at 0: fields hold only their offsets
    for step in range(0, LANE_BYTES, 4):
        torch.bitwise_xor(fields, body[:, step : step + 4], out=index)
        torch.index_select(tab.lane, 0, index.view(-1), out=rows.view(-1))
        torch.bitwise_xor(rows[:, :2], rows[:, 2:], out=rows[:, :2])
        torch.bitwise_xor(rows[:, 0], rows[:, 1], out=packed)
        fields = packed.view(torch.int16).view(lanes, 4)
    return fields


def _tree(state: torch.Tensor, tab: _Tables) -> torch.Tensor:
    """Combines the slots of ``state`` (slots x 4 int32 fields, in message order) pairwise,
    level by level, into one: the left one advanced over the right one's bytes, XOR the
    right one. A first slot left over at an odd level moves up unchanged (its value is that
    of a lane with zero bytes in front)."""
    level = 0
    packed = torch.empty(state.shape[0] // 2, dtype=torch.int64, device=state.device)
    while state.shape[0] > 1:
        odd = state.shape[0] & 1
        pairs = state[odd:].view(-1, 2, 4)
        count = pairs.shape[0]
        rows = tab.levels[level][pairs[:, 0]]  # (count, 4) int64
        torch.bitwise_xor(rows[:, :2], rows[:, 2:], out=rows[:, :2])
        torch.bitwise_xor(rows[:, 0], rows[:, 1], out=packed[:count])
        merged = torch.empty((count + odd, 4), dtype=torch.int32, device=state.device)
        if odd:
            merged[0] = state[0]
        fields = packed[:count].view(torch.int16).view(count, 4)
        torch.bitwise_xor(fields, pairs[:, 1], out=merged[odd:])
        state = merged
        level += 1
    return state
