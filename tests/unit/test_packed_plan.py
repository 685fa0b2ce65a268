"""Planning packed parts: what a pair of ranks needs is worked out once, and checked as before."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvbroker.errors import FailedPrecondition
from kvbroker.plan import ChunkShape, Layout, RankKey, SourcePlan, plan_packed
from kvbroker.v1 import common_pb2, peer_pb2

VRAM = common_pb2.MEMORY_KIND_VRAM
Builder = Callable[..., Any]


def _vram(layout: Layout) -> Any:
    """What planning reads of a descriptor table: every region in VRAM on GPU 0."""
    return SimpleNamespace(region_kind=(VRAM,) * len(layout.regions), region_device=(0,) * len(layout.regions))


def _plan() -> SourcePlan:
    return SourcePlan(RankKey("p", 0, 0), peer_pb2.SOURCE_MODE_FULL_PAGES, 1, 0, 4, False, False)


def _pages(src: list[int], dst: list[int]) -> ChunkShape:
    return ChunkShape(np.array(src, dtype=np.int32), np.array(dst, dtype=np.int32), None, {})


def test_a_pairs_kv_packing_is_planned_once_per_receiver_layout(make_layout: Builder) -> None:
    """Every chunk between two ranks packs the same regions: the second chunk reuses the
    first's packing (one memo entry), a new receiver layout (another room) gets its own,
    and each chunk's blocks hold its own pages."""
    sender, receiver = make_layout(), make_layout(role=common_pb2.ROLE_DECODE)
    st, dt = _vram(sender), _vram(receiver)
    first = plan_packed(sender, st, receiver, dt, _plan(), _pages([1, 2], [5, 6]))
    second = plan_packed(sender, st, receiver, dt, _plan(), _pages([3], [7]))
    assert first.kv is not None and second.kv is not None
    assert first.kv[0].regions == second.kv[0].regions and len(first.kv[0].regions) == 8
    assert list(first.kv[0].items) == [1, 2] and list(first.kv[1].items) == [5, 6]
    assert list(second.kv[0].items) == [3] and list(second.kv[1].items) == [7]
    packings = [k for k in sender.memo if k[0] == "kv-packing"]
    assert len(packings) == 1
    other = make_layout(role=common_pb2.ROLE_DECODE)
    plan_packed(sender, st, other, _vram(other), _plan(), _pages([1], [1]))
    assert len([k for k in sender.memo if k[0] == "kv-packing"]) == 2


def test_whole_pages_of_different_sizes_fail_every_chunk(make_layout: Builder) -> None:
    """Whole KV pages whose items differ in size cannot be packed alike: every chunk fails
    with the layer and both sizes, the first and the ones the memo serves."""
    sender = make_layout(dtype="float16")
    receiver = make_layout(dtype="bfloat16", page_size=8, role=common_pb2.ROLE_DECODE)
    st, dt = _vram(sender), _vram(receiver)
    for _ in range(2):
        with pytest.raises(FailedPrecondition, match=r"layer 0: the sender's items are 512 bytes, the receiver's 1024"):
            plan_packed(sender, st, receiver, dt, _plan(), _pages([0], [0]))
