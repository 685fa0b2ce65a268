"""Exportable engine memory, with torch tensors over it.

The broker can only move memory it has mapped, so an engine allocates its KV
pool, aux rows and state buffers here: one sealed memfd per engine rank,
mapped shared, and torch tensors that are views of it. The engine computes
into the tensors as usual; the broker maps the same pages from the fd the
client hands it at registration.

Layout of the buffer (each region starts on a 4 KiB boundary):

- KV, for every layer this rank holds: ``k[layer]`` and ``v[layer]``, each
  ``[num_pages, page_size, kv_heads_per_rank, head_dim]`` of ``dtype``
  ("NHD" pages), or ``mla[layer]`` ``[num_pages, page_size, 1, head_dim]``;
- aux: ``aux[i]``, ``[aux_rows, row_bytes_i]`` uint8, one row per request;
- state: ``state[name][j]``, ``[num_items, item_bytes]`` uint8, for each
  layer of the component on this rank (ascending), ``num_regions`` buffers.

``device="cpu"`` (the default) allocates host memory: a memfd. A CUDA
device (``"cuda"``, ``"cuda:1"``) allocates the same layout in VRAM with
CUDA VMM (``cuMemCreate`` with a POSIX-fd shareable handle, see
:mod:`kvbroker.cudavmm`), and the tensors are CUDA tensors over it. The
memory is freed when :meth:`EngineMemory.close` was called and no tensor
view of it is left. For VRAM, a sender must let the kernels that wrote its
pages finish (e.g. ``torch.cuda.current_stream().synchronize()``) before
``send``: the broker reads the pages as soon as it has the chunk. The VRAM
path has not run on a GPU yet (see the README's Status).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from kvbroker import cudavmm
from kvbroker.errors import FailedPrecondition, InvalidArgument
from kvbroker.plan import kv_kinds_of
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.client.adopt import StateTensors

__all__ = ["EngineMemory", "ModelSpec", "RankSpec", "StateSpec", "even_pp_layer_begins"]

ALIGN = 4096
_ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE, "both": common_pb2.ROLE_BOTH}
_KV_KINDS = (common_pb2.REGION_KIND_KEY, common_pb2.REGION_KIND_VALUE, common_pb2.REGION_KIND_MLA, common_pb2.REGION_KIND_KV)
_STATE_TYPES = {"mamba": common_pb2.STATE_TYPE_MAMBA, "swa": common_pb2.STATE_TYPE_SWA, "nsa": common_pb2.STATE_TYPE_NSA}


@dataclass(frozen=True)
class ModelSpec:
    """What the KV cache of the whole model looks like."""

    num_layers: int
    #: KV heads of the whole model (1 for MLA).
    total_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    #: Tokens per page.
    page_size: int
    mla: bool = False
    #: How each layer's KV lies in memory: "nhd" (a K and a V tensor per
    #: layer, ``[pages, page_size, heads, head_dim]``; SGLang) or "hnd_fused"
    #: (one tensor per layer, ``[pages, heads, page_size, 2 * head_dim]``,
    #: which holds, per head, the page's keys then its values in the
    #: attention kernel's order; vLLM's CPU KV cache: pages move whole, or
    #: as whole heads between different tp sizes; equal page sizes only).
    kv_layout: Literal["nhd", "hnd_fused"] = "nhd"
    #: The layers that hold KV, ascending (a hybrid model's attention layers;
    #: its other layers carry state only). None: every layer.
    kv_layers: tuple[int, ...] | None = None
    #: What must match between the two sides of a room beyond these shapes
    #: (engine and version, model, dtypes, attention backend): an adapter's
    #: digest, at most 256 characters. A receiver refuses a room whose sender
    #: declared another. "": not declared (no check).
    compatibility: str = ""

    def kv_layers_in(self, begin: int, end: int) -> list[int]:
        """The layers of [begin, end) that hold KV."""
        if self.kv_layers is None:
            return list(range(begin, end))
        return [layer for layer in self.kv_layers if begin <= layer < end]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def fused(self) -> bool:
        return self.kv_layout == "hnd_fused"

    @property
    def kv_layout_enum(self) -> int:
        """``kv_layout`` as ``common_pb2.KvLayout``."""
        return common_pb2.KV_LAYOUT_HND_FUSED if self.fused else common_pb2.KV_LAYOUT_NHD

    def kv_kinds(self) -> tuple[int, ...]:
        """The region kinds of one layer's KV."""
        return kv_kinds_of(self.mla, self.kv_layout_enum)

    def page_shape(self, tp_size: int) -> tuple[int, int, int]:
        """The shape of one page of one KV tensor on a rank of ``tp_size``."""
        heads = self.heads_per_rank(tp_size)
        if self.fused:
            return (heads, self.page_size, 2 * self.head_dim)
        return (self.page_size, heads, self.head_dim)

    def heads_per_rank(self, tp_size: int) -> int:
        return 1 if self.mla else max(1, self.total_kv_heads // tp_size)


def even_pp_layer_begins(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """First layer of each pp rank when layers split as evenly as possible."""
    base, extra = divmod(num_layers, pp_size)
    begins, layer = [], 0
    for rank in range(pp_size):
        begins.append(layer)
        layer += base + (1 if rank < extra else 0)
    return tuple(begins)


@dataclass(frozen=True)
class RankSpec:
    """Who this engine rank is. ``role``: "prefill" sends rooms, "decode"
    receives them, "both" does either, room by room (vLLM's ``kv_both``)."""

    group: str
    role: Literal["prefill", "decode", "both"]
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    #: First layer of each pp rank; None splits the layers evenly.
    pp_layer_begins: tuple[int, ...] | None = None

    def layer_begins(self, model: ModelSpec) -> tuple[int, ...]:
        return self.pp_layer_begins or even_pp_layer_begins(model.num_layers, self.pp_size)

    def layer_range(self, model: ModelSpec) -> tuple[int, int]:
        begins = self.layer_begins(model)
        end = begins[self.pp_rank + 1] if self.pp_rank + 1 < self.pp_size else model.num_layers
        return begins[self.pp_rank], end

    def to_proto(self) -> common_pb2.EngineRankId:
        return common_pb2.EngineRankId(group=self.group, tp_rank=self.tp_rank, pp_rank=self.pp_rank)


@dataclass(frozen=True)
class StateSpec:
    """One hybrid-model state component."""

    name: str
    type: Literal["mamba", "swa", "nsa"]
    #: Bytes of one item in each region of the component.
    item_bytes: int
    num_items: int
    #: Buffers of the component per layer (e.g. 2 for Mamba conv + ssm state).
    num_regions: int = 1
    #: Model layers that carry this component; the rank allocates those in
    #: its layer range. None: one set of buffers for the whole rank, filed
    #: under its first layer (then both sides need the same pp split).
    layers: tuple[int, ...] | None = None

    def layers_on(self, begin: int, end: int) -> list[int]:
        """The layers of this component a rank holding [begin, end) allocates."""
        if self.layers is None:
            return [begin]
        return [layer for layer in self.layers if begin <= layer < end]


@dataclass(eq=False)
class EngineMemory:
    """One engine rank's exportable memory. Build it with :meth:`allocate`."""

    layout: common_pb2.EngineLayout
    #: (fd, spec) per buffer, handed to the broker at registration; fd -1 for
    #: a buffer that goes as a CUDA IPC handle (``spec.cuda_ipc_handle``).
    buffers: list[tuple[int, common_pb2.BufferSpec]]
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    mla: dict[int, torch.Tensor] = field(default_factory=dict)
    #: KV_LAYOUT_HND_FUSED: one tensor per layer, ``[pages, heads, page_size, 2 * head_dim]``
    #: (per head: the page's keys, then its values, in the attention kernel's order).
    kv: dict[int, torch.Tensor] = field(default_factory=dict)
    aux: list[torch.Tensor] = field(default_factory=list)
    state: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: The whole buffer as uint8 (for tests that check bytes around regions).
    raw: torch.Tensor | None = None
    #: [start, stop) byte spans of the canary guards in ``raw``.
    guards: list[tuple[int, int]] = field(default_factory=list)
    _maps: list[mmap.mmap] = field(default_factory=list, repr=False)

    @classmethod
    def allocate(
        cls,
        rank: RankSpec,
        model: ModelSpec,
        *,
        num_pages: int,
        aux_rows: int = 0,
        aux_row_bytes: Sequence[int] = (),
        state: Sequence[StateSpec] = (),
        device: str = "cpu",
        guard_bytes: int = 4096,
    ) -> EngineMemory:
        """Allocate and map the memory; every region byte starts as zero.

        ``guard_bytes`` of canary bytes sit before the first region and after
        every region (plus the slack to the next 4 KiB boundary);
        :meth:`check_guards` reports any that changed: a write outside the
        registered regions. 0 turns guards off.
        """
        where = torch.device(device)
        if where.type not in ("cpu", "cuda"):
            raise InvalidArgument(f"device {device!r}: engine memory lives on the host ('cpu') or a CUDA device")
        if rank.role not in _ROLES:
            raise InvalidArgument(f"role must be 'prefill', 'decode' or 'both', got {rank.role!r}")
        if num_pages < 1:
            raise InvalidArgument("num_pages must be at least 1")
        if aux_row_bytes and aux_rows < 1:
            raise InvalidArgument("aux_rows must be at least 1 when aux_row_bytes is given")
        begin, end = rank.layer_range(model)
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        page_shape = model.page_shape(rank.tp_size)
        page_bytes = page_shape[0] * page_shape[1] * page_shape[2] * itemsize
        kinds = model.kv_kinds()

        regions: list[common_pb2.Region] = []
        if guard_bytes % ALIGN:
            raise InvalidArgument(f"guard_bytes must be a multiple of {ALIGN}")
        offset = guard_bytes
        guards: list[tuple[int, int]] = [(0, guard_bytes)] if guard_bytes else []

        def place(kind: int, length: int, item: int, layer: int = 0, component: str = "") -> common_pb2.Region:
            nonlocal offset
            region = common_pb2.Region(
                kind=kind,  # type: ignore[arg-type]
                buffer=0,
                offset_bytes=offset,
                length_bytes=length,
                item_bytes=item,
                layer_id=layer,
                component=component,
            )
            regions.append(region)
            end = align(offset + length)
            if guard_bytes:
                # The slack up to the alignment boundary and a guard after it.
                guards.append((offset + length, end + guard_bytes))
            offset = end + guard_bytes
            return region

        for layer in model.kv_layers_in(begin, end):
            for kind in kinds:
                place(kind, num_pages * page_bytes, page_bytes, layer)
        for row_bytes in aux_row_bytes:
            place(common_pb2.REGION_KIND_AUX, aux_rows * row_bytes, row_bytes)
        for spec in state:
            if spec.type not in _STATE_TYPES:
                raise InvalidArgument(f"state type must be one of {sorted(_STATE_TYPES)}, got {spec.type!r}")
            for layer in spec.layers_on(begin, end):
                for _ in range(spec.num_regions):
                    place(
                        common_pb2.REGION_KIND_STATE,
                        spec.num_items * spec.item_bytes,
                        spec.item_bytes,
                        layer=layer,
                        component=spec.name,
                    )
        total = max(offset, ALIGN)

        name = f"kvbroker-{rank.group}-tp{rank.tp_rank}-pp{rank.pp_rank}"
        if where.type == "cuda":
            fd, raw, buffer_spec = _device_buffer(where, total)
            maps: list[mmap.mmap] = []
        else:
            fd, raw, buffer_spec, mapping = _host_buffer(name, total)
            maps = [mapping]
        layout = engine_layout(rank, model, regions, state)
        for start, stop in guards:
            raw[start:stop] = _canary(start, stop).to(raw.device)
        if raw.is_cuda:
            torch.cuda.synchronize(raw.device)
        memory = cls(layout=layout, buffers=[(fd, buffer_spec)], raw=raw, _maps=maps, guards=guards)

        def view(region: common_pb2.Region) -> torch.Tensor:
            return raw[region.offset_bytes : region.offset_bytes + region.length_bytes]

        for region in regions:
            if region.kind in _KV_KINDS:
                memory.kv_target(region.kind)[region.layer_id] = view(region).view(model.dtype).view(num_pages, *page_shape)
            elif region.kind == common_pb2.REGION_KIND_AUX:
                memory.aux.append(view(region).view(aux_rows, region.item_bytes))
            else:
                memory.state.setdefault(region.component, []).append(
                    view(region).view(region.length_bytes // region.item_bytes, region.item_bytes)
                )
        return memory

    @classmethod
    def adopt(
        cls,
        rank: RankSpec,
        model: ModelSpec,
        *,
        kv: Mapping[int, Sequence[torch.Tensor]],
        aux: Sequence[torch.Tensor] = (),
        state: Mapping[str, StateTensors] = {},  # noqa: B006 - read only
        cuda_driver: cudavmm.Driver | None = None,
    ) -> EngineMemory:
        """The engine's own tensors (``kv``: layer -> [k, v] or [mla]; aux
        rows; ``state``: hybrid-model state components): host tensors moved
        into sealed memfds in place, CUDA tensors exported where they are:
        see :mod:`kvbroker.client.adopt`."""
        from kvbroker.client.adopt import adopt

        return adopt(rank, model, kv=kv, aux=aux, state=state, cuda_driver=cuda_driver)

    def check_guards(self) -> list[str]:
        """The guard spans whose canary bytes changed (empty: nothing wrote outside a region)."""
        if self.raw is None:
            return []
        return [
            f"guard [{start}, {stop}) was overwritten"
            for start, stop in self.guards
            if not torch.equal(self.raw[start:stop].cpu(), _canary(start, stop))
        ]

    def kv_tensors(self, layer: int) -> list[torch.Tensor]:
        """The KV tensors of ``layer``: [k, v], [mla], or [kv] (fused)."""
        if layer in self.mla:
            return [self.mla[layer]]
        if layer in self.kv:
            return [self.kv[layer]]
        return [self.k[layer], self.v[layer]]

    def kv_target(self, kind: int) -> dict[int, torch.Tensor]:
        """The dict of KV tensors of region kind ``kind``."""
        targets: dict[int, dict[int, torch.Tensor]] = {
            common_pb2.REGION_KIND_KEY: self.k,
            common_pb2.REGION_KIND_VALUE: self.v,
            common_pb2.REGION_KIND_MLA: self.mla,
            common_pb2.REGION_KIND_KV: self.kv,
        }
        return targets[kind]

    def take_fds(self) -> list[tuple[int, common_pb2.BufferSpec]]:
        """Hand the buffers' fds to the caller, who closes them (the memory keeps none)."""
        buffers, self.buffers = self.buffers, []
        return buffers

    def export_fds(self) -> list[tuple[int, common_pb2.BufferSpec]]:
        """Duplicates of the buffers' fds, for one upload (the caller closes
        them); the memory keeps its own until ``close``, so the engine can
        register again with a restarted broker."""
        return [(os.dup(fd) if fd >= 0 else -1, spec) for fd, spec in self.buffers]

    def buffer_sizes(self) -> list[int]:
        return [spec.size_bytes for _, spec in self.buffers]

    def close(self) -> None:
        """Close fds and, once no tensor views remain, the mapping."""
        for fd, _ in self.take_fds():
            if fd >= 0:
                os.close(fd)
        self.k.clear()
        self.v.clear()
        self.mla.clear()
        self.kv.clear()
        self.aux.clear()
        self.state.clear()
        self.raw = None
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:
                # A caller still holds a tensor view; the mapping goes with it.
                pass
        self._maps.clear()


def engine_layout(
    rank: RankSpec, model: ModelSpec, regions: Sequence[common_pb2.Region], state: Sequence[StateSpec] = ()
) -> common_pb2.EngineLayout:
    """The layout message of ``rank``'s memory, given its regions."""
    if rank.role not in _ROLES:
        raise InvalidArgument(f"role must be 'prefill', 'decode' or 'both', got {rank.role!r}")
    begin, end = rank.layer_range(model)
    return common_pb2.EngineLayout(
        role=_ROLES[rank.role],
        tp_size=rank.tp_size,
        pp_size=rank.pp_size,
        num_layers=model.num_layers,
        layer_begin=begin,
        layer_end=end,
        page_size_tokens=model.page_size,
        total_kv_heads=model.total_kv_heads,
        kv_heads_per_rank=model.heads_per_rank(rank.tp_size),
        head_dim=model.head_dim,
        dtype=model.dtype_name,
        mla=model.mla,
        regions=regions,
        state_components=[
            common_pb2.StateComponent(name=s.name, type=_STATE_TYPES[s.type]) for s in state if s.layers_on(begin, end)
        ],
        pp_layer_begins=list(rank.layer_begins(model)),
        kv_layout=model.kv_layout_enum,  # type: ignore[arg-type]
        kv_layers=[] if model.kv_layers is None else model.kv_layers_in(begin, end),
        compatibility=model.compatibility,
    )


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` zero bytes, sealed so it can neither shrink nor grow
    (the broker refuses buffers that could shrink under it: SIGBUS)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _host_buffer(name: str, total: int) -> tuple[int, torch.Tensor, common_pb2.BufferSpec, mmap.mmap]:
    """A sealed memfd of ``total`` zero bytes, mapped here: (fd, bytes, spec, mapping)."""
    fd = sealed_memfd(name, total)
    try:
        mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    spec = common_pb2.BufferSpec(size_bytes=total, kind=common_pb2.MEMORY_KIND_DRAM, device_id=0)
    return fd, torch.frombuffer(mapping, dtype=torch.uint8), spec, mapping


class _VramBytes:
    """Owns a VMM mapping and shows it to torch (``__cuda_array_interface__``).

    torch keeps this object alive as long as any tensor over the memory
    exists, and drops it after the last one: then the mapping is released.
    """

    def __init__(self, mapping: cudavmm.VmmMapping) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "shape": (mapping.size_bytes,),
            "typestr": "|u1",
            "data": (mapping.address, False),
            "strides": None,
            "version": 2,
        }

    def __del__(self) -> None:
        try:
            self.mapping.release()
        except Exception:  # noqa: BLE001 - nothing to report to at collection time
            pass


def _device_buffer(device: torch.device, total: int) -> tuple[int, torch.Tensor, common_pb2.BufferSpec]:
    """VRAM of at least ``total`` bytes on ``device``, zeroed, exported: (fd, bytes, spec)."""
    if not torch.cuda.is_available():
        raise FailedPrecondition(f"device {str(device)!r}: torch sees no CUDA device in this process")
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    mapping, fd = cudavmm.export_buffer(ordinal, total)
    try:
        uuid = cudavmm.device_uuid(ordinal)
        raw = torch.as_tensor(_VramBytes(mapping), device=torch.device("cuda", ordinal))
    except BaseException:
        os.close(fd)
        mapping.release()
        raise
    raw.zero_()
    spec = common_pb2.BufferSpec(
        size_bytes=mapping.size_bytes, kind=common_pb2.MEMORY_KIND_VRAM, device_id=ordinal, device_uuid=uuid
    )
    return fd, raw, spec


def align(value: int) -> int:
    """``value`` rounded up to the 4 KiB region alignment."""
    return (value + ALIGN - 1) // ALIGN * ALIGN


def _canary(start: int, stop: int) -> torch.Tensor:
    """The canary bytes of [start, stop): position-dependent, never all zero."""
    positions = torch.arange(start, stop, dtype=torch.int64)
    return ((positions * 131 + 0x5A) & 0xFF).to(torch.uint8)
