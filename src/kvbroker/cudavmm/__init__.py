"""GPU memory that crosses processes as a file descriptor: CUDA VMM (docs/design.md section 3).

An engine allocates its VRAM KV pool with ``cuMemCreate`` asking for a
POSIX-fd shareable handle, maps it into its own address space and exports
the fd (:func:`export_buffer`); the broker imports the fd
(``cuMemImportFromShareableHandle``) and maps it into *its* address space
(:func:`import_buffer`), for its own copy kernels. The physical memory stays
alive while either side holds it, so an engine that dies cannot pull memory
out from under a copy. Memory the engine allocated with ``cudaMalloc`` comes
as a CUDA IPC handle instead (:func:`export_allocation`, :func:`open_ipc`).

Neither is ever registered with NIXL: on an H100, a NIXL write into a VMM
allocation fell back to TCP on the host (0.45 GB/s) and an IPC-opened
pointer could not be registered at all. The broker's own transfer buffers
(:func:`alloc_device`: ``cuMemAlloc``, what ``cudaMalloc`` gives) are the
device memory NIXL sees (``kvbroker.broker.memory``).

This package talks to the CUDA driver (``libcuda.so.1``) through ctypes:
no build step and no dependency beyond the driver itself. Every call goes
through :class:`Driver`, which tests replace with a scripted fake. Its
modules (private: use the names here):

- ``_driver``: the binding (:class:`Driver`, the constants and structures,
  the default driver, devices by UUID) and plain device memory
  (:func:`alloc_device`);
- ``_vmm``: VMM allocations exported and imported as fds (:func:`export_buffer`,
  :func:`import_buffer`, :class:`VmmMapping`);
- ``_ipc``: an engine's existing allocation exported (:func:`export_allocation`)
  and CUDA IPC handles opened (:func:`open_ipc`, :class:`IpcMapping`).

Status: the call sequence, the structures and the cleanup paths are
unit-tested against a fake driver on CPU machines; the export, import and
IPC calls have run on an H100 (../shared/gpu/README.md); ``alloc_device``
has not run on a GPU yet.
"""

from __future__ import annotations

from kvbroker.cudavmm._driver import (
    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    CU_IPC_HANDLE_SIZE,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    CU_MEM_ALLOCATION_TYPE_PINNED,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CUDA_ERROR_INVALID_VALUE,
    AccessDesc,
    AllocationProp,
    AllocFlags,
    DeviceAllocation,
    Driver,
    IpcMemHandle,
    MemLocation,
    alloc_device,
    default_driver,
    device_for_uuid,
    device_uuid,
    driver_present,
)
from kvbroker.cudavmm._ipc import AllocationExport, IpcMapping, export_allocation, open_ipc
from kvbroker.cudavmm._vmm import VmmMapping, export_buffer, import_buffer, round_up
from kvbroker.cudavmm._vmm import _map as _map  # (tests/test_vram.py maps an allocation by hand)
from kvbroker.errors import CudaError

__all__ = [
    # What the broker, the client and the tests call.
    "AccessDesc",
    "AllocationProp",
    "Driver",
    "VmmMapping",
    "default_driver",
    "device_for_uuid",
    "device_uuid",
    "driver_present",
    "AllocationExport",
    "DeviceAllocation",
    "IpcMapping",
    "alloc_device",
    "IpcMemHandle",
    "export_allocation",
    "export_buffer",
    "import_buffer",
    "open_ipc",
    # The cuda.h constants and structures, the error every call raises, and
    # round_up: reached as cudavmm.X as when this was one module.
    "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
    "CU_IPC_HANDLE_SIZE",
    "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS",
    "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
    "CU_MEM_ALLOC_GRANULARITY_MINIMUM",
    "CU_MEM_ALLOCATION_TYPE_PINNED",
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "CU_MEM_LOCATION_TYPE_DEVICE",
    "CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL",
    "CUDA_ERROR_INVALID_VALUE",
    "AllocFlags",
    "CudaError",
    "MemLocation",
    "round_up",
]
