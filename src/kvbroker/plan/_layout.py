"""Engine layouts: the validated, typed view of ``kvbroker.v1.EngineLayout``.

A layout says how one engine rank's memory is organised: which regions hold
which layer's keys and values (or MLA latents), aux rows and state items, and
how many items each has. Everything here is pure and checked once, at
registration; later code trusts a :class:`Layout`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

__all__ = [
    "DTYPE_BYTES",
    "Layout",
    "RankKey",
    "RegionView",
    "rank_key",
]

#: Bytes per element of the dtypes an engine may declare.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}

_KV_KINDS = (common_pb2.REGION_KIND_KEY, common_pb2.REGION_KIND_VALUE, common_pb2.REGION_KIND_MLA, common_pb2.REGION_KIND_KV)
FUSED = common_pb2.KV_LAYOUT_HND_FUSED


def kv_kinds_of(mla: bool, kv_layout: int) -> tuple[int, ...]:
    """Region kinds holding one layer's KV: (MLA,), (KV,) fused, or (KEY, VALUE)."""
    if mla:
        return (common_pb2.REGION_KIND_MLA,)
    if kv_layout == FUSED:
        return (common_pb2.REGION_KIND_KV,)
    return (common_pb2.REGION_KIND_KEY, common_pb2.REGION_KIND_VALUE)


def kv_page_bytes_of(page_size: int, heads: int, head_dim: int, dtype_bytes: int, kv_layout: int) -> int:
    """Bytes of one KV page of one layer region (a fused region holds keys and values)."""
    return page_size * heads * head_dim * dtype_bytes * (2 if kv_layout == FUSED else 1)

#: Limits that keep one registration or handshake from exhausting the broker.
MAX_LAYERS = 1 << 16
MAX_PP_SIZE = 1 << 10
MAX_TP_SIZE = 1 << 12
#: Longest EngineLayout.compatibility (a digest; a description fits too).
MAX_COMPATIBILITY = 256
#: Addressable items (descriptors) of one engine rank over all its regions.
MAX_ITEMS_PER_ENGINE = 1 << 24


class RankKey(NamedTuple):
    """An engine rank's identity as a hashable key: (group, tp rank, pp rank)."""

    group: str
    tp_rank: int
    pp_rank: int

    def to_proto(self) -> common_pb2.EngineRankId:
        return common_pb2.EngineRankId(group=self.group, tp_rank=self.tp_rank, pp_rank=self.pp_rank)

    def __str__(self) -> str:
        return f"{self.group}/tp{self.tp_rank}/pp{self.pp_rank}"


def rank_key(rank: common_pb2.EngineRankId) -> RankKey:
    """The key of an ``EngineRankId`` message (one shared object per rank:
    records of many rooms hold it)."""
    return _shared_key(rank.group, rank.tp_rank, rank.pp_rank)


@functools.lru_cache(maxsize=4096)
def _shared_key(group: str, tp_rank: int, pp_rank: int) -> RankKey:
    return RankKey(group, tp_rank, pp_rank)


@dataclass(frozen=True)
class RegionView:
    """One region of a layout, with its position in ``Layout.regions``."""

    index: int
    kind: int
    buffer: int
    offset_bytes: int
    length_bytes: int
    item_bytes: int
    layer_id: int
    component: str

    @property
    def items(self) -> int:
        """Addressable items (pages, rows, state items) in the region."""
        return self.length_bytes // self.item_bytes


@dataclass(frozen=True)
class Layout:
    """A validated engine layout. Build it with :meth:`from_proto`."""

    role: int
    tp_size: int
    pp_size: int
    num_layers: int
    layer_begin: int
    layer_end: int
    page_size_tokens: int
    total_kv_heads: int
    kv_heads_per_rank: int
    head_dim: int
    dtype: str
    mla: bool
    pp_layer_begins: tuple[int, ...]
    regions: tuple[RegionView, ...]
    #: (region kind, layer id) -> region index, for KEY/VALUE/MLA regions.
    kv_regions: dict[tuple[int, int], int]
    #: Aux region indices in the order the engine listed them.
    aux_regions: tuple[int, ...]
    #: component name -> (state type, region indices in listed order).
    state_components: dict[str, tuple[int, tuple[int, ...]]]
    #: KV pages per layer region (0 when the engine has no KV regions).
    num_pages: int
    #: Rows per aux region (0 when the engine has no aux regions).
    aux_rows: int
    #: component name -> items per region of that component.
    state_items: dict[str, int]
    #: common_pb2.KvLayout: how each layer's KV lies in memory.
    kv_layout: int = common_pb2.KV_LAYOUT_NHD
    #: What must match beyond shapes (EngineLayout.compatibility); "": not declared.
    compatibility: str = ""
    #: The layers of [layer_begin, layer_end) that hold KV (a hybrid model's
    #: attention layers); None: every one.
    kv_layers: tuple[int, ...] | None = None
    #: What the planners work out of this layout alone, once (``kv_regions``,
    #: ``kv_region_pairs``): every chunk of every room asks the same.
    memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def kv_layers_in(self, begin: int, end: int) -> list[int]:
        """The layers of [begin, end) that hold KV on this rank's model."""
        if self.kv_layers is None:
            return list(range(begin, end))
        return [layer for layer in self.kv_layers if begin <= layer < end]

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one KV page of one layer region on this rank (worked out once)."""
        found: int | None = self.memo.get("kv_page_bytes")
        if found is None:
            found = self.memo["kv_page_bytes"] = kv_page_bytes_of(
                self.page_size_tokens, self.kv_heads_per_rank, self.head_dim, self.dtype_bytes, self.kv_layout
            )
        return found

    def kv_kinds(self) -> tuple[int, ...]:
        """Region kinds holding KV: (MLA,), (KV,) or (KEY, VALUE)."""
        return kv_kinds_of(self.mla, self.kv_layout)

    def layer_range_of_pp_rank(self, pp_rank: int) -> tuple[int, int]:
        """[begin, end) of the layers that pp rank ``pp_rank`` of this group holds."""
        begins = self.pp_layer_begins
        end = begins[pp_rank + 1] if pp_rank + 1 < len(begins) else self.num_layers
        return begins[pp_rank], end

    @classmethod
    def from_proto(
        cls,
        msg: common_pb2.EngineLayout,
        *,
        rank: RankKey,
        buffer_sizes: Sequence[int],
    ) -> Layout:
        """Validate ``msg`` for engine rank ``rank`` whose buffers have ``buffer_sizes``.

        Raises ``InvalidArgument`` naming the first inconsistency.
        """
        if msg.role not in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_BOTH):
            raise InvalidArgument("layout.role must be ROLE_PREFILL, ROLE_DECODE or ROLE_BOTH")
        if len(msg.compatibility) > MAX_COMPATIBILITY:
            raise InvalidArgument(f"layout.compatibility is {len(msg.compatibility)} characters; the limit is {MAX_COMPATIBILITY}")
        if msg.tp_size < 1 or msg.pp_size < 1:
            raise InvalidArgument("layout.tp_size and layout.pp_size must be at least 1")
        if msg.tp_size > MAX_TP_SIZE or msg.pp_size > MAX_PP_SIZE or msg.num_layers > MAX_LAYERS:
            raise InvalidArgument(
                f"layout sizes out of range (tp_size <= {MAX_TP_SIZE}, pp_size <= {MAX_PP_SIZE}, num_layers <= {MAX_LAYERS})"
            )
        if rank.tp_rank >= msg.tp_size or rank.pp_rank >= msg.pp_size:
            raise InvalidArgument(
                f"rank tp{rank.tp_rank}/pp{rank.pp_rank} is outside tp_size {msg.tp_size}, pp_size {msg.pp_size}"
            )
        if not rank.group:
            raise InvalidArgument("rank.group must not be empty")
        if not 0 <= msg.layer_begin < msg.layer_end <= msg.num_layers:
            raise InvalidArgument(
                f"layer range [{msg.layer_begin}, {msg.layer_end}) must be non-empty and inside num_layers {msg.num_layers}"
            )
        pp_begins = tuple(msg.pp_layer_begins) or ((0,) if msg.pp_size == 1 else ())
        if len(pp_begins) != msg.pp_size:
            raise InvalidArgument(
                f"pp_layer_begins must list the first layer of each of the {msg.pp_size} pp ranks"
            )
        if pp_begins[0] != 0 or any(a >= b for a, b in zip(pp_begins, pp_begins[1:])) or pp_begins[-1] >= msg.num_layers:
            raise InvalidArgument(f"pp_layer_begins {list(pp_begins)} must start at 0 and increase below num_layers")
        own_end = pp_begins[rank.pp_rank + 1] if rank.pp_rank + 1 < msg.pp_size else msg.num_layers
        if (pp_begins[rank.pp_rank], own_end) != (msg.layer_begin, msg.layer_end):
            raise InvalidArgument(
                f"layer range [{msg.layer_begin}, {msg.layer_end}) disagrees with pp_layer_begins for pp rank {rank.pp_rank}"
            )
        if msg.page_size_tokens < 1 or msg.head_dim < 1:
            raise InvalidArgument("page_size_tokens and head_dim must be at least 1")
        if msg.dtype not in DTYPE_BYTES:
            raise InvalidArgument(f"unknown dtype {msg.dtype!r}; known: {sorted(DTYPE_BYTES)}")
        if msg.kv_layout not in common_pb2.KvLayout.values():
            raise InvalidArgument(f"unknown kv_layout {msg.kv_layout}")
        if msg.mla and msg.kv_layout != common_pb2.KV_LAYOUT_NHD:
            raise InvalidArgument("an MLA layout has one latent region per layer: kv_layout must be KV_LAYOUT_NHD")
        _check_heads(msg)
        kv_layers = tuple(msg.kv_layers) or None
        if kv_layers is not None and (
            any(a >= b for a, b in zip(kv_layers, kv_layers[1:]))
            or not msg.layer_begin <= kv_layers[0]
            or kv_layers[-1] >= msg.layer_end
        ):
            raise InvalidArgument(
                f"kv_layers {list(kv_layers)} must increase inside this rank's layers [{msg.layer_begin}, {msg.layer_end})"
            )

        regions = tuple(_region_view(i, r, buffer_sizes) for i, r in enumerate(msg.regions))
        items = sum(r.items for r in regions)
        if items > MAX_ITEMS_PER_ENGINE:
            raise InvalidArgument(
                f"the regions hold {items} items (pages, rows, state items); the limit per engine rank is "
                f"{MAX_ITEMS_PER_ENGINE}: use larger pages"
            )
        _check_no_overlap(regions)
        kv_regions, num_pages = _index_kv(msg, regions, kv_layers)
        aux_regions, aux_rows = _index_aux(regions)
        state_components, state_items = _index_state(msg, regions)
        return cls(
            role=msg.role,
            tp_size=msg.tp_size,
            pp_size=msg.pp_size,
            num_layers=msg.num_layers,
            layer_begin=msg.layer_begin,
            layer_end=msg.layer_end,
            page_size_tokens=msg.page_size_tokens,
            total_kv_heads=msg.total_kv_heads,
            kv_heads_per_rank=msg.kv_heads_per_rank,
            head_dim=msg.head_dim,
            dtype=msg.dtype,
            mla=msg.mla,
            pp_layer_begins=pp_begins,
            regions=regions,
            kv_regions=kv_regions,
            aux_regions=aux_regions,
            state_components=state_components,
            num_pages=num_pages,
            aux_rows=aux_rows,
            compatibility=msg.compatibility,
            state_items=state_items,
            kv_layout=msg.kv_layout,
            kv_layers=kv_layers,
        )


def _check_heads(msg: common_pb2.EngineLayout) -> None:
    if msg.mla:
        if msg.kv_heads_per_rank != 1 or msg.total_kv_heads != 1:
            raise InvalidArgument("an MLA layout has one latent KV head: set total_kv_heads = kv_heads_per_rank = 1")
        return
    total, tp = msg.total_kv_heads, msg.tp_size
    if total < 1:
        raise InvalidArgument("total_kv_heads must be at least 1")
    if total > tp and total % tp:
        raise InvalidArgument(f"total_kv_heads {total} must divide evenly over tp_size {tp}")
    if tp > total and tp % total:
        raise InvalidArgument(f"tp_size {tp} must be a multiple of total_kv_heads {total} when heads are replicated")
    expected = max(1, total // tp)
    if msg.kv_heads_per_rank != expected:
        raise InvalidArgument(
            f"kv_heads_per_rank is {msg.kv_heads_per_rank}, but total_kv_heads {total} over tp_size {tp} gives {expected}"
        )


def _region_view(index: int, r: common_pb2.Region, buffer_sizes: Sequence[int]) -> RegionView:
    where = f"region {index}"
    if r.kind == common_pb2.REGION_KIND_UNSPECIFIED or r.kind not in common_pb2.RegionKind.values():
        raise InvalidArgument(f"{where}: kind {r.kind} is unspecified or unknown")
    if r.buffer >= len(buffer_sizes):
        raise InvalidArgument(f"{where}: buffer {r.buffer} does not exist (engine uploaded {len(buffer_sizes)})")
    if r.item_bytes == 0 or r.length_bytes == 0:
        raise InvalidArgument(f"{where}: item_bytes and length_bytes must be positive")
    if r.length_bytes % r.item_bytes:
        raise InvalidArgument(f"{where}: length_bytes {r.length_bytes} is not a multiple of item_bytes {r.item_bytes}")
    if r.offset_bytes + r.length_bytes > buffer_sizes[r.buffer]:
        raise InvalidArgument(
            f"{where}: [{r.offset_bytes}, {r.offset_bytes + r.length_bytes}) lies outside buffer {r.buffer} "
            f"of {buffer_sizes[r.buffer]} bytes"
        )
    return RegionView(
        index=index,
        kind=r.kind,
        buffer=r.buffer,
        offset_bytes=r.offset_bytes,
        length_bytes=r.length_bytes,
        item_bytes=r.item_bytes,
        layer_id=r.layer_id,
        component=r.component,
    )


def _check_no_overlap(regions: tuple[RegionView, ...]) -> None:
    """Two regions sharing bytes would let a write to one corrupt the other."""
    spans = sorted((r.buffer, r.offset_bytes, r.offset_bytes + r.length_bytes, r.index) for r in regions)
    for (buf_a, _, end_a, a), (buf_b, start_b, _, b) in zip(spans, spans[1:]):
        if buf_a == buf_b and start_b < end_a:
            raise InvalidArgument(f"regions {a} and {b} overlap in buffer {buf_a}")


def _index_kv(
    msg: common_pb2.EngineLayout, regions: tuple[RegionView, ...], kv_layers: tuple[int, ...] | None
) -> tuple[dict[tuple[int, int], int], int]:
    kinds = kv_kinds_of(msg.mla, msg.kv_layout)
    kv: dict[tuple[int, int], int] = {}
    for region in regions:
        if region.kind not in _KV_KINDS:
            continue
        name = common_pb2.RegionKind.Name(region.kind)
        if region.kind not in kinds:
            what = "an MLA" if msg.mla else "a fused (KV_LAYOUT_HND_FUSED)" if msg.kv_layout == FUSED else "an MHA/GQA"
            raise InvalidArgument(f"region {region.index}: {name} does not belong in {what} layout")
        if not msg.layer_begin <= region.layer_id < msg.layer_end:
            raise InvalidArgument(
                f"region {region.index}: layer {region.layer_id} is outside this rank's layers [{msg.layer_begin}, {msg.layer_end})"
            )
        if kv_layers is not None and region.layer_id not in kv_layers:
            raise InvalidArgument(f"region {region.index}: layer {region.layer_id} holds no KV (it is not in kv_layers)")
        if (region.kind, region.layer_id) in kv:
            raise InvalidArgument(f"region {region.index}: a second {name} region for layer {region.layer_id}")
        kv[(region.kind, region.layer_id)] = region.index
    if not kv:
        return kv, 0
    missing: list[str] = []
    for layer in kv_layers if kv_layers is not None else range(msg.layer_begin, msg.layer_end):
        missing.extend(f"{common_pb2.RegionKind.Name(k)}/layer {layer}" for k in kinds if (k, layer) not in kv)
        if len(missing) > 8:
            break
    if missing:
        raise InvalidArgument(f"KV regions missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    page_bytes = kv_page_bytes_of(msg.page_size_tokens, msg.kv_heads_per_rank, msg.head_dim, DTYPE_BYTES[msg.dtype], msg.kv_layout)
    counts = set()
    for index in kv.values():
        region = regions[index]
        if region.item_bytes != page_bytes:
            raise InvalidArgument(
                f"region {index}: item_bytes {region.item_bytes} is not one page "
                f"({msg.page_size_tokens} tokens x {msg.kv_heads_per_rank} heads x {msg.head_dim}"
                f"{' x 2 (keys and values)' if msg.kv_layout == FUSED else ''} x {msg.dtype} = {page_bytes})"
            )
        counts.add(region.items)
    if len(counts) != 1:
        raise InvalidArgument(f"every KV region must hold the same number of pages, got {sorted(counts)}")
    return kv, counts.pop()


def _index_aux(regions: tuple[RegionView, ...]) -> tuple[tuple[int, ...], int]:
    aux = tuple(r.index for r in regions if r.kind == common_pb2.REGION_KIND_AUX)
    rows = {regions[i].items for i in aux}
    if len(rows) > 1:
        raise InvalidArgument(f"every aux region must hold the same number of rows, got {sorted(rows)}")
    return aux, (rows.pop() if rows else 0)


def _index_state(
    msg: common_pb2.EngineLayout, regions: tuple[RegionView, ...]
) -> tuple[dict[str, tuple[int, tuple[int, ...]]], dict[str, int]]:
    declared: dict[str, int] = {}
    for comp in msg.state_components:
        if not comp.name:
            raise InvalidArgument("state component names must not be empty")
        if comp.name in declared:
            raise InvalidArgument(f"state component {comp.name!r} is declared twice")
        if comp.type == common_pb2.STATE_TYPE_UNSPECIFIED:
            raise InvalidArgument(f"state component {comp.name!r} has no type")
        declared[comp.name] = comp.type
    members: dict[str, list[int]] = {name: [] for name in declared}
    for region in regions:
        if region.kind != common_pb2.REGION_KIND_STATE:
            continue
        if region.component not in declared:
            raise InvalidArgument(f"region {region.index}: state component {region.component!r} is not declared")
        if not msg.layer_begin <= region.layer_id < msg.layer_end:
            raise InvalidArgument(
                f"region {region.index}: state of layer {region.layer_id} is outside this rank's layers "
                f"[{msg.layer_begin}, {msg.layer_end})"
            )
        members[region.component].append(region.index)
    components: dict[str, tuple[int, tuple[int, ...]]] = {}
    items: dict[str, int] = {}
    for name, indices in members.items():
        if not indices:
            raise InvalidArgument(f"state component {name!r} has no regions")
        counts = {regions[i].items for i in indices}
        if len(counts) != 1:
            raise InvalidArgument(f"state component {name!r}: every region must hold the same number of items")
        components[name] = (declared[name], tuple(indices))
        items[name] = counts.pop()
    return components, items
