"""Page-index encoding on the wire: ``kvbroker.plan``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.errors import InvalidArgument
from kvbroker.plan import as_index, decode_indices, encode_indices
from kvbroker.v1 import common_pb2

INT32_MIN = int(np.iinfo(np.int32).min)
INT32_MAX = int(np.iinfo(np.int32).max)


@pytest.mark.parametrize(
    "indices",
    [
        np.array([0, 1, 2, 7, 3], dtype=np.int32),
        np.array([5, 4, 1_000_000], dtype=np.int64),
        np.array([9, 8], dtype=np.uint16),
        np.array([1, 2, 3], dtype=">i4"),
        [3, 1, 4, 1, 5, 9, 2, 6],
        (INT32_MIN, -1, 0, INT32_MAX),
        [],
        np.array([], dtype=np.int64),
    ],
    ids=[
        "int32",
        "int64",
        "uint16",
        "big-endian-int32",
        "list",
        "tuple-extremes",
        "empty-list",
        "empty-int64",
    ],
)
def test_round_trip(indices: object) -> None:
    """encode then decode gives back the same values as a native int32 array."""
    message = encode_indices(indices)  # type: ignore[arg-type]
    assert len(message.values) == 0
    decoded = decode_indices(message)
    assert decoded.dtype == np.int32
    assert decoded.dtype.isnative
    assert decoded.ndim == 1
    assert decoded.tolist() == [int(v) for v in np.asarray(indices).tolist()]


def test_encode_packs_little_endian_int32() -> None:
    """encode_indices writes 4 little-endian bytes per index into ``packed``."""
    message = encode_indices([1, 256, -1])
    assert message.packed == b"\x01\x00\x00\x00" + b"\x00\x01\x00\x00" + b"\xff\xff\xff\xff"


def test_empty_message_is_empty_array() -> None:
    """A message with neither packed nor values decodes to an empty int32 array."""
    decoded = decode_indices(common_pb2.PageIndices())
    assert decoded.dtype == np.int32
    assert decoded.size == 0


def test_values_form_decodes() -> None:
    """The grpcurl-friendly ``values`` form decodes to the same int32 array."""
    decoded = decode_indices(common_pb2.PageIndices(values=[4, 0, INT32_MAX, INT32_MIN]))
    assert decoded.dtype == np.int32
    assert decoded.tolist() == [4, 0, INT32_MAX, INT32_MIN]


def test_packed_and_values_both_set_rejected() -> None:
    """Setting both packed and values is InvalidArgument naming the field."""
    message = common_pb2.PageIndices(packed=encode_indices([1]).packed, values=[1])
    with pytest.raises(InvalidArgument, match="packed or values"):
        decode_indices(message, what="src pages")


def test_error_message_names_what() -> None:
    """decode errors start with the ``what`` the caller passed."""
    message = common_pb2.PageIndices(packed=b"\x00\x00\x00", values=[])
    with pytest.raises(InvalidArgument, match="^INVALID_ARGUMENT: aux rows: "):
        decode_indices(message, what="aux rows")


@pytest.mark.parametrize("length", [1, 2, 3, 5, 7])
def test_packed_length_not_multiple_of_four_rejected(length: int) -> None:
    """A packed byte string whose length is not a multiple of 4 is InvalidArgument."""
    with pytest.raises(InvalidArgument, match="multiple of 4"):
        decode_indices(common_pb2.PageIndices(packed=b"\x01" * length))


@pytest.mark.parametrize(
    "indices",
    [
        [INT32_MAX + 1],
        [INT32_MIN - 1],
        np.array([0, 2**40], dtype=np.int64),
        np.array([2**32 - 1], dtype=np.uint32),
        np.array([2**63], dtype=np.uint64),
    ],
    ids=["max+1", "min-1", "int64-large", "uint32-max", "uint64-huge"],
)
def test_out_of_int32_range_rejected(indices: object) -> None:
    """Values that do not fit int32 are InvalidArgument (never silently wrapped)."""
    with pytest.raises(InvalidArgument, match="int32"):
        encode_indices(indices)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "indices",
    [
        np.zeros((2, 3), dtype=np.int32),
        [[1, 2], [3, 4]],
        np.zeros((0, 2), dtype=np.int32),
        np.int32(5),
    ],
    ids=["2d", "nested-list", "2d-empty", "scalar"],
)
def test_not_one_dimensional_rejected(indices: object) -> None:
    """Arrays that are not one-dimensional (2-D, scalars) are InvalidArgument."""
    with pytest.raises(InvalidArgument, match="one-dimensional"):
        encode_indices(indices)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "indices",
    [np.array([1.0, 2.0]), np.array([True, False]), ["1", "2"]],
    ids=["float", "bool", "str"],
)
def test_non_integer_dtype_rejected(indices: object) -> None:
    """Non-integer arrays are InvalidArgument rather than truncated."""
    with pytest.raises(InvalidArgument, match="integers"):
        encode_indices(indices)  # type: ignore[arg-type]


def test_negative_values_survive_decoding() -> None:
    """Negative indices decode unchanged; bounds are checked later, per region."""
    packed = np.array([-5, 3, -1], dtype="<i4").tobytes()
    assert decode_indices(common_pb2.PageIndices(packed=packed)).tolist() == [-5, 3, -1]
    assert decode_indices(common_pb2.PageIndices(values=[-7])).tolist() == [-7]
    assert decode_indices(encode_indices([-2, -3])).tolist() == [-2, -3]


def test_wire_round_trip_through_serialization() -> None:
    """A serialized and re-parsed message decodes to the same indices."""
    original = np.arange(10_000, dtype=np.int32)[::-1]
    data = encode_indices(original).SerializeToString()
    parsed = common_pb2.PageIndices.FromString(data)
    np.testing.assert_array_equal(decode_indices(parsed), original)


@given(st.lists(st.integers(min_value=INT32_MIN, max_value=INT32_MAX), max_size=200))
def test_round_trip_property(values: list[int]) -> None:
    """Any list of int32 values round-trips through both wire forms."""
    packed = decode_indices(encode_indices(values))
    assert packed.dtype == np.int32
    assert packed.tolist() == values
    via_values = decode_indices(common_pb2.PageIndices(values=values))
    assert via_values.tolist() == values


def test_values_wider_than_int32_are_refused_when_decoding() -> None:
    """The broker refuses a ``values`` index that does not fit int32 (grpcurl can send one): it used to
    arrive cut to 32 bits, 2**32 + 3 becoming page 3."""
    with pytest.raises(InvalidArgument, match="4294967299 does not fit in int32"):
        decode_indices(common_pb2.PageIndices(values=[2**32 + 3]))
    with pytest.raises(InvalidArgument, match="does not fit in int32"):
        decode_indices(common_pb2.PageIndices(values=[-(2**31) - 1]))


@pytest.mark.parametrize("value", [2**32 + 3, -(2**31) - 1, True, 1.0])
def test_one_index_is_checked_like_a_list(value: object) -> None:
    """An aux row wider than int32 (or not an integer) is refused before it could be converted."""
    with pytest.raises(InvalidArgument):
        as_index(value, "aux_row")  # type: ignore[arg-type]
    assert as_index(np.int64(7), "aux_row") == 7
