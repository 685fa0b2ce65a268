"""The CUDA driver (``libcuda.so.1``) through ctypes: the calls kvbroker makes, and plain device memory.

:class:`Driver` makes every call and checks it (tests replace its library
with a scripted fake); with it: the ``cuda.h`` constants and structures the
calls take, the process's default driver, the devices by UUID (stable across
processes, unlike ordinals), and device memory held under a retained primary
context: :class:`DeviceAllocation` (:func:`alloc_device`, ``cuMemAlloc``),
the broker's own transfer buffers, the device memory NIXL sees. VMM
allocations shared as fds are ``_vmm``'s; CUDA IPC and an engine's existing
allocations, ``_ipc``'s.
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
    "DeviceAllocation",
    "Driver",
    "IpcMemHandle",
    "alloc_device",
    "default_driver",
    "device_for_uuid",
    "device_uuid",
    "driver_present",
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


# -- what every kind of device memory here shares ----------------------------------
def _open(driver: Driver | None, ordinal: int, size_bytes: int) -> tuple[Driver, int, int]:
    """Check the size, find the device, retain its primary context: (driver, device, context)."""
    drv = driver or default_driver()
    if size_bytes <= 0:
        raise InvalidArgument("a VRAM buffer must not be empty")
    dev = drv.device(ordinal)
    return drv, dev, drv.retain_context(dev)


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
