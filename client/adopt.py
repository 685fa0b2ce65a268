"""Memory the engine already has: its KV tensors, moved into shareable memory in place.

Engines allocate their KV caches with their own allocators. The broker can
only move memory it maps from an fd, and only a sealed memfd (a buffer its
engine could shrink would crash the broker with SIGBUS). :func:`adopt`
takes the engine's CPU tensors as they are and, for each storage they view:

1. creates a sealed memfd of the storage's size and copies the bytes into it
   (once, at registration; logged with its size and time: never silent);
2. re-points every given tensor, and the base tensor of each given view,
   at the memfd (``Tensor.set_``), keeping each tensor object, its shape,
   strides, offset and contents: code that holds these tensor objects goes
   on computing into them, now in shared memory.

A storage that other tensors view too (tensors the engine did not pass,
other than the bases of the given views)
would leave those behind on the old memory, and the engine would compute
into memory the broker never sees. :func:`adopt` counts the storage's
users before it moves anything and refuses with ``InvalidArgument`` naming
what to pass instead. It never copies at transfer time.

KV tensors are whole pages of the model's ``kv_layout``: "nhd" (per layer
a K and a V tensor, or one MLA tensor, ``[num_pages, page_size, heads,
head_dim]``, or any contiguous tensor of whole such pages, such as SGLang's
``[tokens, heads, head_dim]`` buffers) or "hnd_fused" (one tensor per
layer, ``[num_pages, heads, page_size, 2 * head_dim]``, per head the keys then the values
of the page's tokens in the attention kernel's order: vLLM's CPU cache). Aux tensors are
``[rows, ...]``, one row per request slot.

CUDA KV tensors stay where they are: for each device allocation they lie in
(``cuMemGetAddressRange``), :func:`adopt` exports the whole allocation once
and the regions are offsets into it. A VMM allocation (``cuMemCreate`` with
the POSIX-fd handle type: kvbroker's own allocator, the fast path) goes as
an fd; a ``cudaMalloc`` allocation as a CUDA IPC handle, which the broker
opens on the device named by its UUID. Aux tensors stay host tensors (moved
into memfds as above). See :mod:`kvbroker.cudavmm` for what each export
requires and refuses. Never run on a GPU: tested against the fake driver.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog
import torch

from kvbroker import cudavmm
from kvbroker.client.memory import (
    ALIGN,
    EngineMemory,
    ModelSpec,
    RankSpec,
    StateSpec,
    align,
    engine_layout,
    sealed_memfd,
)
from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

__all__ = ["StateTensors", "adopt"]

log = structlog.get_logger(__name__)


@dataclass
class _Storage:
    """One storage the given tensors view, and where it goes."""

    storage: torch.UntypedStorage
    tensors: list[torch.Tensor]
    buffer: int


def adopt(
    rank: RankSpec,
    model: ModelSpec,
    *,
    kv: Mapping[int, Sequence[torch.Tensor]],
    aux: Sequence[torch.Tensor] = (),
    state: Mapping[str, StateTensors] = {},  # noqa: B006 - read only
    cuda_driver: cudavmm.Driver | None = None,
) -> EngineMemory:
    """The engine's own KV (``kv``: layer -> [k, v], [mla], or [kv] for
    the fused layout), aux and hybrid-model state tensors (``state``:
    component name -> :class:`StateTensors`), as an :class:`EngineMemory`
    to register: host tensors moved into sealed memfds in place, CUDA KV
    and state tensors exported where they are (see the module docstring).
    ``cuda_driver``: the CUDA driver to export with (default libcuda; given,
    the KV tensors' memory is taken as that driver's device memory, which is
    how tests stand in for a GPU)."""
    begin, end = rank.layer_range(model)
    if sorted(kv) != model.kv_layers_in(begin, end):
        raise InvalidArgument(f"kv must give the layers of this rank that hold KV, {model.kv_layers_in(begin, end)}, got {sorted(kv)}")
    if model.mla and model.fused:
        raise InvalidArgument("an MLA model has one latent tensor per layer: kv_layout must be 'nhd'")
    kv_tensors = [t for layer in sorted(kv) for t in kv[layer]]
    on_device = [t.device.type == "cuda" for t in kv_tensors]
    if any(on_device) and not all(on_device):
        raise InvalidArgument("the KV tensors must all be on CUDA devices or all on the host")
    device = cuda_driver is not None or all(on_device)
    page_shape = model.page_shape(rank.tp_size)
    page_elems = page_shape[0] * page_shape[1] * page_shape[2]
    kinds = model.kv_kinds()
    per_layer = len(kinds)
    num_pages = None
    for layer, tensors in kv.items():
        if len(tensors) != per_layer:
            want = "[mla]" if model.mla else "[kv]" if model.fused else "[k, v]"
            raise InvalidArgument(f"layer {layer}: give {want}, got {len(tensors)} tensors")
        for tensor in tensors:
            _check(tensor, f"layer {layer}", model.dtype, device=device)
            if tensor.numel() % page_elems:
                raise InvalidArgument(f"layer {layer}: {tuple(tensor.shape)} is not whole pages of {page_shape}")
            pages = tensor.numel() // page_elems
            if num_pages is None:
                num_pages = pages
            elif pages != num_pages:
                raise InvalidArgument(f"layer {layer}: {pages} pages, other KV tensors have {num_pages}")
    for i, rows in enumerate(aux):
        _check(rows, f"aux {i}", None, device=False)
        if rows.dim() < 1 or rows.shape[0] < 1:
            raise InvalidArgument(f"aux {i}: give [rows, ...] with at least one row, got {tuple(rows.shape)}")
    state_specs = [_check_state(name, component, begin, end, device) for name, component in state.items()]
    state_tensors = [t for component in state.values() for layer in sorted(component.layers) for t in component.layers[layer]]

    buffers: list[tuple[int, common_pb2.BufferSpec]] = []
    #: id(tensor) -> (buffer index, offset of its first byte in the buffer)
    placed: dict[int, tuple[int, int]] = {}
    try:
        if device:
            placed.update(_export_device(kv_tensors + state_tensors, cuda_driver, buffers))
        host = list(aux) if device else kv_tensors + state_tensors + list(aux)
        placed.update(_move_to_memfds(rank, host, buffers))
    except BaseException:
        for fd, _ in buffers:
            if fd >= 0:
                os.close(fd)
        raise

    regions: list[common_pb2.Region] = []
    memory = EngineMemory(layout=common_pb2.EngineLayout(), buffers=buffers)
    for layer in sorted(kv):
        for kind, tensor in zip(kinds, kv[layer]):
            regions.append(_region(kind, tensor, placed[id(tensor)], page_elems * tensor.element_size(), layer))
            memory.kv_target(kind)[layer] = tensor.view(-1, *page_shape)
    for rows in aux:
        row_bytes = rows.numel() // rows.shape[0] * rows.element_size()
        regions.append(_region(common_pb2.REGION_KIND_AUX, rows, placed[id(rows)], row_bytes))
        memory.aux.append(rows.view(torch.uint8).view(rows.shape[0], row_bytes))
    for name, component in state.items():
        for layer in sorted(component.layers):
            for items in component.layers[layer]:
                item_bytes = items.numel() // items.shape[0] * items.element_size()
                region = _region(common_pb2.REGION_KIND_STATE, items, placed[id(items)], item_bytes, layer)
                region.component = name
                regions.append(region)
                memory.state.setdefault(name, []).append(items.view(torch.uint8).view(items.shape[0], item_bytes))
    memory.layout = engine_layout(rank, model, regions, state_specs)
    return memory


@dataclass(frozen=True)
class StateTensors:
    """One hybrid-model state component as the engine holds it: its type
    ("mamba", "swa" or "nsa") and, per model layer of this rank that carries
    it, its tensors (e.g. Mamba's conv and SSM state), each ``[items, ...]``
    with one item per slot; every tensor of the component has as many items
    (their sizes may differ). State indices in rooms address those items."""

    type: str
    layers: Mapping[int, Sequence[torch.Tensor]]


def _check_state(name: str, component: StateTensors, begin: int, end: int, device: bool) -> StateSpec:
    """Check one state component's tensors; its spec for the layout."""
    if not component.layers:
        raise InvalidArgument(f"state {name!r}: give at least one layer")
    outside = [layer for layer in component.layers if not begin <= layer < end]
    if outside:
        raise InvalidArgument(f"state {name!r}: layers {outside} are outside this rank's layers {begin}..{end - 1}")
    counts = {len(tensors) for tensors in component.layers.values()}
    if len(counts) != 1 or 0 in counts:
        raise InvalidArgument(f"state {name!r}: every layer needs the same number of tensors (at least one)")
    items = None
    for layer, tensors in component.layers.items():
        for tensor in tensors:
            _check(tensor, f"state {name!r} layer {layer}", None, device=device)
            if tensor.dim() < 1 or tensor.shape[0] < 1:
                raise InvalidArgument(f"state {name!r} layer {layer}: give [items, ...], got {tuple(tensor.shape)}")
            if items is None:
                items = int(tensor.shape[0])
            elif tensor.shape[0] != items:
                raise InvalidArgument(f"state {name!r} layer {layer}: {tensor.shape[0]} items, other tensors have {items}")
    assert items is not None
    if component.type not in ("mamba", "swa", "nsa"):
        raise InvalidArgument(f"state {name!r}: type must be 'mamba', 'swa' or 'nsa', got {component.type!r}")
    return StateSpec(
        name=name, type=component.type, item_bytes=0, num_items=items,  # type: ignore[arg-type]
        num_regions=counts.pop(), layers=tuple(sorted(component.layers)),
    )


def _move_to_memfds(
    rank: RankSpec, tensors: Sequence[torch.Tensor], buffers: list[tuple[int, common_pb2.BufferSpec]]
) -> dict[int, tuple[int, int]]:
    """Host tensors into sealed memfds in place (appended to ``buffers``): where each landed."""
    if not tensors:
        return {}
    storages = _storages(tensors, first_buffer=len(buffers))
    name = f"kvbroker-{rank.group}-tp{rank.tp_rank}-pp{rank.pp_rank}"
    started, moved = time.perf_counter(), 0
    for entry in storages:
        size = max(align(entry.storage.nbytes()), ALIGN)
        fd = sealed_memfd(f"{name}-{entry.buffer}", size)
        buffers.append((fd, common_pb2.BufferSpec(size_bytes=size, kind=common_pb2.MEMORY_KIND_DRAM, device_id=0)))
        # torch's own way to map an fd it is handed (its multiprocessing
        # reductions use it); the storage owns the dup and the mapping.
        shared = torch.UntypedStorage._new_shared_fd_cpu(os.dup(fd), size)  # type: ignore[attr-defined]
        old = entry.storage
        torch.empty(0, dtype=torch.uint8).set_(shared)[: old.nbytes()].copy_(
            torch.empty(0, dtype=torch.uint8).set_(old)
        )
        for tensor in entry.tensors:
            tensor.set_(shared, tensor.storage_offset(), tensor.shape, tensor.stride())
        moved += old.nbytes()
    log.info(
        "engine_memory_adopted",
        rank=f"{rank.group}/tp{rank.tp_rank}/pp{rank.pp_rank}",
        buffers=len(storages),
        bytes=moved,
        seconds=round(time.perf_counter() - started, 4),
    )
    return {id(t): (entry.buffer, int(t.storage_offset()) * t.element_size()) for entry in storages for t in entry.tensors}


def _export_device(
    tensors: Sequence[torch.Tensor], driver: cudavmm.Driver | None, buffers: list[tuple[int, common_pb2.BufferSpec]]
) -> dict[int, tuple[int, int]]:
    """Export the device allocations ``tensors`` lie in, one buffer each
    (appended to ``buffers``), without moving anything: where each tensor is."""
    drv = driver or cudavmm.default_driver()
    by_base: dict[int, tuple[int, cudavmm.AllocationExport]] = {}
    placed: dict[int, tuple[int, int]] = {}
    for tensor in tensors:
        ptr = tensor.data_ptr()
        entry = next(((i, e) for i, e in by_base.values() if e.base <= ptr < e.base + e.size_bytes), None)
        if entry is None:
            export = cudavmm.export_allocation(ptr, drv)
            spec = common_pb2.BufferSpec(
                size_bytes=export.size_bytes,
                kind=common_pb2.MEMORY_KIND_VRAM,
                device_id=export.device,
                device_uuid=cudavmm.device_uuid(export.device, drv),
                cuda_ipc_handle=export.ipc_handle or b"",
            )
            buffers.append((export.fd if export.fd is not None else -1, spec))
            entry = by_base[export.base] = (len(buffers) - 1, export)
        index, export = entry
        if ptr + tensor.numel() * tensor.element_size() > export.base + export.size_bytes:
            raise InvalidArgument(f"a KV tensor at {ptr:#x} runs past the end of its CUDA allocation")
        placed[id(tensor)] = (index, ptr - export.base)
    log.info(
        "engine_memory_exported",
        buffers=len(by_base),
        ipc=sum(1 for _, e in by_base.values() if e.ipc_handle),
        bytes=sum(e.size_bytes for _, e in by_base.values()),
    )
    return placed


def _check(tensor: torch.Tensor, what: str, dtype: torch.dtype | None, *, device: bool) -> None:
    if tensor.device.type not in (("cuda", "cpu") if device else ("cpu",)):
        raise InvalidArgument(
            f"{what}: a {tensor.device.type} tensor; adopt takes host (CPU) tensors, and CUDA tensors for the KV"
        )
    if dtype is not None and tensor.dtype != dtype:
        raise InvalidArgument(f"{what}: dtype {tensor.dtype}, the model says {dtype}")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{what}: not contiguous (strides {tensor.stride()}); the broker addresses whole pages and rows")


def _storages(tensors: Sequence[torch.Tensor], first_buffer: int = 0) -> list[_Storage]:
    """The storages ``tensors`` view, each with its tensors; refuses a storage
    that other tensors view too (they would be left on the old memory)."""
    by_ptr: dict[int, _Storage] = {}
    # A view keeps its base tensor (``_base``) alive: the base moves with it.
    with_bases = [*tensors, *(t._base for t in tensors if t._base is not None)]
    for tensor in with_bases:
        storage = tensor.untyped_storage()
        entry = by_ptr.setdefault(storage.data_ptr(), _Storage(storage, [], first_buffer + len(by_ptr)))
        if all(t is not tensor for t in entry.tensors):
            entry.tensors.append(tensor)
    for entry in by_ptr.values():
        # Users of the storage: each tensor viewing it, and the one Python
        # handle this function holds (entry.storage).
        users = torch._C._storage_Use_Count(entry.storage._cdata) - 1
        if users != len(entry.tensors):
            raise InvalidArgument(
                f"{users - len(entry.tensors)} more tensor(s) view the memory of the given ones "
                f"({entry.storage.nbytes()} bytes): they would stay behind when it moves to shared memory. Pass "
                "every tensor that views it (e.g. the engine's whole KV allocation's views), or allocate the KV "
                "with EngineMemory.allocate"
            )
    return list(by_ptr.values())


def _region(kind: int, tensor: torch.Tensor, where: tuple[int, int], item_bytes: int, layer: int = 0) -> common_pb2.Region:
    return common_pb2.Region(
        kind=kind,  # type: ignore[arg-type]
        buffer=where[0],
        offset_bytes=where[1],
        length_bytes=tensor.numel() * tensor.element_size(),
        item_bytes=item_bytes,
        layer_id=layer,
    )

