"""zlib-compatible CRC-32 of a uint8 tensor, computed on the tensor's own device.

The broker checksums transfer slots of up to a few hundred MiB that live in GPU
memory; copying them to the host only to run ``zlib.crc32`` would cost a full
device-to-host transfer. This module computes the same value (``zlib.crc32(bytes(data),
value)``) on whatever device ``data`` is on, in a number of launches that does not
depend on the size (:func:`launches_for`): 2 (a fill and one kernel, ``_devcrc_triton``)
where Triton is installed and ``data`` is on a GPU (or ``TRITON_INTERPRET=1`` is set),
else :data:`TORCH_LAUNCHES` torch operations (CPU, or a GPU without Triton). Only the
32-bit result is read back; nothing but the lookup tables (uploaded once per device,
:func:`prepare`) goes to the device.

The math: the raw CRC register (no pre/post conditioning) is linear over GF(2), so for
messages A and B, ``raw(A || B) = shift_|B|(raw(A)) ^ raw(B)``, where ``shift_k`` is the
32x32 GF(2) matrix that advances the register over k zero bytes; leading zero bytes
leave it 0; and ``zlib.crc32(M, prev) = raw(M) ^ shift_|M|(~prev) ^ 0xFFFFFFFF``.

The torch path holds a register as its 32 bits, one per column of a float row (each 0
or 1), and XORs by summing and reducing mod 2 (``remainder``): one ``embedding_bag``
(the sum of table rows per bag) or one matrix product then XORs any number of terms, so
the number of operations is fixed. Every sum is an integer below 2**24 (exact in
float32), and every sum made in bf16 and every input of a matrix product is at most
256 (exact in bf16 and tf32), so reduced-precision settings cannot change a result.

1. The body (the last ``n - h`` bytes, ``h = n % LANE_BYTES``) is cut into lanes of
   ``LANE_BYTES``, processed together in ``STEPS`` steps of ``STEP_BYTES`` bytes each.
   A step sums, per lane, the rows of its bytes in one table (row ``e * 256 + v``: the
   bits of the raw CRC of byte v followed by e zero bytes) in one bf16 ``embedding_bag``,
   adds the lane's state advanced over the step (``addmm_`` with the matrix of
   ``shift_STEP_BYTES``) and reduces mod 2.
2. The head (the first h bytes) is one bag of fewer than STEP_BYTES bytes and up to
   STEPS - 1 bags of STEP_BYTES, summed by one ``embedding_bag`` and combined by one
   matrix product (each bag advanced over the bags after it). It is one more lane, in
   front of the first (as if padded with leading zero bytes).
3. The lanes are combined in ``len(FAN_IN)`` levels. Level k groups ``FAN_IN[k]`` items
   (zero items in front where needed: their raw CRC is 0) and, in one float32 matrix
   product, sums each item advanced over the items after it in its group.
4. The 32 bits are weighed into the integer (float64) and XOR-ed with zlib's conditioning.

Scratch on the device: about 0.8 times the input's size at the peak (a step's int32
indices, half the input, and the lanes' states). A caller short of memory can hash a slot in pieces and
chain them (``crc32(b, crc32(a)) == zlib.crc32(a + b)``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import sys
import threading
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from kvbroker.broker.device._gf2 import MASK, bits, byte_table, conditioning, matrix, zero_bytes

__all__ = [
    "LANE_BYTES",
    "MAX_BYTES",
    "TORCH_LAUNCHES",
    "backend",
    "crc32",
    "crc32_tensor",
    "launches_for",
    "prepare",
]

STEP_BYTES = 128
"""Bytes of each lane summed per step (at most 224: a step's sum, at most STEP_BYTES + 32,
stays exact in bf16)."""
STEPS = 8
"""Steps per lane."""
LANE_BYTES = STEP_BYTES * STEPS
"""Bytes per lane."""
FAN_IN = (256, 128, 128)
"""Items combined per group at each level; their product bounds the lanes (+1, the head)."""
MAX_BYTES = math.prod(FAN_IN) * LANE_BYTES - 1
"""The longest input (4 GiB - 1)."""

TORCH_LAUNCHES = 1 + 5 + 2 + 4 * STEPS - 1 + 2 * len(FAN_IN) + 3
"""Torch operations of the torch path for any non-empty input (48): the zeroed scratch;
the head's 5; the bags' offsets and the indices' upper bytes; per step a copy of its
bytes into the indices, a bag sum, an advance (not at the first) and a remainder; 2 per
level; 3 to the integer."""

_log = logging.getLogger(__name__)

if sys.byteorder != "little":  # the torch path writes bytes into int32 indices
    raise ImportError("kvbroker's device CRC-32 needs a little-endian host")

def _stacked(distances: range) -> npt.NDArray[np.float32]:
    """The matrices of ``distances`` (bytes) stacked: (len * 32, 32) float32."""
    return np.concatenate([matrix(d) for d in distances]).astype(np.float32)


@functools.cache
def _host_tables() -> dict[str, npt.NDArray[np.generic]]:
    s, k = STEP_BYTES, STEPS
    # Row e * 256 + v: the bits of the raw CRC of byte v followed by e zero bytes.
    rows = np.empty((s, 256), dtype=np.uint32)
    rows[0] = byte_table()
    for e in range(1, s):
        rows[e] = zero_bytes(rows[e - 1], 1)
    levels = {}
    unit = LANE_BYTES
    for i, fan_in in enumerate(FAN_IN):
        levels[f"level{i}"] = _stacked(range((fan_in - 1) * unit, -1, -unit))
        unit *= fan_in
    j = np.arange(LANE_BYTES)
    starts = np.arange(s)[:, None] + s * np.arange(-1, k - 1)[None, :]
    starts[:, 0] = 0
    return {
        "step": bits(rows.reshape(-1)),
        "advance": matrix(s),
        "head": _stacked(range((k - 1) * s, -1, -s)).astype(np.uint8),
        "head_index": ((LANE_BYTES - 1 - j) % s * 256).astype(np.int32),
        "head_offsets": starts.astype(np.int32),
        "weights": (2.0 ** np.arange(32)).astype(np.float64),
        **levels,
    }


@dataclass(frozen=True)
class _Tables:
    step: torch.Tensor  # (STEP_BYTES * 256, 32) bf16: row e * 256 + v
    advance: torch.Tensor  # (32, 32) bf16: shift_STEP_BYTES
    head: torch.Tensor  # (STEPS * 32, 32) bf16: block i = shift_{(STEPS-1-i) * STEP_BYTES}
    head_index: torch.Tensor  # (LANE_BYTES,) int32: row offsets of the head's bytes
    head_offsets: torch.Tensor  # (STEP_BYTES, STEPS) int32: row r, the head's bag starts
    weights: torch.Tensor  # (32,) float64: 2**j
    levels: tuple[torch.Tensor, ...]  # (FAN_IN[k] * 32, 32) float32


_device_tables: dict[torch.device, _Tables] = {}
_device_lock = threading.Lock()


def _tables(device: torch.device) -> _Tables:
    tables = _device_tables.get(device)
    if tables is None:
        with _device_lock:
            tables = _device_tables.get(device)
            if tables is None:
                on = {name: torch.from_numpy(a).to(device) for name, a in _host_tables().items()}
                for name in ("step", "advance", "head"):
                    on[name] = on[name].to(torch.bfloat16)
                levels = tuple(on.pop(f"level{i}") for i in range(len(FAN_IN)))
                tables = _Tables(levels=levels, **on)
                _device_tables[device] = tables
    return tables


# -- which path, and how many launches -------------------------------------------------


def _interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


_no_triton: set[torch.device] = set()  # devices where prepare() found the kernel wrong


def backend(device: torch.device | str) -> Literal["triton", "torch"]:
    """The path :func:`crc32_tensor` takes for a tensor on ``device``: ``"triton"`` where
    Triton is installed and the device is a GPU (or ``TRITON_INTERPRET=1``: any device,
    interpreted), unless :func:`prepare` found the kernel failing there; else ``"torch"``."""
    device = _indexed(torch.device(device))
    if (device.type == "cuda" or _interpret()) and _triton_installed() and device not in _no_triton:
        return "triton"
    return "torch"


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current CUDA device), as tensors name it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def launches_for(nbytes: int, device: torch.device | str = "cpu") -> int:
    """The device operations (torch operations, and Triton kernels) that
    :func:`crc32_tensor` launches for ``nbytes`` bytes on ``device``: a constant for
    every size from 1 byte to :data:`MAX_BYTES` (1 for an empty input: a fill).

    Not counted: the one-time upload of the lookup tables to a device (and Triton's
    compilation), which :func:`prepare` does ahead of time.
    """
    if nbytes < 0 or nbytes > MAX_BYTES:
        raise ValueError(f"crc32 input of {nbytes} bytes is out of range")
    if nbytes == 0:
        return 1
    if backend(device) == "triton":
        from kvbroker.broker.device._devcrc_triton import LAUNCHES

        return LAUNCHES
    return TORCH_LAUNCHES


def prepare(device: torch.device | str) -> str:
    """Readies ``device`` for checksums now, synchronously, so that no checksum pays for
    it: uploads the lookup tables and, on the Triton path, compiles the kernel (an
    aligned and an unaligned variant) and checks it against zlib on a few inputs; a
    kernel that fails or is wrong is logged and not used on ``device`` again (the torch
    path serves it). Returns the path in use (:func:`backend`). Idempotent."""
    device = _indexed(torch.device(device))
    generator = torch.Generator().manual_seed(0x5EED)
    sample = torch.randint(0, 256, (3 * LANE_BYTES + 77,), dtype=torch.uint8, generator=generator)
    on_device = sample.to(device)
    if backend(device) == "triton":
        try:
            ok = all(
                crc32(on_device[start:], 0x1234)
                == zlib.crc32(sample[start:].numpy().tobytes(), 0x1234)
                for start in (0, 1)
            )
        except Exception:
            _log.exception("crc32: the Triton kernel failed on %s; using the torch path", device)
            ok = False
        if not ok:
            _log.error("crc32: the Triton kernel is wrong on %s; using the torch path", device)
            _no_triton.add(device)
    if backend(device) == "torch":
        expected = zlib.crc32(sample.numpy().tobytes())
        if crc32(on_device) != expected:
            raise RuntimeError(f"crc32 on {device} disagrees with zlib")
    return backend(device)


# -- the checksum ----------------------------------------------------------------------


def _check(data: torch.Tensor) -> None:
    if data.dtype != torch.uint8:
        raise TypeError(f"crc32 needs a uint8 tensor, not {data.dtype}")
    if data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"crc32 needs a 1-D contiguous tensor (shape {tuple(data.shape)})")
    if data.numel() > MAX_BYTES:
        raise ValueError(f"crc32 input of {data.numel()} bytes is too long (at most {MAX_BYTES})")


def crc32_tensor(data: torch.Tensor, value: int = 0) -> torch.Tensor:
    """``zlib.crc32(bytes(data), value)`` as a 0-dim int64 tensor on ``data``'s device.

    ``data`` is a 1-D contiguous uint8 tensor of at most :data:`MAX_BYTES`. Does not
    block: the work is queued on the current stream of ``data``'s device (which must see
    ``data`` complete) and the result is ready when that stream reaches it;
    :func:`launches_for` tells how many launches it queued. The first call on a device
    uploads the lookup tables (about 4 MiB) synchronously, unless :func:`prepare` did.
    """
    _check(data)
    value &= MASK
    n = data.numel()
    if n == 0:
        return torch.full((), value, dtype=torch.int64, device=data.device)
    if backend(data.device) == "triton":
        from kvbroker.broker.device._devcrc_triton import crc32_triton

        return crc32_triton(data, conditioning(value, n))
    return _crc32_torch(data, conditioning(value, n))


def crc32(data: torch.Tensor, value: int = 0) -> int:
    """``zlib.crc32(bytes(data), value)`` for a 1-D contiguous uint8 tensor, computed on
    ``data``'s device. Blocks until the result is there (reads back one integer)."""
    return int(crc32_tensor(data, value).item())


def _plan(items: int) -> list[tuple[int, int]]:
    """(rows, groups) per level for ``items`` items at the first: each level's rows are
    its items with zero items in front to whole groups, or the items alone where they
    fit in one group."""
    plan = []
    for fan_in in FAN_IN:
        groups = -(-items // fan_in)
        plan.append((items if groups == 1 else groups * fan_in, groups))
        items = groups
    assert items == 1
    return plan


def _crc32_torch(data: torch.Tensor, conditioning: int) -> torch.Tensor:
    """The torch path (module docstring); ``conditioning``: what zlib's conditioning adds."""
    device = data.device
    tab = _tables(device)
    s, n = STEP_BYTES, data.numel()
    lanes, h = divmod(n, LANE_BYTES)
    q, r = divmod(h, s)
    plan = _plan(lanes + 1)
    scratch = torch.zeros(sum(rows for rows, _ in plan) * 32, dtype=torch.float32, device=device)
    levels, at = [], 0
    for rows, _ in plan:
        levels.append(scratch[at : at + rows * 32].view(rows, 32))
        at += rows * 32
    first = levels[0]

    # The head: q + 1 bags (the first r bytes, then q of STEP_BYTES), each advanced over
    # those after it, into the row in front of the first lane's.
    index = torch.add(data[:h], tab.head_index[LANE_BYTES - h :])
    sums = F.embedding_bag(index, tab.step, tab.head_offsets[r, : q + 1], mode="sum")
    torch.remainder(sums, 2, out=sums)
    head = torch.mm(sums.view(1, -1), tab.head[(STEPS - 1 - q) * 32 :])
    row = first.shape[0] - lanes - 1
    torch.remainder(head, 2, out=first[row : row + 1])

    # The lanes, STEP_BYTES at a time, in bf16: a step's sums are at most STEP_BYTES + 32.
    body = data[h:].view(lanes, LANE_BYTES)
    bags = torch.arange(0, lanes * s, s, dtype=torch.int32, device=device)
    # Index p of a lane is (STEP_BYTES - 1 - p) * 256 + byte: the first term, set once,
    # fills the upper bytes of the little-endian int32, and each step copies its data
    # bytes into the lowest (no int32 copy of the data, on CPU either).
    index = torch.empty((lanes, s), dtype=torch.int32, device=device)
    index.copy_(tab.head_index[LANE_BYTES - s :].expand(lanes, s))
    low = index.view(torch.uint8).view(lanes, s, 4)[:, :, 0]
    state = torch.empty((lanes, 32), dtype=torch.bfloat16, device=device)
    for step in range(STEPS):
        low.copy_(body[:, step * s : (step + 1) * s])
        sums = F.embedding_bag(index.view(-1), tab.step, bags, mode="sum")
        if step:
            sums.addmm_(state, tab.advance)
        last = step == STEPS - 1
        torch.remainder(sums, 2, out=first[first.shape[0] - lanes :] if last else state)

    # The levels: each group's items advanced over the items after them, summed.
    bits = torch.empty((1, 32), dtype=torch.float64, device=device)
    for i, ((_, groups), weights) in enumerate(zip(plan, tab.levels)):
        items = levels[i].view(groups, -1)
        product = torch.mm(items, weights[weights.shape[0] - items.shape[1] :])
        if i + 1 < len(plan):
            torch.remainder(product, 2, out=levels[i + 1][levels[i + 1].shape[0] - groups :])
        else:
            torch.remainder(product, 2, out=bits)
    raw = torch.dot(bits.view(32), tab.weights).to(torch.int64)
    return torch.bitwise_xor(raw, conditioning)
