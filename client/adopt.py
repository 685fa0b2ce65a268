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
``[rows, ...]``, one row per request slot. CUDA tensors are not taken here
(VRAM goes through ``EngineMemory.allocate(device="cuda")`` for now).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog
import torch

from kvbroker.client.memory import (
    ALIGN,
    EngineMemory,
    ModelSpec,
    RankSpec,
    align,
    engine_layout,
    sealed_memfd,
)
from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

__all__ = ["adopt"]

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
) -> EngineMemory:
    """The engine's own KV (``kv``: layer -> [k, v], [mla], or [kv] for
    the fused layout) and aux tensors,
    moved into sealed memfds in place, as an :class:`EngineMemory` to
    register. See the module docstring for what is checked."""
    begin, end = rank.layer_range(model)
    if sorted(kv) != list(range(begin, end)):
        raise InvalidArgument(f"kv must give layers {begin}..{end - 1} of this rank, got {sorted(kv)}")
    if model.mla and model.fused:
        raise InvalidArgument("an MLA model has one latent tensor per layer: kv_layout must be 'nhd'")
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
            _check(tensor, f"layer {layer}", model.dtype)
            if tensor.numel() % page_elems:
                raise InvalidArgument(f"layer {layer}: {tuple(tensor.shape)} is not whole pages of {page_shape}")
            pages = tensor.numel() // page_elems
            if num_pages is None:
                num_pages = pages
            elif pages != num_pages:
                raise InvalidArgument(f"layer {layer}: {pages} pages, other KV tensors have {num_pages}")
    for i, rows in enumerate(aux):
        _check(rows, f"aux {i}", None)
        if rows.dim() < 1 or rows.shape[0] < 1:
            raise InvalidArgument(f"aux {i}: give [rows, ...] with at least one row, got {tuple(rows.shape)}")

    tensors = [t for layer in sorted(kv) for t in kv[layer]] + list(aux)
    storages = _storages(tensors)
    name = f"kvbroker-{rank.group}-tp{rank.tp_rank}-pp{rank.pp_rank}"
    buffers: list[tuple[int, common_pb2.BufferSpec]] = []
    started, moved = time.perf_counter(), 0
    try:
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
    except BaseException:
        for fd, _ in buffers:
            os.close(fd)
        raise
    log.info(
        "engine_memory_adopted",
        rank=f"{rank.group}/tp{rank.tp_rank}/pp{rank.pp_rank}",
        buffers=len(buffers),
        bytes=moved,
        seconds=round(time.perf_counter() - started, 4),
    )

    buffer_of = {id(t): entry.buffer for entry in storages for t in entry.tensors}
    regions: list[common_pb2.Region] = []
    memory = EngineMemory(layout=common_pb2.EngineLayout(), buffers=buffers)
    for layer in sorted(kv):
        for kind, tensor in zip(kinds, kv[layer]):
            regions.append(_region(kind, tensor, buffer_of[id(tensor)], page_elems * tensor.element_size(), layer))
            memory.kv_target(kind)[layer] = tensor.view(-1, *page_shape)
    for rows in aux:
        row_bytes = rows.numel() // rows.shape[0] * rows.element_size()
        regions.append(_region(common_pb2.REGION_KIND_AUX, rows, buffer_of[id(rows)], row_bytes))
        memory.aux.append(rows.view(torch.uint8).view(rows.shape[0], row_bytes))
    memory.layout = engine_layout(rank, model, regions)
    return memory


def _check(tensor: torch.Tensor, what: str, dtype: torch.dtype | None) -> None:
    if tensor.device.type != "cpu":
        raise InvalidArgument(
            f"{what}: a {tensor.device.type} tensor; adopt takes host (CPU) tensors. VRAM: allocate the KV with "
            "EngineMemory.allocate(device='cuda')"
        )
    if dtype is not None and tensor.dtype != dtype:
        raise InvalidArgument(f"{what}: dtype {tensor.dtype}, the model says {dtype}")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{what}: not contiguous (strides {tensor.stride()}); the broker addresses whole pages and rows")


def _storages(tensors: Sequence[torch.Tensor]) -> list[_Storage]:
    """The storages ``tensors`` view, each with its tensors; refuses a storage
    that other tensors view too (they would be left on the old memory)."""
    by_ptr: dict[int, _Storage] = {}
    # A view keeps its base tensor (``_base``) alive: the base moves with it.
    with_bases = [*tensors, *(t._base for t in tensors if t._base is not None)]
    for tensor in with_bases:
        storage = tensor.untyped_storage()
        entry = by_ptr.setdefault(storage.data_ptr(), _Storage(storage, [], len(by_ptr)))
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


def _region(kind: int, tensor: torch.Tensor, buffer: int, item_bytes: int, layer: int = 0) -> common_pb2.Region:
    return common_pb2.Region(
        kind=kind,  # type: ignore[arg-type]
        buffer=buffer,
        offset_bytes=int(tensor.storage_offset()) * tensor.element_size(),
        length_bytes=tensor.numel() * tensor.element_size(),
        item_bytes=item_bytes,
        layer_id=layer,
    )

