"""What one chunk becomes on the wire: pure planning of its parts.

A chunk that a source sends to one receiver becomes one or more parts, each
one NIXL write carrying its own ``TransferNotice`` (``part`` of ``parts``):

- ``WHOLE``: whole items (KV pages of FULL_PAGES sources, aux rows, state
  items), by index into the prepared descriptor lists, one part per
  (local memory kind, remote memory kind) pair;
- ``STAGED``: the head slices of a HEAD_SLICE source's pages, packed into a
  staging buffer and written in one descriptor (docs/design.md section 6);
- ``TOKENS``: the same head slices with one descriptor per (layer region,
  page, token), when staging is off or the packed block cannot fit;
- ``NOTICE``: no bytes, only the notification: a completion-only source, or
  a last chunk with no pages, aux or state, so completion stays explicit.

Nothing here does I/O; the sender's state machine counts the parts in
flight and the executor carries them out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from kvbroker.broker.descriptors import DescriptorTable, Segment, plan_parts
from kvbroker.broker.layout import Layout
from kvbroker.broker.mapping import SourcePlan
from kvbroker.broker.segments import ChunkShape, build_segments
from kvbroker.broker.slicing import HeadSlice, head_slice, kv_region_pairs, staged_bytes
from kvbroker.errors import FailedPrecondition
from kvbroker.indices import IndexArray
from kvbroker.v1 import common_pb2

__all__ = ["PartKind", "PartSpec", "plan_chunk", "span_names"]


class PartKind(enum.Enum):
    WHOLE = "prepped"
    STAGED = "staged"
    TOKENS = "per_token"
    NOTICE = "notice"


@dataclass(frozen=True)
class PartSpec:
    """One part of a chunk to one receiver: what moves, not yet how."""

    kind: PartKind
    nbytes: int
    #: WHOLE: memory kinds and index lists into the prepared lists.
    local_kind: int = 0
    remote_kind: int = 0
    local_indices: IndexArray | None = None
    remote_indices: IndexArray | None = None
    #: Span names of the aux rows and state components this part carries.
    carries: tuple[str, ...] = ()
    #: STAGED / TOKENS: (source region, receiver region) of every KV region
    #: of the layers moved, the pages on both sides and the head slice.
    pairs: tuple[tuple[int, int], ...] = ()
    src_pages: IndexArray | None = None
    dst_pages: IndexArray | None = None
    slice: HeadSlice | None = None


#: Decides whether a head-sliced block of ``nbytes`` from memory kind
#: ``src_kind`` (device ``src_device``) to ``dst_kind`` is staged.
StagePolicy = Callable[[int, int, int, int], bool]


def plan_chunk(
    src: Layout,
    src_table: DescriptorTable,
    dst: Layout,
    dst_table: DescriptorTable,
    plan: SourcePlan,
    shape: ChunkShape,
    stage: StagePolicy,
) -> list[PartSpec]:
    """The parts of one chunk (``shape``) that source ``plan`` sends one receiver.

    Raises ``FailedPrecondition`` when the layouts do not pair. Never empty:
    a chunk that moves nothing is one ``NOTICE`` part.
    """
    segments = build_segments(src, dst, plan, shape)
    parts = [
        PartSpec(
            kind=PartKind.WHOLE,
            nbytes=p.bytes,
            local_kind=p.local_kind,
            remote_kind=p.remote_kind,
            local_indices=p.local_indices,
            remote_indices=p.remote_indices,
            carries=_carried(src, src_table, dst_table, segments).get((p.local_kind, p.remote_kind), ()),
        )
        for p in plan_parts(src_table, dst_table, segments)
    ]
    if plan.head_sliced and shape.src_pages.size:
        hs = head_slice(src, dst, plan)
        pairs = tuple(kv_region_pairs(src, dst, plan.layer_begin, plan.layer_end))
        nbytes = staged_bytes(len(pairs), int(shape.src_pages.size), hs.src)
        kinds = {(src_table.region_kind[s], dst_table.region_kind[d]) for s, d in pairs}
        if len(kinds) != 1:
            raise FailedPrecondition("the KV regions of a head-sliced transfer must share one memory kind per side")
        (src_kind, dst_kind) = next(iter(kinds))
        device = src_table.region_device[pairs[0][0]] if pairs else 0
        staged = stage(nbytes, src_kind, device, dst_kind)
        parts.append(
            PartSpec(
                kind=PartKind.STAGED if staged else PartKind.TOKENS,
                nbytes=nbytes,
                local_kind=src_kind,
                remote_kind=dst_kind,
                pairs=pairs,
                src_pages=shape.src_pages,
                dst_pages=shape.dst_pages,
                slice=hs,
            )
        )
    if not parts:
        parts.append(PartSpec(kind=PartKind.NOTICE, nbytes=0))
    return parts


def _carried(
    layout: Layout, src: DescriptorTable, dst: DescriptorTable, segments: list[Segment]
) -> dict[tuple[int, int], tuple[str, ...]]:
    """(local kind, remote kind) -> span names of the aux rows and state components in that part."""
    out: dict[tuple[int, int], list[str]] = {}
    for seg in segments:
        name = span_names(layout, seg.src_region)
        if name is None:
            continue
        names = out.setdefault((src.region_kind[seg.src_region], dst.region_kind[seg.dst_region]), [])
        if name not in names:
            names.append(name)
    return {k: tuple(v) for k, v in out.items()}


def span_names(layout: Layout, region: int) -> str | None:
    """The span name of what region ``region`` carries, for aux and state regions."""
    r = layout.regions[region]
    if r.kind == common_pb2.REGION_KIND_AUX:
        return "kvbroker.aux"
    if r.kind == common_pb2.REGION_KIND_STATE:
        return f"kvbroker.state.{r.component}"
    return None
