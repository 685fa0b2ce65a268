"""The Triton path of the device CRC-32 (``_devcrc.backend`` chooses it): a one-element
fill and one kernel launch, whatever the size.

The message is seen as ``pad`` zero bytes followed by the data, ``pad`` making the whole
a multiple of ``CHUNK`` (leading zero bytes leave the raw CRC 0, and are never read: the
loads are masked). Program c takes chunk c, ``LANES`` lanes of ``LANE`` bytes, one lane
per element of its vectors: each lane folds ``WIDTH`` bytes per step into its register
(slicing-by-WIDTH: byte p of the step, XOR byte p of the register for p < 4, selects row
``(WIDTH - 1 - p) * 256 + byte``, the raw CRC of that byte followed by the step's later
bytes as zeros; the rows are XOR-ed). Each lane's register is then advanced over the
lanes after it in the chunk (its own 4 lookups of 256 entries: a 32x32 GF(2) matrix, one
table per byte of the register), the lanes are XOR-ed into one, that is advanced over
the chunks after it (one such matrix per set bit of their count), and XOR-ed atomically
into the result, which the fill set to zlib's conditioning.

Imported only where ``triton`` is installed. Under ``TRITON_INTERPRET=1`` the same
kernel runs in Triton's interpreter, on CPU tensors too (the unit tests).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

# Untyped (or, without triton, missing: this module is then never imported).
import triton  # type: ignore[import-not-found, import-untyped, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, import-untyped, unused-ignore]

from kvbroker.broker.device._gf2 import byte_table, matrix, zero_bytes

__all__ = ["LAUNCHES", "crc32_triton"]

LANES = 256
"""Lanes per program (a power of two)."""
LANE = 64
"""Bytes per lane (a multiple of WIDTH)."""
WIDTH = 16
"""Bytes of each lane read per step (a power of two, at least 4)."""
CHUNK = LANES * LANE
"""Bytes per program."""
CHUNK_BITS = 18
"""Bits of a chunk's distance to the end: inputs up to ``CHUNK << CHUNK_BITS`` bytes (4 GiB)."""
LAUNCHES = 2
"""Launches per call: the fill of the result, and the kernel."""


def _xor(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    return a ^ b


# Made a JITFunction whatever the mode, not by triton.jit: the compiler needs one, and the
# interpreter calls its function. (Triton's own tl.xor_sum is jitted when triton.language
# is first imported, and fails in the interpreter if that was without TRITON_INTERPRET=1;
# torch imports triton early, e.g. for a TorchDispatchMode.)
_xor_combine = triton.JITFunction(_xor)


def _crc32_kernel(
    data: tl.tensor,
    pad: tl.tensor,
    bits: tl.tensor,
    steps: tl.tensor,
    lanes: tl.tensor,
    chunk_tables: tl.tensor,
    out: tl.tensor,
    LANES: tl.constexpr,
    LANE: tl.constexpr,
    WIDTH: tl.constexpr,
) -> None:
    chunk = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, LANES)
    start = chunk * (LANES * LANE) + lane.to(tl.int64) * LANE - pad
    crc = tl.full([LANES], 0, dtype=tl.uint32)
    for k in range(0, LANE, WIDTH):
        # Byte p of the step (XOR byte p of the register, p < 4) selects row
        # (WIDTH - 1 - p) * 256 + byte: its raw CRC advanced over the step's later bytes.
        step = tl.full([LANES], 0, dtype=tl.uint32)
        for p in tl.static_range(WIDTH):
            at = start + (k + p)
            byte = tl.load(data + at, mask=at >= 0, other=0).to(tl.uint32)
            if p < 4:
                byte = byte ^ ((crc >> (8 * p)) & 0xFF)
            row = tl.load(steps + ((WIDTH - 1 - p) * 256 + byte).to(tl.int32))
            step = step ^ row.to(tl.uint32, bitcast=True)
        crc = step
    # Lane t advanced over the LANES - 1 - t lanes after it: 4 lookups in its own table
    # (entry j * 256 + v: the advanced value of byte j = v).
    own = lanes + lane * 1024
    crc = (
        tl.load(own + (crc & 0xFF).to(tl.int32))
        ^ tl.load(own + (256 + ((crc >> 8) & 0xFF)).to(tl.int32))
        ^ tl.load(own + (512 + ((crc >> 16) & 0xFF)).to(tl.int32))
        ^ tl.load(own + (768 + (crc >> 24)).to(tl.int32))
    ).to(tl.uint32, bitcast=True)
    total = tl.reduce(crc, 0, _xor_combine)
    # The chunk advanced over the chunks after it, one set bit b of their count at a
    # time (table b: the advance over 2**b chunks).
    after = tl.num_programs(0).to(tl.int64) - 1 - chunk
    for b in range(bits):
        table = chunk_tables + b * 1024
        moved = (
            tl.load(table + (total & 0xFF).to(tl.int32))
            ^ tl.load(table + (256 + ((total >> 8) & 0xFF)).to(tl.int32))
            ^ tl.load(table + (512 + ((total >> 16) & 0xFF)).to(tl.int32))
            ^ tl.load(table + (768 + (total >> 24)).to(tl.int32))
        ).to(tl.uint32, bitcast=True)
        total = tl.where(((after >> b) & 1) != 0, moved, total)
    tl.atomic_xor(out, total.to(tl.int64))


_OPTIONS = {"enable_fp_fusion": False}
"""Compile options: no floating point here, and saying so spares Triton 3.9's warning
about its default (a test error under -W error)."""

_kernels: dict[bool, Any] = {}
_lock = threading.Lock()


def _interpreting() -> bool:
    """What ``triton.jit`` reads to choose between compiling and interpreting."""
    if hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel() -> Any:
    """The kernel, jitted for the mode in force (compiled, or interpreted). The pad and
    the bit count are not specialized on: one compiled kernel serves every size."""
    mode = _interpreting()
    kernel = _kernels.get(mode)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(mode)
            if kernel is None:
                kernel = triton.jit(_crc32_kernel, do_not_specialize=["pad", "bits"])
                _kernels[mode] = kernel
    return kernel


@functools.cache
def _host_tables() -> tuple[npt.NDArray[np.int32], ...]:
    """(steps, lanes, chunks): WIDTH * 256 rows; LANES and CHUNK_BITS advances as
    4 tables of 256 entries each (one per byte of the register)."""
    rows = np.empty((WIDTH, 256), dtype=np.uint32)
    rows[0] = byte_table()
    for e in range(1, WIDTH):
        rows[e] = zero_bytes(rows[e - 1], 1)
    lanes = [_byte_tables(matrix((LANES - 1 - t) * LANE)) for t in range(LANES)]
    chunks = [_byte_tables(matrix(CHUNK << b)) for b in range(CHUNK_BITS)]
    return tuple(np.stack(list(t)).reshape(-1).view(np.int32) for t in (rows, lanes, chunks))


def _byte_tables(matrix: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint32]:
    """(4, 256): entry j, v is ``matrix`` applied to ``v << 8j`` (rows of bits in, as
    ``_gf2.matrix`` makes them)."""
    values = np.arange(256, dtype=np.uint32)
    bits = ((values[:, None] >> np.arange(8, dtype=np.uint32)) & 1).astype(np.int64)
    weights = np.uint32(1) << np.arange(32, dtype=np.uint32)
    tables = np.empty((4, 256), dtype=np.uint32)
    for j in range(4):
        image = (bits @ matrix[8 * j : 8 * j + 8].astype(np.int64)) & 1  # (256, 32)
        tables[j] = (image.astype(np.uint32) * weights).sum(axis=1, dtype=np.uint32)
    return tables


_device_tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    tables = _device_tables.get(device)
    if tables is None:
        with _lock:
            tables = _device_tables.get(device)
            if tables is None:
                tables = tuple(torch.from_numpy(t).to(device) for t in _host_tables())
                _device_tables[device] = tables
    return tables


def crc32_triton(data: torch.Tensor, conditioning: int) -> torch.Tensor:
    """The raw CRC-32 of ``data`` (1-D uint8, not empty) XOR ``conditioning``, as a
    0-dim int64 tensor on ``data``'s device, queued on its current stream."""
    n = data.numel()
    chunks = -(-n // CHUNK)
    if chunks > 1 << CHUNK_BITS:
        raise ValueError(f"crc32 input of {n} bytes is too long")
    steps, lanes, chunk_tables = _tables(data.device)
    out = torch.full((), conditioning, dtype=torch.int64, device=data.device)
    pad = chunks * CHUNK - n
    bits = (chunks - 1).bit_length()
    args = (data, pad, bits, steps, lanes, chunk_tables, out)
    # Triton launches on the current device (on its current stream): make it data's.
    guard: contextlib.AbstractContextManager[Any] = (
        torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext()
    )
    with guard:
        _launch(_kernel(), chunks, *args, LANES=LANES, LANE=LANE, WIDTH=WIDTH, **_OPTIONS)
    return out


def _launch(kernel: Any, programs: int, *args: Any, **constants: Any) -> None:
    """One launch of ``kernel`` over ``programs`` programs (the one place that launches:
    tests count here)."""
    kernel[(programs,)](*args, **constants)
