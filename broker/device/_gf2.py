"""CRC-32 over GF(2) on the host: the byte table, advancing raw registers over zero
bytes, and the 32x32 matrices of those advances (the math: ``_devcrc``'s docstring).

Both device paths build their lookup tables from these: the torch path (``_devcrc``)
and the Triton path (``_devcrc_triton``). Numpy only; nothing here touches a device.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

__all__ = ["MASK", "bits", "byte_table", "conditioning", "matrix", "zero_bytes"]

_POLY = 0xEDB88320  # the reflected CRC-32 polynomial of zlib
MASK = 0xFFFFFFFF
_U8 = npt.NDArray[np.uint8]
_U32 = npt.NDArray[np.uint32]


@functools.cache
def byte_table() -> _U32:
    """The classic table: entry v is the raw CRC of the one byte v."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(
            table & 1, (table >> np.uint32(1)) ^ np.uint32(_POLY), table >> np.uint32(1)
        )
    return table.astype(np.uint32)


def zero_bytes(values: _U32, count: int) -> _U32:
    """``values`` (raw registers) advanced over ``count`` zero bytes, one byte at a time."""
    table = byte_table()
    for _ in range(count):
        values = table[values & np.uint32(0xFF)] ^ (values >> np.uint32(8))
    return values


def bits(values: _U32) -> _U8:
    """(len, 32) 0/1: bit j of each value in column j."""
    return ((values.reshape(-1, 1) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(
        np.uint8
    )


@functools.cache
def _power_matrix(log2_bytes: int) -> _U8:
    """shift_k for k = 2**log2_bytes, in rows: row i holds the bits of shift_k(1 << i)."""
    if log2_bytes == 0:
        return bits(zero_bytes(np.uint32(1) << np.arange(32, dtype=np.uint32), 1))
    half = _power_matrix(log2_bytes - 1).astype(np.int64)
    return ((half @ half) & 1).astype(np.uint8)


def matrix(nbytes: int) -> _U8:
    """shift_nbytes in rows (``x @ matrix`` advances the row of bits x)."""
    out = np.eye(32, dtype=np.int64)
    k = 0
    while nbytes:
        if nbytes & 1:
            out = (out @ _power_matrix(k).astype(np.int64)) & 1
        nbytes >>= 1
        k += 1
    return out.astype(np.uint8)


@functools.cache
def _power_bytes(log2_bytes: int) -> tuple[tuple[int, ...], ...]:
    """shift_k (k = 2**log2_bytes) as 4 tables of 256 ints: one per byte of the register."""
    rows = [sum(int(b) << j for j, b in enumerate(row)) for row in _power_matrix(log2_bytes)]
    return tuple(tuple(_xor_of(rows[8 * j : 8 * j + 8], v) for v in range(256)) for j in range(4))


def _xor_of(rows: list[int], v: int) -> int:
    out = 0
    for bit, row in enumerate(rows):
        if v >> bit & 1:
            out ^= row
    return out


def _shift(vector: int, nbytes: int) -> int:
    """shift_nbytes(vector), on the host: one 4-lookup product per set bit of nbytes."""
    k = 0
    while nbytes:
        if nbytes & 1:
            t = _power_bytes(k)
            vector = (
                t[0][vector & 0xFF]
                ^ t[1][vector >> 8 & 0xFF]
                ^ t[2][vector >> 16 & 0xFF]
                ^ t[3][vector >> 24]
            )
        nbytes >>= 1
        k += 1
    return vector


def conditioning(value: int, nbytes: int) -> int:
    """What zlib's pre/post conditioning adds to the raw CRC: shift_n(~value) ^ ~0."""
    return _shift(value ^ MASK, nbytes) ^ MASK
