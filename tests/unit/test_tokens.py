"""Token runs between different page sizes (broker/tokens.py), against token-by-token definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.broker.rooms import SenderLeg, SourceExpectation
from kvbroker.errors import FailedPrecondition
from kvbroker.plan import FULL_PAGES, DescriptorTable, RankKey, SourcePlan
from kvbroker.plan._tokens import (
    TokenGeometry,
    completed_pages,
    held_pages,
    run_descriptors,
    same_token_count,
    token_runs,
)


def test_same_token_count_is_the_definition() -> None:
    """same_token_count(a, sa, b, sb) is true exactly when some token count fills a pages of sa tokens and b pages of
    sb."""
    for a in range(0, 8):
        for sa in range(1, 7):
            for b in range(0, 8):
                for sb in range(1, 7):
                    exists = any(-(-t // sa) == a and -(-t // sb) == b for t in range(0, 60))
                    assert same_token_count(a, sa, b, sb) == exists, (a, sa, b, sb)


def test_held_pages_are_the_whole_ones() -> None:
    """held_pages counts the whole pages of the other page size that a number of pages' tokens fill."""
    assert held_pages(3, 8, 4) == 6 and held_pages(3, 4, 8) == 1 and held_pages(2, 6, 4) == 3 and held_pages(0, 4, 8) == 0


@given(
    ps=st.integers(1, 9),
    pd=st.integers(1, 9),
    data=st.data(),
)
def test_runs_move_every_token_to_where_the_receiver_holds_it(ps: int, pd: int, data: st.DataObject) -> None:
    """token_runs moves every token of the range from its sender page and offset to its receiver page and offset, in
    maximal runs."""
    tokens = data.draw(st.integers(1, 60))
    src_first = data.draw(st.integers(0, (tokens - 1) // ps))
    dst_first = data.draw(st.integers(0, (tokens - 1) // pd))
    begin = data.draw(st.integers(max(src_first * ps, dst_first * pd), tokens))
    end = data.draw(st.integers(begin, tokens))
    src = np.array(data.draw(st.permutations(range(100, 100 + -(-tokens // ps) - src_first))), dtype=np.int32)
    dst = np.array(data.draw(st.permutations(range(200, 200 + -(-tokens // pd) - dst_first))), dtype=np.int32)
    runs = token_runs(src, src_first, ps, dst, dst_first, pd, begin, end)
    moved = [
        ((sp, so + i), (dp, do + i)) for sp, so, dp, do, n in runs.tolist() for i in range(n)
    ]
    expected = [
        ((int(src[t // ps - src_first]), t % ps), (int(dst[t // pd - dst_first]), t % pd)) for t in range(begin, end)
    ]
    assert moved == expected
    # Maximal: every run ends where a page ends on one side (or at the end).
    for _sp, so, _dp, do, n in runs.tolist()[:-1]:
        assert so + n == ps or do + n == pd


def test_runs_refuse_tokens_outside_the_pages() -> None:
    """token_runs refuses, FAILED_PRECONDITION, tokens past the sender's pages or the receiver's, naming which."""
    pages = np.arange(2, dtype=np.int32)
    with pytest.raises(FailedPrecondition, match="sender's pages"):
        token_runs(pages, 0, 4, np.arange(4, dtype=np.int32), 0, 4, 0, 9)
    with pytest.raises(FailedPrecondition, match="receiver's pages"):
        token_runs(np.arange(4, dtype=np.int32), 0, 4, pages, 1, 4, 0, 8)


@given(ps=st.integers(1, 9), pd=st.integers(1, 9), tokens=st.integers(1, 60), prefix=st.integers(0, 5), data=st.data())
def test_each_receiver_page_is_completed_once_by_the_chunk_that_writes_its_last_token(
    ps: int, pd: int, tokens: int, prefix: int, data: st.DataObject
) -> None:
    """However a room is cut into chunks, each receiver page is completed once, in order, by the chunk that writes its
    last token."""
    dst_end = -(-tokens // pd)
    prefix = min(prefix, dst_end - 1)
    count = dst_end - prefix
    src_pages = -(-tokens // ps)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, src_pages - 1)), max_size=4)))) if src_pages > 1 else []
    bounds = [0, *cuts, src_pages]
    done, seen = 0, []
    for i, b in enumerate(bounds[1:]):
        stop = min(b * ps, dst_end * pd)
        first, n = completed_pages(done, count, prefix, pd, stop, i == len(bounds) - 2)
        assert first == done
        for position in range(first, first + n):
            page_end = min((prefix + position + 1) * pd, tokens)
            assert page_end <= max(stop, tokens if i == len(bounds) - 2 else 0), "completed before its last token came"
        seen.extend(range(first, first + n))
        done = first + n
    assert seen == list(range(count))


def _table(item_bytes: int, base: int, pages: int) -> DescriptorTable:
    rows = {0: np.array([[base, item_bytes, 0, item_bytes, pages]], dtype=np.uint64)}
    return DescriptorTable(rows, (0,), (0,), (base,), (item_bytes,), (0,))


def test_runs_adjacent_in_memory_on_both_sides_merge() -> None:
    """Pages 0-3 of 4 tokens into pages 0-1 of 8, both consecutive in memory: one descriptor; the
    receiver's pages in reverse order: one per receiver page."""
    src_t, dst_t = _table(4 * 10, 1000, 8), _table(8 * 10, 100000, 8)
    runs = token_runs(np.arange(4, dtype=np.int32), 0, 4, np.arange(2, dtype=np.int32), 0, 8, 0, 16)
    local, remote = run_descriptors(src_t, dst_t, ((0, 0),), runs, TokenGeometry(4, 10), TokenGeometry(8, 10))
    assert local.tolist() == [[1000, 160, 0]] and remote.tolist() == [[100000, 160, 0]]
    runs = token_runs(np.arange(4, dtype=np.int32), 0, 4, np.array([1, 0], dtype=np.int32), 0, 8, 0, 16)
    local, remote = run_descriptors(src_t, dst_t, ((0, 0),), runs, TokenGeometry(4, 10), TokenGeometry(8, 10))
    assert local.tolist() == [[1000, 80, 0], [1080, 80, 0]] and remote.tolist() == [[100080, 80, 0], [100000, 80, 0]]


def test_a_straddled_page_arrived_only_if_every_chunk_that_wrote_it_landed() -> None:
    """Pages of 4 tokens, chunks of 6: chunk 0 wrote tokens [0, 6) and completed page 0; chunk 1
    wrote [6, 12) and completed pages 1 and 2. Page 1 started in chunk 0: with chunk 0 lost it did
    not arrive, though chunk 1 (which completed it) landed."""
    plan = SourcePlan(RankKey("p", 0, 0), FULL_PAGES, 1, 0, 1, False, False)
    exp = SourceExpectation(plan=plan, leg=SenderLeg("p-broker", "p-host:1"), expects_aux=False, expected_components=frozenset())
    exp.chunk_pages = {0: (0, 1), 1: (1, 2)}
    exp.chunk_tokens = {0: (0, 6), 1: (6, 12)}
    exp.parts_expected = {0: 1, 1: 1}
    exp.parts_received = {1: 1}
    assert exp.landed_positions(0, 4) == {2}
    exp.parts_received = {0: 1, 1: 1}
    assert exp.landed_positions(0, 4) == {0, 1, 2}
    exp.parts_received = {0: 1}
    assert exp.landed_positions(0, 4) == {0}
