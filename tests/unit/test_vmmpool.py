"""kvbroker's VMM allocator (src/kvbroker/native/vmm_allocator.c), compiled here and driven
through the scripted fake CUDA driver: what it allocates is a VMM allocation with the POSIX-fd
handle type that EngineMemory.adopt can export and a broker import; frees release everything;
a failing step releases what came before."""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker import cudavmm, vmmpool
from kvbroker.testing.fake_cuda import FakeCudaLib

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")

_u64 = ctypes.c_ulonglong
_FUNCTIONS = [  # the C file's Driver struct, in order
    ("cuDeviceGetAttribute", [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]),
    ("cuMemGetAllocationGranularity", [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(cudavmm.AllocationProp), ctypes.c_int]),
    ("cuMemCreate", [ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.POINTER(cudavmm.AllocationProp), _u64]),
    ("cuMemRelease", [_u64]),
    ("cuMemAddressReserve", [ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.c_size_t, _u64, _u64]),
    ("cuMemAddressFree", [_u64, ctypes.c_size_t]),
    ("cuMemMap", [_u64, ctypes.c_size_t, ctypes.c_size_t, _u64, _u64]),
    ("cuMemUnmap", [_u64, ctypes.c_size_t]),
    ("cuMemSetAccess", [_u64, ctypes.c_size_t, ctypes.POINTER(cudavmm.AccessDesc), ctypes.c_size_t]),
]


class _Table(ctypes.Structure):
    _fields_ = [(name, ctypes.CFUNCTYPE(ctypes.c_int, *args)) for name, args in _FUNCTIONS]


def _callback(fake: FakeCudaLib, name: str, argtypes: list) -> object:  # type: ignore[type-arg]
    """A C-callable entry of ``fake``: pointer arguments become the byref objects it expects."""

    def call(*args: object) -> int:
        converted = [ctypes.byref(a.contents) if isinstance(a, ctypes._Pointer) else a for a in args]  # type: ignore[attr-defined]
        return int(getattr(fake, name)(*converted))

    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(call)


@pytest.fixture
def allocator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ctypes.CDLL, FakeCudaLib]]:
    monkeypatch.setenv("KVBROKER_NATIVE_CACHE", str(tmp_path))
    lib = vmmpool.load()
    fake = FakeCudaLib(devices=2, granularity=4096)
    callbacks = [_callback(fake, name, args) for name, args in _FUNCTIONS]
    table = _Table(*callbacks)
    lib.kvbroker_vmm_set_driver(ctypes.byref(table))
    driver = cudavmm.Driver(fake)
    driver.retain_context(driver.device(1))  # torch's context on the allocating thread
    yield lib, fake
    driver.call("cuDevicePrimaryCtxRelease_v2", 1)
    del callbacks, table


def test_the_library_is_built_once_per_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native allocator library is built once per source, in KVBROKER_NATIVE_CACHE, and found there after."""
    monkeypatch.setenv("KVBROKER_NATIVE_CACHE", str(tmp_path))
    first = vmmpool.library_path()
    assert first.exists() and first.parent == tmp_path
    assert vmmpool.library_path() == first and list(tmp_path.iterdir()) == [first]


def test_an_allocation_is_a_vmm_allocation_the_broker_can_import(allocator: tuple[ctypes.CDLL, FakeCudaLib]) -> None:
    """The allocator's memory is a VMM allocation (rounded to the granularity, RDMA-capable) that exports as
    EngineMemory.adopt does and imports in the broker to the same bytes, which outlive the engine's free while the
    broker holds them."""
    lib, fake = allocator
    driver = cudavmm.Driver(fake)
    address = lib.kvbroker_vmm_malloc(5000, 1, None)
    assert address and lib.kvbroker_vmm_live() == 1
    created = fake.created[-1]
    assert (created["device"], created["handle_types"], created["size"], created["rdma"]) == (1, 1, 8192, 1)
    assert fake.access[address] == (1, cudavmm.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    export = cudavmm.export_allocation(address + 100, driver)  # what EngineMemory.adopt does
    assert (export.base, export.size_bytes, export.device, export.ipc_handle) == (address, 8192, 1, None)
    assert export.fd is not None
    imported = cudavmm.import_buffer(export.fd, export.size_bytes, 0, driver)  # what the broker does
    os.close(export.fd)
    ctypes.memmove(address + 100, b"engine bytes", 12)
    assert ctypes.string_at(imported.address + 100, 12) == b"engine bytes"
    lib.kvbroker_vmm_free(address, 5000, 1, None)
    assert lib.kvbroker_vmm_live() == 0
    assert ctypes.string_at(imported.address + 100, 12) == b"engine bytes", "the broker's reference keeps the memory"
    imported.release()
    assert [leak for leak in fake.leaks() if "primary context" not in leak] == []


@pytest.mark.parametrize("step", ["cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"])
def test_a_failed_step_returns_null_and_releases_what_came_before(allocator: tuple[ctypes.CDLL, FakeCudaLib], step: str) -> None:
    """An allocation that fails at any step returns NULL and leaks nothing; the next one succeeds; freeing an address
    not the allocator's is ignored."""
    lib, fake = allocator
    fake.fail[step] = 2
    assert lib.kvbroker_vmm_malloc(4096, 1, None) is None
    assert lib.kvbroker_vmm_live() == 0
    assert [leak for leak in fake.leaks() if "primary context" not in leak] == []
    del fake.fail[step]
    address = lib.kvbroker_vmm_malloc(4096, 1, None)
    assert address
    lib.kvbroker_vmm_free(address, 4096, 1, None)
    lib.kvbroker_vmm_free(12345, 4096, 1, None)  # not one of ours: ignored
    assert [leak for leak in fake.leaks() if "primary context" not in leak] == []
