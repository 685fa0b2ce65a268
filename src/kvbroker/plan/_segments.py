"""What one chunk moves: pure functions from layouts, a plan and indices to segments.

A :class:`~kvbroker.plan.Segment` pairs items of one source
region with items of one destination region. For a chunk of whole pages:

- KV (whole pages, ``SOURCE_MODE_FULL_PAGES``): for every layer the source
  owes (``SourcePlan.layer_begin/end``, paired by layer id) and every KV kind
  (KEY and VALUE, or MLA), the chunk's source pages go to the matching slice
  of the receiver's pages (head-sliced KV is ``slicing``'s business);
- aux (last chunk, when the source sends aux and the receiver asked for a
  row): the source row of every aux region goes to the receiver's row of the
  aux region in the same position;
- state (last chunk, when the source sends state): for every component the
  receiver listed with non-empty indices, the source's indices of that
  component go to the receiver's, for the regions of the source's layers,
  paired by layer id. A length mismatch is trimmed to the shorter list for
  paged components (SWA, NSA) and is an error for position-indexed ones
  (Mamba).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import structlog

from kvbroker.errors import FailedPrecondition
from kvbroker.plan._descriptors import Segment
from kvbroker.plan._indices import IndexArray
from kvbroker.plan._layout import Layout
from kvbroker.plan._mapping import SourcePlan
from kvbroker.plan._slicing import kv_region_pairs
from kvbroker.plan._tokens import TokenRange
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["ChunkShape", "build_segments", "same_item_bytes", "state_regions", "state_segments"]

log = structlog.get_logger(__name__)

_PAGED_STATE = (common_pb2.STATE_TYPE_SWA, common_pb2.STATE_TYPE_NSA)


@dataclass(frozen=True)
class ChunkShape:
    """The indices of one chunk on both sides."""

    src_pages: IndexArray
    dst_pages: IndexArray
    #: (source row, destination row) when the chunk carries aux.
    aux_rows: tuple[int, int] | None
    #: component -> (source indices, destination indices) when it carries state.
    state: dict[str, tuple[IndexArray, IndexArray]]
    #: Different page sizes: the KV moves as token runs, the sender's room
    #: tokens ``tokens`` in ``runs`` (``tokens.token_runs``); ``src_pages``
    #: and ``dst_pages`` are empty then.
    tokens: TokenRange | None = None
    runs: npt.NDArray[np.int64] | None = None
    #: The same room tokens among the receiver's pages (the device path packs them).
    dst_tokens: TokenRange | None = None


def build_segments(src: Layout, dst: Layout, plan: SourcePlan, shape: ChunkShape, *, kv: bool = True) -> list[Segment]:
    """The segments of one chunk that move whole items: KV pages (unless the
    plan slices heads: see ``slicing``; or ``kv`` is False: the caller plans
    them, see ``parts.KvPairs``), aux rows and state items. Raises
    ``FailedPrecondition`` on layouts that do not pair."""
    segments: list[Segment] = []
    if kv and shape.src_pages.size and plan.mode == peer_pb2.SOURCE_MODE_FULL_PAGES:
        for s, d in kv_region_pairs(src, dst, plan.layer_begin, plan.layer_end):
            item = same_item_bytes(src, s, dst, d, f"layer {src.regions[s].layer_id}")
            segments.append(Segment(s, d, shape.src_pages, shape.dst_pages, item))
    if shape.aux_rows is not None:
        if len(src.aux_regions) != len(dst.aux_regions):
            raise FailedPrecondition(
                f"the sender has {len(src.aux_regions)} aux regions, the receiver {len(dst.aux_regions)}"
            )
        src_row = np.array([shape.aux_rows[0]], dtype=np.int32)
        dst_row = np.array([shape.aux_rows[1]], dtype=np.int32)
        for i, (s, d) in enumerate(zip(src.aux_regions, dst.aux_regions)):
            item = same_item_bytes(src, s, dst, d, f"aux region {i}")
            segments.append(Segment(s, d, src_row, dst_row, item))
    for name, (src_idx, dst_idx) in shape.state.items():
        segments.extend(state_segments(src, dst, name, src_idx, dst_idx, plan.layer_begin, plan.layer_end))
    return segments


def state_regions(layout: Layout, name: str, layer_begin: int, layer_end: int) -> list[int]:
    """Regions of component ``name`` whose layer is in [layer_begin, layer_end), in listed order."""
    return [r for r in layout.state_components[name][1] if layer_begin <= layout.regions[r].layer_id < layer_end]


def state_segments(
    src: Layout,
    dst: Layout,
    name: str,
    src_idx: IndexArray,
    dst_idx: IndexArray,
    layer_begin: int,
    layer_end: int,
) -> list[Segment]:
    """Segments of state component ``name`` for the layers [layer_begin, layer_end).

    Regions pair by (layer id, position among that layer's regions). A length
    mismatch is trimmed for paged components (on local copies, never the
    inputs: lesson 4) and is an error for position-indexed ones.
    """
    if name not in src.state_components or name not in dst.state_components:
        side = "sender" if name not in src.state_components else "receiver"
        raise FailedPrecondition(f"the {side} has no state component {name!r}")
    src_type = src.state_components[name][0]
    if src_type != dst.state_components[name][0]:
        raise FailedPrecondition(f"state component {name!r} has different types on the two sides")
    src_regions = state_regions(src, name, layer_begin, layer_end)
    dst_regions = state_regions(dst, name, layer_begin, layer_end)
    src_layers = [src.regions[r].layer_id for r in src_regions]
    dst_layers = [dst.regions[r].layer_id for r in dst_regions]
    if src_layers != dst_layers:
        raise FailedPrecondition(
            f"state component {name!r}: the sender's regions are at layers {src_layers}, the receiver's at {dst_layers}"
        )
    if src_idx.size != dst_idx.size:
        if src_type not in _PAGED_STATE:
            raise FailedPrecondition(
                f"state component {name!r} ({common_pb2.StateType.Name(src_type)}) is position-indexed: the sender "
                f"sent {src_idx.size} indices, the receiver expects {dst_idx.size}"
            )
        n = min(src_idx.size, dst_idx.size)
        log.warning("state_indices_trimmed", component=name, sender=int(src_idx.size), receiver=int(dst_idx.size), kept=n)
        src_idx, dst_idx = src_idx[:n], dst_idx[:n]
    segments = []
    for i, (s, d) in enumerate(zip(src_regions, dst_regions)):
        item = same_item_bytes(src, s, dst, d, f"state {name!r} region {i}")
        segments.append(Segment(s, d, src_idx, dst_idx, item))
    return segments


def same_item_bytes(src: Layout, s: int, dst: Layout, d: int, what: str) -> int:
    a, b = src.regions[s].item_bytes, dst.regions[d].item_bytes
    if a != b:
        raise FailedPrecondition(f"{what}: the sender's items are {a} bytes, the receiver's {b}")
    return a
