"""The CUDA VMM export/import path against a scripted driver (no GPU here).

These check what can be checked without a device: the driver structures'
layout, the order and arguments of the calls, that every failure releases
what the steps before it took, and that the broker's importer finds devices
by UUID and closes the fd. Whether the driver accepts it all on a real GPU
is tests/test_gpu.py's job.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from kvbroker import cudavmm
from kvbroker.broker.memory import VramImporter, importer_for
from kvbroker.errors import FailedPrecondition, InvalidArgument
from kvbroker.testing.fake_cuda import FakeCudaLib
from kvbroker.v1 import common_pb2

MiB = 1 << 20


@pytest.fixture
def fake() -> FakeCudaLib:
    return FakeCudaLib(devices=2, granularity=2 * MiB)


def test_structures_match_cuda_h() -> None:
    """CUmemAllocationProp and CUmemAccessDesc as cuda.h lays them out on 64-bit Linux."""
    prop = cudavmm.AllocationProp
    assert ctypes.sizeof(prop) == 32
    assert (prop.type.offset, prop.requestedHandleTypes.offset, prop.location.offset) == (0, 4, 8)
    assert (prop.win32HandleMetaData.offset, prop.allocFlags.offset) == (16, 24)
    assert cudavmm.AllocFlags.gpuDirectRDMACapable.offset == 1
    assert ctypes.sizeof(cudavmm.AccessDesc) == 12
    assert cudavmm.AccessDesc.flags.offset == 8


def test_export_then_import_maps_the_same_allocation_and_releases_everything(fake: FakeCudaLib) -> None:
    """An exported VMM buffer (rounded up to the granularity, RDMA-capable, read-write) imports as the same allocation
    at another address; each side releases its own (idempotently) and nothing leaks; cuInit runs once."""
    driver = cudavmm.Driver(fake)
    exported, fd = cudavmm.export_buffer(1, 3 * MiB, driver)
    try:
        assert exported.size_bytes == 4 * MiB, "rounded up to the granularity"
        assert fake.created == [
            {"device": 1, "handle_types": cudavmm.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "rdma": 1, "size": 4 * MiB}
        ]
        assert fake.access[exported.address] == (1, cudavmm.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        imported = cudavmm.import_buffer(fd, 4 * MiB, 1, driver)
    finally:
        os.close(fd)
    assert imported.handle == exported.handle and imported.address != exported.address
    assert fake.access[imported.address] == (1, cudavmm.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    assert fake.refs[exported.handle] == 4, "two handles, two mappings"
    exported.release()
    assert fake.refs[exported.handle] == 2, "the importer still holds the memory after the exporter let go"
    imported.release()
    imported.release()  # idempotent
    assert fake.leaks() == []
    assert fake.calls[0] == "cuInit" and fake.calls.count("cuInit") == 1


def test_no_rdma_flag_when_the_device_cannot(fake: FakeCudaLib) -> None:
    """On a device without GPUDirect RDMA the allocation is made without the RDMA flag."""
    fake.rdma = False
    mapping, fd = cudavmm.export_buffer(0, MiB, cudavmm.Driver(fake))
    os.close(fd)
    mapping.release()
    assert fake.created[0]["rdma"] == 0
    assert fake.leaks() == []


@pytest.mark.parametrize(
    "step",
    ["cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemExportToShareableHandle", "cuCtxSetCurrent"],
)
def test_a_failed_export_step_releases_what_came_before(fake: FakeCudaLib, step: str) -> None:
    """An export that fails at any step raises CudaError naming the step and the CUDA error, and leaks nothing of the
    steps before."""
    fake.fail[step] = 2
    with pytest.raises(cudavmm.CudaError, match=f"{step} failed: CUDA_ERROR_OUT_OF_MEMORY"):
        cudavmm.export_buffer(0, MiB, cudavmm.Driver(fake))
    assert fake.leaks() == []


@pytest.mark.parametrize("step", ["cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"])
def test_a_failed_import_step_releases_what_came_before(fake: FakeCudaLib, step: str) -> None:
    """An import that fails at any step raises CudaError naming the step and leaks nothing of the steps before."""
    driver = cudavmm.Driver(fake)
    exported, fd = cudavmm.export_buffer(0, 2 * MiB, driver)
    fake.fail[step] = 2
    try:
        with pytest.raises(cudavmm.CudaError, match=step):
            cudavmm.import_buffer(fd, 2 * MiB, 0, driver)
    finally:
        os.close(fd)
        exported.release()
    assert fake.leaks() == []


def test_import_refuses_a_size_the_allocation_does_not_hold(fake: FakeCudaLib) -> None:
    """An import of a size off the granularity, larger than the allocation, or on a device that does not exist is
    INVALID_ARGUMENT, and leaks nothing."""
    driver = cudavmm.Driver(fake)
    exported, fd = cudavmm.export_buffer(0, 2 * MiB, driver)
    try:
        with pytest.raises(InvalidArgument, match="granularity"):
            cudavmm.import_buffer(fd, 3 * MiB, 0, driver)
        with pytest.raises(InvalidArgument, match="larger than the allocation"):
            cudavmm.import_buffer(fd, 4 * MiB, 0, driver)
        with pytest.raises(InvalidArgument, match="does not exist"):
            cudavmm.import_buffer(fd, 2 * MiB, 7, driver)
    finally:
        os.close(fd)
        exported.release()
    assert fake.leaks() == []


def test_devices_are_found_by_uuid(fake: FakeCudaLib) -> None:
    """A device's UUID names it back; an unknown UUID is FAILED_PRECONDITION pointing at CUDA_VISIBLE_DEVICES."""
    driver = cudavmm.Driver(fake)
    assert cudavmm.device_uuid(1, driver) == fake.uuid_of(1)
    assert cudavmm.device_for_uuid(fake.uuid_of(1), driver) == 1
    with pytest.raises(FailedPrecondition, match="CUDA_VISIBLE_DEVICES"):
        cudavmm.device_for_uuid(b"\xee" * 16, driver)


def _spec(size: int, uuid: bytes = b"", device_id: int = 0) -> common_pb2.BufferSpec:
    return common_pb2.BufferSpec(size_bytes=size, kind=common_pb2.MEMORY_KIND_VRAM, device_id=device_id, device_uuid=uuid)


def test_broker_importer_maps_on_the_device_named_by_uuid_and_closes_the_fd(fake: FakeCudaLib) -> None:
    """The broker's VRAM importer maps on the device the UUID names, not the engine's device number, and closes the
    fd."""
    driver = cudavmm.Driver(fake)
    exported, fd = cudavmm.export_buffer(1, 2 * MiB, driver)
    # The engine calls the device 0 (its CUDA_VISIBLE_DEVICES), the UUID says 1.
    buf = importer_for(common_pb2.MEMORY_KIND_VRAM, driver).import_buffer(fd, _spec(2 * MiB, fake.uuid_of(1), device_id=0))
    with pytest.raises(OSError):
        os.fstat(fd)
    assert (buf.kind, buf.device_id, buf.size_bytes) == (common_pb2.MEMORY_KIND_VRAM, 1, 2 * MiB)
    assert fake.access[buf.address][0] == 1
    buf.release()
    exported.release()
    assert fake.leaks() == []


def test_broker_importer_closes_the_fd_on_refusal(fake: FakeCudaLib) -> None:
    """The broker's VRAM importer closes the fd when it refuses the buffer (a UUID that is not 16 bytes)."""
    driver = cudavmm.Driver(fake)
    exported, fd = cudavmm.export_buffer(0, 2 * MiB, driver)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        VramImporter(driver).import_buffer(fd, _spec(2 * MiB, b"short"))
    with pytest.raises(OSError):
        os.fstat(fd)
    exported.release()
    assert fake.leaks() == []


@pytest.mark.skipif(cudavmm.driver_present(), reason="this host has a CUDA driver")
def test_without_a_driver_vram_is_refused_clearly() -> None:
    """Without a CUDA driver, importing VRAM is FAILED_PRECONDITION saying libcuda cannot be loaded, and the fd is
    closed."""
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(FailedPrecondition, match="libcuda.so.1 cannot be loaded"):
        VramImporter(cudavmm.Driver()).import_buffer(r, _spec(2 * MiB))
    with pytest.raises(OSError):
        os.fstat(r)


def test_a_failed_cuinit_is_reported_and_retried(fake: FakeCudaLib) -> None:
    """A failed cuInit raises CudaError naming the error, and the next call tries cuInit again."""
    driver = cudavmm.Driver(fake)
    fake.fail["cuInit"] = 101
    with pytest.raises(cudavmm.CudaError, match="cuInit failed: CUDA_ERROR_INVALID_DEVICE"):
        cudavmm.device_uuid(0, driver)
    del fake.fail["cuInit"]
    assert cudavmm.device_uuid(0, driver) == fake.uuid_of(0)
    assert fake.calls.count("cuInit") == 2


def _cuda_malloc(fake: FakeCudaLib, size: int, device: int = 0) -> int:
    driver = cudavmm.Driver(fake)
    driver.retain_context(driver.device(device))
    ptr = ctypes.c_ulonglong()
    driver.call("cuMemAlloc_v2", ctypes.byref(ptr), size)
    return ptr.value


def test_structures_of_ipc_are_cuda_h_sized() -> None:
    """The CUDA IPC memory handle structure is 64 bytes, as in cuda.h."""
    assert ctypes.sizeof(cudavmm.IpcMemHandle) == 64


def test_an_engines_allocation_exports_whole_from_any_pointer_inside(fake: FakeCudaLib) -> None:
    """cudaMalloc: an IPC handle of the whole allocation; VMM: an fd, the retained handle released."""
    driver = cudavmm.Driver(fake)
    base = _cuda_malloc(fake, 8192, device=1)
    export = cudavmm.export_allocation(base + 5000, driver)
    assert (export.base, export.size_bytes, export.device, export.fd) == (base, 8192, 1, None)
    assert export.ipc_handle is not None and len(export.ipc_handle) == 64
    mapping, fd = cudavmm.export_buffer(0, 4096, driver)
    os.close(fd)
    vmm = cudavmm.export_allocation(mapping.address + 10, driver)
    assert (vmm.base, vmm.size_bytes, vmm.device, vmm.ipc_handle) == (mapping.address, 2 * MiB, 0, None)  # granularity
    assert vmm.fd is not None
    os.close(vmm.fd)
    assert fake.calls.count("cuMemRetainAllocationHandle") == 2 and "cuMemRelease" in fake.calls
    mapping.release()
    driver.call("cuMemFree_v2", base)
    driver.call("cuDevicePrimaryCtxRelease_v2", 1)
    assert fake.leaks() == []


def test_opening_an_ipc_handle_checks_it_and_releases_on_every_path(fake: FakeCudaLib) -> None:
    """Opening an IPC handle refuses one of the wrong length, one that does not open and a size the allocation does
    not hold; an opened one maps the same bytes; release is idempotent and nothing leaks."""
    driver = cudavmm.Driver(fake)
    base = _cuda_malloc(fake, 4096)
    handle = cudavmm.export_allocation(base, driver).ipc_handle
    assert handle is not None
    with pytest.raises(InvalidArgument, match="64 bytes"):
        cudavmm.open_ipc(handle[:10], 4096, 0, driver)
    with pytest.raises(InvalidArgument, match="does not open"):
        cudavmm.open_ipc(bytes(64), 4096, 0, driver)
    with pytest.raises(InvalidArgument, match="holds 4096"):
        cudavmm.open_ipc(handle, 8192, 0, driver)
    opened = cudavmm.open_ipc(handle, 4096, 0, driver)
    ctypes.memmove(base, b"same bytes", 10)
    assert ctypes.string_at(opened.address, 10) == b"same bytes"
    opened.release()
    opened.release()  # idempotent
    driver.call("cuMemFree_v2", base)
    driver.call("cuDevicePrimaryCtxRelease_v2", 0)
    assert fake.leaks() == []


def test_the_broker_importer_opens_ipc_buffers_without_an_fd(fake: FakeCudaLib) -> None:
    """The broker's VRAM importer opens a buffer by its CUDA IPC handle, with no fd, on the device its UUID names."""
    driver = cudavmm.Driver(fake)
    base = _cuda_malloc(fake, 4096, device=1)
    export = cudavmm.export_allocation(base, driver)
    spec = common_pb2.BufferSpec(
        size_bytes=4096, kind=common_pb2.MEMORY_KIND_VRAM, device_uuid=fake.uuid_of(1), cuda_ipc_handle=export.ipc_handle
    )
    buffer = VramImporter(driver).import_buffer(-1, spec)
    assert buffer.device_id == 1 and buffer.size_bytes == 4096
    buffer.release()
    driver.call("cuMemFree_v2", base)
    driver.call("cuDevicePrimaryCtxRelease_v2", 1)
    assert fake.leaks() == []
