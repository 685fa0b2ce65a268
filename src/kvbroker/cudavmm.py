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

This module talks to the CUDA driver (``libcuda.so.1``) through ctypes:
no build step and no dependency beyond the driver itself. Every call goes
through :class:`Driver`, which tests replace with a scripted fake.

Status: the call sequence, the structures and the cleanup paths are
unit-tested against a fake driver on CPU machines; the export, import and
IPC calls have run on an H100 (../shared/gpu/README.md); ``alloc_device``
has not run on a GPU yet.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbroker.errors import CudaError, FailedPrecondition, InvalidArgument, KvBrokerError

__all__ = [
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
]

# cuda.h constants (stable since CUDA 10.2).
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CUDA_ERROR_INVALID_VALUE = 1
CU_IPC_HANDLE_SIZE = 64


class MemLocation(ctypes.Structure):
    """``CUmemLocation``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    """The ``allocFlags`` member of ``CUmemAllocationProp``."""

    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (32 bytes on x86_64 and aarch64)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``."""

    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class IpcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * CU_IPC_HANDLE_SIZE)]


_u64 = ctypes.c_ulonglong
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetUuid": [ctypes.c_char_p, ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuDeviceTotalMem_v2": [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(AllocationProp), ctypes.c_int],
    "cuMemCreate": [ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.POINTER(AllocationProp), _u64],
    "cuMemRelease": [_u64],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.c_size_t, _u64, _u64],
    "cuMemAddressFree": [_u64, ctypes.c_size_t],
    "cuMemMap": [_u64, ctypes.c_size_t, ctypes.c_size_t, _u64, _u64],
    "cuMemUnmap": [_u64, ctypes.c_size_t],
    "cuMemSetAccess": [_u64, ctypes.c_size_t, ctypes.POINTER(AccessDesc), ctypes.c_size_t],
    "cuMemExportToShareableHandle": [ctypes.c_void_p, _u64, ctypes.c_int, _u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_size_t), _u64],
    "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, _u64],
    "cuMemRetainAllocationHandle": [ctypes.POINTER(_u64), ctypes.c_void_p],
    "cuIpcGetMemHandle": [ctypes.POINTER(IpcMemHandle), _u64],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(_u64), IpcMemHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [_u64],
    "cuMemAlloc_v2": [ctypes.POINTER(_u64), ctypes.c_size_t],
    "cuMemFree_v2": [_u64],
}


class Driver:
    """The CUDA driver calls kvbroker makes, each checked.

    ``lib`` is anything with the driver's functions as attributes (the real
    ``libcuda.so.1`` by default, loaded on first use; a fake in tests). Every
    function returns a ``CUresult``; outputs come back through ``byref``
    arguments.
    """

    def __init__(self, lib: Any = None) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._initialised = False

    @property
    def lib(self) -> Any:
        with self._lock:
            if self._lib is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as exc:
                    raise FailedPrecondition(
                        f"VRAM buffers need the CUDA driver, and libcuda.so.1 cannot be loaded here: {exc}"
                    ) from None
                for name, argtypes in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype = ctypes.c_int
                    fn.argtypes = argtypes
                self._lib = lib
            if not self._initialised:
                self._check("cuInit", self._lib.cuInit(0))
                self._initialised = True
            return self._lib

    def call(self, name: str, *args: Any) -> None:
        """Call driver function ``name``; ``CudaError`` unless it returns CUDA_SUCCESS."""
        self._check(name, getattr(self.lib, name)(*args))

    def _check(self, name: str, code: int) -> None:
        if code == 0:
            return
        text = ctypes.c_char_p()
        try:
            self._lib.cuGetErrorName(code, ctypes.byref(text))
            label = (text.value or b"").decode() or "CUDA_ERROR"
        except Exception:  # noqa: BLE001 - naming the error must not hide it
            label = "CUDA_ERROR"
        raise CudaError(name, code, label)

    # -- small helpers ------------------------------------------------------
    def device(self, ordinal: int) -> int:
        """The ``CUdevice`` of ``ordinal``; ``InvalidArgument`` if there is none."""
        count = self.device_count()
        if not 0 <= ordinal < count:
            raise InvalidArgument(f"CUDA device {ordinal} does not exist here ({count} visible)")
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        return dev.value

    def device_count(self) -> int:
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def retain_context(self, dev: int) -> int:
        """Retain ``dev``'s primary context (the one torch uses), make it current, return it."""
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        try:
            self.call("cuCtxSetCurrent", ctx)
        except KvBrokerError:
            with contextlib.suppress(KvBrokerError):
                self.call("cuDevicePrimaryCtxRelease_v2", dev)
            raise
        return ctx.value or 0

    def allocation_prop(self, dev: int, *, rdma: bool) -> AllocationProp:
        prop = AllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = dev
        prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
        return prop

    def granularity(self, prop: AllocationProp) -> int:
        size = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return size.value

    def rdma_capable(self, dev: int) -> bool:
        value = ctypes.c_int()
        try:
            self.call(
                "cuDeviceGetAttribute", ctypes.byref(value), CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev
            )
        except CudaError:
            return False
        return bool(value.value)


_default: Driver | None = None
_default_lock = threading.Lock()


def driver_present() -> bool:
    """Whether this host's CUDA driver (``libcuda.so.1``) can be loaded."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def default_driver() -> Driver:
    """The process's driver (``libcuda.so.1``, loaded on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Driver()
        return _default


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


def _attempt_all(driver: Driver, steps: list[tuple[str, tuple[Any, ...]]], *, quiet: bool = False) -> None:
    """Call every step, even after one fails; raise the first failure unless ``quiet``."""
    errors: list[KvBrokerError] = []
    for name, args in steps:
        try:
            driver.call(name, *args)
        except KvBrokerError as exc:
            errors.append(exc)
    if errors and not quiet:
        raise errors[0]


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


def _open(driver: Driver | None, ordinal: int, size_bytes: int) -> tuple[Driver, int, int]:
    """Check the size, find the device, retain its primary context: (driver, device, context)."""
    drv = driver or default_driver()
    if size_bytes <= 0:
        raise InvalidArgument("a VRAM buffer must not be empty")
    dev = drv.device(ordinal)
    return drv, dev, drv.retain_context(dev)


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


def device_uuid(ordinal: int, driver: Driver | None = None) -> bytes:
    """The 16-byte UUID of CUDA device ``ordinal`` (stable across processes, unlike ordinals)."""
    drv = driver or default_driver()
    dev = drv.device(ordinal)
    uuid = ctypes.create_string_buffer(16)
    drv.call("cuDeviceGetUuid", uuid, dev)
    return uuid.raw


def device_for_uuid(uuid: bytes, driver: Driver | None = None) -> int:
    """The ordinal of the device with ``uuid`` as this process sees it."""
    drv = driver or default_driver()
    for ordinal in range(drv.device_count()):
        if device_uuid(ordinal, drv) == uuid:
            return ordinal
    raise FailedPrecondition(
        f"no CUDA device with UUID {uuid.hex()} is visible to this broker (check CUDA_VISIBLE_DEVICES: "
        "the broker must see every GPU its engines use)"
    )


# -- an engine's existing allocation --------------------------------------------
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
class _ContextMemory:
    """Device memory held in this process under a retained primary context.
    ``release`` frees it (``_FREE``) and drops the context; idempotent."""

    _FREE: ClassVar[str] = ""
    address: int
    size_bytes: int
    device: int
    context: int
    driver: Driver = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        _attempt_all(
            self.driver,
            [
                ("cuCtxSetCurrent", (ctypes.c_void_p(self.context),)),
                (self._FREE, (self.address,)),
                ("cuDevicePrimaryCtxRelease_v2", (self.device,)),
            ],
        )


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


# -- the broker's own transfer buffers ---------------------------------------------
@dataclass(eq=False)
class DeviceAllocation(_ContextMemory):
    """Device memory allocated here with ``cuMemAlloc`` (what ``cudaMalloc``
    gives): not a VMM allocation, so a NIXL write into it moves over CUDA
    IPC (measured on an H100: a VMM target falls back to TCP on the host)."""

    _FREE: ClassVar[str] = "cuMemFree_v2"

    def make_current(self) -> None:
        """Make the device's primary context (the one this memory lives in) current on this thread."""
        self.driver.call("cuCtxSetCurrent", ctypes.c_void_p(self.context))


def alloc_device(ordinal: int, size_bytes: int, driver: Driver | None = None) -> DeviceAllocation:
    """``size_bytes`` of device memory on ``ordinal`` in its primary context (``cuMemAlloc``)."""
    drv, dev, ctx = _open(driver, ordinal, size_bytes)
    ptr = _u64()
    try:
        drv.call("cuMemAlloc_v2", ctypes.byref(ptr), size_bytes)
    except BaseException:
        with contextlib.suppress(KvBrokerError):
            drv.call("cuDevicePrimaryCtxRelease_v2", dev)
        raise
    return DeviceAllocation(address=ptr.value, size_bytes=size_bytes, device=dev, context=ctx, driver=drv)
