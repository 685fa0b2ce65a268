"""kvbroker's VMM allocator as a ``torch.cuda.MemPool``: the fast path for engines' allocator hooks.

An engine that allocates its KV cache inside ``torch.cuda.use_mem_pool(mem_pool(device))``
gets memory made by ``native/vmm_allocator.c``: one CUDA VMM allocation per
segment, with the POSIX-fd handle type, which ``EngineMemory.adopt`` hands
to the broker as an fd (the broker maps it and holds a reference, so it
outlives an engine that dies mid-transfer). vLLM's connector offers it
through ``get_mem_pool_context``, SGLang's backend through SGLang's custom
memory pool setting.

torch loads allocators from a shared library (``CUDAPluggableAllocator``),
so the C source ships with the package and is compiled with the host's C
compiler (``$CC``, default ``cc``; no CUDA headers needed: the driver is
opened with ``dlopen``) into ``$KVBROKER_NATIVE_CACHE`` (default
``~/.cache/kvbroker/native``), once per source version.

Status: the C allocator is compiled and driven against the scripted fake
CUDA driver on CPU (tests/unit/test_vmmpool.py); the MemPool has never run
on a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from kvbroker.errors import FailedPrecondition

__all__ = ["SOURCE", "library_path", "load", "mem_pool"]

SOURCE = Path(__file__).parent / "native" / "vmm_allocator.c"
MALLOC, FREE = "kvbroker_vmm_malloc", "kvbroker_vmm_free"
_lock = threading.Lock()
_pools: dict[int, Any] = {}


def library_path() -> Path:
    """The compiled allocator, built on first use (``FailedPrecondition`` with
    the compiler's output if it cannot be)."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = Path(os.environ.get("KVBROKER_NATIVE_CACHE") or Path.home() / ".cache" / "kvbroker" / "native")
    target = cache / f"vmm_allocator-{digest}.so"
    with _lock:
        if target.exists():
            return target
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        compiler = os.environ.get("CC", "cc")
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl", "-lpthread"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except OSError as exc:
            raise FailedPrecondition(f"kvbroker's VMM allocator needs a C compiler ({compiler}): {exc}") from exc
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise FailedPrecondition(f"compiling kvbroker's VMM allocator failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        partial.replace(target)
        return target


def load() -> ctypes.CDLL:
    """The allocator library, loaded into this process."""
    lib = ctypes.CDLL(str(library_path()))
    lib.kvbroker_vmm_malloc.restype = ctypes.c_void_p
    lib.kvbroker_vmm_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.kvbroker_vmm_free.restype = None
    lib.kvbroker_vmm_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.kvbroker_vmm_live.restype = ctypes.c_size_t
    return lib


def mem_pool(device: int) -> Any:
    """A ``torch.cuda.MemPool`` on CUDA device ``device`` whose segments are
    kvbroker VMM allocations (one per device, made once)."""
    import torch

    if not torch.cuda.is_available():
        raise FailedPrecondition("kvbroker's VMM memory pool needs CUDA; torch sees no CUDA device")
    with _lock:
        pool = _pools.get(device)
    if pool is not None:
        return pool
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(library_path()), MALLOC, FREE)
    with torch.cuda.device(device):
        pool = torch.cuda.MemPool(allocator.allocator())  # type: ignore[no-untyped-call]
    with _lock:
        return _pools.setdefault(device, pool)
