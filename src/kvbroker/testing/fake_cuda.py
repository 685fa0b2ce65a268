"""A scripted stand-in for the CUDA driver's VMM calls (``libcuda.so.1``).

:class:`FakeCudaLib` has the functions :mod:`kvbroker.cudavmm` calls, with
the driver's conventions (``CUresult`` return codes, outputs through
``byref``), and keeps books: physical allocations and their references,
reserved and mapped address ranges, access grants, exported fds (real
memfds, so they pass through sockets like the driver's), primary-context
references. :meth:`FakeCudaLib.leaks` lists whatever is still held, so a
test can show that every path releases what it took. ``fail`` makes a call
return an error code, to drive the cleanup paths.

"Device memory" is host memory: each physical allocation is a memfd, and
``cuMemMap`` maps it (shared, at the reserved address), so an exporter's
and an importer's mappings show the same bytes, as they would on a GPU.
That lets the broker's VRAM code paths (import, registration, descriptors,
release) run against the fake NIXL agent, which copies with ``memmove``.
:func:`as_fake_vram` turns an engine's host buffer into such an allocation.
It tests the call sequence, the bookkeeping and the broker's handling of
VRAM buffers, not CUDA.

:meth:`FakeCudaLib.memory_kind` says what kind of device allocation an
address lies in; the fake NIXL agent asks it, to follow what a real GPU
showed (../shared/gpu/README.md, an H100 with UCX): a pointer opened from a
CUDA IPC handle cannot be registered with NIXL, and a write whose target is
a VMM allocation (own or imported) moves at host speed (TCP on the host,
about 0.45 GB/s) while a ``cuMemAlloc`` target moves over CUDA IPC.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvbroker.broker.memory import map_memory, unmap
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.client.memory import EngineMemory

__all__ = ["FakeCudaLib", "as_fake_vram"]

_MAP_FIXED = 0x10
_PROT_NONE = 0
_MAP_NORESERVE = 0x4000
_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
_ERROR_NAMES = {1: b"CUDA_ERROR_INVALID_VALUE", 2: b"CUDA_ERROR_OUT_OF_MEMORY", 101: b"CUDA_ERROR_INVALID_DEVICE"}


def _value(arg: Any) -> Any:
    return arg.value if hasattr(arg, "value") else arg


def _out(arg: Any) -> Any:
    """The ctypes object behind a ``byref`` argument."""
    return arg._obj


class FakeCudaLib:
    """The CUDA driver's VMM surface, in Python, with books kept."""

    def __init__(self, devices: int = 2, granularity: int = 2 << 20, rdma: bool = True, *, foreign_fds: bool = False) -> None:
        self.devices = devices
        #: Whether ``cuMemImportFromShareableHandle`` takes a memfd this driver never
        #: exported as a new allocation of its size: a broker process's driver, for
        #: engines in another process with fake drivers of their own (each process's
        #: books are its own there, as its driver's would be on a GPU).
        self.foreign_fds = foreign_fds
        self.granularity_bytes = granularity
        self.rdma = rdma
        #: What each device says its memory is (cuDeviceTotalMem).
        self.total_bytes = 80 << 30
        #: call name -> CUresult to return instead of succeeding (once each time it is called).
        self.fail: dict[str, int] = {}
        self.calls: list[str] = []
        self.initialised = False
        self.sizes: dict[int, int] = {}
        self.refs: Counter[int] = Counter()
        self.reserved: dict[int, int] = {}
        self.mapped: dict[int, tuple[int, int]] = {}
        self.access: dict[int, tuple[int, int]] = {}
        self.contexts: Counter[int] = Counter()
        self.current: int | None = None
        self.created: list[dict[str, int]] = []
        self._exported: dict[int, int] = {}
        #: handle -> the memfd behind the allocation (closed when the last reference goes).
        self._backing: dict[int, int] = {}
        self._handles = itertools.count(0x1000)
        #: handle -> the handle types it was created with.
        self.handle_types: dict[int, int] = {}
        #: cuMemAlloc allocations (not VMM): base -> (size, device, memfd).
        self.legacy: dict[int, tuple[int, int, int]] = {}
        #: IPC handles given out: id -> the base they name.
        self._ipc: dict[int, int] = {}
        #: IPC handles opened here: address -> (size, device).
        self.opened: dict[int, tuple[int, int]] = {}

    def adopt(self, fd: int, size: int) -> int:
        """Make the memfd ``fd`` (``size`` bytes) a physical allocation and export it: the exported fd."""
        if size % self.granularity_bytes:
            raise ValueError(f"{size} is not a multiple of the fake granularity {self.granularity_bytes}")
        handle = next(self._handles)
        self.sizes[handle] = size
        self._backing[handle] = os.dup(fd)
        exported = os.dup(fd)
        self._exported[os.fstat(exported).st_ino] = handle
        return exported

    def _drop(self, handle: int) -> None:
        self.refs[handle] -= 1
        if self.refs[handle] <= 0:
            os.close(self._backing.pop(handle))

    # -- what a test checks ------------------------------------------------
    def leaks(self) -> list[str]:
        """What is still held: empty once everything was released."""
        out = [f"allocation {h:#x} ({n} references)" for h, n in self.refs.items() if n]
        out += [f"mapping at {a:#x}" for a in self.mapped]
        out += [f"address range at {a:#x}" for a in self.reserved]
        out += [f"primary context of device {d} ({n} references)" for d, n in self.contexts.items() if n]
        out += [f"opened IPC allocation at {a:#x}" for a in self.opened]
        return out

    def memory_kind(self, address: int, size: int) -> str:
        """What ``[address, address + size)`` lies in: ``"cudaMalloc"`` (``cuMemAlloc``),
        ``"vmm"`` (a ``cuMemMap`` mapping of a VMM allocation), ``"ipc"`` (opened from
        a CUDA IPC handle), or ``"unknown"``."""
        for kind, ranges in (
            ("cudaMalloc", [(a, n) for a, (n, _, _) in self.legacy.items()]),
            ("vmm", [(a, n) for a, (_, n) in self.mapped.items()]),
            ("ipc", [(a, n) for a, (n, _) in self.opened.items()]),
        ):
            if any(a <= address and address + size <= a + n for a, n in ranges):
                return kind
        return "unknown"

    def _device_of_current(self) -> int:
        return (self.current or 0xC7000) - 0xC7000

    def uuid_of(self, ordinal: int) -> bytes:
        return bytes([0xC0, ordinal]) + bytes(14)

    # -- the driver's functions -------------------------------------------
    def __getattr__(self, name: str) -> Any:
        impl = getattr(type(self), "_" + name, None)
        if impl is None:
            raise AttributeError(name)

        def call(*args: Any) -> int:
            self.calls.append(name)
            code = self.fail.get(name)
            if code:
                return code
            return impl(self, *args) or 0

        return call

    def _cuInit(self, flags: Any) -> None:
        self.initialised = True

    def _cuGetErrorName(self, code: Any, out: Any) -> int:
        _out(out).value = _ERROR_NAMES.get(_value(code), b"CUDA_ERROR_UNKNOWN")
        return 0

    def _cuDeviceGetCount(self, out: Any) -> None:
        _out(out).value = self.devices

    def _cuDeviceGet(self, out: Any, ordinal: Any) -> int:
        if not 0 <= _value(ordinal) < self.devices:
            return 101
        _out(out).value = _value(ordinal)
        return 0

    def _cuDeviceGetUuid(self, out: Any, dev: Any) -> None:
        ctypes.memmove(out, self.uuid_of(_value(dev)), 16)

    def _cuDeviceGetAttribute(self, out: Any, attribute: Any, dev: Any) -> None:
        _out(out).value = int(self.rdma)

    def _cuDeviceTotalMem_v2(self, out: Any, dev: Any) -> None:
        _out(out).value = self.total_bytes

    def _cuDevicePrimaryCtxRetain(self, out: Any, dev: Any) -> None:
        self.contexts[_value(dev)] += 1
        _out(out).value = 0xC7000 + _value(dev)

    def _cuDevicePrimaryCtxRelease_v2(self, dev: Any) -> int:
        if self.contexts[_value(dev)] <= 0:
            return 1
        self.contexts[_value(dev)] -= 1
        return 0

    def _cuCtxSetCurrent(self, ctx: Any) -> None:
        self.current = _value(ctx)

    def _cuMemGetAllocationGranularity(self, out: Any, prop: Any, option: Any) -> None:
        _out(out).value = self.granularity_bytes

    def _cuMemCreate(self, out: Any, size: Any, prop: Any, flags: Any) -> int:
        p = _out(prop)
        if _value(size) % self.granularity_bytes or self.current is None:
            return 1
        handle = next(self._handles)
        self.sizes[handle] = _value(size)
        self.refs[handle] += 1
        backing = os.memfd_create("fake-cuda-allocation", os.MFD_CLOEXEC)
        os.ftruncate(backing, _value(size))
        self._backing[handle] = backing
        self.handle_types[handle] = p.requestedHandleTypes
        self.created.append(
            {
                "device": p.location.id,
                "handle_types": p.requestedHandleTypes,
                "rdma": p.allocFlags.gpuDirectRDMACapable,
                "size": _value(size),
            }
        )
        _out(out).value = handle
        return 0

    def _cuMemRelease(self, handle: Any) -> int:
        if self.refs[_value(handle)] <= 0:
            return 1
        self._drop(_value(handle))
        return 0

    def _cuMemAddressReserve(self, out: Any, size: Any, align: Any, addr: Any, flags: Any) -> None:
        address = map_memory(_value(size), _RESERVE_FLAGS, prot=_PROT_NONE)
        self.reserved[address] = _value(size)
        _out(out).value = address

    def _cuMemAddressFree(self, address: Any, size: Any) -> int:
        if self.reserved.get(_value(address)) != _value(size) or _value(address) in self.mapped:
            return 1
        del self.reserved[_value(address)]
        unmap(_value(address), _value(size))
        return 0

    def _cuMemMap(self, address: Any, size: Any, offset: Any, handle: Any, flags: Any) -> int:
        a, n, h = _value(address), _value(size), _value(handle)
        if self.reserved.get(a) != n or self.refs[h] <= 0 or n > self.sizes[h] or n % self.granularity_bytes:
            return 1
        map_memory(n, mmap.MAP_SHARED | _MAP_FIXED, self._backing[h], address=a)
        self.mapped[a] = (h, n)
        self.refs[h] += 1
        return 0

    def _cuMemUnmap(self, address: Any, size: Any) -> int:
        entry = self.mapped.pop(_value(address), None)
        if entry is None:
            return 1
        # Back to a reserved, inaccessible range.
        map_memory(entry[1], _RESERVE_FLAGS | _MAP_FIXED, address=_value(address), prot=_PROT_NONE)
        self._drop(entry[0])
        self.access.pop(_value(address), None)
        return 0

    def _cuMemSetAccess(self, address: Any, size: Any, desc: Any, count: Any) -> int:
        if _value(address) not in self.mapped:
            return 1
        d = _out(desc)
        self.access[_value(address)] = (d.location.id, d.flags)
        return 0

    def _cuMemExportToShareableHandle(self, out: Any, handle: Any, handle_type: Any, flags: Any) -> int:
        if self.refs[_value(handle)] <= 0:
            return 1
        if not self.handle_types.get(_value(handle), 1) & _value(handle_type):
            return 1  # created without that handle type
        fd = os.dup(self._backing[_value(handle)])
        self._exported[os.fstat(fd).st_ino] = _value(handle)
        _out(out).value = fd
        return 0

    def _cuMemImportFromShareableHandle(self, out: Any, os_handle: Any, handle_type: Any) -> int:
        try:
            handle = self._exported.get(os.fstat(_value(os_handle)).st_ino)
        except OSError:
            return 1
        if handle is None or handle not in self._backing:
            if not self.foreign_fds:
                return 1
            handle = self._foreign(_value(os_handle))
        self.refs[handle] += 1
        _out(out).value = handle
        return 0

    def _foreign(self, fd: int) -> int:
        """A memfd another process's fake driver exported: a new allocation of its size here."""
        handle = next(self._handles)
        self.sizes[handle] = os.fstat(fd).st_size
        self._backing[handle] = os.dup(fd)
        self._exported[os.fstat(fd).st_ino] = handle
        return handle

    # -- allocations the engine made itself ----------------------------------
    def _cuMemAlloc_v2(self, out: Any, size: Any) -> int:
        """``cudaMalloc``'s allocation: not VMM; shareable through IPC handles only."""
        n = _value(size)
        backing = os.memfd_create("fake-cuda-malloc", os.MFD_CLOEXEC)
        os.ftruncate(backing, n)
        address = map_memory(n, mmap.MAP_SHARED, backing)
        self.legacy[address] = (n, self._device_of_current(), backing)
        _out(out).value = address
        return 0

    def _cuMemFree_v2(self, address: Any) -> int:
        entry = self.legacy.pop(_value(address), None)
        if entry is None:
            return 1
        unmap(_value(address), entry[0])
        os.close(entry[2])
        return 0

    def _ranges(self) -> list[tuple[int, int, int]]:
        """Every device address range known here: (base, size, device)."""
        out = [(a, n, d) for a, (n, d, _) in self.legacy.items()]
        out += [(a, n, self.access.get(a, (0, 0))[0]) for a, (_, n) in self.mapped.items()]
        out += [(a, n, d) for a, (n, d) in self.opened.items()]
        return out

    def _find(self, ptr: int) -> tuple[int, int, int] | None:
        return next(((a, n, d) for a, n, d in self._ranges() if a <= ptr < a + n), None)

    def _cuMemGetAddressRange_v2(self, base: Any, size: Any, ptr: Any) -> int:
        found = self._find(_value(ptr))
        if found is None:
            return 1
        _out(base).value, _out(size).value = found[0], found[1]
        return 0

    def _cuPointerGetAttribute(self, out: Any, attribute: Any, ptr: Any) -> int:
        found = self._find(_value(ptr))
        if found is None:
            return 1
        _out(out).value = found[2]
        return 0

    def _cuMemRetainAllocationHandle(self, out: Any, address: Any) -> int:
        entry = self.mapped.get(_value(address))
        if entry is None:
            return 1  # not the start of a VMM mapping
        self.refs[entry[0]] += 1
        _out(out).value = entry[0]
        return 0

    def _cuIpcGetMemHandle(self, out: Any, address: Any) -> int:
        if _value(address) not in self.legacy:
            return 1
        ident = next(self._handles)
        self._ipc[ident] = _value(address)
        ctypes.memmove(ctypes.addressof(_out(out)), b"fake-ipc" + ident.to_bytes(8, "little") + bytes(48), 64)
        return 0

    def _cuIpcOpenMemHandle_v2(self, out: Any, handle: Any, flags: Any) -> int:
        raw = bytes(handle)
        base = self._ipc.get(int.from_bytes(raw[8:16], "little")) if raw.startswith(b"fake-ipc") else None
        if base is None or base not in self.legacy:
            return 1
        n, _, backing = self.legacy[base]
        address = map_memory(n, mmap.MAP_SHARED, backing)
        self.opened[address] = (n, self._device_of_current())
        _out(out).value = address
        return 0

    def _cuIpcCloseMemHandle(self, address: Any) -> int:
        entry = self.opened.pop(_value(address), None)
        if entry is None:
            return 1
        unmap(_value(address), entry[0])
        return 0


def as_fake_vram(memory: EngineMemory, fake: FakeCudaLib, device: int = 0) -> None:
    """Hand ``memory``'s host buffer to the broker as a VRAM buffer of ``fake``'s device ``device``.

    The engine's tensors stay views of the same bytes, so a test fills and
    checks them as usual while the broker imports, registers and moves them as
    VRAM. ``fake``'s granularity must divide the buffer size (4096 does).
    """
    (fd, spec), = memory.take_fds()
    try:
        exported = fake.adopt(fd, spec.size_bytes)
    finally:
        os.close(fd)
    memory.buffers = [
        (
            exported,
            common_pb2.BufferSpec(
                size_bytes=spec.size_bytes,
                kind=common_pb2.MEMORY_KIND_VRAM,
                device_id=device,
                device_uuid=fake.uuid_of(device),
            ),
        )
    ]
