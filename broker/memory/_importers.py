"""Importing engine memory from file descriptors (docs/design.md section 3).

NIXL only registers memory mapped in the agent's own process, so engines hand
their buffers over as file descriptors and the broker maps them:

- DRAM: a memfd (or shm file). :class:`DramImporter` maps it shared, read and
  write, into the broker. The memfd must be sealed against shrinking
  (``F_SEAL_SHRINK``): a buffer its engine could truncate would turn a NIXL
  access into SIGBUS and take the whole broker down. Import only maps it
  (and keeps the fd): the engine table faults every page in once the engine
  is registered, in the background, so registration costs what NIXL's own
  does. :func:`populate` allocates the pages in the file (where the host
  cannot back them, that is an error then, not a SIGBUS later) and maps
  each, zeroing those the engine never touched, without holding the
  process's memory-map lock (about 0.3 s/GiB to allocate and 0.4 s/GiB to
  map fresh pages, on the memory thread).
- VRAM: a CUDA VMM POSIX-fd export (``cuMemCreate`` with
  ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``). :class:`VramImporter`
  imports it (``cuMemImportFromShareableHandle``), maps it into the broker
  (``cuMemAddressReserve`` + ``cuMemMap`` + ``cuMemSetAccess``) on the device
  named by the buffer's UUID, and closes the fd (the imported handle keeps
  the memory alive). Or, for an engine's ``cudaMalloc`` allocation, a CUDA
  IPC handle in the buffer's spec (no fd): opened with
  ``cuIpcOpenMemHandle`` on that device. See :mod:`kvbroker.cudavmm`.
  VRAM is mapped for the broker's own copy kernels only and never
  registered with NIXL (the device path, ``kvbroker.plan``).

An importer owns what it maps; ``ImportedBuffer.release`` unmaps and closes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvbroker import cudavmm
from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

__all__ = [
    "DramImporter",
    "ImportedBuffer",
    "MemoryImporter",
    "VramImporter",
    "array_at",
    "importer_for",
    "map_anonymous",
    "map_memory",
    "populate",
    "unmap",
]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class ImportedBuffer:
    """A buffer mapped into the broker. ``release`` unmaps it; idempotent."""

    address: int
    size_bytes: int
    kind: int
    #: CUDA device ordinal as this broker sees it (0 for DRAM).
    device_id: int
    _unmap: Callable[[], None] = field(repr=False)
    _released: bool = field(default=False, repr=False)
    #: The memfd a DRAM buffer maps (held until ``release``; -1 for VRAM).
    fd: int = -1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._unmap()


class MemoryImporter(Protocol):
    """Maps an engine's exported buffer into this process."""

    def import_buffer(self, fd: int, spec: common_pb2.BufferSpec) -> ImportedBuffer:
        """Map ``fd`` (the importer takes ownership of it, also on error)."""


class DramImporter:
    """Maps memfd/shm file descriptors shared, read-write."""

    def import_buffer(self, fd: int, spec: common_pb2.BufferSpec) -> ImportedBuffer:
        try:
            if spec.size_bytes == 0:
                raise InvalidArgument("a DRAM buffer must not be empty")
            actual = os.fstat(fd).st_size
            if actual < spec.size_bytes:
                raise InvalidArgument(f"the fd holds {actual} bytes but the buffer claims {spec.size_bytes}")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise InvalidArgument(
                    "DRAM buffers must be memfds sealed with F_SEAL_SHRINK (a shrinkable buffer could crash the "
                    "broker); kvbroker.client.memory allocates them that way"
                )
            try:
                # Not MAP_POPULATE: that holds this process's memory-map lock
                # for the whole buffer (seconds for gigabytes), stalling every
                # thread that allocates meanwhile, the event loop included.
                address = map_memory(spec.size_bytes, mmap.MAP_SHARED, fd)
            except OSError as exc:
                raise InvalidArgument(f"cannot map the buffer: {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        size = spec.size_bytes

        def unmap_and_close() -> None:
            unmap(address, size)
            os.close(fd)

        return ImportedBuffer(
            address=address, size_bytes=size, kind=common_pb2.MEMORY_KIND_DRAM, device_id=0, _unmap=unmap_and_close, fd=fd
        )


class VramImporter:
    """Imports CUDA VMM POSIX-fd exports and CUDA IPC handles, on their device
    (``driver``: the CUDA driver; None: libcuda.so.1, loaded at the first import)."""

    def __init__(self, driver: cudavmm.Driver | None) -> None:
        self._driver = driver

    def import_buffer(self, fd: int, spec: common_pb2.BufferSpec) -> ImportedBuffer:
        mapping: cudavmm.VmmMapping | cudavmm.IpcMapping
        try:
            driver = self._driver or cudavmm.default_driver()
            if spec.device_uuid:
                if len(spec.device_uuid) != 16:
                    raise InvalidArgument(f"device_uuid must be 16 bytes, got {len(spec.device_uuid)}")
                ordinal = cudavmm.device_for_uuid(spec.device_uuid, driver)
            else:
                ordinal = spec.device_id
            if spec.cuda_ipc_handle:
                mapping = cudavmm.open_ipc(spec.cuda_ipc_handle, spec.size_bytes, ordinal, driver)
            else:
                mapping = cudavmm.import_buffer(fd, spec.size_bytes, ordinal, driver)
        finally:
            # The imported handle holds the memory; the fd is not needed.
            if fd >= 0:
                os.close(fd)
        return ImportedBuffer(
            address=mapping.address,
            size_bytes=mapping.size_bytes,
            kind=common_pb2.MEMORY_KIND_VRAM,
            device_id=mapping.device,
            _unmap=mapping.release,
        )


def importer_for(kind: int, cuda_driver: cudavmm.Driver | None) -> MemoryImporter:
    """The importer for a ``MemoryKind`` (``cuda_driver``: the driver VRAM imports use)."""
    if kind == common_pb2.MEMORY_KIND_DRAM:
        return DramImporter()
    if kind == common_pb2.MEMORY_KIND_VRAM:
        return VramImporter(cuda_driver)
    raise InvalidArgument(f"buffer kind {kind} is not DRAM or VRAM")


def map_memory(
    size_bytes: int, flags: int, fd: int = -1, *, address: int | None = None, prot: int = mmap.PROT_READ | mmap.PROT_WRITE
) -> int:
    """``mmap(2)`` at any address (or ``address``, with ``MAP_FIXED`` in ``flags``); ``OSError`` on failure."""
    addr = _libc.mmap(address, size_bytes, prot, flags, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {size_bytes} bytes: {os.strerror(err)}")
    return int(addr)


_MADV_POPULATE_WRITE = 23
#: Bytes per ``MADV_POPULATE_WRITE`` call where there is no file to allocate in.
_POPULATE_STEP = 8 << 20
_PAGE = mmap.PAGESIZE
#: fallocate errors that mean "not this file" (not "no memory"): fault in by madvise instead.
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENODEV, errno.ESPIPE, errno.EPERM})
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def populate(address: int, size_bytes: int, fd: int = -1, offset: int = 0) -> None:
    """Fault in every page of ``size_bytes`` of a shared mapping at ``address``
    (of ``fd`` from ``offset``), writable, without holding this process's
    memory-map lock. ``OSError`` if the host cannot back it; the data is
    never changed.

    Every thread that maps or unmaps memory needs that lock written (malloc's
    ``brk`` on the control loop, gRPC's and Python's arenas), and
    ``MADV_POPULATE_WRITE`` holds it read while it allocates and zeroes: the
    control loop stalled behind each step for as long as the step took, or
    longer when the memory thread was preempted in it (13-80 ms at a time
    warming 4 GiB, ``perf`` showed it waiting in ``brk``). So the file's
    pages are allocated first (``fallocate``, under the file's own lock only:
    a host that cannot back them is an error here, not a SIGBUS at the first
    touch), then each page is read once (numpy, the GIL released), each fault
    under its mapping's own lock (per-VMA locks; before Linux 6.4, the
    memory-map lock read for one page). Without a file, or one ``fallocate``
    does not serve, ``MADV_POPULATE_WRITE`` in ``_POPULATE_STEP`` steps
    (before Linux 5.14, one read per page)."""
    if fd >= 0:
        if _libc.fallocate(fd, 0, offset, size_bytes) == 0:
            _read_every_page(address, size_bytes)
            return
        err = ctypes.get_errno()
        if err not in _NO_FALLOCATE:
            raise OSError(err, os.strerror(err))
    step = 0
    while step < size_bytes:
        length = min(_POPULATE_STEP, size_bytes - step)
        if _libc.madvise(address + step, length, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL and step == 0:
                _read_every_page(address, size_bytes)
                return
            raise OSError(err, os.strerror(err))
        step += length


def _read_every_page(address: int, size_bytes: int) -> None:
    """Read a byte of every page: one numpy copy, which releases the GIL meanwhile."""
    pages = array_at(address, size_bytes)[::_PAGE]
    np.copyto(np.empty(pages.shape, np.uint8), pages)


def map_anonymous(size_bytes: int) -> int:
    """Map ``size_bytes`` of zeroed, populated, shared memory for the broker's own use."""
    return map_memory(size_bytes, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


def unmap(address: int, size_bytes: int) -> None:
    _libc.munmap(address, size_bytes)


def array_at(address: int, size_bytes: int) -> npt.NDArray[np.uint8]:
    """A numpy uint8 view of mapped host memory (no copy; valid while mapped)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size_bytes).from_address(address))
