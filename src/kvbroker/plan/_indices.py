"""Page-index lists on the wire (``kvbroker.v1.PageIndices``).

Page indices are the bulk of every control message. Engines send them packed
(little-endian int32 bytes: building 10k indices costs about 3.5 us instead of
about 420 us for a repeated field); people with grpcurl send ``values``. Both
decode to the same numpy int32 array. Indices stay numpy arrays end to end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

__all__ = ["NO_INDICES", "NO_STATE", "IndexArray", "as_index", "as_indices", "decode_indices", "encode_indices", "read_only"]

IndexArray = npt.NDArray[np.int32]

#: No indices (an empty int32 array; shared, never written).
NO_INDICES: IndexArray = np.zeros(0, dtype=np.int32)
NO_INDICES.flags.writeable = False

#: No state indices (a read-only mapping; shared).
NO_STATE: Mapping[str, IndexArray] = MappingProxyType({})

_LE_INT32 = np.dtype("<i4")


_I32 = np.iinfo(np.int32)


def as_indices(values: npt.ArrayLike | Sequence[int], what: str = "page indices") -> IndexArray:
    """``values`` as an int32 index array, checked before any conversion.

    ``InvalidArgument`` for anything that is not a one-dimensional list of
    integers, or holds a value outside int32: a 64-bit index such as
    ``2**32 + 3`` must never wrap to ``3`` and move the wrong page.
    """
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidArgument(f"{what} must be one-dimensional, got shape {array.shape}")
    if not array.size:
        return np.zeros(0, dtype=np.int32)
    if array.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < _I32.min or high > _I32.max:
        bad = low if low < _I32.min else high
        raise InvalidArgument(f"{what}: index {bad} does not fit in int32 (indices are 32-bit on the wire)")
    return array.astype(np.int32, copy=False)


def as_index(value: int, what: str) -> int:
    """One index (an aux row), checked like :func:`as_indices`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{what} must be an integer, got {type(value).__name__}")
    if not _I32.min <= int(value) <= _I32.max:
        raise InvalidArgument(f"{what}: {int(value)} does not fit in int32")
    return int(value)


def encode_indices(indices: npt.ArrayLike | Sequence[int], what: str = "page indices") -> common_pb2.PageIndices:
    """Pack indices into a ``PageIndices`` message (the compact form), checked
    by :func:`as_indices` first."""
    return common_pb2.PageIndices(packed=as_indices(indices, what).astype(_LE_INT32, copy=False).tobytes())


def decode_indices(message: common_pb2.PageIndices, *, what: str = "pages") -> IndexArray:
    """The indices of a ``PageIndices`` message as a native int32 array.

    Exactly one of ``packed`` and ``values`` may be set (an empty message is an
    empty list). The result may contain negative values: bounds are checked
    against the region they address (``kvbroker.plan``).
    """
    if message.packed and len(message.values):
        raise InvalidArgument(f"{what}: set either packed or values, not both")
    if message.packed:
        if len(message.packed) % 4:
            raise InvalidArgument(f"{what}: packed indices must be a multiple of 4 bytes, got {len(message.packed)}")
        return np.frombuffer(message.packed, dtype=_LE_INT32).astype(np.int32, copy=False)
    return as_indices(np.fromiter(message.values, dtype=np.int64, count=len(message.values)), what)


def read_only(pages: IndexArray, state: Mapping[str, IndexArray]) -> Mapping[str, IndexArray]:
    """Turn off the write flag of ``pages`` and of ``state``'s arrays (no copy;
    packed indices decode read-only already); ``state`` as a read-only mapping
    of its own (the caller's dict may change after). For the records and
    commands that keep the very arrays once they were validated."""
    pages.setflags(write=False)
    if not state:
        return NO_STATE
    for indices in state.values():
        indices.setflags(write=False)
    return MappingProxyType(dict(state))
