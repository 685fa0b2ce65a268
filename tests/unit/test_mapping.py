"""Which sender ranks a receiver rank waits for: ``kvbroker.plan``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.errors import FailedPrecondition, Unimplemented
from kvbroker.plan import GroupShape, RankKey, SourcePlan, plan_sources, rank_key
from kvbroker.v1 import common_pb2, peer_pb2

FULL = peer_pb2.SOURCE_MODE_FULL_PAGES
SLICE = peer_pb2.SOURCE_MODE_HEAD_SLICE
COMPLETION = peer_pb2.SOURCE_MODE_COMPLETION_ONLY
SENDER = "prefill"


def shape(
    *,
    tp: int = 1,
    pp: int = 1,
    num_layers: int = 4,
    begins: tuple[int, ...] | None = None,
    mla: bool = False,
    total_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    page_size: int = 16,
) -> GroupShape:
    if begins is None:
        begins = tuple(i * (num_layers // pp) for i in range(pp))
    return GroupShape(
        tp_size=tp,
        pp_size=pp,
        num_layers=num_layers,
        pp_layer_begins=begins,
        mla=mla,
        total_kv_heads=1 if mla else total_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        page_size_tokens=page_size,
    )


def plans(sender: GroupShape, receiver: GroupShape, tp: int, pp: int) -> list[SourcePlan]:
    return plan_sources(sender, SENDER, receiver, tp, pp)


def all_plans(sender: GroupShape, receiver: GroupShape) -> dict[tuple[int, int], list[SourcePlan]]:
    """Plans of every receiver rank of the group, by (tp, pp)."""
    return {
        (tp, pp): plans(sender, receiver, tp, pp)
        for tp in range(receiver.tp_size)
        for pp in range(receiver.pp_size)
    }


# -- equal tensor parallelism -------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_equal_tp(tp: int) -> None:
    """Equal tp: rank r hears from exactly tp rank r, whole pages, aux and state, one destination."""
    group = shape(tp=tp)
    for r in range(tp):
        (plan,) = plans(group, group, r, 0)
        assert plan == SourcePlan(
            rank=RankKey(SENDER, r, 0),
            mode=FULL,
            num_destinations=1,
            layer_begin=0,
            layer_end=4,
            sends_aux=True,
            sends_state=True,
        )
        assert plan.writes_data


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_equal_tp_mla(tp: int) -> None:
    """MLA with equal tp behaves like MHA: one full source per rank."""
    group = shape(tp=tp, mla=True)
    for r in range(tp):
        (plan,) = plans(group, group, r, 0)
        assert (plan.rank, plan.mode, plan.num_destinations, plan.sends_aux) == (
            RankKey(SENDER, r, 0),
            FULL,
            1,
            True,
        )


# -- pipeline parallelism -----------------------------------------------------


def test_prefill_pp2_to_decode_pp1() -> None:
    """A pp 1 receiver hears from both sender pp ranks; only the last sends aux; each sends the state of its layers."""
    sender = shape(pp=2, begins=(0, 2))
    receiver = shape()
    got = plans(sender, receiver, 0, 0)
    assert [(p.rank, p.layer_begin, p.layer_end, p.sends_aux, p.sends_state) for p in got] == [
        (RankKey(SENDER, 0, 0), 0, 2, False, True),
        (RankKey(SENDER, 0, 1), 2, 4, True, True),
    ]
    assert all(p.mode == FULL and p.num_destinations == 1 for p in got)


def test_prefill_pp1_to_decode_pp2() -> None:
    """Each receiver pp rank hears from the one sender rank for its own layers; it serves two."""
    sender = shape()
    receiver = shape(pp=2, begins=(0, 2))
    (first,) = plans(sender, receiver, 0, 0)
    (second,) = plans(sender, receiver, 0, 1)
    assert (first.rank, first.layer_begin, first.layer_end) == (RankKey(SENDER, 0, 0), 0, 2)
    assert (second.rank, second.layer_begin, second.layer_end) == (RankKey(SENDER, 0, 0), 2, 4)
    assert first.num_destinations == second.num_destinations == 2
    # The sender's only pp rank is its last: it carries aux and state to both.
    assert first.sends_aux and second.sends_aux


def test_uneven_pp_split() -> None:
    """Prefill (0,3) vs decode (0,2,4) over 5 layers pairs layers by id."""
    sender = shape(pp=2, num_layers=5, begins=(0, 3))
    receiver = shape(pp=3, num_layers=5, begins=(0, 2, 4))
    by_rank = {
        pp: {
            p.rank.pp_rank: (p.layer_begin, p.layer_end, p.sends_aux)
            for p in plans(sender, receiver, 0, pp)
        }
        for pp in range(3)
    }
    assert by_rank[0] == {0: (0, 2, False), 1: (0, 0, True)}  # pp1 owes only aux/state here
    assert by_rank[1] == {0: (2, 3, False), 1: (3, 4, True)}
    assert by_rank[2] == {1: (4, 5, True)}
    counts = {p.rank: p.num_destinations for pp in range(3) for p in plans(sender, receiver, 0, pp)}
    assert counts == {RankKey(SENDER, 0, 0): 2, RankKey(SENDER, 0, 1): 3}


def _check_plan_invariants(sender: GroupShape, receiver: GroupShape) -> None:
    """Layer and head coverage, aux uniqueness and destination counts for every receiver rank."""
    everything = all_plans(sender, receiver)
    served: Counter[RankKey] = Counter()
    heads_per_rank = 1 if receiver.mla else max(1, receiver.total_kv_heads // receiver.tp_size)
    for (tp, pp), got in everything.items():
        r_begin, r_end = receiver.layer_range(pp)
        writing = [p for p in got if p.writes_data]
        # Every (layer, receiver head) is written by exactly one source.
        cells: Counter[tuple[int, int]] = Counter()
        for p in writing:
            first = p.dst_head_start if p.mode == SLICE else 0
            count = p.num_heads if p.mode == SLICE else heads_per_rank
            for layer in range(p.layer_begin, p.layer_end):
                cells.update((layer, h) for h in range(first, first + count))
            if p.layer_begin < p.layer_end:
                s_begin, s_end = sender.layer_range(p.rank.pp_rank)
                assert s_begin <= p.layer_begin and p.layer_end <= s_end
        wanted = {(layer, h) for layer in range(r_begin, r_end) for h in range(heads_per_rank)}
        assert set(cells) == wanted and set(cells.values()) == {1}, (tp, pp, cells)
        # Exactly one source sends aux, at the sender's last pp rank; state
        # comes from every source that writes layers.
        extras = [p for p in got if p.sends_aux]
        assert len(extras) == 1
        assert extras[0].rank.pp_rank == sender.pp_size - 1 and extras[0].writes_data
        assert [p for p in got if p.sends_state] == [p for p in writing if p.layer_begin < p.layer_end]
        # Sources are distinct ranks.
        assert len({p.rank for p in got}) == len(got)
        served.update(p.rank for p in got)
    for got in everything.values():
        for p in got:
            assert p.num_destinations == served[p.rank]


@pytest.mark.parametrize(
    "sender,receiver",
    [
        (shape(pp=2, num_layers=5, begins=(0, 3)), shape(pp=3, num_layers=5, begins=(0, 2, 4))),
        (shape(pp=3, num_layers=5, begins=(0, 2, 4)), shape(pp=2, num_layers=5, begins=(0, 3))),
        (shape(pp=4, num_layers=8), shape(pp=2, num_layers=8, begins=(0, 5))),
        (shape(pp=1, num_layers=7), shape(pp=4, num_layers=7, begins=(0, 1, 2, 6))),
        (shape(pp=4, num_layers=7, begins=(0, 1, 2, 6)), shape(pp=1, num_layers=7)),
        (shape(tp=2, pp=2, num_layers=6, begins=(0, 4)), shape(tp=2, pp=3, num_layers=6)),
        (
            shape(tp=4, pp=2, mla=True, num_layers=6, begins=(0, 1)),
            shape(tp=2, pp=3, mla=True, num_layers=6),
        ),
        (
            shape(tp=1, pp=3, mla=True, num_layers=6),
            shape(tp=4, pp=2, mla=True, num_layers=6, begins=(0, 5)),
        ),
    ],
)
def test_layer_coverage_over_shapes(sender: GroupShape, receiver: GroupShape) -> None:
    """For every receiver rank, writing sources' layer ranges partition its own range."""
    _check_plan_invariants(sender, receiver)


@st.composite
def _begins(draw: Any, num_layers: int) -> tuple[int, ...]:
    if num_layers == 1:
        return (0,)
    starts = draw(
        st.sets(st.integers(min_value=1, max_value=num_layers - 1), max_size=min(4, num_layers - 1))
    )
    return (0, *sorted(starts))


@st.composite
def _group_pair(draw: Any) -> tuple[GroupShape, GroupShape]:
    num_layers = draw(st.integers(min_value=1, max_value=12))
    mla = draw(st.booleans())
    s_begins = draw(_begins(num_layers))
    r_begins = draw(_begins(num_layers))
    s_tp, r_tp = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    heads = draw(st.sampled_from([1, 2, 4, 8, 32]))
    sender = shape(tp=s_tp, pp=len(s_begins), num_layers=num_layers, begins=s_begins, mla=mla, total_kv_heads=heads)
    receiver = shape(tp=r_tp, pp=len(r_begins), num_layers=num_layers, begins=r_begins, mla=mla, total_kv_heads=heads)
    return sender, receiver


@given(_group_pair())
def test_layer_coverage_property(pair: tuple[GroupShape, GroupShape]) -> None:
    """Any pp splits (and MLA tp ratios): layers are covered once, aux once, counts agree."""
    _check_plan_invariants(*pair)


# -- MLA with different tp sizes -----------------------------------------------


def test_mla_tp4_to_tp2() -> None:
    """MLA tp 4 -> 2: decode rank d hears from 2d (writes) and 2d+1 (completion only)."""
    sender, receiver = shape(tp=4, mla=True), shape(tp=2, mla=True)
    got0 = plans(sender, receiver, 0, 0)
    got1 = plans(sender, receiver, 1, 0)
    assert [(p.rank.tp_rank, p.mode) for p in got0] == [(0, FULL), (1, COMPLETION)]
    assert [(p.rank.tp_rank, p.mode) for p in got1] == [(2, FULL), (3, COMPLETION)]
    for p in got0 + got1:
        assert p.num_destinations == 1
        if p.mode == COMPLETION:
            assert not p.writes_data
            assert (p.layer_begin, p.layer_end, p.sends_aux, p.sends_state) == (0, 0, False, False)
        else:
            assert (p.layer_begin, p.layer_end, p.sends_aux, p.sends_state) == (0, 4, True, True)
    every = Counter(p.rank for p in got0 + got1)
    assert set(every) == {RankKey(SENDER, t, 0) for t in range(4)}
    assert set(every.values()) == {1}


def test_mla_tp1_to_tp4() -> None:
    """MLA tp 1 -> 4: every decode rank's only writing source is tp 0, which serves four."""
    sender, receiver = shape(tp=1, mla=True), shape(tp=4, mla=True)
    for d in range(4):
        (plan,) = plans(sender, receiver, d, 0)
        assert (plan.rank, plan.mode, plan.num_destinations) == (RankKey(SENDER, 0, 0), FULL, 4)
        assert plan.sends_aux


def test_mla_tp2_to_tp4() -> None:
    """MLA tp 2 -> 4: decode ranks 0,1 hear from tp 0 and ranks 2,3 from tp 1."""
    sender, receiver = shape(tp=2, mla=True), shape(tp=4, mla=True)
    sources = [plans(sender, receiver, d, 0) for d in range(4)]
    assert [[p.rank.tp_rank for p in s] for s in sources] == [[0], [0], [1], [1]]
    assert all(p.num_destinations == 2 for s in sources for p in s)


@pytest.mark.parametrize("s_tp,r_tp", [(3, 2), (2, 3), (4, 3)])
def test_mla_tp_not_multiple(s_tp: int, r_tp: int) -> None:
    """MLA tp sizes that are not multiples of one another are Unimplemented."""
    with pytest.raises(Unimplemented, match="multiple of the smaller"):
        plans(shape(tp=s_tp, mla=True), shape(tp=r_tp, mla=True), 0, 0)


def _slices(sender: GroupShape, receiver: GroupShape) -> list[list[tuple[int, int, int, int, int]]]:
    """Per receiver tp rank: (sender tp, mode, src head start, dst head start, heads)."""
    return [
        [(p.rank.tp_rank, p.mode, p.src_head_start, p.dst_head_start, p.num_heads) for p in plans(sender, receiver, d, 0)]
        for d in range(receiver.tp_size)
    ]


def test_hand_derived_4_to_2_with_8_heads() -> None:
    """Lesson 3, 4 -> 2 with 8 heads: prefill ranks' heads start at [0, 2, 0, 2] in the decode pages."""
    got = _slices(shape(tp=4, total_kv_heads=8), shape(tp=2, total_kv_heads=8))
    assert got == [[(0, SLICE, 0, 0, 2), (1, SLICE, 0, 2, 2)], [(2, SLICE, 0, 0, 2), (3, SLICE, 0, 2, 2)]]
    assert [start for rank in got for (_, _, _, start, _) in rank] == [0, 2, 0, 2]


def test_hand_derived_1_to_4_with_2_heads() -> None:
    """Lesson 3, GQA 1 -> 4 with 2 heads: decode ranks take prefill heads starting [0, 0, 1, 1]."""
    got = _slices(shape(tp=1, total_kv_heads=2), shape(tp=4, total_kv_heads=2))
    assert [rank[0][2] for rank in got] == [0, 0, 1, 1]
    assert all(rank == [(0, SLICE, rank[0][2], 0, 1)] for rank in got)
    (plan,) = plans(shape(tp=1, total_kv_heads=2), shape(tp=4, total_kv_heads=2), 0, 0)
    assert plan.num_destinations == 4


def test_gqa_replicas_on_the_prefill_side_write_once() -> None:
    """GQA 4 -> 1 with 2 heads: ranks 0 and 2 write heads 0 and 1; their replicas 1 and 3 only complete."""
    got = _slices(shape(tp=4, total_kv_heads=2), shape(tp=1, total_kv_heads=2))
    assert got == [[(0, SLICE, 0, 0, 1), (1, COMPLETION, 0, 0, 0), (2, SLICE, 0, 1, 1), (3, COMPLETION, 0, 0, 0)]]


def test_heads_moving_whole_pages_need_no_slicing() -> None:
    """2 -> 4 with 1 head: every rank holds the one head, so pages move whole."""
    got = _slices(shape(tp=2, total_kv_heads=1), shape(tp=4, total_kv_heads=1))
    assert got == [[(0, FULL, 0, 0, 0), (1, COMPLETION, 0, 0, 0)]] * 4


def test_lesson2_sources_stay_distinct_with_pp1() -> None:
    """Lesson 2: 4 -> 2 with pp 1 gives two distinct sources per decode rank (keyed by tp too)."""
    for d in range(2):
        keys = [p.rank for p in plans(shape(tp=4), shape(tp=2), d, 0)]
        assert len(set(keys)) == len(keys) == 2
        assert all(k.pp_rank == 0 for k in keys)


def test_heads_that_do_not_divide_are_unimplemented() -> None:
    """KV heads that do not split evenly over a tp size are refused."""
    with pytest.raises(Unimplemented, match="do not divide evenly"):
        plans(shape(tp=3, total_kv_heads=8), shape(tp=2, total_kv_heads=8), 0, 0)


# -- compatibility ------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_layers", 6),
        ("dtype", "float16"),
        ("head_dim", 64),
        ("total_kv_heads", 4),
    ],
)
def test_incompatible_groups(field: str, value: object) -> None:
    """Groups differing in a model field raise FailedPrecondition naming the field."""
    sender = shape()
    receiver = replace(sender, **{field: value})
    with pytest.raises(FailedPrecondition, match=rf"{field} {getattr(sender, field)} vs {value}"):
        plans(sender, receiver, 0, 0)


@pytest.mark.parametrize(
    "sender,receiver",
    [
        (shape(tp=2, page_size=16), shape(tp=2, page_size=64)),  # equal tp: whole tokens
        (shape(tp=2, mla=True, total_kv_heads=1, page_size=64), shape(tp=4, mla=True, total_kv_heads=1, page_size=1)),
        (shape(tp=2, pp=2, page_size=32), shape(tp=2, page_size=16)),
    ],
)
def test_page_sizes_may_differ_where_whole_tokens_move(sender: GroupShape, receiver: GroupShape) -> None:
    """Different page sizes plan as equal ones do (the sender moves token runs) when no head is sliced."""
    same = replace(receiver, page_size_tokens=sender.page_size_tokens)
    assert all_plans(sender, receiver) == all_plans(sender, same)


def test_fused_pages_of_different_sizes_are_refused() -> None:
    """The fused layout moves whole pages only: different page sizes are UNIMPLEMENTED, naming why."""
    fused = replace(shape(), kv_layout=common_pb2.KV_LAYOUT_HND_FUSED)
    with pytest.raises(Unimplemented, match="order of tokens inside a fused page is the attention kernel's"):
        plans(fused, replace(fused, page_size_tokens=32), 0, 0)


def test_head_slices_between_page_sizes_are_refused() -> None:
    """Head slices (different tp sizes, not MLA) between different page sizes: UNIMPLEMENTED, naming both."""
    with pytest.raises(Unimplemented, match="page sizes 16 and 32 tokens with tp 2 -> 4: head slices"):
        plans(shape(tp=2), shape(tp=4, page_size=32), 0, 0)
    # Whole pages between tp 4 and tp 2 are still head slices on the receiver's side.
    with pytest.raises(Unimplemented, match="head slices between different page sizes"):
        plans(shape(tp=4), shape(tp=2, page_size=32), 0, 0)


def test_incompatible_mla_flag() -> None:
    """An MLA group and an MHA group cannot exchange KV."""
    sender = shape(mla=True)
    receiver = replace(sender, mla=False)
    with pytest.raises(FailedPrecondition, match="mla True vs False"):
        plans(sender, receiver, 0, 0)


def test_incompatible_lists_every_problem() -> None:
    """Several differences are all named in one error."""
    sender = shape()
    receiver = replace(sender, head_dim=64, dtype="float32")
    with pytest.raises(FailedPrecondition, match="dtype bfloat16 vs float32; head_dim 128 vs 64"):
        plans(sender, receiver, 0, 0)


def test_compatibility_checked_before_mapping() -> None:
    """An incompatible non-MLA pair with different tp is FailedPrecondition, not Unimplemented."""
    with pytest.raises(FailedPrecondition):
        plans(shape(tp=2), shape(tp=1, head_dim=64), 0, 0)


# -- keys and the wire ---------------------------------------------------------


@pytest.mark.parametrize(
    "sender,receiver",
    [
        (shape(tp=4, mla=True), shape(tp=2, mla=True)),
        (shape(tp=8, mla=True), shape(tp=1, mla=True)),
    ],
)
def test_sources_keyed_by_tp_and_pp(sender: GroupShape, receiver: GroupShape) -> None:
    """With pp 1 and several tp sources, each source has its own RankKey (lesson 2)."""
    for d in range(receiver.tp_size):
        got = plans(sender, receiver, d, 0)
        assert len(got) == sender.tp_size // receiver.tp_size > 1
        keys = {p.rank for p in got}
        assert len(keys) == len(got)
        assert {k.pp_rank for k in keys} == {0}
        assert all(k.group == SENDER for k in keys)


def test_sources_keyed_by_group() -> None:
    """The sender group name is part of every source key."""
    group = shape()
    (plan,) = plan_sources(group, "other-prefill", group, 0, 0)
    assert plan.rank == RankKey("other-prefill", 0, 0)


@pytest.mark.parametrize(
    "plan",
    [
        SourcePlan(RankKey("p", 3, 1), FULL, 2, 4, 8, True, False),
        SourcePlan(RankKey("p", 0, 0), COMPLETION, 1, 0, 0, False, False),
        SourcePlan(RankKey("p", 1, 2), FULL, 4, 0, 0, True, True),
    ],
)
def test_source_plan_proto_round_trip(plan: SourcePlan) -> None:
    """SourcePlan survives to_proto / serialize / from_proto unchanged."""
    msg = plan.to_proto()
    assert msg.rank == common_pb2.EngineRankId(
        group=plan.rank.group, tp_rank=plan.rank.tp_rank, pp_rank=plan.rank.pp_rank
    )
    parsed = peer_pb2.SourcePlan.FromString(msg.SerializeToString())
    back = SourcePlan.from_proto(parsed)
    assert back == plan
    assert isinstance(back.rank, RankKey)


def test_plans_round_trip_through_proto() -> None:
    """Every plan of a real mapping round-trips through the wire form."""
    sender = shape(tp=4, pp=2, mla=True, begins=(0, 1))
    receiver = shape(tp=2, pp=1, mla=True)
    for d in range(2):
        for plan in plans(sender, receiver, d, 0):
            assert SourcePlan.from_proto(plan.to_proto()) == plan


def test_group_shape_of_layout(make_layout: Callable[..., Any]) -> None:
    """GroupShape.of copies the group fields of a validated layout."""
    layout = make_layout(
        tp_size=2, total_kv_heads=8, num_layers=6, pp_size=3, pp_rank=1, pp_layer_begins=(0, 2, 3)
    )
    got = GroupShape.of(layout)
    assert got == GroupShape(
        tp_size=2,
        pp_size=3,
        num_layers=6,
        pp_layer_begins=(0, 2, 3),
        mla=False,
        total_kv_heads=8,
        head_dim=8,
        dtype="float16",
        page_size_tokens=4,
    )
    assert [got.layer_range(p) for p in range(3)] == [(0, 2), (2, 3), (3, 6)]


def test_rooms_of_a_group_pair_share_their_plans_and_keys() -> None:
    """A broker holds plans and rank keys per room: equal ones are one object (memory per room)."""
    group = shape()
    assert plan_sources(group, SENDER, group, 0, 0) is plan_sources(group, SENDER, group, 0, 0)
    (plan,) = plan_sources(group, SENDER, group, 0, 0)
    again = SourcePlan.from_proto(plan.to_proto())
    assert again == plan and again is SourcePlan.from_proto(plan.to_proto())
    assert again.rank is rank_key(plan.rank.to_proto())


def test_the_fused_layout_pairs_only_with_itself_and_slices_heads_like_nhd() -> None:
    """KV_LAYOUT_HND_FUSED pairs only with itself (the refusal names why); between different tp
    sizes its plans are those of the token-major layout (the slice geometry differs, not the plan)."""
    fused = common_pb2.KV_LAYOUT_HND_FUSED
    assert plan_sources(replace(shape(), kv_layout=fused), SENDER, replace(shape(), kv_layout=fused), 0, 0)
    with pytest.raises(FailedPrecondition, match="kv_layout 0 vs 1"):
        plan_sources(shape(), SENDER, replace(shape(), kv_layout=fused), 0, 0)
    for ps, pd in ((2, 1), (1, 4), (4, 2)):
        sender, receiver = shape(tp=ps), shape(tp=pd)
        assert all_plans(replace(sender, kv_layout=fused), replace(receiver, kv_layout=fused)) == all_plans(sender, receiver)
