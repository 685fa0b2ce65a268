"""kvbroker.broker.device against zlib.crc32, on CPU tensors."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvbroker.broker.device._devcrc import LANE_BYTES, crc32, crc32_tensor

L = LANE_BYTES
VALUES = (0, 1, 0x12345678, 0xFFFFFFFF)


def _bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


# Short inputs, and around the first few multiples of the lane length (head only, lanes
# only, head and lanes, odd and even lane counts).
SIZES = [*range(9), 100, *(k * L + d for k in range(1, 10) for d in (-4, -1, 0, 1, 5))]


@pytest.mark.parametrize("n", SIZES)
def test_matches_zlib_around_lane_boundaries(n: int) -> None:
    data = _bytes(n, seed=n)
    tensor = _tensor(data)
    for value in VALUES:
        assert crc32(tensor, value) == zlib.crc32(data, value), (n, value)


def test_matches_zlib_for_random_lengths_up_to_3_mib() -> None:
    rng = np.random.default_rng(7)
    lengths = [int(x) for x in rng.integers(1, 3 << 20, 4)] + [3 << 20, (3 << 20) + L - 1]
    for i, n in enumerate(lengths):
        data = _bytes(n, seed=100 + i)
        value = int(rng.integers(0, 1 << 32))
        assert crc32(_tensor(data), value) == zlib.crc32(data, value), (n, value)
        assert crc32(_tensor(data)) == zlib.crc32(data), n


@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x5A])
def test_constant_data(fill: int) -> None:
    data = bytes([fill]) * (37 * L + 11)
    for value in VALUES:
        assert crc32(_tensor(data), value) == zlib.crc32(data, value)


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5, L + 7])
@pytest.mark.parametrize("n", [3, L - 1, L + 1, 10 * L + 13, 70_001])
def test_slice_of_a_larger_tensor_at_any_alignment(offset: int, n: int) -> None:
    data = _bytes(offset + n + 9, seed=offset * 31 + n)
    view = _tensor(data)[offset : offset + n]
    assert view.storage_offset() == offset and view.is_contiguous()
    assert crc32(view, 0xCAFEF00D) == zlib.crc32(data[offset : offset + n], 0xCAFEF00D)


def test_unaligned_address() -> None:
    data = _bytes(64 * L + 3, seed=5)
    buf = _tensor(data)
    for start in (1, 2, 3):
        view = buf[start:]
        assert view.data_ptr() % 4 != 0 or buf.data_ptr() % 4 != 0
        assert crc32(view) == zlib.crc32(data[start:])


def test_chaining() -> None:
    data = _bytes(50 * L + 77, seed=11)
    tensor = _tensor(data)
    for cut in (0, 1, L - 1, L, 17 * L + 3, len(data) - 1, len(data)):
        first = crc32(tensor[:cut])
        assert crc32(tensor[cut:], first) == zlib.crc32(data), cut
    a, b = 5 * L + 1, 30 * L + 2
    running = crc32(tensor[b:], crc32(tensor[a:b], crc32(tensor[:a], 99)))
    assert running == zlib.crc32(data, 99)


@pytest.mark.parametrize("value", [0, 1, 0xFFFFFFFF, -1, (1 << 40) + 5])
def test_empty_input_returns_value_as_zlib_does(value: int) -> None:
    empty = torch.empty(0, dtype=torch.uint8)
    assert crc32(empty, value) == zlib.crc32(b"", value)
    assert crc32(_tensor(b"xyz"), value) == zlib.crc32(b"xyz", value)


def test_tensor_result_is_a_0_dim_int64_on_the_data_device() -> None:
    data = _bytes(3 * L + 1, seed=3)
    out = crc32_tensor(_tensor(data), 42)
    assert out.shape == () and out.dtype == torch.int64 and out.device == torch.device("cpu")
    assert int(out) == zlib.crc32(data, 42)
    empty = crc32_tensor(torch.empty(0, dtype=torch.uint8), 42)
    assert empty.shape == () and int(empty) == 42


def test_rejects_what_it_cannot_hash() -> None:
    with pytest.raises(TypeError):
        crc32(torch.zeros(8, dtype=torch.int8))
    with pytest.raises(ValueError):
        crc32(torch.zeros((2, 4), dtype=torch.uint8))
    with pytest.raises(ValueError):
        crc32(torch.zeros(16, dtype=torch.uint8)[::2])


class _Calls(TorchFunctionMode):
    """Records the torch functions called (and whether they got a tensor index)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__" and isinstance(args[1], torch.Tensor):
            name = "__getitem__[tensor]"
        self.names[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _recording() -> Iterator[_Calls]:
    calls = _Calls()
    with calls:
        yield calls


# The calls that launch work on the device (views, shapes and allocations do not).
_COMPUTE = set(
    "bitwise_xor bitwise_or __xor__ index_select copy_ __setitem__ zeros full sum".split()
)
_COMPUTE.add("__getitem__[tensor]")


def _compute_ops(n: int) -> int:
    tensor = torch.zeros(n, dtype=torch.uint8)
    crc32(tensor)  # the tables are on the device already
    with _recording() as calls:
        crc32_tensor(tensor)
    return sum(count for name, count in calls.names.items() if name in _COMPUTE)


def test_operations_grow_with_log_n() -> None:
    small, large = L << 6, L << 12
    ops_small, ops_large = _compute_ops(small), _compute_ops(large)
    # LANE_BYTES / 4 lane steps of 4 operations, then 4 per tree level (+1 at an odd one).
    assert ops_small <= L + 5 * 6 + 8
    assert ops_large - ops_small <= 5 * 6
    assert _compute_ops(large + 3) <= L + 5 * 13 + 16


def test_data_stays_on_its_device() -> None:
    tensor = _tensor(_bytes(20 * L + 5, seed=9))
    crc32(tensor)
    with _recording() as calls:
        crc32_tensor(tensor, 7)
    host = {"cpu", "numpy", "tolist", "item", "to", "__int__", "__index__", "__bool__", "__array__"}
    assert not host & set(calls.names), calls.names
