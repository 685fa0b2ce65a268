"""What moves where: KV layouts, the rank mapping between parallel layouts, and
the descriptors, token runs, parts and packed blocks a chunk becomes, and an
engine's own room timeouts (pure functions and values the client and the
broker share).
"""

from kvbroker.plan._checksum import ChunkSum, chunk_checksum
from kvbroker.plan._descriptors import (
    BufferPlacement,
    DescriptorTable,
    build_descriptor_table,
    expand_rows,
)
from kvbroker.plan._indices import (
    NO_INDICES,
    IndexArray,
    as_index,
    as_indices,
    decode_indices,
    encode_indices,
)
from kvbroker.plan._layout import Layout, RankKey, kv_kinds_of, rank_key
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
    "Block",
    "BufferPlacement",
    "ChunkShape",
    "ChunkSum",
    "chunk_checksum",
    "DescriptorTable",
    "FULL_PAGES",
    "GroupShape",
    "IndexArray",
    "KvPairs",
    "Layout",
    "MAX_PARTS",
    "NO_INDICES",
    "PackLimit",
    "PartKind",
    "PartSpec",
    "RankKey",
    "RoomTimeouts",
    "SliceSide",
    "SourcePlan",
    "StagePolicy",
    "TokenRange",
    "as_index",
    "as_indices",
    "build_descriptor_table",
    "check_chunk",
    "check_declared_pages",
    "check_room_indices",
    "check_state_supported",
    "completed_pages",
    "decode_indices",
    "encode_indices",
    "expand_rows",
    "held_pages",
    "kv_block",
    "kv_kinds_of",
    "kv_pairs",
    "kv_regions",
    "landing_blocks",
    "packed_bytes",
    "packed_offsets",
    "page_blocks",
    "plan_chunk",
    "plan_sources",
    "pool_text",
    "rank_key",
    "run_descriptors",
    "same_token_count",
    "slice_side",
    "state_regions",
    "token_descriptors",
    "token_geometry",
    "token_runs",
    "transfer_pool",
]
