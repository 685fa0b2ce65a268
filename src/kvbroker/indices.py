"""Page-index lists on the wire (``kvbroker.v1.PageIndices``).

Page indices are the bulk of every control message. Engines send them packed
(little-endian int32 bytes: building 10k indices costs about 3.5 us instead of
about 420 us for a repeated field); people with grpcurl send ``values``. Both
decode to the same numpy int32 array. Indices stay numpy arrays end to end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

__all__ = ["IndexArray", "decode_indices", "encode_indices"]

IndexArray = npt.NDArray[np.int32]

_LE_INT32 = np.dtype("<i4")


def encode_indices(indices: npt.ArrayLike | Sequence[int]) -> common_pb2.PageIndices:
    """Pack indices into a ``PageIndices`` message (the compact form).

    Raises ``InvalidArgument`` for values that do not fit int32 or arrays that
    are not one-dimensional.
    """
    array = np.asarray(indices)
    if array.ndim != 1:
        raise InvalidArgument(f"page indices must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise InvalidArgument(f"page indices must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        raise InvalidArgument("page indices must fit in int32")
    return common_pb2.PageIndices(packed=array.astype(_LE_INT32, copy=False).tobytes())


def decode_indices(message: common_pb2.PageIndices, *, what: str = "pages") -> IndexArray:
    """The indices of a ``PageIndices`` message as a native int32 array.

    Exactly one of ``packed`` and ``values`` may be set (an empty message is an
    empty list). The result may contain negative values: bounds are checked
    against the region they address (``kvbroker.broker.descriptors``).
    """
    if message.packed and len(message.values):
        raise InvalidArgument(f"{what}: set either packed or values, not both")
    if message.packed:
        if len(message.packed) % 4:
            raise InvalidArgument(f"{what}: packed indices must be a multiple of 4 bytes, got {len(message.packed)}")
        return np.frombuffer(message.packed, dtype=_LE_INT32).astype(np.int32, copy=False)
    return np.asarray(message.values, dtype=np.int32)
