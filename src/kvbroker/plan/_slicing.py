"""Head-sliced KV transfers (different tp sizes, non-MLA): pure functions.

Pages are token-major ("NHD"): a page of one layer is ``page_size`` tokens,
each ``heads_per_rank * head_bytes`` long. A head slice of a page is
therefore ``page_size`` strided pieces of ``num_heads * head_bytes``.
Two ways to move them (docs/design.md sections 5 and 6):

- per-token descriptors (:func:`token_descriptors`): one NIXL descriptor per
  (layer region, page, token); correct, slow;
- staging (``kvbroker.broker.memory``), one copy on the side that holds
  fewer heads: the sender packs the receiver's slice and writes packed pages
  into the receiver's pages, or writes its whole pages into a slot the
  receiver reserved and the receiver unpacks them. The packed layout, shared
  by both sides:
  for every (layer, kind) pair in :func:`kv_region_pairs` order,
  ``[pages, page_size, num_heads * head_bytes]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbroker.errors import FailedPrecondition
from kvbroker.plan._descriptors import DescriptorTable
from kvbroker.plan._indices import IndexArray
from kvbroker.plan._layout import FUSED, Layout
from kvbroker.plan._mapping import SourcePlan
from kvbroker.v1 import common_pb2

__all__ = [
    "HeadSlice",
    "SliceSide",
    "head_slice",
    "kv_region_pairs",
    "kv_regions",
    "slice_side",
    "staged_bytes",
    "token_descriptors",
]


@dataclass(frozen=True)
class SliceSide:
    """Byte geometry of a head slice on one side of a transfer."""

    page_size: int
    #: Bytes of one token of one page (heads per rank x head bytes).
    token_bytes: int
    #: Where the slice starts inside a token.
    offset_bytes: int
    #: Bytes of the slice inside a token (heads moved x head bytes).
    slice_bytes: int


@dataclass(frozen=True)
class HeadSlice:
    """Both sides of one head-sliced (source, receiver) pair."""

    src: SliceSide
    dst: SliceSide


def slice_side(layout: Layout, head_start: int, num_heads: int, who: str) -> SliceSide:
    """The geometry of heads [head_start, head_start + num_heads) of ``layout``'s pages.

    A fused page (``KV_LAYOUT_HND_FUSED``) is head-major: one head's keys and
    values are one contiguous part of it, whatever order the attention kernel
    keeps inside. Its slice is described as one "token" per page (``page_size``
    1, the head's part of the page as the head's bytes), so every path below
    moves one contiguous piece per page.
    """
    if num_heads == 0 or head_start + num_heads > layout.kv_heads_per_rank:
        raise FailedPrecondition(
            f"heads [{head_start}, {head_start + num_heads}) are not inside the {who}'s "
            f"{layout.kv_heads_per_rank} heads per rank"
        )
    rows = 1 if layout.kv_layout == FUSED else layout.page_size_tokens
    head_bytes = layout.kv_page_bytes // layout.kv_heads_per_rank // rows
    return SliceSide(
        page_size=rows,
        token_bytes=layout.kv_heads_per_rank * head_bytes,
        offset_bytes=head_start * head_bytes,
        slice_bytes=num_heads * head_bytes,
    )


def head_slice(src: Layout, dst: Layout, plan: SourcePlan) -> HeadSlice:
    """The geometry of ``plan``'s slice; ``FailedPrecondition`` if it does not fit."""
    return HeadSlice(
        src=slice_side(src, plan.src_head_start, plan.num_heads, "sender"),
        dst=slice_side(dst, plan.dst_head_start, plan.num_heads, "receiver"),
    )


def kv_regions(layout: Layout, layer_begin: int, layer_end: int, who: str) -> tuple[int, ...]:
    """KV regions of every layer in [layer_begin, layer_end) that holds KV, each layer's kinds in order."""
    key = ("kv", layer_begin, layer_end)
    found: tuple[int, ...] | None = layout.memo.get(key)
    if found is None:
        found = layout.memo[key] = _regions_of(layout, layout.kv_layers_in(layer_begin, layer_end), who)
    return found


def _regions_of(layout: Layout, layers: list[int], who: str) -> tuple[int, ...]:
    out = []
    for layer in layers:
        for kind in layout.kv_kinds():
            region = layout.kv_regions.get((kind, layer))
            if region is None:
                raise FailedPrecondition(f"the {who} has no {common_pb2.RegionKind.Name(kind)} region for layer {layer}")
            out.append(region)
    return tuple(out)


def kv_region_pairs(src: Layout, dst: Layout, layer_begin: int, layer_end: int) -> tuple[tuple[int, int], ...]:
    """(source region, receiver region) of every KV kind of every layer in the range, paired by layer id
    (worked out once per pair of layouts and range: kept in the source's memo, beside the receiver's layout)."""
    key = ("pairs", id(dst), layer_begin, layer_end)
    found: tuple[Layout, tuple[tuple[int, int], ...]] | None = src.memo.get(key)
    if found is not None and found[0] is dst:
        return found[1]
    pairs = _pairs(src, dst, layer_begin, layer_end)
    remember(src, key, (dst, pairs))
    return pairs


def remember(layout: Layout, key: Any, value: Any) -> None:
    """Keep ``value`` in ``layout``'s memo (one that grew full starts over: the
    receivers' layouts and tables its entries hold come and go)."""
    if len(layout.memo) >= _MEMO_KEPT:
        layout.memo.clear()
    layout.memo[key] = value


#: How many entries a layout's memo holds before it starts over.
_MEMO_KEPT = 256


def _pairs(src: Layout, dst: Layout, layer_begin: int, layer_end: int) -> tuple[tuple[int, int], ...]:
    if src.mla != dst.mla:
        raise FailedPrecondition("one side is MLA and the other is not")
    if src.kv_layout != dst.kv_layout:
        raise FailedPrecondition("the two sides lay out their KV differently (kv_layout)")
    layers, theirs = src.kv_layers_in(layer_begin, layer_end), dst.kv_layers_in(layer_begin, layer_end)
    if layers != theirs:
        raise FailedPrecondition(
            f"the sender holds KV on layers {layers} and the receiver on {theirs} of [{layer_begin}, {layer_end}): "
            "not the same model (kv_layers)"
        )
    return tuple(zip(_regions_of(src, layers, "sender"), _regions_of(dst, layers, "receiver")))


def staged_bytes(num_regions: int, num_pages: int, side: SliceSide) -> int:
    """Bytes of the packed block of ``num_pages`` pages over ``num_regions`` regions."""
    return num_regions * num_pages * side.page_size * side.slice_bytes


def token_descriptors(
    src_table: DescriptorTable,
    dst_table: DescriptorTable,
    pairs: list[tuple[int, int]],
    src_pages: IndexArray,
    dst_pages: IndexArray,
    hs: HeadSlice,
) -> tuple[int, int, npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """One descriptor per (region pair, page, token): (local kind, remote kind, local N x 3, remote N x 3).

    Every pair must live in one memory kind on each side (KV regions do).
    """
    kinds = {(src_table.region_kind[s], dst_table.region_kind[d]) for s, d in pairs}
    if len(kinds) != 1:
        raise FailedPrecondition("the KV regions of a head-sliced transfer must share one memory kind per side")
    local_kind, remote_kind = kinds.pop()
    local = _token_descs(src_table, [s for s, _ in pairs], src_pages, hs.src)
    remote = _token_descs(dst_table, [d for _, d in pairs], dst_pages, hs.dst)
    return local_kind, remote_kind, local, remote


def _token_descs(
    table: DescriptorTable, regions: list[int], pages: IndexArray, side: SliceSide
) -> npt.NDArray[np.uint64]:
    page_addr = np.concatenate([table.item_addresses(r, pages) for r in regions]) if regions else np.zeros(0, np.uint64)
    devices = np.repeat(np.asarray([table.region_device[r] for r in regions], dtype=np.uint64), pages.size)
    tokens = np.arange(side.page_size, dtype=np.uint64) * np.uint64(side.token_bytes)
    out = np.empty((page_addr.size * side.page_size, 3), dtype=np.uint64)
    out[:, 0] = (page_addr[:, None] + tokens[None, :] + np.uint64(side.offset_bytes)).ravel()
    out[:, 1] = side.slice_bytes
    out[:, 2] = np.repeat(devices, side.page_size)
    return out
