"""CUDA VMM allocations that cross processes as a POSIX fd (docs/design.md section 3).

An engine allocates its VRAM KV pool with ``cuMemCreate`` asking for a
POSIX-fd shareable handle, maps it into its own address space and exports
the fd (:func:`export_buffer`); the broker imports the fd
(``cuMemImportFromShareableHandle``) and maps it into *its* address space
(:func:`import_buffer`), for its own copy kernels. Either side holds a
:class:`VmmMapping`; the physical memory stays alive while either side holds
it, so an engine that dies cannot pull memory out from under a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass, field
from typing import Any

from kvbroker.cudavmm._driver import (
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE,
    CUDA_ERROR_INVALID_VALUE,
    AccessDesc,
    Driver,
    _attempt_all,
    _open,
    _u64,
)
from kvbroker.errors import CudaError, InvalidArgument, KvBrokerError

__all__ = ["VmmMapping", "export_buffer", "import_buffer", "round_up"]


@dataclass(eq=False)
class VmmMapping:
    """A VMM allocation mapped read-write at ``address`` for ``device``.

    ``release`` unmaps it, frees the address range, drops this process's
    reference to the physical memory and the primary context; idempotent.
    The physical memory itself lives until every process that holds it
    (exporter and importers) has released it.
    """

    address: int
    size_bytes: int
    device: int
    handle: int
    context: int
    driver: Driver = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        _unwind(self.driver, self.device, self.context, self.handle, self.address, self.size_bytes, mapped=True)


def _unwind(
    driver: Driver, dev: int, ctx: int, handle: int, address: int, size: int, *, mapped: bool, quiet: bool = False
) -> None:
    """Undo the steps that succeeded, last first; every step is attempted.

    Raises the first failure unless ``quiet`` (cleaning up after another error,
    which is the one to report).
    """
    # The calls need a current context; a release may run on another thread.
    steps: list[tuple[str, tuple[Any, ...]]] = [("cuCtxSetCurrent", (ctypes.c_void_p(ctx),))]
    if mapped:
        steps.append(("cuMemUnmap", (address, size)))
    if address:
        steps.append(("cuMemAddressFree", (address, size)))
    if handle:
        steps.append(("cuMemRelease", (handle,)))
    steps.append(("cuDevicePrimaryCtxRelease_v2", (dev,)))
    _attempt_all(driver, steps, quiet=quiet)


def _map(driver: Driver, dev: int, handle: int, size: int, granularity: int) -> int:
    """Reserve an address range, map ``handle`` there and allow ``dev`` to read and write it."""
    ptr = _u64()
    driver.call("cuMemAddressReserve", ctypes.byref(ptr), size, granularity, 0, 0)
    try:
        driver.call("cuMemMap", ptr.value, size, 0, handle, 0)
    except KvBrokerError:
        with contextlib.suppress(KvBrokerError):
            driver.call("cuMemAddressFree", ptr.value, size)
        raise
    access = AccessDesc()
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = dev
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    try:
        driver.call("cuMemSetAccess", ptr.value, size, ctypes.byref(access), 1)
    except KvBrokerError:
        with contextlib.suppress(KvBrokerError):
            driver.call("cuMemUnmap", ptr.value, size)
        with contextlib.suppress(KvBrokerError):
            driver.call("cuMemAddressFree", ptr.value, size)
        raise
    return ptr.value


def round_up(size_bytes: int, granularity: int) -> int:
    return -(-size_bytes // granularity) * granularity


def export_buffer(ordinal: int, size_bytes: int, driver: Driver | None = None) -> tuple[VmmMapping, int]:
    """Allocate at least ``size_bytes`` of VRAM on device ``ordinal``, mapped here, and export it.

    Returns the mapping (its ``size_bytes`` rounded up to the allocation
    granularity) and a POSIX fd the caller owns (hand it to the broker, then
    close it). The memory is not zeroed. GPUDirect RDMA is requested when the
    device supports it with VMM allocations.
    """
    drv, dev, ctx = _open(driver, ordinal, size_bytes)
    handle = 0
    try:
        prop = drv.allocation_prop(dev, rdma=drv.rdma_capable(dev))
        granularity = drv.granularity(prop)
        size = round_up(size_bytes, granularity)
        raw_handle = _u64()
        drv.call("cuMemCreate", ctypes.byref(raw_handle), size, ctypes.byref(prop), 0)
        handle = raw_handle.value
        address = _map(drv, dev, handle, size, granularity)
    except BaseException:
        _unwind(drv, dev, ctx, handle, 0, 0, mapped=False, quiet=True)
        raise
    mapping = VmmMapping(address=address, size_bytes=size, device=dev, handle=handle, context=ctx, driver=drv)
    fd = ctypes.c_int(-1)
    try:
        drv.call("cuMemExportToShareableHandle", ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
    except BaseException:
        with contextlib.suppress(KvBrokerError):
            mapping.release()
        raise
    return mapping, fd.value


def import_buffer(fd: int, size_bytes: int, ordinal: int, driver: Driver | None = None) -> VmmMapping:
    """Import a VMM allocation exported as ``fd`` and map ``size_bytes`` of it for device ``ordinal``.

    ``size_bytes`` must be a multiple of the allocation granularity and at
    most the allocation's size (the driver refuses a larger mapping, so a
    buffer cannot claim more than it holds). Does not close ``fd``.
    """
    drv, dev, ctx = _open(driver, ordinal, size_bytes)
    handle = 0
    try:
        granularity = drv.granularity(drv.allocation_prop(dev, rdma=False))
        if size_bytes % granularity:
            raise InvalidArgument(
                f"a VRAM buffer of {size_bytes} bytes is not a multiple of device {ordinal}'s "
                f"allocation granularity ({granularity} bytes)"
            )
        raw_handle = _u64()
        try:
            drv.call(
                "cuMemImportFromShareableHandle",
                ctypes.byref(raw_handle),
                ctypes.c_void_p(fd),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        except CudaError as exc:
            if exc.cuda_code == CUDA_ERROR_INVALID_VALUE:
                raise InvalidArgument(f"the fd is not an exported CUDA VMM allocation: {exc.message}") from exc
            raise
        handle = raw_handle.value
        try:
            address = _map(drv, dev, handle, size_bytes, granularity)
        except CudaError as exc:
            if exc.cuda_code == CUDA_ERROR_INVALID_VALUE:
                raise InvalidArgument(
                    f"cannot map {size_bytes} bytes of the exported VRAM buffer on device {ordinal} "
                    f"(larger than the allocation?): {exc.message}"
                ) from exc
            raise
    except BaseException:
        _unwind(drv, dev, ctx, handle, 0, 0, mapped=False, quiet=True)
        raise
    return VmmMapping(address=address, size_bytes=size_bytes, device=dev, handle=handle, context=ctx, driver=drv)
