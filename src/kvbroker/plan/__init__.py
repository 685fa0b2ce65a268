"""What moves where: KV layouts, the rank mapping between parallel layouts, and
the descriptors, token runs, parts and packed blocks a chunk becomes, and an
engine's own room timeouts (pure functions and values the client and the
broker share).
"""

from kvbroker.plan._checksum import ChunkSum, chunk_checksum
from kvbroker.plan._descriptors import (
    BufferPlacement,
    DescriptorTable,
    Segment,
    build_descriptor_table,
    expand_rows,
)
from kvbroker.plan._indices import (
    NO_INDICES,
    NO_STATE,
    IndexArray,
    as_index,
    as_indices,
    decode_indices,
    encode_indices,
    read_only,
)
from kvbroker.plan._layout import DTYPE_BYTES, Layout, RankKey, kv_kinds_of, rank_key
from kvbroker.plan._mapping import (
    FULL_PAGES,
    GroupShape,
    SourcePlan,
    check_state_supported,
    plan_sources,
)
from kvbroker.plan._packing import (
    Block,
    kv_block,
    landing_blocks,
    packed_bytes,
    packed_offsets,
    plan_packed,
    pool_text,
    transfer_pool,
)
from kvbroker.plan._parts import (
    MAX_PARTS,
    KvPairs,
    PackLimit,
    PartKind,
    PartSpec,
    StagePolicy,
    kv_pairs,
    page_blocks,
    plan_chunk,
)
from kvbroker.plan._segments import ChunkShape, state_regions
from kvbroker.plan._slicing import SliceSide, kv_regions, slice_side, token_descriptors
from kvbroker.plan._timeouts import RoomTimeouts
from kvbroker.plan._tokens import (
    TokenRange,
    completed_pages,
    held_pages,
    run_descriptors,
    same_token_count,
    token_geometry,
    token_runs,
)
from kvbroker.plan._validation import check_chunk, check_declared_pages, check_room_indices

__all__ = [
    # Engine layouts and rank keys (_layout).
    "DTYPE_BYTES",
    "Layout",
    "RankKey",
    "kv_kinds_of",
    "rank_key",
    # Page-index lists on the wire (_indices).
    "IndexArray",
    "NO_INDICES",
    "NO_STATE",
    "as_index",
    "as_indices",
    "decode_indices",
    "read_only",
    "encode_indices",
    # The check of every index a room or chunk names (_validation).
    "check_chunk",
    "check_declared_pages",
    "check_room_indices",
    # Which sender ranks owe a receiver rank what (_mapping).
    "FULL_PAGES",
    "GroupShape",
    "SourcePlan",
    "check_state_supported",
    "plan_sources",
    # Descriptor tables: regions and indices to NIXL index lists (_descriptors).
    "BufferPlacement",
    "DescriptorTable",
    "Segment",
    "build_descriptor_table",
    "expand_rows",
    # What one chunk moves, region by region (_segments).
    "ChunkShape",
    "state_regions",
    # Head-sliced KV between different tp sizes (_slicing).
    "SliceSide",
    "kv_regions",
    "slice_side",
    "token_descriptors",
    # Token runs between sides of different page sizes (_tokens).
    "TokenRange",
    "completed_pages",
    "held_pages",
    "run_descriptors",
    "same_token_count",
    "token_geometry",
    "token_runs",
    # The parts a chunk becomes on the wire (_parts).
    "MAX_PARTS",
    "KvPairs",
    "PackLimit",
    "PartKind",
    "PartSpec",
    "StagePolicy",
    "kv_pairs",
    "page_blocks",
    "plan_chunk",
    # The device path's packed parts: blocks of bytes (_packing).
    "Block",
    "kv_block",
    "landing_blocks",
    "packed_bytes",
    "packed_offsets",
    "plan_packed",
    "pool_text",
    "transfer_pool",
    # End-to-end chunk checksums (_checksum).
    "ChunkSum",
    "chunk_checksum",
    # An engine rank's own room timeouts (_timeouts).
    "RoomTimeouts",
]
