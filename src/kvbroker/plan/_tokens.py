"""KV between engines whose pages hold different numbers of tokens: pure functions.

A room's tokens are numbered from 0. On a side whose pages hold ``P``
tokens, token ``t`` is in room page ``t // P`` at offset ``t % P``; each side
counts room pages in its own page size (the sender's ``num_pages`` and
``room_page``, the receiver's ``prefix_pages`` and ``pages``). When the two
page sizes differ the broker moves *token runs*: maximal ranges of tokens
inside one page on both sides, cut wherever either side's page ends.

Pages must be token-major (NHD: the keys, or the values, of every head of
a token together; MLA): a run is then one contiguous piece of a page per
layer region, and runs adjacent in memory on both sides merge into one
descriptor. Fused pages (``KV_LAYOUT_HND_FUSED``) are refused by the
mapping: the order of tokens inside them is the attention kernel's.

What a chunk moves: the room tokens of its pages, clipped to what the
receiver lacks (at or after its prefix, before the end of its pages); the
pages' tails past the prompt's last token move too when both sides have
room for them (they are never read). Which receiver pages a chunk
*completes*: those whose last token (clipped to the room's end) it writes;
the last chunk completes the rest. A receiver page written by several
chunks has arrived when all of them have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbroker.errors import FailedPrecondition
from kvbroker.plan._descriptors import DescriptorTable
from kvbroker.plan._indices import IndexArray
from kvbroker.plan._layout import FUSED, Layout

__all__ = [
    "TokenGeometry",
    "TokenRange",
    "check_alike",
    "completed_pages",
    "held_pages",
    "run_descriptors",
    "same_token_count",
    "token_geometry",
    "token_rows",
    "token_runs",
]

#: Columns of a runs array.
SRC_PAGE, SRC_OFFSET, DST_PAGE, DST_OFFSET, TOKENS = range(5)


@dataclass(frozen=True)
class TokenRange:
    """Room tokens [begin, end) of one side's ``pages``, which hold room pages from ``first``."""

    pages: IndexArray
    first: int
    begin: int
    end: int


@dataclass(frozen=True)
class TokenGeometry:
    """How one side's token-major KV pages hold tokens (the same for every KV region of a layout)."""

    page_size: int
    #: Bytes of one token of one KV region.
    token_bytes: int


def token_geometry(layout: Layout) -> TokenGeometry:
    if layout.kv_layout == FUSED:
        raise FailedPrecondition("fused (KV_LAYOUT_HND_FUSED) pages move whole only")
    return TokenGeometry(layout.page_size_tokens, layout.kv_page_bytes // layout.page_size_tokens)


def same_token_count(pages_a: int, size_a: int, pages_b: int, size_b: int) -> bool:
    """Whether some number of tokens fills exactly ``pages_a`` pages of
    ``size_a`` tokens and ``pages_b`` pages of ``size_b`` (the last ones partly)."""
    if pages_a == 0 or pages_b == 0:
        return pages_a == pages_b
    return max((pages_a - 1) * size_a, (pages_b - 1) * size_b) < min(pages_a * size_a, pages_b * size_b)


def held_pages(prefix_pages: int, prefix_page_size: int, page_size: int) -> int:
    """Whole pages of ``page_size`` tokens inside a prefix of ``prefix_pages`` pages of ``prefix_page_size``."""
    return prefix_pages * prefix_page_size // page_size


def token_runs(
    src_pages: IndexArray,
    src_first: int,
    src_size: int,
    dst_pages: IndexArray,
    dst_first: int,
    dst_size: int,
    begin: int,
    end: int,
) -> npt.NDArray[np.int64]:
    """The runs that move room tokens [begin, end): K x 5 (source page, offset
    in it, receiver page, offset in it, tokens), in token order.

    ``src_pages[i]`` holds room page ``src_first + i`` on the sending side,
    ``dst_pages[j]`` room page ``dst_first + j`` on the receiving side; both
    must cover [begin, end) (``FailedPrecondition`` otherwise).
    """
    if end <= begin:
        return np.zeros((0, 5), dtype=np.int64)
    if begin < src_first * src_size or end > (src_first + src_pages.size) * src_size:
        raise FailedPrecondition(f"tokens [{begin}, {end}) are not all in the sender's pages of this chunk")
    if begin < dst_first * dst_size or end > (dst_first + dst_pages.size) * dst_size:
        raise FailedPrecondition(f"tokens [{begin}, {end}) are not all in the receiver's pages")
    cuts = np.union1d(
        np.arange(-(-begin // src_size) * src_size, end, src_size, dtype=np.int64),
        np.arange(-(-begin // dst_size) * dst_size, end, dst_size, dtype=np.int64),
    )
    starts = np.union1d(cuts, [begin])
    lengths = np.diff(np.append(starts, end))
    out = np.empty((starts.size, 5), dtype=np.int64)
    out[:, SRC_PAGE] = src_pages[starts // src_size - src_first]
    out[:, SRC_OFFSET] = starts % src_size
    out[:, DST_PAGE] = dst_pages[starts // dst_size - dst_first]
    out[:, DST_OFFSET] = starts % dst_size
    out[:, TOKENS] = lengths
    return out


def completed_pages(done_before: int, dst_count: int, dst_first: int, dst_size: int, end: int, is_last: bool) -> tuple[int, int]:
    """Which receiver pages (positions in its ``pages``) a chunk completes: (first, count).

    ``done_before``: pages completed by earlier chunks; ``end``: the room token
    the chunk's tokens end at. The last chunk completes every page left.
    """
    if is_last:
        return done_before, max(0, dst_count - done_before)
    upto = min(dst_count, max(0, end // dst_size - dst_first))
    return done_before, max(0, upto - done_before)


def token_rows(
    table: DescriptorTable, regions: list[int], page_col: int, offset_col: int, runs: npt.NDArray[np.int64], geom: TokenGeometry
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Addresses, lengths and devices of every (region, run) piece on one side, in that order."""
    within = runs[:, offset_col] * geom.token_bytes
    addresses, devices = [], []
    for region in regions:
        addresses.append(table.item_addresses(region, runs[:, page_col].astype(np.int32)).astype(np.int64) + within)
        devices.append(np.full(runs.shape[0], table.region_device[region], dtype=np.uint64))
    lengths = np.tile(runs[:, TOKENS] * geom.token_bytes, len(regions))
    address = np.concatenate(addresses) if addresses else np.zeros(0, np.int64)
    device = np.concatenate(devices) if devices else np.zeros(0, np.uint64)
    return address.astype(np.uint64), lengths.astype(np.uint64), device


def run_descriptors(
    src_table: DescriptorTable,
    dst_table: DescriptorTable,
    pairs: tuple[tuple[int, int], ...],
    runs: npt.NDArray[np.int64],
    src: TokenGeometry,
    dst: TokenGeometry,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """NIXL descriptors (local N x 3, remote N x 3) for ``runs`` of every region
    pair, one per (region pair, run); pieces adjacent in memory on both sides are merged. The two sides'
    tokens must be alike (:func:`check_alike`)."""
    s_addr, length, s_dev = token_rows(src_table, [s for s, _ in pairs], SRC_PAGE, SRC_OFFSET, runs, src)
    d_addr, _, d_dev = token_rows(dst_table, [d for _, d in pairs], DST_PAGE, DST_OFFSET, runs, dst)
    if length.size == 0:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty
    # Merge pieces that continue the previous one on both sides.
    follows = (
        (s_addr[1:] == s_addr[:-1] + length[:-1])
        & (d_addr[1:] == d_addr[:-1] + length[:-1])
        & (s_dev[1:] == s_dev[:-1])
        & (d_dev[1:] == d_dev[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    merged = np.add.reduceat(length, starts)
    return np.stack((s_addr[starts], merged, s_dev[starts]), axis=1), np.stack((d_addr[starts], merged, d_dev[starts]), axis=1)


def check_alike(src: TokenGeometry, dst: TokenGeometry) -> None:
    """``FailedPrecondition`` unless a token of a KV region has the same bytes on both sides."""
    if src.token_bytes != dst.token_bytes:
        raise FailedPrecondition(
            f"a token of a KV region is {src.token_bytes} bytes on the sender, {dst.token_bytes} on the receiver"
        )
