"""Builders of hand-made ``EngineLayout`` protos for the pure unit tests.

The builders are handed out by fixtures (``--import-mode=importlib`` makes a
plain ``from conftest import ...`` unreliable). A built layout puts every KV
region (K then V per layer, or one MLA region per layer) in buffer 0, the aux
regions in buffer 1 and the state regions in buffer 2; the buffer sizes it
returns fit the regions exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvbroker.plan import DTYPE_BYTES, Layout, RankKey, RoomTimeouts
from kvbroker.v1 import common_pb2


@dataclass(frozen=True)
class StateSpec:
    """One state component: ``regions`` regions of ``items`` items of ``item_bytes``."""

    name: str
    type: int
    items: int = 8
    item_bytes: int = 64
    regions: int = 2


@dataclass
class BuiltLayout:
    """A layout proto, the sizes of its buffers, and the rank it belongs to."""

    proto: common_pb2.EngineLayout
    buffer_sizes: list[int]
    rank: RankKey
    page_bytes: int
    extra: dict[str, object] = field(default_factory=dict)

    def build(self) -> Layout:
        return Layout.from_proto(self.proto, rank=self.rank, buffer_sizes=self.buffer_sizes)


def _layout_proto(
    *,
    mla: bool = False,
    role: int = common_pb2.ROLE_PREFILL,
    group: str = "g",
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    num_layers: int = 4,
    pp_layer_begins: Sequence[int] = (),
    page_size: int = 4,
    total_kv_heads: int | None = None,
    kv_heads_per_rank: int | None = None,
    head_dim: int = 8,
    dtype: str = "float16",
    num_pages: int = 16,
    aux_rows: int = 4,
    aux_row_bytes: Sequence[int] = (16, 32),
    state: Sequence[StateSpec] = (),
) -> BuiltLayout:
    """A valid layout for rank (group, tp_rank, pp_rank) of a group of that shape."""
    if total_kv_heads is None:
        total_kv_heads = 1 if mla else 8
    if kv_heads_per_rank is None:
        kv_heads_per_rank = 1 if mla else max(1, total_kv_heads // tp_size)
    begins = list(pp_layer_begins)
    if not begins:
        per = num_layers // pp_size
        begins = [i * per for i in range(pp_size)]
    layer_begin = begins[pp_rank]
    layer_end = begins[pp_rank + 1] if pp_rank + 1 < pp_size else num_layers
    page_bytes = page_size * kv_heads_per_rank * head_dim * DTYPE_BYTES[dtype]
    kinds = (
        (common_pb2.REGION_KIND_MLA,)
        if mla
        else (common_pb2.REGION_KIND_KEY, common_pb2.REGION_KIND_VALUE)
    )
    regions: list[common_pb2.Region] = []
    offset = 0
    for layer in range(layer_begin, layer_end):
        for kind in kinds:
            regions.append(
                common_pb2.Region(
                    kind=kind,
                    buffer=0,
                    offset_bytes=offset,
                    length_bytes=num_pages * page_bytes,
                    item_bytes=page_bytes,
                    layer_id=layer,
                )
            )
            offset += num_pages * page_bytes
    sizes = [offset]
    aux_offset = 0
    for row_bytes in aux_row_bytes:
        regions.append(
            common_pb2.Region(
                kind=common_pb2.REGION_KIND_AUX,
                buffer=1,
                offset_bytes=aux_offset,
                length_bytes=aux_rows * row_bytes,
                item_bytes=row_bytes,
            )
        )
        aux_offset += aux_rows * row_bytes
    sizes.append(aux_offset)
    state_offset = 0
    components = []
    for spec in state:
        components.append(common_pb2.StateComponent(name=spec.name, type=spec.type))  # type: ignore[arg-type]
        for i in range(spec.regions):
            regions.append(
                common_pb2.Region(
                    kind=common_pb2.REGION_KIND_STATE,
                    buffer=2,
                    offset_bytes=state_offset,
                    length_bytes=spec.items * spec.item_bytes,
                    item_bytes=spec.item_bytes,
                    layer_id=layer_begin + i,
                    component=spec.name,
                )
            )
            state_offset += spec.items * spec.item_bytes
    if state:
        sizes.append(state_offset)
    proto = common_pb2.EngineLayout(
        role=role,  # type: ignore[arg-type]
        tp_size=tp_size,
        pp_size=pp_size,
        num_layers=num_layers,
        layer_begin=layer_begin,
        layer_end=layer_end,
        page_size_tokens=page_size,
        total_kv_heads=total_kv_heads,
        kv_heads_per_rank=kv_heads_per_rank,
        head_dim=head_dim,
        dtype=dtype,
        mla=mla,
        regions=regions,
        state_components=components,
        pp_layer_begins=begins if (pp_layer_begins or pp_size > 1) else [],
    )
    return BuiltLayout(
        proto=proto,
        buffer_sizes=sizes,
        rank=RankKey(group, tp_rank, pp_rank),
        page_bytes=page_bytes,
    )


@pytest.fixture
def layout_proto() -> Callable[..., BuiltLayout]:
    """Builder of a valid MHA/GQA (``mla=False``) or MLA (``mla=True``) layout proto."""
    return _layout_proto


@pytest.fixture
def make_layout() -> Callable[..., Layout]:
    """Builder of a validated :class:`Layout` (same keywords as ``layout_proto``)."""

    def make(**kwargs: object) -> Layout:
        return _layout_proto(**kwargs).build()  # type: ignore[arg-type]

    return make


@pytest.fixture
def state_spec() -> type[StateSpec]:
    """The ``StateSpec`` class, for the ``state=`` keyword of the builders."""
    return StateSpec


# -- stand-ins for the room state machines' unit tests ------------------------


@dataclass(eq=False)
class EngineStub:
    """What the room state machines read of an engine rank (``engines.Engine``)."""

    key: RankKey
    engine_id: str
    layout: Layout
    table: Any
    generation: int = 1
    timeouts: RoomTimeouts = field(default_factory=RoomTimeouts)

    @property
    def label(self) -> str:
        return f"{self.key}#{self.generation}"

    @property
    def role(self) -> int:
        return self.layout.role


def _engine_stub(
    role: str = "prefill",
    *,
    group: str | None = None,
    memory_kind: int = common_pb2.MEMORY_KIND_DRAM,
    device: int = 0,
    base_address: int = 1 << 30,
    **kwargs: Any,
) -> EngineStub:
    from kvbroker.plan import BufferPlacement, build_descriptor_table

    role_value = common_pb2.ROLE_PREFILL if role == "prefill" else common_pb2.ROLE_DECODE
    built = _layout_proto(role=role_value, group=group or f"{role}-group", **kwargs)
    layout = built.build()
    placements = [
        BufferPlacement(base_address + (i << 24), size, *((memory_kind, device) if i == 0 else (common_pb2.MEMORY_KIND_DRAM, 0)))
        for i, size in enumerate(built.buffer_sizes)
    ]
    table = build_descriptor_table(layout, placements)
    return EngineStub(key=built.rank, engine_id=f"eng-{built.rank}", layout=layout, table=table)


@pytest.fixture
def engine_stub() -> Callable[..., EngineStub]:
    """Builder of an engine rank stand-in with a valid layout and descriptor table
    (keywords: ``role``, ``group``, ``memory_kind`` and ``device`` of its KV buffer, and any of ``layout_proto``'s)."""
    return _engine_stub
