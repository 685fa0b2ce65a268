"""kvbroker.broker.device's CRC-32 against zlib.crc32: the torch path on CPU tensors, the
Triton kernel in Triton's interpreter (where triton is installed), both on a GPU (where
there is one), and the launches each makes, counted."""

from __future__ import annotations

import importlib.util
import sys
import types
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbroker.broker.device import _devcrc
from kvbroker.broker.device._devcrc import (
    LANE_BYTES,
    MAX_BYTES,
    STEP_BYTES,
    TORCH_LAUNCHES,
    backend,
    crc32,
    crc32_tensor,
    launches_for,
    prepare,
)

L, S = LANE_BYTES, STEP_BYTES
VALUES = (0, 1, 0x12345678, 0xFFFFFFFF)
MIB = 1 << 20
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the torch path (whatever the environment says)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert backend("cpu") == "torch"


# -- the torch path ----------------------------------------------------------------------

# Short inputs; heads of every bag count (q) with an empty, a 1-byte and a full first bag
# (r); lanes only; head and lanes; and item counts around the first level's groups.
SIZES = sorted(
    {
        *range(10),
        *(q * S + r for q in range(8) for r in (0, 1, S - 1)),
        *(k * L + d for k in (1, 2, 3, 7) for d in (-1, 0, 1, S, S + 3, L - 1)),
        *(k * L + d for k in (254, 255, 256, 257, 511, 512) for d in (0, 5)),
    }
)


@pytest.mark.parametrize("n", SIZES)
def test_matches_zlib_around_step_lane_and_group_boundaries(torch_path: None, n: int) -> None:
    """The torch path's CRC-32 equals zlib's for short inputs and lengths around the step, lane and first-level group
    boundaries."""
    data = _bytes(n, seed=n)
    tensor = _tensor(data)
    for value in VALUES:
        assert crc32(tensor, value) == zlib.crc32(data, value), (n, value)


def test_matches_zlib_across_the_second_and_third_levels(torch_path: None) -> None:
    """The torch path's CRC-32 equals zlib's for lengths that spill into the second and third levels of the
    combine."""
    # 256 * 128 items fill the second level's first group: one more lane spills into a
    # second group there, and so into the third level.
    for n in (255 * 128 * L + 17, 256 * 128 * L - 1, 256 * 128 * L + 3 * L + 5):
        data = _bytes(n, seed=n % 1000)
        assert crc32(_tensor(data), 0xCAFE) == zlib.crc32(data, 0xCAFE), n


def test_matches_zlib_for_random_lengths_and_values(torch_path: None) -> None:
    """The torch path's CRC-32 equals zlib's for random lengths up to 3 MiB and random starting values."""
    rng = np.random.default_rng(7)
    lengths = [int(x) for x in rng.integers(1, 3 * MIB, 6)] + [3 * MIB, 3 * MIB + L - 1]
    for i, n in enumerate(lengths):
        data = _bytes(n, seed=100 + i)
        value = int(rng.integers(0, 1 << 32))
        assert crc32(_tensor(data), value) == zlib.crc32(data, value), (n, value)


@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x5A])
def test_constant_data(torch_path: None, fill: int) -> None:
    """The torch path's CRC-32 equals zlib's for data of one repeated byte (zeros, ones, a pattern)."""
    data = bytes([fill]) * (37 * L + 3 * S + 11)
    for value in VALUES:
        assert crc32(_tensor(data), value) == zlib.crc32(data, value)


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5, 7, L + 9])
@pytest.mark.parametrize("n", [3, S - 1, L - 1, L + 1, 10 * L + 13, 70_001])
def test_slice_of_a_larger_tensor_at_any_alignment(torch_path: None, offset: int, n: int) -> None:
    """A slice of a larger tensor at any byte offset hashes as its own bytes do."""
    data = _bytes(offset + n + 9, seed=offset * 31 + n)
    view = _tensor(data)[offset : offset + n]
    assert view.storage_offset() == offset and view.is_contiguous()
    assert crc32(view, 0xCAFEF00D) == zlib.crc32(data[offset : offset + n], 0xCAFEF00D)


def test_chaining(torch_path: None) -> None:
    """CRCs chain as zlib's do: a tensor hashed in pieces, each from the last one's value, gives the whole's CRC."""
    data = _bytes(50 * L + 77, seed=11)
    tensor = _tensor(data)
    for cut in (0, 1, S - 1, L, 17 * L + 3, len(data) - 1, len(data)):
        first = crc32(tensor[:cut])
        assert crc32(tensor[cut:], first) == zlib.crc32(data), cut
    a, b = 5 * L + 1, 30 * L + 2
    running = crc32(tensor[b:], crc32(tensor[a:b], crc32(tensor[:a], 99)))
    assert running == zlib.crc32(data, 99)


@pytest.mark.parametrize("value", [0, 1, 0xFFFFFFFF, -1, (1 << 40) + 5])
def test_empty_input_returns_value_as_zlib_does(torch_path: None, value: int) -> None:
    """An empty input gives back the starting value, reduced to 32 bits as zlib does (negative and wider values
    included)."""
    empty = torch.empty(0, dtype=torch.uint8)
    assert crc32(empty, value) == zlib.crc32(b"", value)
    assert crc32(_tensor(b"xyz"), value) == zlib.crc32(b"xyz", value)


def test_tensor_result_is_a_0_dim_int64_on_the_data_device(torch_path: None) -> None:
    """crc32_tensor answers a 0-dim int64 tensor on the data's device (the starting value for no data)."""
    data = _bytes(3 * L + 1, seed=3)
    out = crc32_tensor(_tensor(data), 42)
    assert out.shape == () and out.dtype == torch.int64 and out.device == torch.device("cpu")
    assert int(out) == zlib.crc32(data, 42)
    empty = crc32_tensor(torch.empty(0, dtype=torch.uint8), 42)
    assert empty.shape == () and int(empty) == 42


def test_rejects_what_it_cannot_hash() -> None:
    """crc32 refuses anything but a contiguous 1-D uint8 tensor, and sizes past MAX_BYTES (at least 4 GiB - 1)."""
    with pytest.raises(TypeError):
        crc32(torch.zeros(8, dtype=torch.int8))
    with pytest.raises(ValueError):
        crc32(torch.zeros((2, 4), dtype=torch.uint8))
    with pytest.raises(ValueError):
        crc32(torch.zeros(16, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError):
        launches_for(MAX_BYTES + 1)
    assert MAX_BYTES >= (4 << 30) - 1


# -- launches, counted -------------------------------------------------------------------


class _Launches(TorchDispatchMode):
    """Counts the torch operations dispatched that do work on the device: all but views
    and allocations (which launch nothing). ``paused`` stops the count (a Triton launch
    in the interpreter moves its arguments with torch operations of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels = 0
        self.paused = False
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not self.paused:
            self.calls.append((str(func), kwargs))
            if not func.is_view and func.__name__.split(".")[0] not in ("empty", "empty_strided"):
                self.ops[str(func)] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + self.kernels


@contextmanager
def _counting() -> Iterator[_Launches]:
    """Counts launches: torch operations, and Triton kernels (each call of the Triton
    module's one launching function, if it is loaded, counts one; the torch operations
    it makes itself, none)."""
    launches = _Launches()
    module = sys.modules.get("kvbroker.broker.device._devcrc_triton")
    launch: Callable[..., None] | None = getattr(module, "_launch", None)

    def counted(*args: Any, **kwargs: Any) -> None:
        assert launch is not None
        launches.kernels += 1
        launches.paused = True
        try:
            launch(*args, **kwargs)
        finally:
            launches.paused = False

    if module is not None:
        setattr(module, "_launch", counted)  # noqa: B010
    try:
        with launches:
            yield launches
    finally:
        if module is not None:
            setattr(module, "_launch", launch)  # noqa: B010


def _count(n: int) -> int:
    prepare("cpu")  # the tables are on the device already
    tensor = torch.zeros(n, dtype=torch.uint8)
    with _counting() as launches:
        crc32_tensor(tensor, 5)
    return launches.total


def test_launches_do_not_depend_on_the_size(torch_path: None) -> None:
    """The torch path makes the same number of launches (under 50) whatever the size, and launches_for says how
    many."""
    counts = {n: _count(n) for n in (1, S + 1, L, 3 * L + 7, MIB, 256 * MIB)}
    assert set(counts.values()) == {TORCH_LAUNCHES}, counts
    assert TORCH_LAUNCHES == launches_for(MIB) == launches_for(256 * MIB) == launches_for(1)
    assert TORCH_LAUNCHES < 50
    assert _count(0) == launches_for(0) == 1


def test_data_stays_on_its_device(torch_path: None) -> None:
    """crc32_tensor reads nothing back to the host, makes no tensor of host data and copies nothing to another
    device."""
    tensor = _tensor(_bytes(20 * L + 5, seed=9))
    crc32(tensor)
    with _counting() as launches:
        crc32_tensor(tensor, 7)
    names = {name for name, _ in launches.calls}
    # No read back (item), no tensor made from host data, no copy to another device.
    assert not {"aten._local_scalar_dense.default", "aten.lift_fresh.default"} & names
    assert all("device" not in kwargs for name, kwargs in launches.calls if "_to_copy" in name)


def test_prepare_uploads_and_says_which_path(torch_path: None) -> None:
    """prepare uploads the device's tables and says which path it will hash with (torch on CPU)."""
    assert prepare("cpu") == "torch"
    assert torch.device("cpu") in _devcrc._device_tables


def test_prepare_falls_back_to_torch_where_the_kernel_is_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the Triton kernel answers wrong, prepare turns the device to the torch path, which hashes correctly."""
    # A stand-in Triton path that answers wrong: prepare() turns the device to torch.
    fake = types.ModuleType("kvbroker.broker.device._devcrc_triton")
    fake.crc32_triton = lambda data, conditioning: torch.tensor(12345)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvbroker.broker.device._devcrc_triton", fake)
    monkeypatch.setattr(_devcrc, "_triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_devcrc, "_no_triton", set())
    assert backend("cpu") == "triton"
    assert prepare("cpu") == "torch"
    assert backend("cpu") == "torch"
    data = _bytes(1000, seed=1)
    assert crc32(_tensor(data)) == zlib.crc32(data)


# -- the Triton kernel, in Triton's interpreter -------------------------------------------

needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="needs triton (its interpreter runs the kernel)"
)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """CPU tensors take the Triton path, run by Triton's interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_devcrc, "_no_triton", set())
    from kvbroker.broker.device import _devcrc_triton

    assert backend("cpu") == "triton"
    yield _devcrc_triton


@needs_triton
def test_triton_kernel_matches_zlib(interpreted: Any) -> None:
    """The Triton kernel (interpreted) equals zlib around lanes and chunks, for views at any offset and several
    starting values."""
    chunk = interpreted.CHUNK
    lane = interpreted.LANE
    # One chunk, partly or wholly; around lanes and chunks; and 9 chunks (4 bits of
    # distance between chunks).
    sizes = [
        1,
        2,
        5,
        17,
        lane - 1,
        lane + 1,
        chunk - 1,
        chunk,
        chunk + 1,
        2 * chunk + 77,
        8 * chunk + 3,
    ]
    for n in sizes:
        data = _bytes(n + 3, seed=n)
        for offset, value in ((0, 0), (3, 0xFFFFFFFF), (1, 0x9E3779B9)):
            view = _tensor(data)[offset : offset + n]
            expected = zlib.crc32(data[offset : offset + n], value)
            assert crc32(view, value) == expected, (n, offset, value)


@needs_triton
def test_triton_kernel_chains_and_handles_empty_and_constant_data(interpreted: Any) -> None:
    """The Triton kernel (interpreted) chains, gives back the starting value for no data, and hashes constant data as
    zlib does."""
    data = _bytes(interpreted.CHUNK + 999, seed=4)
    tensor = _tensor(data)
    cut = interpreted.CHUNK // 2 + 1
    assert crc32(tensor[cut:], crc32(tensor[:cut], 7)) == zlib.crc32(data, 7)
    assert crc32(torch.empty(0, dtype=torch.uint8), 9) == 9
    ones = b"\xff" * (interpreted.CHUNK + 1)
    assert crc32(_tensor(ones)) == zlib.crc32(ones)


@needs_triton
def test_triton_launches_do_not_depend_on_the_size(interpreted: Any) -> None:
    """The Triton kernel makes two launches whatever the size."""
    counts = {n: _count(n) for n in (1, interpreted.CHUNK + 1, 5 * interpreted.CHUNK)}
    assert set(counts.values()) == {interpreted.LAUNCHES} == {launches_for(1)} == {2}, counts


@needs_triton
def test_prepare_keeps_a_correct_kernel(interpreted: Any) -> None:
    """Where the Triton kernel answers right, prepare keeps it."""
    assert prepare("cpu") == "triton"
    assert backend("cpu") == "triton"


# -- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_gpu_checksums_match_zlib_of_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random CUDA tensors (unaligned views, one over 64 MiB) hashed on the GPU by each
    path there is (Triton where installed, and torch), against zlib.crc32 of the same
    bytes copied to the host; without a synchronization (CUDA's sync debug mode raises
    on one) and in the launches counted."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda", torch.cuda.current_device())
    paths = ["torch"] + (["triton"] if backend(device) == "triton" else [])
    generator = torch.Generator(device=device).manual_seed(28)
    buffer = torch.randint(
        0, 256, (65 * MIB + 4 * L + 11,), dtype=torch.uint8, device=device, generator=generator
    )
    host = buffer.cpu().numpy().tobytes()
    cases = [
        (0, 1),
        (1, 1000),
        (3, S * 7 + 5),
        (0, MIB),
        (2, MIB + 3),
        (5, 16 * MIB + L - 1),
        (0, 65 * MIB + 4 * L),
        (7, 65 * MIB + 4 * L),
    ]
    for path in paths:
        if path == "torch":
            monkeypatch.setattr(_devcrc, "_no_triton", {device})
        else:
            monkeypatch.setattr(_devcrc, "_no_triton", set())
        assert backend(device) == path
        assert prepare(device) == path
        for offset, n in cases:
            view = buffer[offset : offset + n]
            for value in (0, 0xFFFFFFFF, 0x2468ACE1):
                expected = zlib.crc32(host[offset : offset + n], value)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with _counting() as launches:
                        result = crc32_tensor(view, value)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                assert launches.total == launches_for(n, device), (path, n, launches.ops)
                assert result.device == device and result.dtype == torch.int64
                assert int(result.item()) == expected, (path, offset, n, value)


@needs_triton
@pytest.mark.timeout(300)
@pytest.mark.parametrize("capability", [80, 90])
def test_triton_kernel_compiles_for_a_gpu(capability: int) -> None:
    """Triton compiles the kernel to a cubin for an A100 and an H100 without a GPU (the
    interpreter runs the Python, not the compiler's rules), its result XOR-ed in once
    per program with a 64-bit atomic."""
    import triton
    from triton.backends.compiler import GPUTarget

    from kvbroker.broker.device import _devcrc_triton as module

    kernel = triton.JITFunction(module._crc32_kernel, do_not_specialize=["pad", "bits"])
    pointers = {
        "data": "*u8",
        "steps": "*i32",
        "lanes": "*i32",
        "chunk_tables": "*i32",
        "out": "*i64",
    }
    signature = {**pointers, "pad": "i64", "bits": "i32"}
    constants = {"LANES": module.LANES, "LANE": module.LANE, "WIDTH": module.WIDTH}
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", capability, 32), options=dict(module._OPTIONS)
    )
    assert compiled.asm["cubin"]
    assert "atom.global.gpu.acq_rel.xor.b64" in compiled.asm["ptx"]
