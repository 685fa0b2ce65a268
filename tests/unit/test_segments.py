"""What one chunk moves: ``kvbroker.plan``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from kvbroker.errors import FailedPrecondition
from kvbroker.plan import Layout, RankKey, Segment, SourcePlan
from kvbroker.plan._segments import ChunkShape, build_segments, state_segments
from kvbroker.v1 import common_pb2, peer_pb2

K = common_pb2.REGION_KIND_KEY
V = common_pb2.REGION_KIND_VALUE
MLA = common_pb2.REGION_KIND_MLA
MAMBA = common_pb2.STATE_TYPE_MAMBA
SWA = common_pb2.STATE_TYPE_SWA
NSA = common_pb2.STATE_TYPE_NSA

Builder = Callable[..., Any]


def i32(values: list[int] | range) -> np.ndarray:
    return np.array(list(values), dtype=np.int32)


def plan(begin: int, end: int, *, aux: bool = True, state: bool = True) -> SourcePlan:
    return SourcePlan(
        RankKey("p", 0, 0), peer_pb2.SOURCE_MODE_FULL_PAGES, 1, begin, end, aux, state
    )


def chunk(
    src: list[int] | None = None,
    dst: list[int] | None = None,
    aux: tuple[int, int] | None = None,
    state: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> ChunkShape:
    return ChunkShape(i32(src or []), i32(dst or []), aux, state or {})


@pytest.fixture
def pair(make_layout: Builder) -> tuple[Layout, Layout]:
    """A sender holding layers [0, 4) and a receiver pp rank holding layers [2, 4)."""
    sender = make_layout(role=common_pb2.ROLE_PREFILL, num_layers=4, num_pages=16)
    receiver = make_layout(
        role=common_pb2.ROLE_DECODE,
        num_layers=4,
        num_pages=32,
        pp_size=2,
        pp_rank=1,
        pp_layer_begins=(0, 2),
    )
    return sender, receiver


@pytest.fixture
def state_pair(make_layout: Builder, state_spec: Any) -> tuple[Layout, Layout]:
    """Sender and receiver with swa, nsa (paged) and mamba (position-indexed) state."""
    state = (
        state_spec("swa", SWA, items=8, item_bytes=32, regions=2),
        state_spec("nsa", NSA, items=8, item_bytes=16, regions=1),
        state_spec("mamba", MAMBA, items=4, item_bytes=128, regions=2),
    )
    return make_layout(state=state), make_layout(role=common_pb2.ROLE_DECODE, state=state)


# -- KV -------------------------------------------------------------------------


def test_kv_segments_pair_by_layer_id(pair: tuple[Layout, Layout]) -> None:
    """Every layer of the plan and every KV kind pairs sender and receiver regions by layer id."""
    sender, receiver = pair
    src_pages, dst_pages = [3, 4, 9], [20, 21, 22]
    segments = build_segments(sender, receiver, plan(2, 4, aux=False), chunk(src_pages, dst_pages))
    assert len(segments) == 4
    seen = []
    for seg in segments:
        s, d = sender.regions[seg.src_region], receiver.regions[seg.dst_region]
        assert s.kind == d.kind and s.layer_id == d.layer_id
        assert seg.item_bytes == sender.kv_page_bytes == receiver.kv_page_bytes
        assert seg.src_items.tolist() == src_pages
        assert seg.dst_items.tolist() == dst_pages
        seen.append((s.kind, s.layer_id))
    assert seen == [(K, 2), (V, 2), (K, 3), (V, 3)]
    # Region positions differ on the two sides: pairing is not by list position.
    assert [seg.src_region for seg in segments] == [4, 5, 6, 7]
    assert [seg.dst_region for seg in segments] == [0, 1, 2, 3]


def test_kv_segments_only_plan_layers(pair: tuple[Layout, Layout]) -> None:
    """Only the layers in the plan's range get segments."""
    sender, receiver = pair
    segments = build_segments(sender, receiver, plan(3, 4, aux=False), chunk([0], [0]))
    assert [sender.regions[s.src_region].layer_id for s in segments] == [3, 3]


def test_kv_segments_mla(make_layout: Builder) -> None:
    """MLA layouts pair one MLA region per layer."""
    sender = make_layout(mla=True, num_layers=3)
    receiver = make_layout(
        mla=True, num_layers=3, role=common_pb2.ROLE_DECODE, tp_size=2, tp_rank=1
    )
    segments = build_segments(sender, receiver, plan(0, 3, aux=False), chunk([1, 2], [5, 6]))
    assert [
        (sender.regions[s.src_region].kind, sender.regions[s.src_region].layer_id) for s in segments
    ] == [
        (MLA, 0),
        (MLA, 1),
        (MLA, 2),
    ]


def test_no_pages_no_kv_segments(pair: tuple[Layout, Layout]) -> None:
    """A chunk without pages makes no KV segments (but still carries aux; lesson 1)."""
    sender, receiver = pair
    assert build_segments(sender, receiver, plan(2, 4), chunk()) == []
    segments = build_segments(sender, receiver, plan(2, 4), chunk(aux=(1, 3)))
    assert [sender.regions[s.src_region].kind for s in segments] == [common_pb2.REGION_KIND_AUX] * 2


def test_empty_plan_range_no_kv_segments(pair: tuple[Layout, Layout]) -> None:
    """A plan owing no layers (aux/state only) makes no KV segments even with pages."""
    sender, receiver = pair
    assert build_segments(sender, receiver, plan(0, 0), chunk([1], [1])) == []


def test_kv_layer_missing_on_receiver(pair: tuple[Layout, Layout]) -> None:
    """A plan layer the receiver does not hold is FailedPrecondition naming the side."""
    sender, receiver = pair
    with pytest.raises(
        FailedPrecondition, match="the receiver has no REGION_KIND_KEY region for layer 1"
    ):
        build_segments(sender, receiver, plan(1, 4), chunk([0], [0]))


def test_kv_layer_missing_on_sender(pair: tuple[Layout, Layout]) -> None:
    """A plan layer the sender does not hold is FailedPrecondition naming the side."""
    receiver, sender = pair  # the [2, 4) rank sends
    with pytest.raises(
        FailedPrecondition, match="the sender has no REGION_KIND_KEY region for layer 0"
    ):
        build_segments(sender, receiver, plan(0, 2), chunk([0], [0]))


def test_kv_item_size_mismatch(make_layout: Builder) -> None:
    """KV pages of different sizes on the two sides are FailedPrecondition."""
    sender = make_layout(dtype="float16")
    receiver = make_layout(dtype="bfloat16", page_size=8, role=common_pb2.ROLE_DECODE)
    with pytest.raises(
        FailedPrecondition, match=r"layer 0: the sender's items are 512 bytes, the receiver's 1024"
    ):
        build_segments(sender, receiver, plan(0, 4), chunk([0], [0]))


# -- aux --------------------------------------------------------------------------


def test_aux_segments_pair_by_position(pair: tuple[Layout, Layout]) -> None:
    """Aux rows pair aux regions by position, one row each."""
    sender, receiver = pair
    segments = build_segments(sender, receiver, plan(2, 4), chunk([0], [0], aux=(2, 3)))
    aux = segments[4:]
    assert [(s.src_region, s.dst_region) for s in aux] == list(
        zip(sender.aux_regions, receiver.aux_regions)
    )
    assert [s.item_bytes for s in aux] == [16, 32]
    for s in aux:
        assert s.src_items.tolist() == [2]
        assert s.dst_items.tolist() == [3]
        assert s.src_items.dtype == s.dst_items.dtype == np.int32


def test_no_aux_segments_without_aux_rows(pair: tuple[Layout, Layout]) -> None:
    """Without aux rows in the chunk there are no aux segments."""
    sender, receiver = pair
    segments = build_segments(sender, receiver, plan(2, 4), chunk([0], [0]))
    assert all(sender.regions[s.src_region].kind != common_pb2.REGION_KIND_AUX for s in segments)


def test_aux_region_count_mismatch(make_layout: Builder) -> None:
    """Different numbers of aux regions on the two sides are FailedPrecondition."""
    sender = make_layout(aux_row_bytes=(16, 32))
    receiver = make_layout(aux_row_bytes=(16,), role=common_pb2.ROLE_DECODE)
    with pytest.raises(FailedPrecondition, match="the sender has 2 aux regions, the receiver 1"):
        build_segments(sender, receiver, plan(0, 4), chunk(aux=(0, 0)))


def test_aux_item_size_mismatch(make_layout: Builder) -> None:
    """Aux rows of different sizes are FailedPrecondition naming the aux region."""
    sender = make_layout(aux_row_bytes=(16, 32))
    receiver = make_layout(aux_row_bytes=(16, 64), role=common_pb2.ROLE_DECODE)
    with pytest.raises(
        FailedPrecondition, match="aux region 1: the sender's items are 32 bytes, the receiver's 64"
    ):
        build_segments(sender, receiver, plan(0, 4), chunk(aux=(0, 0)))


# -- state --------------------------------------------------------------------------


def test_state_segments_per_region(state_pair: tuple[Layout, Layout]) -> None:
    """Each component's indices go region by region in listed order."""
    sender, receiver = state_pair
    src, dst = i32([1, 2]), i32([5, 6])
    segments = build_segments(sender, receiver, plan(0, 4), chunk(state={"swa": (src, dst)}))
    assert [(s.src_region, s.dst_region) for s in segments] == list(
        zip(sender.state_components["swa"][1], receiver.state_components["swa"][1])
    )
    assert all(
        s.item_bytes == 32 and s.src_items.tolist() == [1, 2] and s.dst_items.tolist() == [5, 6]
        for s in segments
    )


def test_only_listed_components(state_pair: tuple[Layout, Layout]) -> None:
    """Components the chunk does not name make no segments."""
    sender, receiver = state_pair
    segments = build_segments(
        sender, receiver, plan(0, 4), chunk(state={"mamba": (i32([0]), i32([3]))})
    )
    mamba_regions = set(sender.state_components["mamba"][1])
    assert {s.src_region for s in segments} == mamba_regions
    assert len(segments) == 2


@pytest.mark.parametrize("name", ["swa", "nsa"])
@pytest.mark.parametrize("src_len,dst_len", [(5, 3), (2, 6)])
def test_paged_state_trimmed_without_mutating_inputs(
    state_pair: tuple[Layout, Layout], name: str, src_len: int, dst_len: int
) -> None:
    """Paged state (swa, nsa) is trimmed to the shorter list on a copy; the caller's arrays stay (lesson 4)."""
    sender, receiver = state_pair
    src = i32(range(src_len))
    dst = i32(range(10, 10 + dst_len))
    src_before, dst_before = src.copy(), dst.copy()
    with capture_logs() as logs:
        segments = build_segments(sender, receiver, plan(0, 4), chunk(state={name: (src, dst)}))
    n = min(src_len, dst_len)
    assert segments
    for seg in segments:
        assert seg.src_items.size == seg.dst_items.size == n
        assert seg.src_items.tolist() == src_before[:n].tolist()
        assert seg.dst_items.tolist() == dst_before[:n].tolist()
    np.testing.assert_array_equal(src, src_before)
    np.testing.assert_array_equal(dst, dst_before)
    assert (src.shape, dst.shape) == ((src_len,), (dst_len,))
    assert [(e["event"], e["log_level"], e["kept"]) for e in logs] == [
        ("state_indices_trimmed", "warning", n)
    ]


def test_paged_state_trim_to_empty(state_pair: tuple[Layout, Layout]) -> None:
    """A paged component with an empty side trims to empty segments without error."""
    sender, receiver = state_pair
    segments = state_segments(sender, receiver, "swa", i32([1, 2, 3]), i32([]), 0, 4)
    assert all(s.src_items.size == 0 and s.dst_items.size == 0 for s in segments)


def test_mamba_length_mismatch(state_pair: tuple[Layout, Layout]) -> None:
    """Position-indexed state (mamba) with different lengths is FailedPrecondition."""
    sender, receiver = state_pair
    with pytest.raises(
        FailedPrecondition,
        match=r"'mamba' \(STATE_TYPE_MAMBA\) is position-indexed: the sender sent 2 indices, the receiver expects 1",
    ):
        build_segments(
            sender, receiver, plan(0, 4), chunk(state={"mamba": (i32([0, 1]), i32([3]))})
        )


@pytest.mark.parametrize("missing_on", ["sender", "receiver"])
def test_component_missing_on_one_side(
    make_layout: Builder, state_spec: Any, missing_on: str
) -> None:
    """A component one side does not carry is FailedPrecondition naming that side."""
    with_state = make_layout(state=(state_spec("swa", SWA),))
    without = make_layout()
    sender, receiver = (without, with_state) if missing_on == "sender" else (with_state, without)
    with pytest.raises(FailedPrecondition, match=f"the {missing_on} has no state component 'swa'"):
        build_segments(sender, receiver, plan(0, 4), chunk(state={"swa": (i32([0]), i32([0]))}))


def test_component_type_mismatch(make_layout: Builder, state_spec: Any) -> None:
    """A component with different types on the two sides is FailedPrecondition."""
    sender = make_layout(state=(state_spec("x", SWA),))
    receiver = make_layout(state=(state_spec("x", MAMBA),))
    with pytest.raises(FailedPrecondition, match="'x' has different types"):
        state_segments(sender, receiver, "x", i32([0]), i32([0]), 0, 4)


def test_component_region_count_mismatch(make_layout: Builder, state_spec: Any) -> None:
    """A component with different region counts on the two sides is FailedPrecondition."""
    sender = make_layout(state=(state_spec("swa", SWA, regions=2),))
    receiver = make_layout(state=(state_spec("swa", SWA, regions=3),))
    with pytest.raises(FailedPrecondition, match=r"sender.s regions are at layers \[0, 1\], the receiver.s at \[0, 1, 2\]"):
        state_segments(sender, receiver, "swa", i32([0]), i32([0]), 0, 4)


def test_component_item_size_mismatch(make_layout: Builder, state_spec: Any) -> None:
    """State items of different sizes are FailedPrecondition naming the component region."""
    sender = make_layout(state=(state_spec("swa", SWA, item_bytes=32),))
    receiver = make_layout(state=(state_spec("swa", SWA, item_bytes=64),))
    with pytest.raises(
        FailedPrecondition, match="state 'swa' region 0: the sender's items are 32 bytes"
    ):
        state_segments(sender, receiver, "swa", i32([0]), i32([0]), 0, 4)


def test_full_last_chunk(state_pair: tuple[Layout, Layout]) -> None:
    """A last chunk with pages, aux and two components carries all of them, KV first."""
    sender, receiver = state_pair
    segments = build_segments(
        sender,
        receiver,
        plan(0, 4),
        chunk(
            [0, 1],
            [2, 3],
            aux=(0, 1),
            state={"swa": (i32([1]), i32([2])), "mamba": (i32([0]), i32([0]))},
        ),
    )
    kinds = [sender.regions[s.src_region].kind for s in segments]
    assert (
        kinds == [K, V] * 4 + [common_pb2.REGION_KIND_AUX] * 2 + [common_pb2.REGION_KIND_STATE] * 4
    )
    assert all(isinstance(s, Segment) for s in segments)
