"""An engine's existing VRAM allocation, exported for the broker, and CUDA IPC handles opened here.

:func:`export_allocation` exports the allocation a pointer lies in: a VMM
allocation with the POSIX-fd handle type as an fd (the broker imports it
with ``_vmm.import_buffer``), memory the engine allocated with ``cudaMalloc``
as a CUDA IPC handle, which the broker opens with :func:`open_ipc`
(:class:`IpcMapping`: the memory lives while the exporting process does).
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import ClassVar

from kvbroker.cudavmm._driver import (
    CU_IPC_HANDLE_SIZE,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CUDA_ERROR_INVALID_VALUE,
    Driver,
    IpcMemHandle,
    _ContextMemory,
    _open,
    _u64,
    default_driver,
)
from kvbroker.errors import CudaError, FailedPrecondition, InvalidArgument, KvBrokerError

__all__ = ["AllocationExport", "IpcMapping", "export_allocation", "open_ipc"]


@dataclass(frozen=True)
class AllocationExport:
    """The whole VRAM allocation that holds a pointer, exported for the broker:
    ``fd`` (a VMM allocation with a POSIX-fd handle type; the caller owns it)
    or ``ipc_handle`` (a ``cudaMalloc`` allocation; 64 bytes)."""

    base: int
    size_bytes: int
    #: The device ordinal as this process sees it.
    device: int
    fd: int | None = None
    ipc_handle: bytes | None = None


def export_allocation(ptr: int, driver: Driver | None = None) -> AllocationExport:
    """Export the allocation ``ptr`` lies in (``cuMemGetAddressRange``).

    A VMM allocation (``cuMemCreate``, as PyTorch's expandable segments and
    kvbroker's own allocator make) is retained and exported as a POSIX fd;
    the range must be one allocation mapped from its start, and created with
    the POSIX-fd handle type, or this raises ``FailedPrecondition`` saying so.
    Any other device allocation (``cudaMalloc``) gets a CUDA IPC handle.
    """
    drv = driver or default_driver()
    base, size = _u64(), ctypes.c_size_t()
    try:
        drv.call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
    except CudaError as exc:
        raise InvalidArgument(f"{ptr:#x} is not in a CUDA device allocation: {exc.message}") from exc
    ordinal = ctypes.c_int(-1)
    drv.call("cuPointerGetAttribute", ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    handle = _u64()
    try:
        drv.call("cuMemRetainAllocationHandle", ctypes.byref(handle), base.value)
    except CudaError:
        handle.value = 0  # not a VMM allocation
    if handle.value:
        fd = ctypes.c_int(-1)
        try:
            drv.call("cuMemExportToShareableHandle", ctypes.byref(fd), handle.value, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        except CudaError as exc:
            raise FailedPrecondition(
                f"the VMM allocation at {base.value:#x} cannot be exported as a POSIX fd ({exc.message}): it was "
                "created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; allocate the KV with kvbroker's "
                "EngineMemory.allocate(device='cuda') or with that handle type"
            ) from exc
        finally:
            drv.call("cuMemRelease", handle.value)
        return AllocationExport(base=base.value, size_bytes=size.value, device=ordinal.value, fd=fd.value)
    ipc = IpcMemHandle()
    drv.call("cuIpcGetMemHandle", ctypes.byref(ipc), base.value)
    return AllocationExport(base=base.value, size_bytes=size.value, device=ordinal.value, ipc_handle=bytes(ipc))


@dataclass(eq=False)
class IpcMapping(_ContextMemory):
    """An engine's ``cudaMalloc`` allocation opened in this process
    (``cuIpcOpenMemHandle``). The memory lives while the exporting process does."""

    _FREE: ClassVar[str] = "cuIpcCloseMemHandle"


def open_ipc(handle: bytes, size_bytes: int, ordinal: int, driver: Driver | None = None) -> IpcMapping:
    """Open a CUDA IPC handle of an allocation of at least ``size_bytes`` on device ``ordinal``."""
    if len(handle) != CU_IPC_HANDLE_SIZE:
        raise InvalidArgument(f"a CUDA IPC handle is {CU_IPC_HANDLE_SIZE} bytes, got {len(handle)}")
    drv, dev, ctx = _open(driver, ordinal, size_bytes)
    ptr = _u64()
    try:
        try:
            drv.call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), IpcMemHandle.from_buffer_copy(handle), CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        except CudaError as exc:
            if exc.cuda_code == CUDA_ERROR_INVALID_VALUE:
                raise InvalidArgument(f"the CUDA IPC handle does not open on device {ordinal}: {exc.message}") from exc
            raise
        base, size = _u64(), ctypes.c_size_t()
        drv.call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr.value)
        if size.value < size_bytes:
            with contextlib.suppress(KvBrokerError):
                drv.call("cuIpcCloseMemHandle", ptr.value)
            raise InvalidArgument(f"the buffer claims {size_bytes} bytes but its CUDA allocation holds {size.value}")
    except BaseException:
        with contextlib.suppress(KvBrokerError):
            drv.call("cuDevicePrimaryCtxRelease_v2", dev)
        raise
    return IpcMapping(address=ptr.value, size_bytes=size_bytes, device=dev, context=ctx, driver=drv)
